"""The URL guard and the guarded page fetcher.

Refusals are checked three ways: literal addresses and schemes; DNS names resolving to refused
addresses (a resolver seam stands in for DNS: no /etc/hosts edits, no network); and redirects, served
by a real local HTTP server whose address the guard is told to allow (`allowed_networks`), so the
first hop is fetched for real and the redirect's target is what gets refused. Every refusal must
happen before any connection to the refused target (the server counts its requests).
"""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from search_r1.agents.urlguard import BlockedURLError, UrlGuard, address_problem, check_url
from search_r1.agents.webpage import AccessError, PageFetcher, html_to_text

PUBLIC = "93.184.216.34"


def fake_dns(table: dict):
    """A resolver over a fixed table (what the guard sees instead of DNS)."""
    def resolve(host, port):
        if host not in table:
            raise OSError(f"unknown host {host}")
        value = table[host]
        return value() if callable(value) else list(value)
    return resolve


@pytest.mark.parametrize("url, problem", [
    ("http://127.0.0.1/", "loopback"),
    ("http://127.1.2.3:8080/admin", "loopback"),
    ("http://[::1]/", "loopback"),
    ("http://localhost:8000/", "loopback"),             # through the system resolver
    ("http://2130706433/", "loopback"),                 # 127.0.0.1 spelled as one number
    ("http://[::ffff:127.0.0.1]/", "loopback"),         # IPv4-mapped IPv6
    ("http://10.0.0.5/", "private"),
    ("http://172.16.3.4/", "private"),
    ("https://192.168.1.1/", "private"),
    ("http://[fd12::1]/", "private"),
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://169.254.10.10/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://224.0.0.1/", "multicast"),
    ("http://0.0.0.0:80/", "unspecified"),
    ("http://100.64.1.1/", "not globally routable"),
])
def test_refused_addresses(url, problem):
    with pytest.raises(BlockedURLError, match=problem):
        check_url(url)


@pytest.mark.parametrize("url, scheme", [
    ("file:///etc/passwd", "file"), ("ftp://ftp.example.org/pub", "ftp"), ("gopher://x.org/", "gopher"),
    ("data:text/html,hi", "data"), ("javascript:alert(1)", "javascript"), ("//no-scheme.org/", "(none)"),
])
def test_refused_schemes_even_when_private_addresses_are_allowed(url, scheme):
    with pytest.raises(BlockedURLError, match=f"scheme '{scheme}'" if scheme != "(none)" else "scheme"):
        check_url(url, allow_private=True)


def test_names_are_judged_by_what_they_resolve_to():
    dns = fake_dns({"metadata.internal": ["169.254.169.254"], "intranet.example": ["10.1.2.3"],
                    "mixed.example": [PUBLIC, "127.0.0.1"], "public.example": [PUBLIC],
                    "v6.example": ["2001:4860:4860::8888"]})
    with pytest.raises(BlockedURLError, match="metadata.internal \\(169.254.169.254\\) is a cloud metadata"):
        check_url("http://metadata.internal/computeMetadata/v1/", resolver=dns)
    with pytest.raises(BlockedURLError, match="private"):
        check_url("https://intranet.example/wiki", resolver=dns)
    with pytest.raises(BlockedURLError, match="loopback"):  # ANY refused address refuses the name
        check_url("http://mixed.example/", resolver=dns)
    assert check_url("http://public.example:8080/x", resolver=dns) == [PUBLIC]
    assert check_url("https://v6.example/", resolver=dns) == ["2001:4860:4860::8888"]
    assert check_url("http://93.184.216.34/") == [PUBLIC]  # a literal is not resolved
    with pytest.raises(OSError, match="unknown host"):
        check_url("http://nowhere.example/", resolver=dns)


def test_flags_lift_the_address_checks():
    dns = fake_dns({"intranet.example": ["10.1.2.3"]})
    assert check_url("http://intranet.example/", allow_private=True, resolver=dns) == ["10.1.2.3"]
    assert check_url("http://intranet.example/", allowed_networks=["10.1.0.0/16"], resolver=dns) == ["10.1.2.3"]
    with pytest.raises(BlockedURLError):
        check_url("http://10.2.0.1/", allowed_networks=["10.1.0.0/16"])
    assert address_problem("127.0.0.1", ["127.0.0.1/32"]) is None
    with pytest.raises(ValueError, match="not an address or CIDR"):
        UrlGuard(allowed_networks=("ten-dot-something",))


# -- the fetcher against a real local server ----------------------------------------------------------
class LocalSite:
    """A real HTTP server on 127.0.0.1 with redirects, pages of several kinds, a slow page."""

    def __init__(self):
        self.requests: list[str] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, status, body=b"", headers=()):
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                site.requests.append(self.path)
                port = site.port
                redirects = {"/to-loopback": f"http://127.0.0.2:{port}/page", "/to-metadata": "http://169.254.169.254/",
                             "/to-file": "file:///etc/passwd", "/to-ftp": "ftp://example.org/x",
                             "/to-name": f"http://intranet.example:{port}/page", "/to-page": "/page",
                             "/loop": "/loop"}
                if self.path in redirects:
                    return self.send(302, headers=[("Location", redirects[self.path])])
                if self.path == "/page":
                    return self.send(200, b"<html><head><title>The  Page</title><script>var x = 1;</script></head>"
                                          b"<body><h1>Rutuk &amp; Mikteis</h1><p>Mikteis is   the capital.</p>"
                                          b"<style>p {}</style><ul><li>one</li><li>two</li></ul></body></html>",
                                     [("Content-Type", "text/html; charset=utf-8")])
                if self.path == "/big":
                    return self.send(200, b"x" * 50_000, [("Content-Type", "text/plain")])
                if self.path == "/image":
                    return self.send(200, b"\x89PNG", [("Content-Type", "image/png")])
                if self.path == "/slow":
                    time.sleep(2.0)
                    try:
                        return self.send(200, b"late", [("Content-Type", "text/plain")])
                    except BrokenPipeError:  # the fetcher gave up, as it should
                        return None
                return self.send(404, b"not found", [("Content-Type", "text/plain")])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site():
    s = LocalSite()
    yield s
    s.close()


def fetcher_for(site, **kw) -> PageFetcher:
    """A fetcher whose guard allows exactly the test server's address (nothing else local)."""
    dns = fake_dns({"intranet.example": ["10.1.2.3"], "site.example": ["127.0.0.1"]})
    return PageFetcher(UrlGuard(allowed_networks=("127.0.0.1/32",), resolver=dns), **kw)


def test_fetch_html_as_text_and_follow_a_safe_redirect(site):
    page = fetcher_for(site).fetch(site.url("/to-page"))
    assert page.url == site.url("/page") and page.title == "The Page"
    assert page.text == "Rutuk & Mikteis\nMikteis is the capital.\none\ntwo" and not page.truncated
    assert site.requests == ["/to-page", "/page"]


@pytest.mark.parametrize("path, problem", [
    ("/to-loopback", "127.0.0.2 is a loopback address"),
    ("/to-metadata", "cloud metadata"),
    ("/to-file", "scheme 'file'"),
    ("/to-ftp", "scheme 'ftp'"),
    ("/to-name", r"intranet.example \(10.1.2.3\) is a private address"),
])
def test_redirects_to_refused_targets_are_not_followed(site, path, problem):
    with pytest.raises(AccessError, match=f"refused: .*{problem}"):
        fetcher_for(site).fetch(site.url(path))
    assert site.requests == [path]  # the refused hop was never requested


def test_without_the_allowance_the_local_site_itself_is_refused(site):
    with pytest.raises(AccessError, match="loopback"):
        PageFetcher().fetch(site.url("/page"))
    with pytest.raises(AccessError, match="loopback"):
        PageFetcher(UrlGuard(resolver=fake_dns({"site.example": ["127.0.0.1"]}))).fetch(
            f"http://site.example:{site.port}/page")
    assert site.requests == []


def test_dns_rebinding_is_refused_at_connect_time(site):
    """The name resolves to a public address when checked, then to 127.0.0.1: the connection is
    opened only to addresses checked at connect time, so it is refused and nothing reaches the server."""
    answers = iter([[PUBLIC], ["127.0.0.1"]])
    fetcher = PageFetcher(UrlGuard(resolver=fake_dns({"rebind.example": lambda: next(answers)})))
    with pytest.raises(AccessError, match="refused: .*rebind.example \\(127.0.0.1\\) is a loopback"):
        fetcher.fetch(f"http://rebind.example:{site.port}/page")
    assert site.requests == []


def test_size_cap_content_type_status_timeout_and_redirect_loop(site):
    page = fetcher_for(site, max_bytes=1000).fetch(site.url("/big"))
    assert page.truncated and len(page.text) == 1000 and page.content_type == "text/plain"
    with pytest.raises(AccessError, match="image/png, which is not a text page"):
        fetcher_for(site).fetch(site.url("/image"))
    with pytest.raises(AccessError, match="HTTP 404"):
        fetcher_for(site).fetch(site.url("/missing"))
    start = time.monotonic()
    with pytest.raises(AccessError, match="timed out"):
        fetcher_for(site, timeout=0.3, deadline=0.5).fetch(site.url("/slow"))
    assert time.monotonic() - start < 1.5
    with pytest.raises(AccessError, match="more than 3 redirects"):
        fetcher_for(site, max_redirects=3).fetch(site.url("/loop"))


def test_html_to_text():
    title, text = html_to_text("<title>A &lt;b&gt;</title><noscript>no</noscript><div>x<br>y</div>"
                               "<template>t</template><p>z&nbsp;w</p><svg><text>s</text></svg>")
    assert title == "A <b>" and text == "x\ny\nz w"  # non-breaking spaces collapse too
