"""Bearer-token auth (--api-key or RETRIEVER_API_KEY) and the restartable server handle."""
import requests

BODY = {"queries": ["city"], "topk": 1}


def test_auth_off_by_default(retriever_server):
    assert requests.post(retriever_server.url, json=BODY, timeout=10).status_code == 200


def test_api_key_flag_requires_the_bearer_token(retriever_server, start_retriever):
    server = start_retriever([retriever_server.index_dir], api_key="s3cret")
    assert requests.post(server.url, json=BODY, timeout=10).status_code == 401
    wrong = requests.post(server.url, json=BODY, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and "bearer" in wrong.json()["detail"].lower()
    assert wrong.headers["www-authenticate"] == "Bearer"
    ok = requests.post(server.url, json=BODY, headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert ok.status_code == 200
    access = requests.post(server.base_url + "/access", json={"ids": ["0"]}, timeout=10)
    assert access.status_code == 401
    # health stays open for probes, and says auth is on
    assert server.health()["auth"] is True


def test_api_key_from_environment_and_restart_on_same_port(retriever_server, start_retriever):
    server = start_retriever([retriever_server.index_dir], env={"RETRIEVER_API_KEY": "envkey"})
    headers = {"Authorization": "Bearer envkey"}
    assert requests.post(server.url, json=BODY, timeout=10).status_code == 401
    assert requests.post(server.url, json=BODY, headers=headers, timeout=10).status_code == 200
    port = server.port
    server.stop()
    try:
        requests.post(server.url, json=BODY, headers=headers, timeout=2)
        raise AssertionError("server still answering after stop()")
    except requests.ConnectionError:
        pass
    server.restart()
    assert server.port == port
    assert requests.post(server.url, json=BODY, headers=headers, timeout=10).status_code == 200
