"""The agent-loop equivalence test against the real vLLM server (slow; .venv-vllm).

tests/verl_ext/test_agent_loop_equivalence.py shows, with a scripted policy and a fake vLLM-shaped
server, that `run_llm_loop` and `SearchR1AgentLoop` build the same trajectories. Here the policy is
real: the warm-started SmolLM2 served by verl's own vLLM server (`vLLMHttpServer`, the CPU variant the
trainer uses) in one engine, greedy, on questions of the synthetic world with the real retriever:

- batch driver: `LLMGenerationManager.run_llm_loop` through `OpenAIGenerator` (`/v1/completions` with
  token-id prompts) on the server's HTTP endpoint;
- verl: `SearchR1AgentLoop` run by verl's real `AgentLoopWorker`, through verl's `LLMServerClient`, on
  the server's Ray handle (`generate`, token in / token out), validation sampling (greedy).

Token ids, response masks and log-probs must be identical, and the Search-R1 statistics equal.
Requests go one at a time on both sides and the prefix cache is off: vLLM's CPU matmuls are not
batch-invariant (a row's logits depend on what shares its batch, and a cached prefix was computed in
another batch), and greedy decoding turns a last-bit difference at a near-tie into another token.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pandas as pd
import pytest

from tests.verl_ext.cpu.vllm.servers import (NO_VLLM, start_verl_vllm_server, verl_vllm_config,
                                            vllm_config_overrides)

pytest.importorskip("vllm", reason=NO_VLLM)

from verl import DataProto  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: E402

from search_r1.models import load_tokenizer  # noqa: E402
from search_r1.prompts import make_messages  # noqa: E402
from search_r1.rollout.backends import OpenAIGenerator  # noqa: E402
from search_r1.rollout.generation import LLMGenerationManager  # noqa: E402
from search_r1.search import RetrieverClient  # noqa: E402
from verl_ext.agent_loop import SearchR1Settings  # noqa: E402

from tests.verl_ext.test_agent_loop_equivalence import STAT_KEYS, unpadded  # noqa: E402
from tests.search_r1.rollout.test_generation import make_batch  # noqa: E402

N_QUESTIONS = 6


class OneServerClient(LLMServerClient):
    """verl's LLMServerClient with its load balancer (a Ray actor choosing among replicas) replaced by
    the one real server, and requests sent one at a time (see the module docstring)."""

    def __init__(self, config, server):
        super().__init__(config, load_balancer_handle=None)
        self.server = server
        self.lock = asyncio.Lock()
        self.requests = 0

    async def _acquire_server(self, request_id: str, **extra):
        return "vllm-0", self.server

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        return None

    async def generate(self, *args, **kwargs):
        async with self.lock:
            self.requests += 1
            return await super().generate(*args, **kwargs)


@pytest.fixture(scope="module")
def verl_vllm(ray_session, warm_smollm2, synth_world, retriever_server):
    import ray

    cfg = verl_vllm_config(warm_smollm2, ["actor_rollout_ref.rollout.enable_prefix_caching=false",
                                          *vllm_config_overrides(synth_world, retriever_server)])
    server, address = start_verl_vllm_server(cfg)
    yield cfg, server, address
    ray.kill(server)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_llm_loop_and_verl_agent_loop_agree_token_for_token_on_real_vllm(verl_vllm, warm_smollm2, synth_world,
                                                                           retriever_server):
    cfg, server, address = verl_vllm
    tok = load_tokenizer(warm_smollm2)
    rows = pd.read_parquet(synth_world / "test.parquet").head(N_QUESTIONS)
    questions = [str(q) for q in rows["question"]]
    settings = SearchR1Settings.from_config(cfg)
    r = settings.retriever
    queries_before = retriever_server.health()["batching"]["batched_queries"]

    # -- batch driver over HTTP ---------------------------------------------------------------------
    prompts, batch = make_batch(tok, questions, "tags")
    gen_config = settings.generation_config(cfg.actor_rollout_ref.rollout)
    with OpenAIGenerator(f"http://{address}", model=warm_smollm2, tokenizer=tok, max_prompts_per_request=1,
                         max_concurrency=1) as gen:
        engine = RetrieverClient(list(r.urls), topk=r.topk, timeout=r.timeout, retries=r.retries)
        batch_out = LLMGenerationManager(tok, gen, gen_config, engine, is_validation=True).run_llm_loop(batch)
        assert gen.token_ids_exact and gen.logprobs_available

    # -- verl's AgentLoopWorker over Ray ------------------------------------------------------------
    client = OneServerClient(cfg, server)
    worker = AgentLoopWorker(cfg, client)
    n = len(questions)
    data = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([make_messages(q, "tags") for q in questions] + [None], dtype=object)[:n],
        "agent_name": np.array(["search_r1"] * n, dtype=object),
        "data_source": np.array(list(rows["data_source"]), dtype=object),
        "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
    }, meta_info={"validate": True, "global_steps": 0})
    verl_out = asyncio.run(worker.generate_sequences(data))

    stats = verl_out.non_tensor_batch["search_r1"]
    m = batch_out.meta_info
    for i in range(n):
        want, got = unpadded(batch_out, i), unpadded(verl_out, i)
        assert got["prompt"] == want["prompt"], f"row {i}: verl's chat template differs from ours"
        assert got["response"] == want["response"], (f"row {i}:\n batch: {tok.decode(want['response'])!r}\n"
                                                     f" verl:  {tok.decode(got['response'])!r}")
        assert got["mask"] == want["mask"], f"row {i}"
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), f"row {i}"
        for ours, theirs in STAT_KEYS.items():
            assert stats[i][ours] == int(m[theirs][i]), f"row {i} {ours}"
    # The comparison covered multi-turn trajectories: searches reached the retriever on both sides,
    # and observation tokens (mask 0) sit between generated turns.
    searches = [s["valid_searches"] for s in stats]
    print(f"\n[vllm agent loop] {n} questions, searches per trajectory {searches}, turns "
          f"{[s['turns'] for s in stats]}, verl requests {client.requests}")
    assert sum(searches) > 0 and any(0 in unpadded(verl_out, i)["mask"] for i in range(n))
    assert retriever_server.health()["batching"]["batched_queries"] - queries_before >= 2 * sum(searches)
