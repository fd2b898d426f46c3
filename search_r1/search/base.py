"""The search-engine contract every rollout path talks to.

`batch_search(queries) -> list[str]` returns, per query, the passages already rendered for the model
(`Doc {i}(Title: {title}) {text}` lines, see `format.render_passages`); `search(query) -> str` is the
one-query form. A subclass implements either one (the other is derived from it): `search` alone, as
the notebook API's specification writes an engine, or `batch_search` when one request can answer many
queries (the retriever client). An engine that cannot answer after its own retries raises
`SearchError`; the rollout turns that into a "search failed" observation instead of crashing the batch.
"""
from __future__ import annotations

from abc import ABC


class SearchError(RuntimeError):
    """The search engine could not answer (timeout, 5xx, connection refused after retries)."""


class SearchEngine(ABC):
    """Turns query strings into rendered passage text, one string per query.

    Implement `search(query) -> str` or `batch_search(queries) -> list[str]` (or both); instantiating
    a subclass that implements neither raises TypeError naming both.
    """

    def __new__(cls, *args, **kwargs):
        if cls.search is SearchEngine.search and cls.batch_search is SearchEngine.batch_search:
            raise TypeError(f"Can't instantiate {cls.__name__}: a SearchEngine implements search(query) -> str "
                            "or batch_search(queries) -> list[str] (either one; the other is derived from it)")
        return super().__new__(cls)

    def search(self, query: str) -> str:
        """The rendered passages for one query (by default: a batch of one)."""
        return self.batch_search([query])[0]

    def batch_search(self, queries: list[str]) -> list[str]:
        """The rendered passages per query (by default: `search` once per query, in order)."""
        return [self.search(q) for q in queries]

    def close(self) -> None:
        """Release connections; engines without resources need not override it."""


class _SingleQueryEngine(SearchEngine):
    """An object with only `search(query) -> str` (not a SearchEngine subclass) as a SearchEngine."""

    def __init__(self, engine):
        self.engine = engine

    def search(self, query: str) -> str:
        return self.engine.search(query)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


def as_search_engine(engine) -> SearchEngine:
    """`engine` as a SearchEngine: a SearchEngine (or any object with `batch_search`) as it is; an
    object with only `search(query) -> str` wrapped so `batch_search` asks it once per query."""
    if isinstance(engine, SearchEngine) or callable(getattr(engine, "batch_search", None)):
        return engine
    if callable(getattr(engine, "search", None)):
        return _SingleQueryEngine(engine)
    raise ValueError(f"search_engine must be a SearchEngine (with search(query) -> str or batch_search(queries) "
                     f"-> list[str]), got {type(engine).__name__}")
