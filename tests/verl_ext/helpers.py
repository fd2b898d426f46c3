"""Shared test helpers for verl_ext: a composed verl config and the vLLM-server-shaped fake.

`FakeVLLMServer` is the one boundary we cannot reach here (a GPU vLLM server). It has the signature
and return type of verl's `vLLMHttpServer.generate` (token ids in, `TokenOutput` out), applies the
same `max_tokens` default and `logprobs` flag handling, and produces tokens with the scripted policy
of tests/search_r1/rollout/scripted.py. `ScriptedLLMClient` is verl's real `LLMServerClient` (so
verl's own request plumbing runs) with the load balancer, a Ray actor, replaced by that one server.
"""
from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import OmegaConf
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from search_r1.rollout.backends import SamplingParams

REPO = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=2)
def _composed(name: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose(name)


def _config(name: str, overrides: dict):
    from search_r1.models import resolve_model_path

    cfg = OmegaConf.create(OmegaConf.to_container(_composed(name), resolve=False))
    OmegaConf.update(cfg, "actor_rollout_ref.model.path", resolve_model_path("tiny-random-qwen3"))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


def verl_config(**overrides):
    """configs/grpo_verl.yaml composed with verl's ppo_trainer (cached), plus dotted `overrides`
    (keys with `__` for dots: actor_rollout_ref__rollout__prompt_length=64). A fresh copy per call."""
    return _config("grpo_verl", overrides)


def ppo_config(**overrides):
    """configs/ppo_verl.yaml, as verl_config (its critic follows the actor's tiny model by interpolation)."""
    return _config("ppo_verl", overrides)


class _Method:
    """`handle.method.remote(**kw)` of a Ray actor handle, for a local object."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _Handle:
    def __init__(self, server):
        self.generate = _Method(server.generate)


class FakeVLLMServer:
    """Answers `generate(prompt_ids, sampling_params, request_id, ...)` like verl's vLLM server.

    scripted: a `ScriptedGenerator`; every call and its sampling params are kept in `calls`.
    """

    def __init__(self, scripted, prompt_length: int, response_length: int, global_steps: int = 0):
        self.scripted, self.calls = scripted, []
        self.prompt_length, self.response_length = prompt_length, response_length
        self.global_steps = global_steps

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, priority=0, **kwargs) -> TokenOutput:
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params)})
        sp = dict(sampling_params)
        # vLLMHttpServer.generate's default when the caller gives no max_tokens.
        default = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        max_tokens = max(1, sp.pop("max_tokens", default))
        params = SamplingParams(max_tokens=max_tokens, temperature=sp.get("temperature", 1.0),
                                top_p=sp.get("top_p", 1.0), top_k=sp.get("top_k", -1), stop=tuple(sp.get("stop") or ()))
        out = self.scripted.generate([list(prompt_ids)], params)[0]
        return TokenOutput(token_ids=list(out.token_ids), log_probs=list(out.logprobs) if sp.get("logprobs") else None,
                           stop_reason="completed", extra_fields={"global_steps": self.global_steps})


class ScriptedLLMClient(LLMServerClient):
    """verl's LLMServerClient routed to one local `FakeVLLMServer` instead of a Ray load balancer."""

    def __init__(self, config, server: FakeVLLMServer):
        super().__init__(config, load_balancer_handle=None)
        self.server = server
        self.acquired: list[str] = []  # the request ids the load balancer would route by

    async def _acquire_server(self, request_id: str, **extra):
        self.acquired.append(request_id)
        return "fake-0", _Handle(self.server)

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        return None
