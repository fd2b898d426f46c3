"""MockSearchEngine: case-insensitive keyword lookup with the upstream 'not found' text."""
import pytest

from search_r1.search import MockSearchEngine, SearchEngine


def test_keyword_match_case_insensitive_and_not_found():
    engine = MockSearchEngine({"Veltra": "Veltra text", "Osk": "Osk text"})
    assert isinstance(engine, SearchEngine)
    assert engine.batch_search(["Who founded VELTRA?", "where is osk", "nothing here"]) == [
        "Veltra text", "Osk text", "No information found for: nothing here"]
    assert engine.search("veltra") == "Veltra text"
    assert engine.queries == ["Who founded VELTRA?", "where is osk", "nothing here", "veltra"]


def test_longest_keyword_wins_then_insertion_order():
    engine = MockSearchEngine({"york": "short", "new york": "long", "a": "A", "b": "B"})
    assert engine.search("New York weather") == "long"
    assert engine.search("ba") == "A"  # equal length: first inserted wins


def test_default_text_and_bad_input():
    assert MockSearchEngine({}, default="nothing").search("x") == "nothing"
    with pytest.raises(ValueError, match="dict"):
        MockSearchEngine([("a", "b")])
    with pytest.raises(ValueError, match="non-empty"):
        MockSearchEngine({"": "b"})
    with pytest.raises(ValueError, match="list of strings"):
        MockSearchEngine({"a": "b"}).batch_search("a")
