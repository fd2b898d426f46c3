"""The chat-model seam: the local transformers implementation (real tiny model, real tokenizer) and
the server implementation (OpenAIChatGenerator.chat against a vLLM-shaped fake server)."""
from __future__ import annotations

import pytest

from search_r1.agents.chat import ContextOverflow, LocalChatModel, ServerChatModel, load_chat_model
from search_r1.grpo.openai_chat import OpenAIChatGenerator
from search_r1.models import load_model_and_tokenizer
from search_r1.prompts import apply_chat_template
from search_r1.rollout.backends import GenerationError, SamplingParams

MESSAGES = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "Question: who?"}]


@pytest.fixture(scope="module")
def local():
    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    return LocalChatModel(model, tokenizer, name="tiny")


def test_local_stops_exactly_at_a_stop_string(local):
    free = local.chat(MESSAGES, max_tokens=40)
    assert free.finish_reason == "length" and free.completion_tokens == 40 and free.prompt_tokens > 0
    text = free.text
    stop = text[12:18]
    assert stop.strip() and stop in text
    cut = local.chat(MESSAGES, stop=[stop, "never-there"], max_tokens=40)  # greedy: the same continuation
    assert cut.text == text[: text.find(stop) + len(stop)]
    assert (cut.finish_reason, cut.stop) == ("stop", stop) and cut.completion_tokens < 40


def test_local_end_of_turn_is_dropped_from_the_text(local):
    ids = local.generator.generate([local.encode(MESSAGES)], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # the first token not seen before
    saved = local.generator.eos_token_ids
    local.generator.eos_token_ids = frozenset({ids[k]})  # pretend that token ends the turn
    try:
        reply = local.chat(MESSAGES, max_tokens=40)
    finally:
        local.generator.eos_token_ids = saved
    assert reply.finish_reason == "end" and reply.completion_tokens == k + 1
    assert reply.text == local.tokenizer.decode(ids[:k], skip_special_tokens=False)


def test_local_continues_an_assistant_message_part_by_part(local):
    parts = ['<tool_call>{"name": "search"}</tool_call>', "\n\n<tool_response>Doc 1(Title: A) a</tool_response>\n\n"]
    msgs = MESSAGES + [{"role": "assistant", "content": "".join(parts), "parts": parts}]
    ids = local.encode(msgs)
    head = apply_chat_template(local.tokenizer, MESSAGES)  # ends with the assistant header
    tail = [t for p in parts for t in local.tokenizer(p, add_special_tokens=False)["input_ids"]]
    assert ids == head + tail
    assert local.encode(MESSAGES + [{"role": "assistant", "content": "ab"}])[len(head):] == \
        local.tokenizer("ab", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="parts must concatenate"):
        local.encode(MESSAGES + [{"role": "assistant", "content": "x", "parts": ["y"]}])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        local.encode([{"role": "tool", "content": "x"}])


def test_local_context_overflow(local):
    saved = local.context_limit
    local.context_limit = len(local.encode(MESSAGES))
    try:
        with pytest.raises(ContextOverflow, match="holds"):
            local.chat(MESSAGES)
    finally:
        local.context_limit = saved


# -- servers ----------------------------------------------------------------------------------------
def test_server_reply_stop_reappended_and_usage(chat_server):
    srv = chat_server(lambda msgs: '<think>x</think><tool_call>{"a": 1}</tool_call> tail words')
    model = ServerChatModel(OpenAIChatGenerator(srv.base_url, "served-model", tokenizer=None))
    reply = model.chat(MESSAGES, stop=["</tool_call>"], max_tokens=50, seed=3)
    assert reply.text == '<think>x</think><tool_call>{"a": 1}</tool_call>'
    assert (reply.finish_reason, reply.stop, reply.completion_tokens) == ("stop", "</tool_call>", 2)
    body = srv.requests[0]
    assert body["stop"] == ["</tool_call>"] and body["max_completion_tokens"] == 50 and body["seed"] == 3
    assert "continue_final_message" not in body
    end = model.chat(MESSAGES, stop=["</never>"])
    assert (end.finish_reason, end.stop) == ("end", "") and end.text.endswith("tail words")
    cut = model.chat(MESSAGES, max_tokens=2)
    assert cut.finish_reason == "length" and cut.text == '<think>x</think><tool_call>{"a": 1}</tool_call>'


def test_server_continues_a_final_assistant_message_without_parts(chat_server):
    srv = chat_server(lambda msgs: " and more")
    model = ServerChatModel(OpenAIChatGenerator(srv.base_url + "/v1", "served-model", tokenizer=None))
    msgs = MESSAGES + [{"role": "assistant", "content": "partial", "parts": ["par", "tial"]}]
    assert model.chat(msgs).text == " and more"
    body = srv.requests[0]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["messages"][-1] == {"role": "assistant", "content": "partial"}


def test_server_key_from_the_environment_never_shown(chat_server, monkeypatch):
    srv = chat_server(lambda msgs: "ok", api_key="sk-right")
    monkeypatch.setenv("MY_KEY", "sk-right")
    assert load_chat_model("served-model", srv.base_url, api_key_env="MY_KEY").chat(MESSAGES).text == "ok"
    monkeypatch.setenv("MY_KEY", "sk-wrong-secret")
    with pytest.raises(GenerationError) as err:
        load_chat_model("served-model", srv.base_url, api_key_env="MY_KEY").chat(MESSAGES)
    assert "MY_KEY" in str(err.value) and "sk-wrong-secret" not in str(err.value) and "***" in str(err.value)
    with pytest.raises(ValueError, match="unencrypted"):
        load_chat_model("m", "http://10.0.0.8:8000/v1", api_key_env="MY_KEY")
    monkeypatch.delenv("MY_KEY")
    load_chat_model("m", "http://10.0.0.8:8000/v1", api_key_env="MY_KEY")  # no key: nothing to leak


def test_generate_still_needs_a_tokenizer(chat_server):
    srv = chat_server(lambda msgs: "ok")
    gen = OpenAIChatGenerator(srv.base_url, "served-model", tokenizer=None)
    with pytest.raises(ValueError, match="needs the local tokenizer"):
        gen.generate([[1, 2]], SamplingParams())
    with pytest.raises(ValueError, match="continue_final=True"):
        gen.chat(MESSAGES, SamplingParams(), continue_final=True)


def test_server_requests_omit_empty_fields(chat_server):
    """The forced final turn has no stop strings: the body has no `stop` (OpenAI rejects `"stop": []`)."""
    srv = chat_server(lambda msgs: "<answer> x </answer>")
    model = ServerChatModel(OpenAIChatGenerator(srv.base_url, "served-model", tokenizer=None))
    reply = model.chat(MESSAGES, stop=(), seed=None)
    assert reply.text == "<answer> x </answer>" and reply.finish_reason == "end"
    assert "stop" not in srv.requests[0] and "seed" not in srv.requests[0]
    gen = OpenAIChatGenerator(srv.base_url, "served-model", tokenizer=None)
    assert "stop" in gen.payload(MESSAGES, SamplingParams(stop=("</a>",)), seed=None)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_server_reasoning_split_off_by_a_reasoning_parser_comes_back(chat_server, field):
    srv = chat_server(lambda msgs: '<think>I should search.</think>\n\n<tool_call>{"a": 1}</tool_call> more',
                      reasoning_field=field)
    model = ServerChatModel(OpenAIChatGenerator(srv.base_url, "served-model", tokenizer=None))
    reply = model.chat(MESSAGES, stop=["</tool_call>"])
    assert reply.text == '<think>I should search.</think>\n\n<tool_call>{"a": 1}</tool_call>'
    assert reply.stop == "</tool_call>"


def test_server_context_overflow_is_a_context_overflow(chat_server):
    srv = chat_server(lambda msgs: "ok", max_model_len=20)
    model = ServerChatModel(OpenAIChatGenerator(srv.base_url, "served-model", tokenizer=None, retries=3))
    assert model.chat(MESSAGES, max_tokens=5).text == "ok"
    with pytest.raises(ContextOverflow, match="maximum context length is 20"):
        model.chat(MESSAGES, max_tokens=30)
    assert len(srv.auth) == 2  # refused at once, never retried


def test_agents_opt_in_to_plain_http_or_send_no_key(chat_server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    with pytest.raises(ValueError, match=r"unencrypted.*--allow-insecure-http.*--no-api-key") as err:
        load_chat_model("m", "http://10.0.0.8:8000/v1")
    assert "SearchR1Config" not in str(err.value) and "search_r1.evaluation" not in str(err.value)
    assert load_chat_model("m", "http://10.0.0.8:8000/v1", allow_insecure_http=True).generator.api_key == "sk-secret"
    assert load_chat_model("m", "http://10.0.0.8:8000/v1", api_key_env=None).generator.api_key == ""
    srv = chat_server(lambda msgs: "ok")  # a server that needs no key gets none
    assert load_chat_model("served-model", srv.base_url, api_key_env=None).chat(MESSAGES).text == "ok"
    assert srv.auth == [None]
