"""Web search APIs as a `SearchEngine`: Google Programmable Search (JSON API), Serper and Tavily.

    engine = WebSearchEngine(provider="serper")              # key from SERPER_API_KEY
    engine = WebSearchEngine(api_key, provider="google", cx="0123:abc")
    texts = engine.batch_search(["who founded Veltra", "capital of Osk"])   # `Doc i(Title: ..) ..` lines
    hits = engine.batch_retrieve(["who founded Veltra"])   # [[{"id": url, "contents", "score": None}]]

Requests, per provider (the shapes the fake servers in tests/search_r1/search/test_web.py answer):
    google  GET  {base}?key=KEY&cx=CX&q=QUERY&num=K          -> {"items": [{"title", "link", "snippet"}]}
    serper  POST {base} {"q", "num"}, header X-API-KEY       -> {"organic": [{"title", "link", "snippet"}],
                                                                  "answerBox": {"title", "answer"|"snippet"}}
    tavily  POST {base} {"query", "max_results", "search_depth"}, header Authorization: Bearer KEY
                                                             -> {"results": [{"title", "url", "content"}]}

Behaviour: each unique, uncached query of a batch is one request, sent concurrently (up to
`max_concurrency` at once) through a token-bucket rate limiter that makes callers queue rather than
exceed `rate_limit` requests per second. Timeouts, connection errors, HTTP 429 and 5xx are retried
(a 429 waits for the server's Retry-After when given, else exponential backoff). A query the
provider rejects as invalid (HTTP 400) or that has no hits gets `No information found for: {query}`;
a blank query gets "" without a request. Results are cached (LRU, `cache_ttl` seconds); when a query
still fails after its retries, a stale cached result is served if there is one, else "" (or a
`SearchError` with `on_failure="raise"`). Wrong or missing keys (HTTP 401/403) raise `SearchError` at
once: a configuration error must not look like an empty web.

Keys travel only over HTTPS; a plain-http `base_url` is accepted for loopback hosts only (local test
servers), and keys never appear in error messages.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from search_r1.search.base import SearchEngine, SearchError
from search_r1.search.format import render_passages
from search_r1.search.retry import backoff_delay
from search_r1.transport import check_key_transport

logger = logging.getLogger(__name__)

PROVIDERS = ("google", "serper", "tavily")
DEFAULT_BASE_URLS = {
    "google": "https://www.googleapis.com/customsearch/v1",
    "serper": "https://google.serper.dev/search",
    "tavily": "https://api.tavily.com/search",
}
KEY_ENV = {"google": "GOOGLE_API_KEY", "serper": "SERPER_API_KEY", "tavily": "TAVILY_API_KEY"}
GOOGLE_CX_ENV = "GOOGLE_CSE_ID"
GOOGLE_MAX_NUM = 10  # the JSON API returns at most 10 results per request
ON_FAILURE = ("empty", "raise")
_RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


def no_information(query: str) -> str:
    return f"No information found for: {query}"


class RateLimiter:
    """Token bucket: at most `rate` acquisitions per second on average, bursts up to `burst`.

    `acquire()` blocks until a token is free, so concurrent callers queue instead of failing.
    """

    def __init__(self, rate: float, burst: int = 1):
        if not rate > 0 or burst < 1:
            raise ValueError(f"RateLimiter needs rate > 0 and burst >= 1, got rate={rate!r}, burst={burst!r}")
        self.rate, self.burst = float(rate), int(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.waited_s = 0.0

    def acquire(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                wait = (1 - self._tokens) / self.rate
                self.waited_s += wait
            time.sleep(wait)


@dataclass
class WebSearchStats:
    """Counters: HTTP requests sent, cache hits, 429 answers, retried attempts, queries that failed
    after their retries, stale cache entries served instead."""

    requests: int = 0
    cache_hits: int = 0
    rate_limited: int = 0
    retries: int = 0
    failures: int = 0
    stale_served: int = 0


class _Retry(Exception):
    def __init__(self, message: str, wait: float | None = None):
        super().__init__(message)
        self.wait = wait


class WebSearchEngine(SearchEngine):
    """A web search API as a SearchEngine (see the module docstring for providers and behaviour).

    Args:
        api_key: provider key; None = the provider's environment variable (KEY_ENV).
        provider: "google" | "serper" | "tavily".
        cx: Google Programmable Search Engine id (google only); None = env GOOGLE_CSE_ID.
        topk: results per query (google: at most 10).
        timeout: seconds per HTTP request; retries: extra attempts per query; backoff: base of the
            exponential backoff (seconds).
        rate_limit: requests per second over all threads; burst: requests allowed back to back.
        cache_size: cached queries (0 disables); cache_ttl: seconds a result is fresh (None = forever).
        max_concurrency: requests in flight at once for one batch.
        base_url: the provider endpoint (default: the public API; a loopback URL in tests).
        on_failure: "empty" (return "" or a stale cached result) or "raise" (SearchError).
    """

    def __init__(self, api_key: str | None = None, provider: str = "google", cx: str | None = None, topk: int = 3,
                 timeout: float = 10.0, retries: int = 3, backoff: float = 0.5, rate_limit: float = 5.0,
                 burst: int = 1, cache_size: int = 4096, cache_ttl: float | None = 3600.0,
                 max_concurrency: int = 8, base_url: str | None = None, on_failure: str = "empty"):
        from search_r1.search.retriever_client import _LRUCache

        if provider not in PROVIDERS:
            raise ValueError(f"unknown web search provider {provider!r}; choose one of {list(PROVIDERS)}")
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure={on_failure!r}; choose one of {list(ON_FAILURE)}")
        for name, value, low in (("topk", topk, 1), ("retries", retries, 0), ("cache_size", cache_size, 0),
                                 ("max_concurrency", max_concurrency, 1), ("burst", burst, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"WebSearchEngine {name} must be an int >= {low}, got {value!r}")
        for name, value in (("timeout", timeout), ("rate_limit", rate_limit)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"WebSearchEngine {name} must be a number > 0, got {value!r}")
        if provider == "google" and topk > GOOGLE_MAX_NUM:
            raise ValueError(f"Google's JSON API returns at most {GOOGLE_MAX_NUM} results per request; got topk={topk}")
        self.provider = provider
        self.api_key = api_key or os.environ.get(KEY_ENV[provider], "")
        if not self.api_key:
            raise ValueError(f"WebSearchEngine(provider={provider!r}) needs an API key: pass api_key=... or set "
                             f"{KEY_ENV[provider]}")
        self.cx = cx or os.environ.get(GOOGLE_CX_ENV, "")
        if provider == "google" and not self.cx:
            raise ValueError(f"Google Programmable Search needs the search engine id: pass cx=... or set {GOOGLE_CX_ENV}")
        self.base_url = check_key_transport(base_url or DEFAULT_BASE_URLS[provider])
        self.topk, self.retries, self.backoff = topk, retries, float(backoff)
        self.cache_ttl, self.on_failure, self.max_concurrency = cache_ttl, on_failure, max_concurrency
        self.stats = WebSearchStats()
        self.limiter = RateLimiter(rate_limit, burst)
        self._cache = _LRUCache(cache_size)  # query -> (hits, stored at, monotonic seconds)
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=httpx.Timeout(timeout), headers=self._headers(),
                                  limits=httpx.Limits(max_connections=max(max_concurrency, 1)))

    # --- SearchEngine ---------------------------------------------------------------------------

    def batch_search(self, queries: list[str]) -> list[str]:
        """Rendered results per query: `Doc i(Title: ..) snippet` lines, `No information found for:
        QUERY` when the provider has no hit, "" for a blank query or a failure (see the module doc)."""
        return [("" if hits is None or not q.strip() else
                 render_passages([h["contents"] for h in hits]) if hits else no_information(q))
                for q, hits in zip(queries, self._batch(queries))]

    def batch_retrieve(self, queries: list[str]) -> list[list[dict]]:
        """Hits per query as `{"id": URL, "contents": '"Title"\\nsnippet', "score": None}` (the
        retriever client's shape; the id is the page URL, "" when the provider gave none); [] for a
        blank query, no hit or a failure."""
        return [[dict(h) for h in hits or []] for hits in self._batch(queries)]

    def _batch(self, queries: list[str]) -> list[list[dict] | None]:
        """Hits per query (None: failed after retries, nothing cached), each unique query once."""
        if isinstance(queries, str) or not isinstance(queries, (list, tuple)):
            raise ValueError(f"queries must be a list of strings, got {type(queries).__name__}")
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise ValueError(f"queries[{i}] must be a string, got {type(q).__name__}: {q!r}")
        results: dict[str, list[dict] | None] = {}
        missing = []
        now = time.monotonic()
        for q in dict.fromkeys(queries):
            if not q.strip():
                results[q] = []  # nothing to search: an empty step, no request
                continue
            hit = self._cache.get(q)
            if hit is not None and (self.cache_ttl is None or now - hit[1] <= self.cache_ttl):
                results[q] = hit[0]
                self._count("cache_hits")
            else:
                missing.append(q)
        if len(missing) == 1:
            results[missing[0]] = self._search_one(missing[0])
        elif missing:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(missing))) as pool:
                results.update(zip(missing, pool.map(self._search_one, missing)))
        return [results[q] for q in queries]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "WebSearchEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- one query ------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def _search_one(self, query: str) -> list[dict] | None:
        last_error, wait = "no attempt made", None
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
                time.sleep(wait if wait is not None else backoff_delay(attempt, self.backoff))
            self.limiter.acquire()
            try:
                hits = self._request(query)
            except _Retry as exc:
                last_error, wait = self._scrub(str(exc)), exc.wait
                continue
            self._cache.put(query, (hits, time.monotonic()))
            return hits
        self._count("failures")
        stale = self._cache.get(query)
        logger.warning("%s search failed after %d attempt(s) for %r: %s%s", self.provider, self.retries + 1,
                       query[:80], last_error, "; serving the cached result" if stale else "")
        if stale is not None:
            self._count("stale_served")
            return stale[0]
        if self.on_failure == "raise":
            raise SearchError(f"{self.provider} search failed after {self.retries + 1} attempt(s): {last_error}")
        return None

    def _request(self, query: str) -> list[dict]:
        self._count("requests")
        try:
            if self.provider == "google":
                resp = self._http.get(self.base_url, params={"key": self.api_key, "cx": self.cx, "q": query,
                                                             "num": self.topk})
            elif self.provider == "serper":
                resp = self._http.post(self.base_url, json={"q": query, "num": self.topk})
            else:
                resp = self._http.post(self.base_url, json={"query": query, "max_results": self.topk,
                                                            "search_depth": "basic"})
        except httpx.TimeoutException as exc:
            raise _Retry(f"timeout ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        if resp.status_code == 429:
            self._count("rate_limited")
            raise _Retry("HTTP 429 (rate limited)", _retry_after(resp))
        if resp.status_code in _RETRYABLE:
            raise _Retry(f"HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code in (401, 403):
            raise SearchError(f"{self.provider} rejected the API key (HTTP {resp.status_code}: "
                              f"{self._scrub(resp.text[:200])}); check {KEY_ENV[self.provider]} / api_key")
        if resp.status_code == 400:  # the provider finds the query itself invalid
            return []
        if resp.status_code != 200:
            raise _Retry(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            docs = self._parse(resp.json())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _Retry(f"malformed response ({exc}): {resp.text[:200]!r}") from None
        return docs[: self.topk]

    # --- provider shapes ------------------------------------------------------------------------

    def _headers(self) -> dict:
        if self.provider == "serper":
            return {"X-API-KEY": self.api_key}
        if self.provider == "tavily":
            return {"Authorization": f"Bearer {self.api_key}"}
        return {}  # google: the key is a query parameter

    def _parse(self, body: dict) -> list[dict]:
        """Response body -> hits `{"id": url, "contents": '"Title"\\ntext', "score": None}`."""
        if self.provider == "google":
            hits = [(h.get("title", ""), h.get("snippet", ""), h.get("link")) for h in body.get("items") or []]
        elif self.provider == "serper":
            hits = []
            box = body.get("answerBox")
            if isinstance(box, dict) and (box.get("answer") or box.get("snippet")):
                hits.append((box.get("title", "Answer"), box.get("answer") or box.get("snippet"), box.get("link")))
            hits += [(h.get("title", ""), h.get("snippet", ""), h.get("link")) for h in body.get("organic") or []]
        else:
            hits = [(h.get("title", ""), h.get("content", ""), h.get("url")) for h in body.get("results") or []]
        # One line per document: snippets may hold newlines.
        return [{"id": url if isinstance(url, str) else "",
                 "contents": f"\"{' '.join(str(t).split())}\"\n{' '.join(str(s).split())}", "score": None}
                for t, s, url in hits if t or s]

    def _scrub(self, text: str) -> str:
        return text.replace(self.api_key, "***") if self.api_key else text


def _retry_after(resp: httpx.Response) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form), capped at 60; None if absent."""
    value = resp.headers.get("Retry-After")
    try:
        return min(max(float(value), 0.0), 60.0) if value is not None else None
    except ValueError:
        return None
