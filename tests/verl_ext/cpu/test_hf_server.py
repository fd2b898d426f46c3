"""The `hf` rollout server (verl_ext.cpu.server) against HFGenerator and verl's server contract, with the
real tiny Qwen3 and its tokenizer; no Ray (the actor class is plain Python until ray.remote wraps it)."""
from __future__ import annotations

import asyncio

import pytest
import torch

import verl  # noqa: F401  (entry point: registers verl_ext.cpu's resolvers)
from search_r1.rollout.backends import HFGenerator, SamplingParams
from verl.workers.rollout.replica import TokenOutput
from verl_ext.cpu.server import HFRolloutServer, default_max_tokens, to_sampling_params


@pytest.fixture(scope="module")
def configs():
    from hydra import compose, initialize_config_dir

    from verl_ext.cpu.replica import ROLLOUT_NAME  # noqa: F401  (replica module imports fine)

    import verl_ext

    config_dir = str(__import__("pathlib").Path(verl_ext.__file__).parent / "configs")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("grpo_verl_cpu")
    return cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model


@pytest.fixture
def server(configs):
    rollout, model = configs
    threads = torch.get_num_threads()  # the server sets this process's threads (compute_threads)
    yield HFRolloutServer(rollout, model, batch_window_s=0.05)
    torch.set_num_threads(threads)


def test_threads_split_the_cores_among_the_nodes_servers(configs, monkeypatch):
    """A node's servers generate at once while the training workers wait: each takes cores // servers."""
    rollout, model = configs
    threads = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    try:
        assert torch.get_num_threads() != 2
        HFRolloutServer(rollout, model, servers_per_node=2)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("SEARCH_R1_COMPUTE_THREADS", "3")
        HFRolloutServer(rollout, model, servers_per_node=2)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def _prompt(server) -> list[int]:
    msgs = [{"role": "user", "content": "Which river flows through Boudro?"}]
    return server.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_default_budget_follows_vllm_server():
    # min(response_length, prompt_length + response_length - len(prompt)), clamped to the context left.
    assert default_max_tokens(100, prompt_length=256, response_length=64, max_model_len=512) == 64
    assert default_max_tokens(300, prompt_length=256, response_length=64, max_model_len=512) == 20
    assert default_max_tokens(500, prompt_length=256, response_length=64, max_model_len=510) == 1
    with pytest.raises(ValueError, match="no room to generate"):
        default_max_tokens(512, prompt_length=256, response_length=64, max_model_len=512)
    params, want = to_sampling_params({"temperature": 0.7, "top_k": 0, "logprobs": True, "stop": "</a>",
                                       "repetition_penalty": 1.0, "include_stop_str_in_output": True},
                                      prompt_len=10, prompt_length=256, response_length=64, max_model_len=512)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop, want) == (64, 0.7, -1, ("</a>",), True)


@pytest.mark.parametrize("bad", [{"repetition_penalty": 1.1}, {"include_stop_str_in_output": False}, {"best_of": 2}])
def test_unsupported_sampling_settings_fail_naming_the_key(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
        to_sampling_params(bad, prompt_len=10, prompt_length=256, response_length=64, max_model_len=512)


def test_generate_equals_hfgenerator_and_stops_at_the_stop_string(server):
    prompt = _prompt(server)
    free = asyncio.run(server.generate(prompt_ids=prompt, request_id="a",
                                       sampling_params={"temperature": 0, "max_tokens": 24, "logprobs": True}))
    assert isinstance(free, TokenOutput) and len(free.token_ids) == 24 and len(free.log_probs) == 24
    # Reference: HFGenerator called directly on the same model (greedy; processed = raw at T=0).
    ref = HFGenerator(server.model, server.tokenizer, logprobs_mode="processed").generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert free.token_ids == ref.token_ids
    assert free.log_probs == pytest.approx(ref.logprobs, abs=1e-5)
    # A stop string taken from the middle of the greedy text ends the output at the token completing it.
    text = server.tokenizer.decode(free.token_ids[:12])
    stop = text[-4:]
    cut = asyncio.run(server.generate(prompt_ids=prompt, request_id="b", sampling_params={
        "temperature": 0, "max_tokens": 24, "stop": [stop], "include_stop_str_in_output": True}))
    assert cut.log_probs is None  # not asked for
    k = len(cut.token_ids)
    assert 1 <= k <= 12 and cut.token_ids == free.token_ids[:k]
    assert stop in server.tokenizer.decode(cut.token_ids)
    assert stop not in server.tokenizer.decode(cut.token_ids[:-1])
    assert cut.extra_fields["finish_reason"] == "stop" and cut.stop_reason == "completed"


def test_concurrent_requests_share_one_batch_and_get_distinct_samples(server):
    prompt = _prompt(server)

    async def burst():
        params = {"temperature": 1.0, "max_tokens": 16, "logprobs": True}
        return await asyncio.gather(*[server.generate(prompt_ids=prompt, sampling_params=dict(params),
                                                      request_id=str(i)) for i in range(3)])

    outs = asyncio.run(burst())
    assert server.stats["batches"] == 1 and server.stats["requests"] == 3
    assert len({tuple(o.token_ids) for o in outs}) == 3  # one RNG stream per row, as a GRPO group needs
    assert all(o.extra_fields["global_steps"] is None for o in outs)


def test_requests_with_different_budgets_share_one_batch_and_keep_their_own(server):
    """The agent loop asks each turn for what is left of its response budget, so concurrent requests
    differ in max_tokens; they still run as one batch (one per request made a 2,400-trajectory
    rehearsal crawl), and each output is what its own budget gives: greedy, the same tokens as alone."""
    prompt = _prompt(server)
    alone = {n: asyncio.run(server.generate(prompt_ids=prompt, request_id=f"alone{n}", sampling_params={
        "temperature": 0, "max_tokens": n, "logprobs": True})) for n in (5, 9, 16)}
    batches = server.stats["batches"]

    async def burst():
        return await asyncio.gather(*[server.generate(prompt_ids=prompt, request_id=str(n), sampling_params={
            "temperature": 0, "max_tokens": n, "logprobs": True}) for n in (5, 9, 16)])

    outs = asyncio.run(burst())
    assert server.stats["batches"] == batches + 1
    for n, out in zip((5, 9, 16), outs):
        assert out.token_ids == alone[n].token_ids and len(out.token_ids) == n
        assert out.log_probs == pytest.approx(alone[n].log_probs, abs=1e-5)
        assert out.extra_fields["finish_reason"] == alone[n].extra_fields["finish_reason"] == "length"


def test_load_weights_changes_the_policy_and_rejects_foreign_names(server):
    prompt = _prompt(server)
    params = {"temperature": 0, "max_tokens": 8, "logprobs": True}
    before = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id="x"))
    checksum = asyncio.run(server.get_weight_checksum())
    new = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in server.model.named_parameters()}
    assert asyncio.run(server.load_weights(new, global_steps=3)) == len(new)
    assert asyncio.run(server.get_weight_checksum()) != pytest.approx(checksum)
    after = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id="y"))
    assert after.log_probs != pytest.approx(before.log_probs, abs=1e-4)
    assert after.extra_fields["global_steps"] == 3
    with pytest.raises(ValueError, match="not in the model"):
        asyncio.run(server.load_weights({"model.no_such.weight": torch.zeros(1)}))
    name = next(iter(new))
    with pytest.raises(ValueError, match="shape"):
        asyncio.run(server.load_weights({name: torch.zeros(1)}))


def test_lifecycle_calls_verl_makes_are_answered(server):
    async def calls():
        await server.sleep()
        await server.wake_up(tags=["weights"])
        await server.release_kv_cache()
        await server.resume_kv_cache()
        await server.clear_kv_cache()
        aborted = await server.abort_all_requests(reject_request=True)
        await server.resume_generation()
        await server.start_profile()
        await server.stop_profile()
        await server.set_global_steps(5)
        await server.wait_for_requests_to_drain()
        return aborted, await server.get_stats()

    aborted, stats = asyncio.run(calls())
    assert aborted == {"aborted_count": 0, "request_ids": []}
    assert stats["global_steps"] == 5 and stats["awake"] is True


def test_replica_refuses_modes_it_does_not_implement(configs):
    """HFReplica serves the hybrid (colocated sync) mode; others fail with the reason before any Ray call."""
    from omegaconf import OmegaConf

    from verl.workers.rollout.replica import RolloutMode
    from verl_ext.cpu.replica import HFReplica

    rollout, model = configs
    replica = HFReplica(replica_rank=0, config=rollout, model_config=model, gpus_per_node=1)
    replica.rollout_mode = RolloutMode.STANDALONE
    with pytest.raises(ValueError, match="hybrid"):
        asyncio.run(replica.launch_servers())
    assert OmegaConf.select(rollout, "tensor_model_parallel_size") == 1


def test_adapter_drains_weights_on_ranks_without_a_server_and_refuses_lora(configs, monkeypatch):
    """verl's FSDP weight generator runs a collective per tensor: every rank must consume all of it,
    also the ranks that hold no server (rollout rank > 0 of a replica)."""
    from omegaconf import OmegaConf

    from verl_ext.cpu.replica import HFServerAdapter

    rollout, model = configs
    monkeypatch.setenv("RANK", "1")
    adapter = HFServerAdapter(OmegaConf.merge(rollout, {"tensor_model_parallel_size": 2}), model, None)
    assert (adapter.replica_rank, adapter.rollout_rank) == (0, 1)
    consumed = []

    def weights():
        for i in range(3):
            consumed.append(i)
            yield f"w{i}", torch.zeros(2)

    asyncio.run(adapter.update_weights(weights(), global_steps=1))
    assert consumed == [0, 1, 2]
    asyncio.run(adapter.resume(["weights"]))  # no server on this rank: a no-op, no Ray lookup
    with pytest.raises(ValueError, match="lora.merge"):
        asyncio.run(adapter.update_weights(weights(), peft_config={"r": 8}))
    with pytest.raises(ValueError, match="named_tensors"):
        asyncio.run(adapter.update_weights(weights(), wire_format="delta_flush"))
