"""The SearchEngine contract: a subclass implements search or batch_search (either one), as the
notebook API's specification writes an engine (one abstract method, `search(query: str) -> str`)."""
import pytest

from search_r1.search import SearchEngine
from search_r1.search.base import as_search_engine


class SpecEngine(SearchEngine):
    """Written exactly as the specification's example: only `search`."""

    def __init__(self):
        self.asked = []

    def search(self, query: str) -> str:
        self.asked.append(query)
        return f"Doc 1(Title: {query}) about {query}"


class BatchEngine(SearchEngine):
    def batch_search(self, queries: list[str]) -> list[str]:
        return [q.upper() for q in queries]


def test_a_search_only_subclass_is_constructible_and_batches_through_search():
    engine = SpecEngine()
    assert engine.search("osk") == "Doc 1(Title: osk) about osk"
    assert engine.batch_search(["a", "b"]) == ["Doc 1(Title: a) about a", "Doc 1(Title: b) about b"]
    assert engine.asked == ["osk", "a", "b"]


def test_a_batch_only_subclass_still_works():
    engine = BatchEngine()
    assert engine.batch_search(["a", "b"]) == ["A", "B"] and engine.search("c") == "C"


def test_a_subclass_with_neither_method_is_a_clear_type_error():
    class Nothing(SearchEngine):
        pass

    with pytest.raises(TypeError, match=r"Nothing.*search\(query\).*batch_search\(queries\)"):
        Nothing()


def test_duck_typed_engines():
    class OnlySearch:  # not a subclass: wrapped
        def search(self, query):
            return query * 2

    wrapped = as_search_engine(OnlySearch())
    assert isinstance(wrapped, SearchEngine) and wrapped.batch_search(["a", "b"]) == ["aa", "bb"]
    batch = BatchEngine()
    assert as_search_engine(batch) is batch
    with pytest.raises(ValueError, match="search_engine must be a SearchEngine.*got int"):
        as_search_engine(3)
