"""A canned search engine for tests and demos that must not depend on a retriever server.

    engine = MockSearchEngine({"Veltra": 'Doc 1(Title: Veltra) Veltra was founded by Ana Osk.\n'})
    engine.search("who founded veltra?")   # -> the Veltra text (case-insensitive substring match)
    engine.search("what is Osk?")          # -> "No information found for: what is Osk?"
"""
from __future__ import annotations

from search_r1.search.base import SearchEngine


class MockSearchEngine(SearchEngine):
    """keyword -> text; a query gets the text of the longest keyword it contains (case-insensitive).

    Ties between equally long keywords go to the one inserted first, so results are deterministic.
    Queries with no keyword get `default`, or `No information found for: {query}` when default is None.
    Every query asked is appended to `.queries` (tests check what the rollout searched for).
    """

    def __init__(self, knowledge_base: dict[str, str], default: str | None = None):
        if not isinstance(knowledge_base, dict):
            raise ValueError("MockSearchEngine knowledge_base must be a dict keyword -> text, "
                             f"got {type(knowledge_base).__name__}")
        for key, text in knowledge_base.items():
            if not isinstance(key, str) or not key.strip() or not isinstance(text, str):
                raise ValueError("MockSearchEngine knowledge_base entries must be non-empty str -> str, "
                                 f"got {key!r}: {text!r}")
        # Longest first (stable sort keeps insertion order among ties): "new york city" beats "york".
        self._keys = sorted(((k.lower(), text) for k, text in knowledge_base.items()), key=lambda kv: -len(kv[0]))
        self.default = default
        self.queries: list[str] = []

    def batch_search(self, queries: list[str]) -> list[str]:
        if isinstance(queries, str) or not isinstance(queries, (list, tuple)):
            raise ValueError(f"queries must be a list of strings, got {type(queries).__name__}")
        self.queries.extend(queries)
        return [self._lookup(q) for q in queries]

    def _lookup(self, query: str) -> str:
        if not isinstance(query, str):
            raise ValueError(f"query must be a string, got {type(query).__name__}: {query!r}")
        q = query.lower()
        for key, text in self._keys:
            if key in q:
                return text
        return self.default if self.default is not None else f"No information found for: {query}"
