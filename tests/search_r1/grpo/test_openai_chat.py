"""use_openai=True with openai_api=chat: rollouts through a local fake of OpenAI's /v1/chat/completions.

The fake is shaped like the real API (the web API is the boundary we cannot reach in tests): it
rejects unknown request fields and malformed message lists with OpenAI's 400 error shape, checks the
bearer key (401 `invalid_api_key`), applies `stop` the way OpenAI does (the reply ends *before* the
first stop string, which is not returned, finish_reason "stop"), cuts at max_completion_tokens
(finish_reason "length"), and reports `logprobs.content[i] = {token, logprob, bytes, top_logprobs}`.
Its "model" is a script keyed on the conversation: search for veltra first, then answer from the
information block it was sent. Tokens: "local" = the test's tokenizer (as a server running the same
model would), "words" = whitespace pieces (a different tokenizer, as api.openai.com's).
"""
import json
import math
import re
import threading
import time

import pytest

from search_r1.grpo import GRPOTrainer, MockSearchEngine, PolicyUpdateUnavailable, SearchR1Config
from search_r1.grpo.openai_chat import OpenAIChatGenerator, missing_stop, resolve_openai_api
from search_r1.models import load_tokenizer
from search_r1.prompts import grpo_messages
from search_r1.rollout.backends import GenerationError, OpenAIGenerator, SamplingParams
from tests._fixtures.json_server import serve_json

VELTRA = "Doc 1(Title: Veltra) Veltra was founded by Ana Osk.\n"
QUERY = "Who founded Veltra?"
TURN1 = "<think> I do not know who founded Veltra. </think>\n<search> veltra </search> and more text"
TURN2 = "<think> The document says Ana Osk. </think>\n<answer> Ana Osk </answer>\nextra"
ALLOWED_FIELDS = {"model", "messages", "stop", "max_completion_tokens", "max_tokens", "temperature", "top_p", "n",
                  "stream", "logprobs", "top_logprobs", "seed"}


def _error(status, message, code=None, param=None):
    kind = "invalid_request_error" if status in (400, 401) else "rate_limit_error" if status == 429 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


class FakeOpenAIChat:
    def __init__(self, tokenizer, tokens: str = "local", api_key: str = "sk-right-key"):
        self.tokenizer, self.tokens, self.api_key = tokenizer, tokens, api_key
        self.requests: list[dict] = []   # bodies of valid requests
        self.responses: list[dict] = []  # what was answered to them
        self.failures: list[tuple[int, dict]] = []  # (status, headers) answered first, one per request
        self.lock = threading.Lock()
        self.server, self.base_url = serve_json(self.handle)

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    # -- the API ----------------------------------------------------------------------------------
    def handle(self, path, headers, body):
        auth = headers.get("Authorization")
        with self.lock:
            if path != "/v1/chat/completions":
                return (*_error(404, f"Invalid URL (POST {path})"), {})
            if auth != f"Bearer {self.api_key}":
                key = (auth or "").removeprefix("Bearer ")
                # A proxy that echoes the key back: the client must not repeat it.
                return (*_error(401, f"Incorrect API key provided: {key}. You can find your API key at "
                                     "https://platform.openai.com/account/api-keys.", code="invalid_api_key"), {})
            if self.failures:
                status, headers = self.failures.pop(0)
                return (*_error(status, "Rate limit reached" if status == 429 else "The server had an error"), headers)
            problem = self.invalid(body)
            if problem:
                return (*_error(400, problem), {})
            self.requests.append(body)
            response = self.complete(body)
            self.responses.append(response)
            return 200, response, {}

    @staticmethod
    def invalid(body) -> str | None:
        unknown = sorted(set(body) - ALLOWED_FIELDS)
        if unknown:
            return f"Unrecognized request argument supplied: {unknown[0]}"
        if not isinstance(body.get("model"), str) or not body["model"]:
            return "you must provide a model parameter"
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty array"
        for m in msgs:
            if set(m) != {"role", "content"} or m["role"] not in ("system", "user", "assistant") \
                    or not isinstance(m["content"], str) or not m["content"]:
                return f"Invalid message: {json.dumps(m)[:100]}"
        roles = [m["role"] for m in msgs]
        # Our mapping: system, user, then assistant/user pairs; the model always answers a user turn.
        expected = ["system", "user"] + ["assistant", "user"] * ((len(roles) - 2) // 2)
        if roles != expected:
            return f"unexpected message order {roles}"
        stop = body.get("stop")
        if not isinstance(stop, list) or not 1 <= len(stop) <= 4 or not all(isinstance(s, str) for s in stop):
            return "'stop' must be a list of up to 4 strings"
        if body.get("logprobs") is not True:
            return "this fake expects logprobs=true"
        if not isinstance(body.get("max_completion_tokens"), int) or body["max_completion_tokens"] < 1:
            return "max_completion_tokens must be a positive integer"
        return None

    def pieces(self, text: str) -> list[str]:
        if self.tokens == "local":
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return [self.tokenizer.decode([i]) for i in ids]
        return re.findall(r"\S+|\s+", text)

    def complete(self, body) -> dict:
        msgs = body["messages"]
        if len(msgs) == 2:
            full = TURN1
        else:  # answer from what the information block says
            full = TURN2 if "Ana Osk" in msgs[-1]["content"] else "<answer> unknown </answer>"
        finish = "stop"
        cuts = [i for i in (full.find(s) for s in body["stop"]) if i >= 0]
        text = full[:min(cuts)] if cuts else full
        pieces = self.pieces(text)
        if len(pieces) > body["max_completion_tokens"]:
            pieces, finish = pieces[:body["max_completion_tokens"]], "length"
            text = "".join(pieces)
        content = [{"token": p, "logprob": -0.01 * (i + 1), "bytes": list(p.encode()), "top_logprobs": []}
                   for i, p in enumerate(pieces)]
        return {"id": f"chatcmpl-{len(self.responses)}", "object": "chat.completion", "created": 0,
                "model": body["model"] + "-2024-07-18", "system_fingerprint": "fp_test",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                             "logprobs": {"content": content, "refusal": None}, "finish_reason": finish}],
                "usage": {"prompt_tokens": 0, "completion_tokens": len(pieces), "total_tokens": len(pieces)}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random-qwen3")


@pytest.fixture
def fake(tokenizer):
    servers = []

    def start(**kwargs) -> FakeOpenAIChat:
        servers.append(FakeOpenAIChat(tokenizer, **kwargs))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def chat_trainer(server, tokenizer, **overrides) -> GRPOTrainer:
    kwargs = dict(use_openai=True, openai_api="chat", openai_base_url=server.base_url + "/v1",
                  openai_api_key="sk-right-key", model_name_or_path="tiny-random-qwen3", max_tokens=256,
                  max_obs_length=64, progress=False, device="cpu")
    kwargs.update(overrides)
    return GRPOTrainer(SearchR1Config(**kwargs), search_engine=MockSearchEngine({"veltra": VELTRA}),
                       tokenizer=tokenizer)


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_search_then_answer_through_chat_messages(fake, tokenizer):
    server = fake(tokens="local")
    trainer = chat_trainer(server, tokenizer)
    assert isinstance(trainer.generator, OpenAIChatGenerator)
    t = trainer.generate_trajectory(QUERY, ground_truth=["Ana Osk"])

    # Two requests: the prompt, then the prompt + the search turn + the information block.
    first, second = server.requests
    system, user = grpo_messages(QUERY)
    assert first["messages"] == [system, user] and first["model"] == "gpt-4o-mini"
    assert first["stop"] == ["</search>", "</answer>"] and first["logprobs"] is True
    turn1 = TURN1.split("</search>")[0] + "</search>"  # the stop tag the API dropped is back
    info = second["messages"][3]["content"]
    assert second["messages"][:3] == [system, user, {"role": "assistant", "content": turn1}]
    assert second["messages"][3]["role"] == "user"
    assert info.startswith("<information>") and info.endswith("</information>") and "Ana Osk" in info
    assert VELTRA.strip() in info

    # The trajectory is what a token-level policy would have seen: turn, block (with its blank lines), turn.
    turn2 = TURN2.split("</answer>")[0] + "</answer>"
    assert t.generated_text == turn1 + "\n\n" + info + "\n\n" + turn2
    assert t.final_answer == "Ana Osk" and t.num_searches == 1
    assert t.reward == 0.5 + 2.0  # format_reward + exact_match_bonus

    # Token steps: local ids of each reply, then of its re-appended tag; API log-probs where its tokens
    # are the local ones (this server tokenizes like the local tokenizer), NaN on the re-appended tags.
    expected_ids, expected_lps = [], []
    for response, tag in zip(server.responses, ("</search>", "</answer>")):
        choice = response["choices"][0]
        expected_ids += ids_of(tokenizer, choice["message"]["content"]) + ids_of(tokenizer, tag)
        expected_lps += [c["logprob"] for c in choice["logprobs"]["content"]] + [math.nan] * len(ids_of(tokenizer, tag))
    assert [s.token_id for s in t.token_steps] == expected_ids
    got = [s.log_prob for s in t.token_steps]
    assert len(got) == len(expected_lps)
    for g, e in zip(got, expected_lps):
        assert (math.isnan(g) and math.isnan(e)) or g == pytest.approx(e)
    assert sum(math.isfinite(g) for g in got) > 10  # most steps carry the API's values
    for p, step in zip(t.generated_positions, t.token_steps):
        assert t.full_input_ids[p] == step.token_id
    with pytest.raises(PolicyUpdateUnavailable, match="no gradient flows through an API"):
        trainer.update_policy([t])


def test_foreign_tokenizer_gives_nan_log_probs_not_misaligned_ones(fake, tokenizer):
    server = fake(tokens="words")
    t = chat_trainer(server, tokenizer).generate_trajectory(QUERY, ground_truth="Ana Osk")
    assert t.final_answer == "Ana Osk" and t.num_searches == 1
    assert t.token_steps and all(math.isnan(s.log_prob) for s in t.token_steps)


def test_length_cut_keeps_the_partial_turn_without_a_tag(fake, tokenizer):
    server = fake(tokens="words")
    gen = chat_trainer(server, tokenizer).generator
    gen.register_prompt([1, 2, 3], grpo_messages(QUERY))
    out = gen.generate([[1, 2, 3]], SamplingParams(max_tokens=5, stop=("</search>", "</answer>")))[0]
    reply = server.responses[-1]["choices"][0]
    assert reply["finish_reason"] == "length" and out.finish_reason == "length"
    assert tokenizer.decode(out.token_ids) == reply["message"]["content"]  # nothing appended
    assert "</search>" not in tokenizer.decode(out.token_ids)


def test_rate_limit_is_retried_after_retry_after(fake, tokenizer):
    server = fake()
    trainer = chat_trainer(server, tokenizer)
    # backoff 5 s: finishing fast proves the 429's Retry-After (0 s) was used; the 503 uses backoff 0.
    server.failures = [(429, {"Retry-After": "0"})]
    trainer.generator.backoff = 5.0
    start = time.perf_counter()
    t = trainer.generate_trajectory(QUERY)
    assert time.perf_counter() - start < 4.0
    assert t.final_answer == "Ana Osk" and len(server.requests) == 2
    server.failures = [(503, {}), (429, {})]
    trainer.generator.backoff = 0.0
    assert trainer.generate_trajectory(QUERY).final_answer == "Ana Osk"


def test_wrong_key_names_the_variable_and_never_shows_the_key(fake, tokenizer):
    server = fake()
    trainer = chat_trainer(server, tokenizer, openai_api_key="sk-wrong-secret-123")
    with pytest.raises(GenerationError) as err:
        trainer.generate_trajectory(QUERY)
    message = str(err.value)
    assert "OPENAI_API_KEY" in message and "401" in message
    assert "sk-wrong-secret-123" not in message and "***" in message
    assert server.requests == []


def test_auto_picks_chat_for_openai_and_completions_elsewhere(tokenizer):
    assert resolve_openai_api("auto", "https://api.openai.com/v1") == "chat"
    assert resolve_openai_api("auto", "http://127.0.0.1:8000/v1") == "completions"
    assert resolve_openai_api("auto", "http://127.0.0.1:8000/v1/chat/completions") == "chat"
    assert resolve_openai_api("completions", "https://api.openai.com/v1") == "completions"
    assert SearchR1Config().resolved_openai_api == "chat"  # the spec's defaults work as they stand
    engine = MockSearchEngine({})
    base = dict(use_openai=True, model_name_or_path="tiny-random-qwen3", device="cpu")
    openai = GRPOTrainer(SearchR1Config(**base), search_engine=engine, tokenizer=tokenizer)  # no request made
    assert isinstance(openai.generator, OpenAIChatGenerator)
    assert openai.generator.url == "https://api.openai.com/v1/chat/completions"
    vllm = GRPOTrainer(SearchR1Config(openai_base_url="http://127.0.0.1:8000/v1", **base), search_engine=engine,
                       tokenizer=tokenizer)
    assert isinstance(vllm.generator, OpenAIGenerator) and vllm.generator.url == "http://127.0.0.1:8000/v1/completions"


@pytest.mark.parametrize("text, expected", [
    ("<think> x </think>\n<search> veltra ", "</search>"),          # stopped on </search>
    ("<answer> Ana Osk ", "</answer>"),                             # stopped on </answer>
    ("<search> a </search> then <answer> b ", "</answer>"),         # the later open tag wins
    ("<answer> b </answer> <search> a ", "</search>"),
    ("<think> nothing open </think>", ""),                          # a natural end: nothing to add
    ("<search> a </search>", ""),                                   # already closed
])
def test_missing_stop(text, expected):
    assert missing_stop(text, ("</search>", "</answer>")) == expected


def test_unregistered_prompt_is_a_clear_error(fake, tokenizer):
    server = fake()
    gen = OpenAIChatGenerator(server.base_url, "gpt-4o-mini", tokenizer)
    with pytest.raises(GenerationError, match="register_prompt"):
        gen.generate([[5, 6, 7]], SamplingParams(stop=("</search>",)))
