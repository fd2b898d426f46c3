"""Fixtures of the vLLM-on-CPU tests (this directory). They run with .venv-vllm's python: `make test`
runs the directory in a second pytest pass, `make test-vllm` runs only it. Each module starts with
`pytest.importorskip("vllm", reason=NO_VLLM)`, so the main venv's pass reports it skipped, saying why.

`warm_smollm2` (session): SmolLM2-135M after the format warm-start of configs/grpo_verl_cpu_vllm.yaml
on the session's synthetic world (`${search_r1_warmstart:smollm2-135m-instruct}`; the first session on
a machine trains it, ~1-2 min, later ones reuse $SEARCH_R1_HOME/warmstart). It writes
<search>/<answer>, so rollouts take several turns and reach the retriever.
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
