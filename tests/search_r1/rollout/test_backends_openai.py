"""OpenAIGenerator against a local fake of vLLM's /v1/completions (the GPU server is the boundary).

The fake answers with the real tiny Qwen3 through HFGenerator and shapes responses like vLLM's
`CompletionResponse` (choices[i].text / logprobs.{text_offset,token_logprobs,tokens,top_logprobs} /
finish_reason / stop_reason / index, plus `token_ids` when `return_token_ids` is honoured). Modes:
  "vllm"      recent vLLM: honours return_token_ids and return_tokens_as_token_ids
  "old-vllm"  vLLM < 0.10.2: no token_ids field, but "token_id:N" strings in logprobs.tokens
  "text"      a server with neither: text pieces only, stop string dropped from the text
  "no-stop"   ignores `stop` (samples the whole budget): the client must trim
"""
import math
import threading
import time

import pytest

from search_r1.models import load_model_and_tokenizer
from search_r1.prompts import apply_chat_template
from search_r1.rollout.backends import GenerationError, HFGenerator, OpenAIGenerator, SamplingParams
from tests._fixtures.json_server import serve_json


class FakeVLLM:
    def __init__(self, generator: HFGenerator, tokenizer, mode: str = "vllm"):
        self.generator, self.tokenizer, self.mode = generator, tokenizer, mode
        self.requests: list[dict] = []
        self.fail_next = 0          # answer this many requests with HTTP 500 first
        self.reject_status = None   # answer every request with this status (e.g. 400)
        self.lock = threading.Lock()
        self.server, self.base_url = serve_json(lambda path, headers, body: self.handle(path, body))

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def handle(self, path, body):
        with self.lock:
            self.requests.append(body)
            if self.reject_status:
                return self.reject_status, _error(self.reject_status, "The model `x` does not exist.")
            if self.fail_next > 0:
                self.fail_next -= 1
                return 500, _error(500, "EngineCore encountered an issue")
        assert path == "/v1/completions"
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        stop = () if self.mode == "no-stop" else tuple(body.get("stop") or ())
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                top_p=body.get("top_p", 1.0), top_k=body.get("top_k", -1), stop=stop,
                                seed=body.get("seed"))
        with self.lock:  # one model, one request at a time (vLLM batches; we need determinism)
            outs = self.generator.generate(prompts, params)
        choices = [self._choice(i, out, body, stop) for i, out in enumerate(outs)]
        n_prompt = sum(len(p) for p in prompts)
        n_out = sum(len(o.token_ids) for o in outs)
        return 200, {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                     "model": body["model"], "choices": choices, "service_tier": None,
                     "system_fingerprint": None, "kv_transfer_params": None,
                     "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                               "total_tokens": n_prompt + n_out, "prompt_tokens_details": None}}

    def _choice(self, index, out, body, stop):
        tok = self.tokenizer
        ids = out.token_ids
        text = tok.decode(ids, skip_special_tokens=body.get("skip_special_tokens", True))
        stop_reason = None
        if out.finish_reason == "stop" and ids[-1] not in self.generator.eos_token_ids:
            stop_reason = min((s for s in stop if s in text), key=text.index)
            end = text.index(stop_reason)
            keep_stop = body.get("include_stop_str_in_output", False) and self.mode != "text"
            text = text[:end + len(stop_reason)] if keep_stop else text[:end]
        pieces = [tok.decode([t]) for t in ids]
        as_ids = body.get("return_tokens_as_token_ids") and self.mode in ("vllm", "old-vllm", "no-stop")
        tokens = [f"token_id:{t}" for t in ids] if as_ids else pieces
        offsets, pos = [], 0
        for piece in pieces:
            offsets.append(pos)
            pos += len(piece)
        choice = {"index": index, "text": text, "finish_reason": out.finish_reason, "stop_reason": stop_reason,
                  "prompt_logprobs": None,
                  "logprobs": {"text_offset": offsets, "token_logprobs": out.logprobs, "tokens": tokens,
                               "top_logprobs": [{t: lp} for t, lp in zip(tokens, out.logprobs)]}}
        if body.get("return_token_ids") and self.mode in ("vllm", "no-stop"):
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = None
        return choice


def _error(code, message):
    return {"error": {"message": message, "type": "BadRequestError" if code < 500 else "InternalServerError",
                      "param": None, "code": code}}


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}])
               for q in ["Who wrote the play Hamlet?", "Name three rivers in Europe.", "Hi"]]
    return HFGenerator(model, tokenizer), tokenizer, prompts


@pytest.fixture
def server(tiny):
    made = []

    def start(mode="vllm"):
        fake = FakeVLLM(tiny[0], tiny[1], mode)
        made.append(fake)
        return fake

    yield start
    for fake in made:
        fake.close()


def test_batched_request_payload_and_exact_ids(tiny, server):
    hf, tok, prompts = tiny
    fake = server("vllm")
    params = SamplingParams(max_tokens=12, temperature=0, top_p=0.95, top_k=40, stop=("</search>", "</answer>"))
    with OpenAIGenerator(fake.base_url + "/v1", "policy", tokenizer=tok) as gen:
        outs = gen.generate(prompts, params)
        assert gen.token_ids_exact and gen.logprobs_available
    assert len(fake.requests) == 1  # no seed: one batched request
    body = fake.requests[0]
    assert body["prompt"] == prompts and all(isinstance(t, int) for t in body["prompt"][0])
    assert body["stop"] == ["</search>", "</answer>"] and body["logprobs"] == 1
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"]) == (12, 0, 0.95, 40)
    assert body["model"] == "policy" and "seed" not in body
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["include_stop_str_in_output"]
    direct = hf.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in direct]
    assert [o.logprobs for o in outs] == [o.logprobs for o in direct]
    assert [o.finish_reason for o in outs] == ["length"] * 3


def _stop_from_sample(tok, ids):
    """A two-token stop string taken from what the tiny model samples (so it really fires)."""
    for i in range(4, len(ids) - 2):
        s = tok.decode(ids[i:i + 2])
        if s.strip() and "\ufffd" not in s:
            return s
    raise AssertionError("no usable stop string in the sample")


@pytest.mark.parametrize("mode", ["vllm", "old-vllm", "no-stop"])
def test_seeded_stops_match_direct_generation(tiny, server, mode):
    hf, tok, prompts = tiny
    fake = server(mode)
    free = hf.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=1.0, seed=5))[0]
    stop = (_stop_from_sample(tok, free.token_ids),)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=5, stop=stop)
    gen = OpenAIGenerator(fake.base_url, "policy", tokenizer=tok)
    outs = gen.generate(prompts, params)
    # With a seed every prompt is its own request, seeded seed + row (vLLM seeds all prompts of a
    # batched request alike, which would collapse GRPO groups).
    assert sorted((r["prompt"] == p, r["seed"]) for r, p in zip(
        sorted(fake.requests, key=lambda r: r["seed"]), prompts)) == [(True, 5), (True, 6), (True, 7)]
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = hf.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=5 + i, stop=stop))[0]
        assert out.token_ids == expected.token_ids and out.finish_reason == expected.finish_reason
        assert out.logprobs == pytest.approx(expected.logprobs)
    assert outs[0].finish_reason == "stop" and stop[0] in tok.decode(outs[0].token_ids)
    assert gen.token_ids_exact


def test_text_only_server_falls_back_to_tokenizing_and_says_so(tiny, server):
    hf, tok, prompts = tiny
    fake = server("text")
    free = hf.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=1.0, seed=9))[0]
    stop = (_stop_from_sample(tok, free.token_ids),)
    gen = OpenAIGenerator(fake.base_url, "policy", tokenizer=tok)
    with pytest.warns(RuntimeWarning, match="token_ids_exact"):
        out = gen.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=1.0, seed=9, stop=stop))[0]
    assert gen.token_ids_exact is False
    text = tok.decode(out.token_ids)
    assert text.endswith(stop[0])  # the dropped stop string (stop_reason) is put back
    sampled = tok.decode(free.token_ids)  # same seed, same path: the text up to the stop string
    assert text == sampled[:sampled.index(stop[0]) + len(stop[0])]
    assert len(out.logprobs) == len(out.token_ids)
    with pytest.raises(GenerationError, match="tokenizer="):
        OpenAIGenerator(fake.base_url, "policy").generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0))


def test_missing_logprobs_are_nan_and_flagged(tiny, server):
    hf, tok, prompts = tiny
    fake = server("vllm")
    original = fake._choice

    def without_logprobs(*args):
        choice = original(*args)
        choice["logprobs"] = None
        return choice

    fake._choice = without_logprobs
    gen = OpenAIGenerator(fake.base_url, "policy", tokenizer=tok)
    with pytest.warns(RuntimeWarning, match="no logprobs"):
        out = gen.generate([prompts[1]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4 and all(math.isnan(x) for x in out.logprobs)
    assert gen.logprobs_available is False


def test_retries_5xx_then_succeeds(tiny, server):
    _, tok, prompts = tiny
    fake = server("vllm")
    fake.fail_next = 2
    gen = OpenAIGenerator(fake.base_url, "policy", tokenizer=tok, retries=3, backoff=0.01)
    out = gen.generate([prompts[2]], SamplingParams(max_tokens=3, temperature=0))
    assert len(fake.requests) == 3 and len(out[0].token_ids) == 3


def test_gives_up_after_retries_and_on_4xx(tiny, server):
    _, tok, prompts = tiny
    fake = server("vllm")
    fake.fail_next = 10
    gen = OpenAIGenerator(fake.base_url, "policy", tokenizer=tok, retries=1, backoff=0.01)
    with pytest.raises(GenerationError, match="after 2 attempts.*HTTP 500"):
        gen.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0))
    assert len(fake.requests) == 2
    fake.requests.clear()
    fake.reject_status = 400
    with pytest.raises(GenerationError, match="rejected the request.*HTTP 400.*does not exist"):
        gen.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0))
    assert len(fake.requests) == 1  # a client error is not retried


def test_connection_refused_is_a_clear_error(tiny):
    _, tok, prompts = tiny
    closed = FakeVLLM(tiny[0], tok)
    url = closed.base_url
    closed.close()  # nothing listens on this port now
    gen = OpenAIGenerator(url, "policy", tokenizer=tok, retries=1, backoff=0.01, timeout=2)
    with pytest.raises(GenerationError, match="failed after 2 attempts.*ConnectError"):
        gen.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))


def test_chunked_requests_and_url_forms(tiny, server):
    _, tok, prompts = tiny
    fake = server("vllm")
    gen = OpenAIGenerator(fake.base_url + "/v1/completions/", "policy", tokenizer=tok, max_prompts_per_request=2)
    outs = gen.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
    assert [len(r["prompt"]) if isinstance(r["prompt"][0], list) else 1 for r in fake.requests] in ([2, 1], [1, 2])
    assert len(outs) == 3 and all(len(o.token_ids) == 2 for o in outs)
    with pytest.raises(ValueError, match="max_prompts_per_request"):
        OpenAIGenerator(fake.base_url, "policy", max_prompts_per_request=0)
