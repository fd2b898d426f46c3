"""WebSearchEngine against local fakes of each provider's API (127.0.0.1 only; no internet).

Each fake answers in the provider's documented shape:
  google  GET /customsearch/v1?key&cx&q&num -> {"kind", "searchInformation", "items": [{"title","link","snippet"}]}
          (no "items" key when nothing is found); errors {"error": {"code", "message", "status"}}
  serper  POST /search {"q","num"} + X-API-KEY -> {"searchParameters", "organic": [...], "answerBox"?}
  tavily  POST /search {"query","max_results","search_depth"} + Bearer key -> {"query","results": [...]}
"""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from search_r1.search import SearchError
from search_r1.search.web import RateLimiter, WebSearchEngine

KEY = "test-key-123"


class FakeProvider:
    def __init__(self, provider: str):
        self.provider = provider
        self.requests: list[dict] = []
        self.script: list = []      # per-request overrides, consumed in order: (status, body, headers) or "hang"
        self.delay = 0.0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status, body, headers=None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method):
                url = urlparse(self.path)
                body = {}
                if method == "POST":
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                record = {"method": method, "path": url.path, "params": {k: v[0] for k, v in parse_qs(url.query).items()},
                          "body": body, "headers": {k.lower(): v for k, v in self.headers.items()}}
                with fake.lock:
                    fake.requests.append(record)
                    step = fake.script.pop(0) if fake.script else None
                if step == "hang":
                    time.sleep(1.5)
                    return self._reply(200, fake.answer(record))
                if fake.delay:
                    time.sleep(fake.delay)
                if step is not None:
                    return self._reply(*step)
                return self._reply(*fake.route(record))

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        port = self.server.server_address[1]
        path = {"google": "/customsearch/v1", "serper": "/search", "tavily": "/search"}[provider]
        self.url = f"http://127.0.0.1:{port}{path}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def query_of(self, r) -> str:
        return r["params"].get("q") if self.provider == "google" else r["body"].get("q", r["body"].get("query"))

    def route(self, r):
        """Auth check as the provider does it, then the answer."""
        if self.provider == "google":
            if r["params"].get("key") != KEY:
                return 400, {"error": {"code": 400, "message": "API key not valid. Please pass a valid API key.",
                                       "status": "INVALID_ARGUMENT"}}
        elif self.provider == "serper":
            if r["headers"].get("x-api-key") != KEY:
                return 403, {"message": "Unauthorized.", "statusCode": 403}
        elif r["headers"].get("authorization") != f"Bearer {KEY}":
            return 401, {"detail": {"error": "Unauthorized: missing or invalid API key."}}
        return 200, self.answer(r)

    def answer(self, r):
        q = self.query_of(r)
        n = 0 if q.startswith("nothing") else 2
        if self.provider == "google":
            body = {"kind": "customsearch#search", "searchInformation": {"totalResults": str(n)}}
            if n:
                body["items"] = [{"kind": "customsearch#result", "title": f"{q} page {i}", "link": f"https://ex.com/{i}",
                                  "snippet": f"About {q},\nresult {i}."} for i in range(1, n + 1)]
            return body
        if self.provider == "serper":
            return {"searchParameters": {"q": q, "type": "search", "engine": "google"},
                    "organic": [{"title": f"{q} page {i}", "link": f"https://ex.com/{i}", "snippet": f"About {q}, result {i}.",
                                 "position": i} for i in range(1, n + 1)]}
        return {"query": q, "follow_up_questions": None, "answer": None, "images": [], "response_time": 0.1,
                "results": [{"title": f"{q} page {i}", "url": f"https://ex.com/{i}", "content": f"About {q}, result {i}.",
                             "score": 0.9 / i, "raw_content": None} for i in range(1, n + 1)]}


@pytest.fixture
def fake():
    started = []

    def start(provider):
        f = FakeProvider(provider)
        started.append(f)
        return f

    yield start
    for f in started:
        f.close()


def _engine(f, **kw):
    kw.setdefault("rate_limit", 1000.0)
    kw.setdefault("backoff", 0.01)
    cx = {"cx": "cx-1"} if f.provider == "google" else {}
    return WebSearchEngine(KEY, provider=f.provider, base_url=f.url, topk=2, **cx, **kw)


@pytest.mark.parametrize("provider", ["google", "serper", "tavily"])
def test_each_provider_request_shape_and_rendering(fake, provider):
    f = fake(provider)
    engine = _engine(f)
    text = engine.search("veltra founder")
    assert text == ("Doc 1(Title: veltra founder page 1) About veltra founder, result 1.\n"
                    "Doc 2(Title: veltra founder page 2) About veltra founder, result 2.\n")
    (r,) = f.requests
    if provider == "google":
        assert r["method"] == "GET" and r["params"] == {"key": KEY, "cx": "cx-1", "q": "veltra founder", "num": "2"}
    elif provider == "serper":
        assert r["method"] == "POST" and r["body"] == {"q": "veltra founder", "num": 2}
        assert r["headers"]["x-api-key"] == KEY
    else:
        assert r["method"] == "POST" and r["body"] == {"query": "veltra founder", "max_results": 2, "search_depth": "basic"}
        assert r["headers"]["authorization"] == f"Bearer {KEY}"
    assert engine.search("nothing here") == "No information found for: nothing here"


@pytest.mark.parametrize("provider", ["google", "serper", "tavily"])
def test_batch_retrieve_keeps_each_hit_url(fake, provider):
    """Agents open result pages by URL: each provider's link field becomes the hit's id."""
    f = fake(provider)
    engine = _engine(f)
    (hits, blank, none) = engine.batch_retrieve(["veltra founder", " ", "nothing here"])
    assert hits == [{"id": f"https://ex.com/{i}", "contents": f'"veltra founder page {i}"\nAbout veltra founder, '
                     f"result {i}.", "score": None} for i in (1, 2)]
    assert blank == [] and none == []
    assert len(f.requests) == 2  # the blank query is never sent
    hits[0]["id"] = "changed"
    assert engine.batch_retrieve(["veltra founder"])[0][0]["id"] == "https://ex.com/1"  # the cache is not aliased


def test_serper_answer_box_comes_first(fake):
    f = fake("serper")
    f.script = [(200, {"answerBox": {"title": "Veltra", "answer": "Ana Osk"},
                       "organic": [{"title": "T", "snippet": "S", "link": "x"}]})]
    assert _engine(f).search("who") == "Doc 1(Title: Veltra) Ana Osk\nDoc 2(Title: T) S\n"


def test_blank_query_cache_and_ttl(fake):
    f = fake("tavily")
    engine = _engine(f, cache_ttl=0.3)
    assert engine.batch_search(["", "a", "a", "  "]) == ["", engine.search("a"), engine.search("a"), ""]
    assert len(f.requests) == 1 and engine.stats.cache_hits >= 2  # blank queries are never sent
    time.sleep(0.4)
    engine.search("a")
    assert len(f.requests) == 2  # expired entry refreshed


def test_invalid_query_400_is_no_information(fake):
    f = fake("google")
    f.script = [(400, {"error": {"code": 400, "message": "Request contains an invalid argument.",
                                 "status": "INVALID_ARGUMENT"}})]
    assert _engine(f).search("???") == "No information found for: ???"


def test_timeout_gives_empty_string_or_the_stale_cached_result(fake):
    f = fake("serper")
    engine = _engine(f, timeout=0.3, retries=1, cache_ttl=0.0)
    fresh = engine.search("veltra")
    f.script = ["hang", "hang"]
    assert engine.search("veltra") == fresh  # expired, refresh timed out twice: the cached result
    assert engine.stats.stale_served == 1 and engine.stats.failures == 1
    f.script = ["hang", "hang"]
    assert engine.search("other") == ""      # nothing cached: empty string
    f.script = ["hang", "hang"]
    strict = _engine(f, timeout=0.3, retries=1, on_failure="raise")
    with pytest.raises(SearchError, match="timeout"):
        strict.search("third")


def test_rate_limited_429_is_retried_after_retry_after(fake):
    f = fake("tavily")
    f.script = [(429, {"detail": {"error": "rate limit"}}, {"Retry-After": "0.2"})]
    engine = _engine(f, retries=2)
    t0 = time.monotonic()
    assert engine.search("veltra").startswith("Doc 1(Title: veltra page 1)")
    assert time.monotonic() - t0 >= 0.2 and engine.stats.rate_limited == 1 and len(f.requests) == 2


def test_server_errors_retried_then_succeed(fake):
    f = fake("google")
    f.script = [(503, {"error": {"code": 503, "message": "Backend Error"}}), (500, {"error": {"code": 500}})]
    engine = _engine(f, retries=2)
    assert engine.search("veltra").startswith("Doc 1(")
    assert engine.stats.retries == 2 and len(f.requests) == 3


@pytest.mark.parametrize("provider", ["serper", "tavily"])
def test_bad_key_is_an_error_naming_the_variable_without_the_key(fake, provider):
    f = fake(provider)
    engine = WebSearchEngine("wrong-key-999", provider=provider, base_url=f.url, rate_limit=1000.0)
    with pytest.raises(SearchError, match=f"{provider.upper()}_API_KEY") as err:
        engine.search("veltra")
    assert "wrong-key-999" not in str(err.value)
    assert len(f.requests) == 1  # not retried


def test_batch_is_searched_concurrently_in_order(fake):
    f = fake("serper")
    f.delay = 0.3
    engine = _engine(f, max_concurrency=6)
    queries = [f"q{i}" for i in range(6)]
    t0 = time.monotonic()
    out = engine.batch_search(queries)
    elapsed = time.monotonic() - t0
    assert [o.split(" page")[0] for o in out] == [f"Doc 1(Title: q{i}" for i in range(6)]
    assert elapsed < 6 * 0.3 * 0.6, f"6 queries took {elapsed:.2f}s: not concurrent"


def test_rate_limiter_queues_callers(fake):
    f = fake("tavily")
    engine = _engine(f, rate_limit=10.0, max_concurrency=5)
    t0 = time.monotonic()
    engine.batch_search([f"q{i}" for i in range(5)])
    # burst 1 then 10/s: the 5th request starts no earlier than 0.4 s after the first
    assert time.monotonic() - t0 >= 0.38 and len(f.requests) == 5
    limiter = RateLimiter(rate=100.0, burst=3)
    t0 = time.monotonic()
    for _ in range(3):
        limiter.acquire()
    assert time.monotonic() - t0 < 0.05  # a burst passes at once


def test_construction_errors(monkeypatch):
    for var in ("GOOGLE_API_KEY", "SERPER_API_KEY", "TAVILY_API_KEY", "GOOGLE_CSE_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="SERPER_API_KEY"):
        WebSearchEngine(provider="serper")
    with pytest.raises(ValueError, match="GOOGLE_CSE_ID"):
        WebSearchEngine("k", provider="google")
    with pytest.raises(ValueError, match="choose one of"):
        WebSearchEngine("k", provider="bing")
    with pytest.raises(ValueError, match="unencrypted"):
        WebSearchEngine("k", provider="tavily", base_url="http://api.example.com/search")
    monkeypatch.setenv("TAVILY_API_KEY", "from-env")
    assert WebSearchEngine(provider="tavily").api_key == "from-env"
    assert WebSearchEngine(provider="tavily", base_url="http://localhost:1/search").base_url.startswith("http://localhost")
