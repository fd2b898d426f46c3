"""The agents' tools: `search` (the retriever or a web search API) and `access` (read one document
whole: a corpus document by id through the retriever's `/access`, or a web page by URL through the
guarded `webpage.PageFetcher`); and `Sources`, the numbered list of everything a run has shown its
model, which is what citations resolve against.

    search = SearchTool(RetrieverClient("http://127.0.0.1:8000", topk=3))
    hits = search("capital of Rutuk")          # [{"id": "0", "contents": '"Rutuk"\\n...', "score": 9.1}]
    access = AccessTool(retriever=client, fetcher=PageFetcher())
    doc = access("34")  or  access("https://example.org/page")   # Document(id, title, text, kind, url)

Tool failures raise `ToolError` (with `webpage.AccessError` and `search.SearchError` mapped to
it): its message is what the agent shows the model, never a crash.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from search_r1.agents.webpage import AccessError, PageFetcher
from search_r1.search.base import SearchError
from search_r1.search.format import split_title

_DOC_REF = re.compile(r"^\[?\s*(?:doc(?:ument)?\s*#?\s*)?(\d+)\s*\]?$", re.IGNORECASE)
_URL_LIKE = re.compile(r"^[a-z][a-z0-9+.-]*://|^www\.", re.IGNORECASE)


class ToolError(RuntimeError):
    """A tool call that failed; the message is shown to the model."""


@dataclass(frozen=True)
class Source:
    """Something shown to the model. number: its number in the run ("Doc 5", "[5]"); id: corpus
    document id or page URL; kind: "doc" (the retriever's corpus) or "web"; found_by: the search
    query that surfaced it, or "access" for a page opened directly."""

    number: int
    id: str
    title: str
    kind: str
    found_by: str

    def label(self) -> str:
        """`Title (doc 34)` or `Title <https://...>`: how reports and answers name the source."""
        where = f"<{self.id}>" if self.kind == "web" else f"(doc {self.id})"
        return f"{self.title or 'untitled'} {where}"


class Sources:
    """The run's numbered sources, in the order they were shown (numbers count from 1)."""

    def __init__(self, items: list[dict] | None = None):
        self.items = [Source(**s) for s in items or []]

    def add(self, doc_id: str, title: str, kind: str, found_by: str) -> Source:
        source = Source(len(self.items) + 1, doc_id, title, kind, found_by)
        self.items.append(source)
        return source

    def get(self, number: int) -> Source | None:
        return self.items[number - 1] if 1 <= number <= len(self.items) else None

    def resolve(self, target: str) -> str:
        """A model's reference to something it was shown ("Doc 3", "[3]") -> that source's id (URL or
        corpus id); any other target unchanged. A bare number is a source number only if no source has
        that id (corpus ids are numbers too, and an id the model copied wins)."""
        target = target.strip()
        m = _DOC_REF.match(target)
        if m is None:
            return target
        if target.isdigit() and any(s.id == target for s in self.items):
            return target
        source = self.get(int(m.group(1)))
        return source.id if source is not None else target

    def to_json(self) -> list[dict]:
        return [asdict(s) for s in self.items]


@dataclass(frozen=True)
class Document:
    """A document read whole: id (corpus id or final URL), title, text; kind "doc" | "web"."""

    id: str
    title: str
    text: str
    kind: str
    truncated: bool = False


class SearchTool:
    """`search(query) -> hits` over any engine with `batch_retrieve` (RetrieverClient, WebSearchEngine).

    kind: "web" when the hits' ids are page URLs (a web search engine), "doc" for corpus ids.
    """

    def __init__(self, engine, kind: str | None = None):
        if not hasattr(engine, "batch_retrieve"):
            raise ValueError(f"{type(engine).__name__} has no batch_retrieve(queries); agents need the hits' ids "
                             "(use RetrieverClient or WebSearchEngine)")
        self.engine = engine
        self.kind = kind or ("web" if type(engine).__name__ == "WebSearchEngine" else "doc")

    def __call__(self, query: str) -> list[dict]:
        if not query.strip():
            raise ToolError("the search query is empty; write what to look up")
        try:
            return self.engine.batch_retrieve([query])[0]
        except SearchError as exc:
            raise ToolError(f"the search engine failed: {exc}") from None


class AccessTool:
    """`access(target) -> Document`: a URL (http/https; `www.` gets https://) through the fetcher, or a
    corpus document id through the retriever's `/access`. Text is capped at `max_chars` characters.

    retriever: a RetrieverClient (None: no corpus documents); fetcher: a PageFetcher (None: web pages
    are off, and URLs are answered with a message saying so).
    """

    def __init__(self, retriever=None, fetcher: PageFetcher | None = None, max_chars: int = 20_000):
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.retriever, self.fetcher, self.max_chars = retriever, fetcher, max_chars

    def __call__(self, target: str) -> Document:
        target = target.strip()
        if not target:
            raise ToolError("access needs a document id or a URL")
        if _URL_LIKE.match(target):
            return self._page(target if "://" in target else "https://" + target)
        if self.retriever is None:
            raise ToolError(f"{target!r} is not a URL, and this agent has no document store to look ids up in")
        try:
            doc = self.retriever.batch_access([target])[0]
        except SearchError as exc:
            raise ToolError(f"the document store failed: {exc}") from None
        if doc is None:
            raise ToolError(f"there is no document with id {target!r}; use an id shown in the search results")
        title, text = split_title(doc["contents"])
        return Document(doc["id"], title, text[: self.max_chars], "doc", len(text) > self.max_chars)

    def _page(self, url: str) -> Document:
        if self.fetcher is None:
            raise ToolError(f"reading web pages is switched off for this run, so {url} cannot be opened "
                            "(the operator enables it with --web-access)")
        try:
            page = self.fetcher.fetch(url)
        except AccessError as exc:
            raise ToolError(str(exc)) from None
        return Document(page.url, page.title, page.text[: self.max_chars], "web",
                        page.truncated or len(page.text) > self.max_chars)
