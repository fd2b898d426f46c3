"""search_r1.transport: an API key travels over https, or plain http to loopback only, unless the user
opts in; every client that sends a key applies the one rule (web search, both OpenAI-compatible
generators, the notebook API's config and the eval CLI)."""
import pytest

from search_r1.grpo.openai_chat import OpenAIChatGenerator
from search_r1.rollout.backends import OpenAIGenerator
from search_r1.search.web import WebSearchEngine
from search_r1.transport import check_key_transport
from tests.search_r1.rollout.scripted import smollm2_tokenizer

REMOTE_HTTP = "http://10.1.2.3:8000/v1"


@pytest.mark.parametrize("url, ok", [
    ("https://api.example.com/v1", True), ("http://127.0.0.1:8000", True), ("http://localhost:8000", True),
    ("http://[::1]:8000", True), ("http://10.1.2.3:8000", False), ("http://gpu-node-7:8000", False),
])
def test_the_rule(url, ok):
    if ok:
        assert check_key_transport(url) == url
    else:
        with pytest.raises(ValueError, match="would send the API key unencrypted to a non-loopback host"):
            check_key_transport(url)
        assert check_key_transport(url, allow_insecure_http=True) == url
    with pytest.raises(ValueError, match="must be an http\\(s\\) URL"):
        check_key_transport("ftp://host/x")


def test_openai_generators_refuse_a_key_over_remote_http_unless_allowed():
    tok = smollm2_tokenizer()
    for make in (lambda **kw: OpenAIGenerator(REMOTE_HTTP, "m", tokenizer=tok, **kw),
                 lambda **kw: OpenAIChatGenerator(REMOTE_HTTP, "m", tok, **kw)):
        with pytest.raises(ValueError, match=r"unencrypted.*allow_insecure_http=True.*--allow-insecure-http"):
            make(api_key="sk-secret")
        make(api_key="sk-secret", allow_insecure_http=True).close()
        make().close()  # no key: nothing to leak
    OpenAIGenerator("http://127.0.0.1:8001", "m", api_key="sk-secret").close()


def test_web_search_keeps_refusing_without_an_opt_in():
    with pytest.raises(ValueError, match="unencrypted"):
        WebSearchEngine(api_key="k", provider="serper", base_url="http://10.1.2.3/search")


def test_notebook_config_and_eval_cli_name_their_switch(tmp_path, capsys, monkeypatch):
    from search_r1.evaluation.cli import main
    from search_r1.grpo import GRPOTrainer, MockSearchEngine, SearchR1Config

    cfg = dict(use_openai=True, openai_api="completions", openai_base_url=REMOTE_HTTP, openai_api_key="sk-secret",
               model_name_or_path="tiny-random-qwen3", device="cpu")
    with pytest.raises(ValueError, match="unencrypted"):
        GRPOTrainer(SearchR1Config(**cfg), search_engine=MockSearchEngine({}))
    trainer = GRPOTrainer(SearchR1Config(**cfg, openai_allow_insecure_http=True), search_engine=MockSearchEngine({}))
    assert trainer.generator.url == "http://10.1.2.3:8000/v1/completions"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")  # the CLI reads the key from --api-key-env's variable
    from search_r1.data.prepare import parse_spec, prepare

    (tmp_path / "q.jsonl").write_text('{"id": "1", "question": "Who?", "golden_answers": ["x"]}\n')
    prepare([parse_spec(f"nq={tmp_path / 'q.jsonl'}")], tmp_path / "data", test_fraction=0.0)
    assert main(["--model", "served", "--base-url", "http://10.1.2.3:8001", "--tokenizer", "tiny-random-qwen3",
                 "--data", str(tmp_path / "data" / "train.parquet"), "--out", str(tmp_path / "ev"), "--no-search",
                 "--no-progress"]) == 2
    assert "--allow-insecure-http" in capsys.readouterr().err
