"""Reading a web page for an agent: guarded fetch, timeouts, a size cap, HTML to text.

    fetcher = PageFetcher(UrlGuard())            # the guard refuses private / local targets
    page = fetcher.fetch("https://example.org/")  # Page(url, title, text, truncated, content_type)

Every hop is checked by the URL guard before its request, and its connection is opened only to
addresses the guard accepts at connect time (`urlguard.GuardedNetworkBackend`); redirects are
followed here, hop by hop, never by the HTTP library. Bodies stop at `max_bytes` (the page is marked
truncated); each network operation times out after `timeout` seconds and the whole fetch after
`deadline` seconds. HTML becomes plain text (`html_to_text`); text/plain, JSON and XML are read
as they are; anything else (PDF, images) is refused with a message the agent shows its model.
Proxies from the environment are not used: a proxy would connect on our behalf, past the guard.
"""
from __future__ import annotations

import re
import ssl
import time
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpcore

from search_r1.agents.urlguard import BlockedURLError, GuardedNetworkBackend, UrlGuard

REDIRECTS = (301, 302, 303, 307, 308)
TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain", "application/json", "text/xml",
              "application/xml", "text/markdown")
USER_AGENT = "search-r1-agent/0.1 (+https://github.com/PeterGriffinJin/Search-R1)"


class AccessError(RuntimeError):
    """A page could not be read (refused, unreachable, HTTP error, unsupported type); the message
    is meant for the model."""


@dataclass(frozen=True)
class Page:
    """A fetched page as text. url: the final URL (after redirects); truncated: the body hit the cap."""

    url: str
    title: str
    text: str
    truncated: bool
    content_type: str


# --- HTML to text ------------------------------------------------------------------------------
_SKIP = frozenset({"script", "style", "noscript", "template", "svg", "iframe", "object", "canvas", "head"})
_BLOCK = frozenset({"p", "div", "br", "li", "ul", "ol", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "table",
                    "section", "article", "header", "footer", "nav", "aside", "main", "pre", "blockquote",
                    "hr", "dl", "dt", "dd", "figcaption", "form", "title"})
_VOID = frozenset({"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source",
                   "track", "wbr"})


class _TextExtractor(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.chunks: list[str] = []
        self.title: list[str] = []
        self._skip: list[str] = []  # open elements whose text is dropped
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        if tag == "title":
            self._in_title = True
        elif tag in _SKIP and tag not in _VOID:
            self._skip.append(tag)
        if tag in _BLOCK:
            self.chunks.append("\n")

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        elif self._skip and tag == self._skip[-1]:
            self._skip.pop()
        if tag in _BLOCK:
            self.chunks.append("\n")

    def handle_data(self, data):
        if self._in_title:
            self.title.append(data)
        elif not self._skip:
            self.chunks.append(data)


def html_to_text(html: str) -> tuple[str, str]:
    """(title, text) of an HTML document: script/style/head content dropped, block elements on their
    own lines, entities decoded, runs of spaces collapsed, empty lines removed."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.chunks).splitlines())
    return " ".join("".join(parser.title).split()), "\n".join(line for line in lines if line)


# --- fetching ----------------------------------------------------------------------------------
_CHARSET = re.compile(r"charset=[\"']?([\w.:-]+)", re.IGNORECASE)


class PageFetcher:
    """Fetches pages through the URL guard (see the module docstring).

    Args: guard (UrlGuard; default refuses every private/local address), timeout (seconds per
    connect / read / write), deadline (seconds for the whole fetch, redirects included), max_bytes
    (body cap), max_redirects.
    """

    def __init__(self, guard: UrlGuard | None = None, timeout: float = 10.0, deadline: float = 30.0,
                 max_bytes: int = 2_000_000, max_redirects: int = 5):
        for name, value in (("timeout", timeout), ("deadline", deadline), ("max_bytes", max_bytes)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"PageFetcher {name} must be > 0, got {value!r}")
        self.guard = guard or UrlGuard()
        self.timeout, self.deadline, self.max_bytes, self.max_redirects = timeout, deadline, max_bytes, max_redirects
        self._pool = httpcore.ConnectionPool(ssl_context=ssl.create_default_context(), max_connections=16,
                                             network_backend=GuardedNetworkBackend(self.guard))

    def close(self) -> None:
        self._pool.close()

    def fetch(self, url: str) -> Page:
        """The page at `url` as text; AccessError (refused, unreachable, HTTP error, wrong type)."""
        start = time.monotonic()
        for _ in range(self.max_redirects + 1):
            try:
                self.guard.check(url)
                status, headers, body, truncated = self._get(url, start)
            except BlockedURLError as exc:
                raise AccessError(f"refused: {exc}") from None
            except OSError as exc:
                raise AccessError(f"cannot reach {url}: {exc}") from None
            except httpcore.TimeoutException:
                raise AccessError(f"{url} timed out") from None
            except httpcore.ProtocolError as exc:
                raise AccessError(f"{url}: protocol error ({type(exc).__name__}: {exc})") from None
            except httpcore.NetworkError as exc:
                raise AccessError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
            except httpcore.UnsupportedProtocol as exc:
                raise AccessError(f"{url}: {exc}") from None
            if status in REDIRECTS:
                location = headers.get("location")
                if not location:
                    raise AccessError(f"{url} answered HTTP {status} without a Location")
                url = urljoin(url, location)  # checked by the guard at the top of the next hop
                continue
            if status != 200:
                raise AccessError(f"{url} answered HTTP {status}")
            return self._page(url, headers.get("content-type", ""), body, truncated)
        raise AccessError(f"more than {self.max_redirects} redirects, last to {url}")

    def _get(self, url: str, start: float) -> tuple[int, dict, bytes, bool]:
        parts = urlsplit(url)
        host = parts.netloc.rsplit("@", 1)[-1]  # never forward userinfo
        headers = [("Host", host), ("User-Agent", USER_AGENT), ("Accept", "text/html,text/plain;q=0.9,*/*;q=0.1"),
                   ("Accept-Encoding", "identity"), ("Connection", "close")]
        left = max(0.1, self.deadline - (time.monotonic() - start))
        t = min(self.timeout, left)
        with self._pool.stream("GET", url, headers=headers,
                               extensions={"timeout": {"connect": t, "read": t, "write": t, "pool": t}}) as resp:
            head = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in resp.headers}
            if resp.status != 200:
                return resp.status, head, b"", False
            chunks, size, truncated = [], 0, False
            for chunk in resp.iter_stream():
                chunks.append(chunk)
                size += len(chunk)
                if size >= self.max_bytes:
                    truncated = True
                    break
                if time.monotonic() - start > self.deadline:
                    raise httpcore.ReadTimeout(f"the page took longer than {self.deadline:g} s")
            return resp.status, head, b"".join(chunks)[: self.max_bytes], truncated

    @staticmethod
    def _page(url: str, content_type: str, body: bytes, truncated: bool) -> Page:
        kind = content_type.split(";", 1)[0].strip().lower() or "text/html"
        if kind not in TEXT_TYPES:
            raise AccessError(f"{url} is {kind}, which is not a text page (readable: HTML, plain text, JSON, XML)")
        match = _CHARSET.search(content_type)
        try:
            text = body.decode(match.group(1) if match else "utf-8", errors="replace")
        except LookupError:  # an unknown charset name
            text = body.decode("utf-8", errors="replace")
        if kind in ("text/html", "application/xhtml+xml"):
            title, text = html_to_text(text)
        else:
            title = ""
        return Page(url, title, text, truncated, kind)
