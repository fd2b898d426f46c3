"""verl_ext.cpu.vllm_worker against vLLM's real CPU model runner (slow; .venv-vllm).

vLLM's CPU backend packs every linear weight for its GEMM kernels after loading and leaves an empty
Parameter behind, so loading new weights into a running engine (what verl's weight sync does) fails;
`restore_packed_weights` makes them loadable again. Checked in the engine's worker process, on SmolLM2
in float32: the weights are packed away, a reload without the fix fails, with it the reload succeeds,
and vLLM's repacking of the reloaded weights gives the same greedy tokens as before.
"""
from __future__ import annotations

import pytest

from tests.verl_ext.cpu.vllm.servers import KV_CACHE_BYTES, NO_VLLM, vllm_env

pytest.importorskip("vllm", reason=NO_VLLM)


def reload_weights(worker, model_dir: str, restore: bool):
    """Runs in vLLM's worker process: (packed-away layers, layers restored, outcome of a full reload)."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from verl_ext.cpu.vllm_worker import packed_away, restore_packed_weights

    model = worker.model_runner.model
    packed = sum(packed_away(m) for m in model.modules())
    restored = restore_packed_weights(model) if restore else 0
    try:
        model.load_weights(load_file(f"{model_dir}/model.safetensors").items())
    except (AssertionError, AttributeError) as err:  # shape [0] / missing weight_loader, by layer kind
        return packed, restored, f"{type(err).__name__}: {err}"
    process_weights_after_loading(model, worker.model_runner.vllm_config.model_config, worker.device)
    return packed, restored, "loaded"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_packed_weights_are_restored_for_a_reload(monkeypatch):
    from vllm import LLM, SamplingParams

    from search_r1.models import resolve_model_path

    for key, value in vllm_env().items():
        monkeypatch.setenv(key, value)
    # The probe is a function sent to the worker: vLLM pickles it only when allowed (local engine).
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    path = resolve_model_path("smollm2-135m-instruct")
    llm = LLM(model=path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES,
              max_model_len=512, seed=0)
    try:
        greedy = SamplingParams(max_tokens=24, temperature=0)
        before = list(llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        [(packed, restored, outcome)] = llm.collective_rpc(reload_weights, args=(path, False))
        assert packed > 0 and restored == 0 and outcome != "loaded", outcome
        [(packed_again, restored, outcome)] = llm.collective_rpc(reload_weights, args=(path, True))
        assert outcome == "loaded" and restored == packed_again == packed
        after = list(llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        assert after == before
        # vLLM packed the reloaded weights again: the next sync has the same work to do
        [(packed_after, _, _)] = llm.collective_rpc(reload_weights, args=(path, True))
        assert packed_after == packed
    finally:
        llm.llm_engine.engine_core.shutdown()
