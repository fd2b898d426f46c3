"""Fixtures of the vLLM-on-CPU tests (this directory). They run with .venv-vllm's python: `make test`
runs the directory in a second pytest pass, `make test-vllm` runs only it. Each module starts with
`pytest.importorskip("vllm", reason=NO_VLLM)`, so the main venv's pass reports it skipped, saying why.

`warm_smollm2` (session): SmolLM2-135M after the format warm-start of configs/grpo_verl_cpu_vllm.yaml
on the session's synthetic world (`${search_r1_warmstart:smollm2-135m-instruct}`; the first session on
a machine trains it, ~1-2 min, later ones reuse $SEARCH_R1_HOME/warmstart). It writes
<search>/<answer>, so rollouts take several turns and reach the retriever.

`vllm_serve_smollm2` (session): one `vllm serve` of it for the tests that need only a running
OpenAI-compatible server (the agents' and the evaluation CLI's tests); tests that need their own
flags start their own.
"""
from __future__ import annotations

import pytest

from tests.verl_ext.cpu.vllm.servers import vllm_config_overrides


@pytest.fixture(scope="session")
def warm_smollm2(synth_world, retriever_server) -> str:
    from hydra import compose, initialize_config_dir

    import verl_ext.cpu  # noqa: F401  (config resolvers)
    from tests.verl_ext.helpers import REPO

    with initialize_config_dir(config_dir=str(REPO / "verl_ext" / "configs"), version_base=None):
        cfg = compose("grpo_verl_cpu_vllm", overrides=vllm_config_overrides(synth_world, retriever_server))
    path = str(cfg.actor_rollout_ref.model.path)
    assert "/warmstart/" in path, path
    return path


@pytest.fixture(scope="session")
def vllm_serve_smollm2(warm_smollm2, tmp_path_factory):
    """`vllm serve` of `warm_smollm2` on loopback with the tests' settings (servers.VLLMServe: served as
    smollm2-135m-instruct, --max-model-len 2048), started once per session (~1-2 min on this CPU) for
    every test that only needs the OpenAI API of a running server; stopped at the session's end."""
    from tests.verl_ext.cpu.vllm.servers import VLLMServe

    with VLLMServe(warm_smollm2, tmp_path_factory.mktemp("vllm_serve") / "vllm_serve.log") as server:
        yield server
