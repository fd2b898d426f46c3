"""The search-engine contract every rollout path talks to.

`batch_search(queries) -> list[str]` returns, per query, the passages already rendered for the model
(`Doc {i}(Title: {title}) {text}` lines, see `format.render_passages`). An engine that cannot answer
after its own retries raises `SearchError`; the rollout turns that into a "search failed" observation
instead of crashing the batch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class SearchError(RuntimeError):
    """The search engine could not answer (timeout, 5xx, connection refused after retries)."""


class SearchEngine(ABC):
    """Turns query strings into rendered passage text, one string per query."""

    @abstractmethod
    def batch_search(self, queries: list[str]) -> list[str]:
        """Search all `queries` in one call (one HTTP request for the retriever client)."""

    def search(self, query: str) -> str:
        return self.batch_search([query])[0]

    def close(self) -> None:
        """Release connections; engines without resources need not override it."""
