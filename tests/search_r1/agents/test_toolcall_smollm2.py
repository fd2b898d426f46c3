"""The tool-call agent with the real bundled model (SmolLM2-135M-Instruct, local, inline transcript)
against the real retriever: the machinery holds for a real model whatever it writes (its answers are
weak: it is not trained for the format). Slow: loads and runs a 135M model on CPU."""
from __future__ import annotations

import json

import pytest

from search_r1.agents.budget import Budgets
from search_r1.agents.chat import load_chat_model
from search_r1.agents.tools import SearchTool
from search_r1.agents.toolcall import ToolCallAgent, ToolCallConfig
from search_r1.search import RetrieverClient

PER_TURN = 48


@pytest.mark.slow
def test_toolcall_agent_runs_smollm2_end_to_end(retriever_server, synth_world):
    with open(synth_world / "test.jsonl") as f:
        questions = [r["question"] for r in map(json.loads, f)][:2]
    model = load_chat_model("smollm2-135m-instruct")
    config = ToolCallConfig(budgets=Budgets(max_steps=3, max_tool_calls=2, max_tokens=400, max_seconds=120),
                            max_tokens_per_turn=PER_TURN, transcript="inline", date="2026-11-23")
    with RetrieverClient(retriever_server.url, topk=3) as client:
        agent = ToolCallAgent(model, SearchTool(client), config=config)
        for q in questions:
            result = agent.run(q)
            turns = [e for e in result["events"] if e["kind"] == "model"]
            assert 1 <= result["turns"] == len(turns) <= config.budgets.max_steps + 1
            assert all(e["tokens"] <= PER_TURN and e["finish"] in ("stop", "end", "length") for e in turns)
            assert result["budget"]["tokens"] == sum(e["tokens"] for e in turns)
            assert result["budget"]["tool_calls"] == result["searches"] <= 2
            # the stopping criterion: a turn ended by the stop string ends exactly at </tool_call>
            for call in result["tool_calls"]:
                assert call["tool"] in ("search", "invalid")
            for turn, event in zip(_model_turns(result["response"]), turns):
                if event["finish"] == "stop":
                    assert turn.endswith("</tool_call>")
            assert result["final_text"] is not None and result["error"] is None


def _model_turns(response: str) -> list[str]:
    """The model's turns of an inline transcript (tool responses removed)."""
    import re

    return [t for t in re.split(r"\n\n<tool_response>.*?</tool_response>\n\n", response, flags=re.DOTALL)]
