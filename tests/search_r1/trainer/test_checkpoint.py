"""CheckpointManager: round trip, keep-last-k, partial dirs ignored, HF-loadable, crash-safe saves."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from search_r1.trainer.checkpoint import (
    MARKER, PAUSE_ENV, PAUSE_SECONDS_ENV, CheckpointManager, capture_rng_state, is_complete,
    restore_rng_state,
)

REPO = Path(__file__).resolve().parents[3]

# Builds the tiny model in tests and in the crash subprocess alike (same code, same weights).
TINY_MODEL_SRC = textwrap.dedent("""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    def tiny_model(seed=0, hidden=32, layers=2, vocab=128):
        torch.manual_seed(seed)
        cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=hidden // 4, max_position_embeddings=128, tie_word_embeddings=True)
        return AutoModelForCausalLM.from_config(cfg)

    def tiny_tokenizer(vocab=128):
        words = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(vocab - 3)]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                       eos_token="<eos>")
""")
_ns: dict = {}
exec(TINY_MODEL_SRC, _ns)
tiny_model, tiny_tokenizer = _ns["tiny_model"], _ns["tiny_tokenizer"]


def _trained(seed=0):
    """A tiny model and AdamW + LR scheduler after two real steps (non-trivial optimizer state)."""
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _draw():
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def _states_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_round_trip(tmp_path):
    model, opt, sched = _trained()
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    loader_state = {"version": 1, "seed": 3, "epoch": 1, "position": 2, "batch_size": 4, "num_rows": 9,
                    "shuffle": True, "drop_last": True}
    path = mgr.save(7, model, tiny_tokenizer(), optimizer_state=opt.state_dict(),
                    scheduler_state=sched.state_dict(), extra_state={"best_val_em": 0.25},
                    dataloader_state=loader_state)
    expected_draws = [_draw() for _ in range(3)]
    assert path == tmp_path / "ckpt" / "global_step_7"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step_7"
    assert (path / "model" / "model.safetensors").is_file()

    # Fresh objects, different weights and RNG, then restore everything.
    model2, opt2, sched2 = _trained(seed=1)
    assert not torch.equal(model2.model.embed_tokens.weight, model.model.embed_tokens.weight)
    state = CheckpointManager(tmp_path / "ckpt").load(model=model2)
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"])
    for (k, v), (k2, v2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()  # still tied
    assert _states_equal(opt.state_dict(), opt2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
    assert [_draw() for _ in range(3)] == expected_draws  # RNG continues identically
    assert state["step"] == 7 and state["extra_state"] == {"best_val_em": 0.25}
    assert state["dataloader"] == loader_state
    # Training continues identically after restore (same next update).
    ids = torch.arange(8).view(1, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
    assert torch.equal(model.model.norm.weight, model2.model.norm.weight)


def test_rng_state_loads_weights_only(tmp_path):
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)  # no pickled numpy objects inside
    restore_rng_state(state)


def test_saved_dir_loads_with_transformers(tmp_path):
    """The project's tiny Qwen3 + real SmolLM2 tokenizer round-trip through from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from search_r1.models import load_model_and_tokenizer
    from search_r1.prompts import apply_chat_template, make_messages

    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # differs from the cached original
    path = CheckpointManager(tmp_path).save(1, model, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(path / "model", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path / "model", local_files_only=True)
    messages = make_messages("who wrote the book")
    ids = apply_chat_template(tok, messages)
    assert ids == apply_chat_template(tokenizer, messages)  # chat template and vocab saved
    assert tok.pad_token_id == tokenizer.pad_token_id
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.allclose(loaded(input_ids=x).logits, model(input_ids=x).logits)


def test_keep_last_k_and_resave(tmp_path):
    model = tiny_model()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, model)
    assert [s for s, _ in mgr.checkpoints()] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "global_step_4", "latest"]
    # Saving a step again (a resumed run) replaces it in place.
    mgr.save(4, model, extra_state={"again": True})
    assert mgr.load()["extra_state"] == {"again": True}
    # An older step saved after newer ones (a run resumed from an old checkpoint): kept, with a warning,
    # and latest() still means the highest step.
    mgr.save(2, model)
    assert [s for s, _ in mgr.checkpoints()] == [2, 4]
    assert mgr.latest().name == "global_step_4"
    keep_all = CheckpointManager(tmp_path / "all", keep_last=None)
    for step in (1, 2, 3, 4):
        keep_all.save(step, model)
    assert len(keep_all.checkpoints()) == 4
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_latest_ignores_partial_dirs(tmp_path):
    model = tiny_model()
    mgr = CheckpointManager(tmp_path, keep_last=5)
    good = mgr.save(2, model)
    # A newer directory without a marker, one whose marker disagrees with the files, and a temp dir
    # of a live process (this one): none of them is a checkpoint.
    (tmp_path / "global_step_9" / "model").mkdir(parents=True)
    bad = tmp_path / "global_step_8"
    import shutil
    shutil.copytree(good, bad)
    with open(bad / "model" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert not is_complete(bad)
    (tmp_path / f".tmp-global_step_10-{os.getpid()}-abcd").mkdir()
    assert mgr.latest() == good
    with pytest.raises(ValueError, match="incomplete"):
        mgr.load(bad)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        CheckpointManager(tmp_path / "empty").load()


def test_bad_extra_state_is_rejected_before_writing(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="JSON"):
        mgr.save(1, tiny_model(), extra_state={"t": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_dirs_cleaned_at_startup(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-global_step_3-{dead.pid}-deadbeef"
    (stale / "model").mkdir(parents=True)
    trash = tmp_path / ".trash-global_step_1-12345678"
    trash.mkdir()
    live = tmp_path / f".tmp-global_step_4-{os.getppid()}-cafe0000"  # parent process: alive
    live.mkdir()
    CheckpointManager(tmp_path)
    assert not stale.exists() and not trash.exists() and live.exists()


CRASH_SCRIPT = TINY_MODEL_SRC + textwrap.dedent("""
    import sys
    from search_r1.trainer.checkpoint import CheckpointManager
    root, step, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = tiny_model(seed=step, hidden=hidden, layers=4, vocab=2048)
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    opt.step()
    print("saving", flush=True)
    CheckpointManager(root, keep_last=1).save(step, model, tiny_tokenizer(), optimizer_state=opt.state_dict())
    print("saved", flush=True)
""")


def _save_first(root):
    """Checkpoint 1, saved in this process the way the subprocess saves checkpoint 2."""
    model, opt, _ = _trained()
    CheckpointManager(root, keep_last=1).save(1, model, tiny_tokenizer(), optimizer_state=opt.state_dict())


def _spawn_save(tmp_path, root, step, hidden=32, pause_after=None):
    script = tmp_path / "save_ckpt.py"
    script.write_text(CRASH_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if pause_after:
        env[PAUSE_ENV] = pause_after
        env[PAUSE_SECONDS_ENV] = "120"
    return subprocess.Popen([sys.executable, str(script), str(root), str(step), str(hidden)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pred, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _assert_previous_survives(root: Path):
    mgr = CheckpointManager(root, keep_last=1)  # a restarted trainer
    latest = mgr.latest()
    assert latest is not None and latest.name == "global_step_1"
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # crashed temp dir cleaned
    state = mgr.load()
    assert state["step"] == 1 and state["optimizer"]["state"]
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(latest / "model")


# Each case starts a fresh Python that imports transformers (~25 s on a loaded 2-core box): one
# runs by default, the others are marked slow.
@pytest.mark.parametrize("pause_after", ["optimizer.pt", pytest.param(MARKER, marks=pytest.mark.slow)])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, pause_after):
    """Killed while writing (after the optimizer file) or just before the rename: step 1 stays latest."""
    root = tmp_path / "ckpt"
    _save_first(root)
    proc = _spawn_save(tmp_path, root, 2, pause_after=pause_after)
    try:
        def paused():
            return any(p.name.startswith(".tmp-global_step_2") and (p / pause_after).exists()
                       for p in root.iterdir())
        assert _wait_for(paused), proc.stderr.read() if proc.poll() is not None else "save never paused"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert (root / "latest").read_text().strip() == "global_step_1"
    _assert_previous_survives(root)


@pytest.mark.slow
def test_sigkill_without_hook_as_soon_as_temp_dir_appears(tmp_path):
    """No test hook: a ~10 MB model, killed the moment its temp dir exists."""
    root = tmp_path / "ckpt"
    _save_first(root)
    proc = _spawn_save(tmp_path, root, 2, hidden=256)
    try:
        assert _wait_for(lambda: any(p.name.startswith(".tmp-global_step_2") for p in root.iterdir()))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"no-hook SIGKILL: save process exit code {proc.returncode}")
    if proc.returncode == 0:  # the machine was fast enough to finish: then step 2 must be complete
        assert CheckpointManager(root).latest().name == "global_step_2"
        return
    _assert_previous_survives(root)
