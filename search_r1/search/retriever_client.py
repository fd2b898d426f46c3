"""HTTP client for the Search-R1 retriever API (`POST /retrieve`), used by every rollout path.

One `batch_search` call sends all of its uncached queries in one request, so a rollout turn costs one
round trip however many trajectories searched. Several server URLs are used round-robin; a URL that
fails (connection error, timeout, 5xx) is skipped for `health_cooldown` seconds and the request moves
to the next one. A 4xx is the caller's fault and is raised at once with the server's message.

    client = RetrieverClient(["http://127.0.0.1:8000", "http://127.0.0.1:8001/retrieve"], topk=3)
    texts = client.batch_search(["who founded Veltra?", "where is Osk?"])   # rendered passages
    docs = client.batch_retrieve(["where is Osk?"])                          # [[{id, contents, score}]]
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import httpx

from search_r1.search.base import SearchEngine, SearchError
from search_r1.search.format import render_passages
from search_r1.search.retry import backoff_delay

API_KEY_ENV = "RETRIEVER_API_KEY"


def normalize_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` or `http://h:p/retrieve` -> `http://h:p/retrieve`.

    Upstream Search-R1 configs pass the full `.../retrieve` URL (`search_url`); people also pass the
    server's base URL. A bare `host:port` gets `http://`.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"retriever url must be a non-empty string like 'http://127.0.0.1:8000', got {url!r}")
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"retriever url {url!r} must use http:// or https://")
    if not url.endswith("/retrieve"):
        url += "/retrieve"
    return url


def resolve_api_key(api_key: str | None = None) -> str | None:
    """The retriever's bearer token: `api_key` when given, else env RETRIEVER_API_KEY, else None."""
    return api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None


def check_reachable(url: str, timeout: float = 5.0, api_key: str | None = None) -> None:
    """GET /health and one tiny /retrieve, sending the bearer token (`resolve_api_key`) as the
    rollouts will; SearchError naming the URL and what failed (a 401/403 names RETRIEVER_API_KEY)."""
    base = normalize_url(url).removesuffix("/retrieve")
    key = resolve_api_key(api_key)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        httpx.get(base + "/health", timeout=timeout).raise_for_status()
        resp = httpx.post(base + "/retrieve", json={"queries": ["test"], "topk": 1, "return_scores": False},
                          headers=headers, timeout=timeout)
    except Exception as exc:  # connection refused, timeout, HTTP error: all mean "not usable"
        raise SearchError(f"retriever at {url} is unreachable ({type(exc).__name__}: {exc})") from None
    if resp.status_code in (401, 403):
        sent = f"the key from {API_KEY_ENV}" if api_key is None and key else ("a key" if key else "no key")
        raise SearchError(f"retriever at {url} refused /retrieve with HTTP {resp.status_code} ({sent} sent): "
                          f"{_error_message(resp)}. Set {API_KEY_ENV} to the server's --api-key")
    if resp.status_code >= 400:
        raise SearchError(f"retriever at {url} answered /retrieve with HTTP {resp.status_code}: {_error_message(resp)}")


def parse_hit(hit) -> dict:
    """One hit of a `/retrieve` result -> `{"id", "contents", "score"}` (score None when absent).

    Accepts both shapes the API produces: `{"document": {...}, "score": s}` (return_scores=true) and
    a bare document (return_scores=false, or servers that never send scores). A document without
    `contents` but with `title`/`text` (some corpora) is folded into the `"Title"\\ntext` convention.
    """
    if not isinstance(hit, dict):
        raise ValueError(f"expected a document object, got {type(hit).__name__}: {str(hit)[:120]}")
    doc = hit["document"] if isinstance(hit.get("document"), dict) else hit
    score = hit.get("score")
    if "contents" in doc:
        contents = doc["contents"]
    elif "text" in doc:
        contents = f"\"{doc.get('title', '')}\"\n{doc['text']}"
    else:
        raise ValueError(f"document has neither 'contents' nor 'text': keys {sorted(doc)}")
    return {"id": str(doc.get("id", "")), "contents": contents,
            "score": None if score is None else float(score)}


class _LRUCache:
    """Thread-safe LRU map; capacity 0 disables it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key not in self._data:
                return None
            self._data.move_to_end(key)
            return self._data[key]

    def put(self, key, value) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


@dataclass
class ClientStats:
    """Counters for metrics and tests; `requests` counts HTTP POSTs actually sent (incl. failed)."""

    requests: int = 0
    queries_sent: int = 0
    cache_hits: int = 0
    failures: int = 0
    retry_rounds: int = 0


class _RetryableError(Exception):
    """A failure another URL (or a later round) may not have: connection, timeout, 5xx, bad body."""


@dataclass
class _Endpoint:
    url: str
    failed_at: float | None = None  # monotonic time of the last failure; None = healthy
    last_error: str = field(default="", repr=False)


class RetrieverClient(SearchEngine):
    """Search engine backed by one or more retriever servers speaking the Search-R1 HTTP API.

    Args:
        urls: one URL or a list; base URLs or full `.../retrieve` URLs.
        topk: passages per query.
        timeout: seconds per HTTP request (connect and read).
        retries: extra rounds after the first; a round tries every URL once, starting round-robin.
        backoff: sleep before retry round r (1-based) is `backoff * 2**(r-1) * U(1, 1.5)` seconds.
        cache_size: LRU entries keyed by (query, topk); 0 disables caching.
        api_key: bearer token; defaults to env `RETRIEVER_API_KEY`.
        max_batch_size: most queries per POST (the server's `--max-queries`); larger calls are split.
        health_cooldown: seconds a failed URL is tried only after the healthy ones.
    """

    def __init__(self, urls: str | list[str], topk: int = 3, timeout: float = 10.0, retries: int = 3,
                 backoff: float = 0.5, cache_size: int = 4096, api_key: str | None = None,
                 max_batch_size: int = 4096, health_cooldown: float = 5.0):
        url_list = [urls] if isinstance(urls, str) else list(urls or [])
        if not url_list:
            raise ValueError("RetrieverClient needs at least one url, e.g. urls='http://127.0.0.1:8000'")
        for name, value, low in (("topk", topk, 1), ("retries", retries, 0),
                                 ("max_batch_size", max_batch_size, 1), ("cache_size", cache_size, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"RetrieverClient {name} must be an int >= {low}, got {value!r}")
        for name, value, positive in (("timeout", timeout, True), ("backoff", backoff, False),
                                      ("health_cooldown", health_cooldown, False)):
            if not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
                raise ValueError(f"RetrieverClient {name} must be a number {'> 0' if positive else '>= 0'}, "
                                 f"got {value!r}")
        self.endpoints = [_Endpoint(normalize_url(u)) for u in dict.fromkeys(url_list)]
        self.topk, self.timeout, self.retries, self.backoff = topk, float(timeout), retries, float(backoff)
        self.max_batch_size, self.health_cooldown = max_batch_size, float(health_cooldown)
        self.stats = ClientStats()
        self._cache = _LRUCache(cache_size)
        self._lock = threading.Lock()  # guards round-robin pointer, endpoint health, stats
        self._next = 0
        api_key = resolve_api_key(api_key)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One pooled keep-alive client for the client's life: no TCP handshake per search call.
        # httpx.Client is safe to share across threads.
        self._http = httpx.Client(timeout=httpx.Timeout(self.timeout), headers=headers,
                                  limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    # --- SearchEngine -------------------------------------------------------------------------

    def batch_search(self, queries: list[str]) -> list[str]:
        """Rendered passages (`Doc {i}(Title: ..) ..` lines) per query, in order."""
        return [render_passages([d["contents"] for d in docs]) for docs in self.batch_retrieve(queries)]

    def batch_retrieve(self, queries: list[str]) -> list[list[dict]]:
        """Raw hits `{"id", "contents", "score"}` per query; cached queries are not re-sent, blank
        (empty or whitespace-only) queries get `[]` without a request."""
        if isinstance(queries, str) or not isinstance(queries, (list, tuple)):
            raise ValueError(f"queries must be a list of strings, got {type(queries).__name__}")
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise ValueError(f"queries[{i}] must be a string, got {type(q).__name__}: {q!r}")
        results: dict[str, list[dict]] = {}
        missing: list[str] = []
        for q in dict.fromkeys(queries):  # de-duplicate, keep order
            if not q.strip():
                # The server rejects blank queries with a 422 for the whole request; one blank query
                # must not fail the other trajectories of the turn, so it gets no documents.
                results[q] = []
                continue
            hit = self._cache.get((q, self.topk))
            if hit is None:
                missing.append(q)
            else:
                results[q] = hit
        with self._lock:
            self.stats.cache_hits += sum(1 for q in results if q.strip())
        for start in range(0, len(missing), self.max_batch_size):
            chunk = missing[start:start + self.max_batch_size]
            for q, docs in zip(chunk, self._post_with_failover(chunk)):
                self._cache.put((q, self.topk), docs)
                results[q] = docs
        # Callers may mutate what they get; hand out copies, keep the cached lists pristine.
        return [[dict(d) for d in results[q]] for q in queries]

    def batch_access(self, ids: list[str]) -> list[dict | None]:
        """Whole documents by id through the server's `POST /access`: `{"id", "contents"}` per id, or
        None for an id the corpus does not hold. Same fail-over, retries and errors as searches;
        not cached (agents read a document once)."""
        if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
            raise ValueError(f"ids must be a list of strings, got {type(ids).__name__}")
        for i, doc_id in enumerate(ids):
            if not isinstance(doc_id, str) or not doc_id.strip():
                raise ValueError(f"ids[{i}] must be a non-empty string, got {doc_id!r}")
        out: list[dict | None] = []
        for start in range(0, len(ids), self.max_batch_size):
            out += self._post_with_failover(list(ids[start:start + self.max_batch_size]), "access")
        return out

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RetrieverClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def clear_cache(self) -> None:
        self._cache.clear()

    # --- transport ----------------------------------------------------------------------------

    def _round_order(self) -> list[_Endpoint]:
        """This round's URL order: healthy ones from the round-robin pointer, then cooling-down ones."""
        with self._lock:
            n = len(self.endpoints)
            start = self._next % n
            self._next += 1
            rotated = self.endpoints[start:] + self.endpoints[:start]
            now = time.monotonic()
            cool = [e.failed_at is None or now - e.failed_at >= self.health_cooldown for e in rotated]
            healthy = [e for e, ok in zip(rotated, cool) if ok]
            sick = sorted((e for e, ok in zip(rotated, cool) if not ok), key=lambda e: e.failed_at)
            return healthy + sick

    def _post_with_failover(self, queries: list[str], route: str = "retrieve") -> list:
        """`_post` to one URL after another, rounds with backoff; route "retrieve" or "access"."""
        tried: dict[str, str] = {}  # url -> last error, in first-tried order
        for rnd in range(self.retries + 1):
            if rnd > 0:
                with self._lock:
                    self.stats.retry_rounds += 1
                time.sleep(backoff_delay(rnd, self.backoff))  # exponential, jittered (no lockstep)
            for ep in self._round_order():
                try:
                    docs = self._post(ep.url, queries, route)
                except _RetryableError as exc:
                    tried[ep.url] = str(exc)
                    with self._lock:
                        ep.failed_at, ep.last_error = time.monotonic(), str(exc)
                        self.stats.failures += 1
                    continue
                with self._lock:
                    ep.failed_at = None
                return docs
        last_url = next(reversed(tried))
        per_url = "; ".join(f"{u} -> {e}" for u, e in tried.items())
        raise SearchError(
            f"retriever failed after {self.retries + 1} round(s) over {len(self.endpoints)} url(s) "
            f"({len(queries)} {'queries' if route == 'retrieve' else 'ids'}); last error from {last_url}: "
            f"{tried[last_url]}; "
            f"last error per url: {per_url}")

    def _post(self, url: str, queries: list[str], route: str = "retrieve") -> list:
        with self._lock:
            self.stats.requests += 1
            self.stats.queries_sent += len(queries) if route == "retrieve" else 0
        if route == "access":  # the endpoint URLs are normalised to .../retrieve
            url = url[: -len("retrieve")] + "access"
            payload = {"ids": queries}
        else:
            payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        try:
            resp = self._http.post(url, json=payload)
        except httpx.TimeoutException as exc:
            raise _RetryableError(f"timeout after {self.timeout:g}s ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise _RetryableError(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise _RetryableError(f"HTTP {resp.status_code}: {_error_message(resp)}")
        if resp.status_code >= 400:
            hint = ""
            if resp.status_code in (401, 403):
                hint = f" (pass api_key=... or set {API_KEY_ENV} to the server's --api-key)"
            raise SearchError(f"retriever {url} rejected the request with HTTP {resp.status_code}: "
                              f"{_error_message(resp)}{hint}")
        try:
            result = resp.json()["result"]
            if not isinstance(result, list) or len(result) != len(queries):
                got = len(result) if isinstance(result, list) else type(result).__name__
                raise ValueError(f"'result' has {got} entries for {len(queries)} requested")
            if route == "access":
                return [None if d is None else parse_hit(d) for d in result]
            return [[parse_hit(h) for h in hits] for hits in result]
        except (ValueError, KeyError, TypeError) as exc:
            raise _RetryableError(f"malformed response body ({exc}): {resp.text[:200]!r}") from exc


def _error_message(resp: httpx.Response) -> str:
    """The server's own explanation: FastAPI's `detail` when JSON, else the body's start."""
    try:
        body = resp.json()
        detail = body.get("detail", body) if isinstance(body, dict) else body
        return detail if isinstance(detail, str) else str(detail)[:500]
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
