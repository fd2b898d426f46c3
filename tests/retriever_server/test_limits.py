"""Bad input and limits: every client error is a 4xx naming the field and the limit; the server
stays up. One server with small limits for the whole module."""
import http.client

import pytest
import requests

LIMITS = dict(max_queries=4, max_query_chars=50, max_topk=10, max_body_bytes=2000, max_ids=3)


@pytest.fixture(scope="module")
def small_server(retriever_server, tmp_path_factory):
    # module scope cannot use the function-scoped factory; the handle class is the same
    from tests._fixtures.retriever import RetrieverHandle
    handle = RetrieverHandle([retriever_server.index_dir],
                             log_path=tmp_path_factory.mktemp("limits") / "server.log", flags=LIMITS)
    handle.start()
    yield handle
    handle.stop()


def post_raw(server, body: bytes, path="/retrieve", headers=None):
    return requests.post(server.base_url + path, data=body, timeout=10,
                         headers={"Content-Type": "application/json", **(headers or {})})


CASES = [
    # (body, expected status, words the message must contain)
    (b'{"queries": ["x"],', 400, ["not valid JSON"]),
    (b"", 422, ["body", "queries"]),
    (b'[1, 2]', 422, ["body"]),
    (b'{"queries": "just a string"}', 422, ["queries", "list"]),
    (b'{"queries": ["ok", 3]}', 422, ["queries.1", "string"]),
    (b'{"queries": ["ok"], "topk": "3"}', 422, ["topk", "integer"]),
    (b'{"queries": ["ok"], "topk": 2.5}', 422, ["topk"]),
    (b'{"queries": ["ok"], "return_scores": "yes"}', 422, ["return_scores"]),
    (b'{"queries": []}', 422, ["queries", "empty"]),
    (b'{"queries": ["ok", "   "]}', 422, ["queries[1]", "empty"]),
    (b'{"queries": ["a", "b", "c", "d", "e"]}', 422, ["queries", "5", "max_queries is 4"]),
    (b'{"queries": ["' + b"y" * 51 + b'"]}', 422, ["queries[0]", "51", "max_query_chars is 50"]),
    (b'{"queries": ["ok"], "topk": 0}', 422, ["topk", "1..10"]),
    (b'{"queries": ["ok"], "topk": 11}', 422, ["topk", "1..10"]),
    (b'{"queries": ["ok"], "topk": -3}', 422, ["topk"]),
    (b'{"queries": ["ok", "\\ud800 lone surrogate"]}', 422, ["queries[1]", "unicode"]),
    (b'{"queries": ["\xff\xfe not utf-8"]}', 400, []),
]


@pytest.mark.parametrize("body,status,words", CASES, ids=[c[0][:40].decode(errors="replace") for c in CASES])
def test_bad_retrieve_requests_get_a_clear_4xx(small_server, body, status, words):
    r = post_raw(small_server, body)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert all(w in detail for w in words), detail


def test_oversize_body_by_content_length_is_413(small_server):
    body = b'{"queries": ["' + b"z" * 3000 + b'"]}'
    r = post_raw(small_server, body)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]


def test_oversize_chunked_body_without_content_length_is_413(small_server):
    # chunked transfer has no Content-Length: the limit is enforced on the bytes actually received
    conn = http.client.HTTPConnection("127.0.0.1", small_server.port, timeout=10)
    chunks = iter([b'{"queries": ["', b"z" * 1500, b"z" * 1500, b'"]}'])
    conn.request("POST", "/retrieve", body=chunks, encode_chunked=True,
                 headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 413 and b"max_body_bytes" in resp.read()
    conn.close()


def test_bad_content_length_is_400(small_server):
    conn = http.client.HTTPConnection("127.0.0.1", small_server.port, timeout=10)
    conn.putrequest("POST", "/retrieve")
    conn.putheader("Content-Length", "abc")
    conn.endheaders()
    resp = conn.getresponse()
    assert 400 <= resp.status < 500
    conn.close()


def test_access_limits(small_server):
    assert post_raw(small_server, b'{"ids": []}', "/access").status_code == 422
    r = post_raw(small_server, b'{"ids": ["a", "b", "c", "d"]}', "/access")
    assert r.status_code == 422 and "max_ids is 3" in r.json()["detail"]
    r = post_raw(small_server, b'{"ids": [1]}', "/access")
    assert r.status_code == 422 and "ids.0" in r.json()["detail"]
    r = post_raw(small_server, b'{"ids": ["\\udc00"]}', "/access")
    assert r.status_code == 422 and "ids[0]" in r.json()["detail"]


def test_server_survives_and_counts_client_errors(small_server):
    # counts its own bad requests (a delta), so it passes alone and after the other tests alike
    before = small_server.health()["counters"]
    for body, status, _ in CASES:
        assert post_raw(small_server, body).status_code == status
    h = small_server.health()
    assert h["counters"]["client_errors"] - before["client_errors"] == len(CASES)
    assert h["counters"]["server_errors"] == 0
    r = post_raw(small_server, b'{"queries": ["city"], "topk": 10, "return_scores": true}')
    assert r.status_code == 200 and len(r.json()["result"][0]) == 10


def test_limits_at_the_boundary_are_accepted(small_server):
    body = {"queries": ["x" * 50, "city", "river", "born"], "topk": 10}
    assert requests.post(small_server.url, json=body, timeout=10).status_code == 200
