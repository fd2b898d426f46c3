"""Search engines the rollout talks to: the HTTP retriever client, web search APIs and a canned mock."""
from search_r1.search.base import SearchEngine, SearchError
from search_r1.search.format import render_passages
from search_r1.search.mock import MockSearchEngine
from search_r1.search.retriever_client import RetrieverClient
from search_r1.search.web import WebSearchEngine

__all__ = ["SearchEngine", "SearchError", "RetrieverClient", "MockSearchEngine", "WebSearchEngine",
           "render_passages"]
