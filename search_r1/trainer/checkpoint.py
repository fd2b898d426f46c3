"""Atomic, keep-last-k training checkpoints.

Layout of one checkpoint, `root/global_step_{step}/`:

    model/                 HF directory: config.json, model.safetensors, tokenizer files
                           (`AutoModelForCausalLM.from_pretrained(...)` and vLLM load it as is)
    optimizer.pt           optimizer state_dict (torch.save; loads with weights_only=True)
    scheduler.pt           LR scheduler state_dict
    rng_state.pt           python / numpy / torch RNG state as tensors, ints and lists only
    dataloader_state.json  PromptDataLoader.state_dict()
    trainer_state.json     step, save time, the caller's JSON `extra_state`
    COMPLETE               written last: the file manifest (name -> size); no marker, no checkpoint

Atomicity: everything is written into `root/.tmp-global_step_{step}-{pid}-{nonce}`, every file and
the directory are fsync'ed, the marker is written, then one `os.rename` publishes the directory.
`root/latest` (the name of the newest checkpoint) is replaced with write-temp + `os.replace`. A crash
at any point leaves either the old set of checkpoints or the old set plus the complete new one;
leftover temp directories are removed by the next `CheckpointManager` on the same root.
Old checkpoints are removed only after the new one is in place, and are first renamed to
`.trash-*` so a half-deleted directory can never look like a checkpoint.

`latest()` trusts the markers, not the pointer file: the newest directory with a valid marker wins,
so a crash between the rename and the pointer update still finds the new checkpoint.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
POINTER = "latest"
FORMAT_VERSION = 1
_DIR_RE = re.compile(r"^global_step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
# Test hook: pause the save (seconds) right after this file name is written, so a test can kill
# the process mid-save deterministically. Unset in normal runs.
PAUSE_ENV = "SEARCH_R1_CKPT_PAUSE_AFTER"
PAUSE_SECONDS_ENV = "SEARCH_R1_CKPT_PAUSE_SECONDS"


# ---------------------------------------------------------------------------------------------
# RNG state


def capture_rng_state() -> dict:
    """Python, numpy and torch RNG state as plain data (ints, lists, tensors) for weights_only load."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
        "numpy": {"name": str(np_name), "keys": [int(k) for k in np_keys], "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# file helpers


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network/FUSE file systems cannot fsync a directory; the rename is still atomic there.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _maybe_pause(name: str) -> None:
    if os.environ.get(PAUSE_ENV) == name:
        time.sleep(float(os.environ.get(PAUSE_SECONDS_ENV, "60")))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _manifest(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MARKER}


def is_complete(directory: Path) -> bool:
    """True if `directory` has a marker whose manifest matches the files on disk (names and sizes)."""
    marker = Path(directory) / MARKER
    try:
        recorded = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, size in recorded.items():
        f = Path(directory) / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def _json_ready(value, what: str):
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{what} must be JSON-serialisable (numbers, strings, lists, dicts): {exc}; "
            f"convert tensors with .tolist() or store them in optimizer/scheduler state") from exc
    return value


# ---------------------------------------------------------------------------------------------


class CheckpointManager:
    """Writes, lists, prunes and loads checkpoints under `root`.

    One manager (one process) should write to a root at a time; temp directories of a live process
    are left alone, those of dead processes are removed at construction.

    Args:
        root: directory holding `global_step_*` checkpoints (created if missing).
        keep_last: number of complete checkpoints to keep (None keeps all).
    """

    def __init__(self, root, keep_last: int | None = 3):
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        self.cleanup_stale()

    # -- listing ---------------------------------------------------------------------------------

    def cleanup_stale(self) -> list[Path]:
        """Remove temp dirs of crashed saves and unfinished deletions; returns what was removed."""
        removed = []
        for p in self.root.iterdir():
            if p.name.startswith(_TRASH_PREFIX):
                removed.append(p)
            elif p.name.startswith(_TMP_PREFIX):
                # .tmp-global_step_{step}-{pid}-{nonce}: keep temp dirs of a save still in progress.
                parts = p.name.rsplit("-", 2)
                pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
                if pid is None or pid == os.getpid() or not _pid_alive(pid):
                    removed.append(p)
        for p in removed:
            logger.warning("removing leftover %s from an interrupted checkpoint save", p)
            shutil.rmtree(p, ignore_errors=True)
        return removed

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first."""
        found = []
        for p in self.root.iterdir():
            m = _DIR_RE.match(p.name)
            if m and p.is_dir():
                if is_complete(p):
                    found.append((int(m.group(1)), p))
                else:
                    logger.warning("ignoring %s: no valid %s marker (incomplete checkpoint)", p, MARKER)
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def discard_after(self, step: int) -> list[Path]:
        """Remove the complete checkpoints of steps after `step` (a branch of training abandoned by a
        rollback, so `latest()` finds the one training continues from). Returns their paths."""
        newer = [path for s, path in self.checkpoints() if s > step]
        for path in newer:
            self._discard(path)
        if newer:
            self._write_pointer(f"global_step_{step}")
        return newer

    # -- saving ----------------------------------------------------------------------------------

    def save(self, step: int, model, tokenizer=None, optimizer_state: dict | None = None,
             scheduler_state: dict | None = None, extra_state: dict | None = None,
             dataloader_state: dict | None = None, rng_state: dict | None = None) -> Path:
        """Write checkpoint `step` atomically and prune old ones; returns its final path.

        `model` is a transformers `PreTrainedModel` (saved with `save_pretrained`, safetensors).
        `rng_state` defaults to this process's RNG (`capture_rng_state()`).
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        extra_state = _json_ready(extra_state or {}, "extra_state")
        if dataloader_state is not None:
            _json_ready(dataloader_state, "dataloader_state")
        name = f"global_step_{step}"
        final = self.root / name
        newer = [s for s, _ in self.checkpoints() if s > step]
        if newer:
            # latest() means the highest step; a run resumed from an older checkpoint keeps losing to
            # the abandoned newer ones until they are removed.
            logger.warning("saving step %d while newer checkpoints %s exist under %s; latest() will keep "
                           "returning step %d until you delete them", step, newer, self.root, max(newer))
        tmp = self.root / f"{_TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            model_dir = tmp / "model"
            model.save_pretrained(model_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(model_dir)
            _maybe_pause("model")
            if optimizer_state is not None:
                torch.save(optimizer_state, tmp / "optimizer.pt")
                _maybe_pause("optimizer.pt")
            if scheduler_state is not None:
                torch.save(scheduler_state, tmp / "scheduler.pt")
            torch.save(rng_state if rng_state is not None else capture_rng_state(), tmp / "rng_state.pt")
            if dataloader_state is not None:
                _write_json(tmp / "dataloader_state.json", dataloader_state)
            _write_json(tmp / "trainer_state.json", {"format_version": FORMAT_VERSION, "step": step,
                                                     "saved_at": time.time(), "extra_state": extra_state})
            for f in tmp.rglob("*"):
                if f.is_file():
                    _fsync_file(f)
            _fsync_dir(model_dir)
            _write_json(tmp / MARKER, {"step": step, "files": _manifest(tmp)})
            _fsync_dir(tmp)
            _maybe_pause(MARKER)
            self._publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_pointer(name)
        self._prune(keep=final)
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():
            # Re-saving a step (e.g. after a resume): move the old one aside first; rename cannot
            # replace a non-empty directory.
            self._discard(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)

    def _write_pointer(self, name: str) -> None:
        tmp = self.root / f"{_TMP_PREFIX}{POINTER}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / POINTER)
        _fsync_dir(self.root)

    def _discard(self, path: Path) -> None:
        trash = self.root / f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        """Keep `keep` (the checkpoint just saved) plus the keep_last - 1 highest-step others."""
        if self.keep_last is None:
            return
        others = [path for _, path in self.checkpoints() if path != keep]
        for path in others[:max(len(others) - (self.keep_last - 1), 0)]:
            self._discard(path)

    # -- loading ---------------------------------------------------------------------------------

    def load(self, path=None, model=None) -> dict:
        """Read a checkpoint (default: `latest()`); optionally copy its weights into `model`.

        Returns a dict with `step`, `path`, `model_dir`, `optimizer`, `scheduler`, `rng`,
        `dataloader`, `extra_state` (missing parts are None). Tensors load on CPU with
        `weights_only=True`. The RNG state is returned, not applied: call `restore_rng_state`.
        """
        if path is None:
            path = self.latest()
            if path is None:
                raise FileNotFoundError(f"no complete checkpoint under {self.root}; train first or set resume=disable")
        return load_checkpoint(path, model)


def read_extra_state(path) -> dict:
    """The caller's `extra_state` of a complete checkpoint, without loading any tensor."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"checkpoint {path} is missing or incomplete (no valid {MARKER} marker); "
                         f"use CheckpointManager.latest() to pick the newest complete one")
    return json.loads((path / "trainer_state.json").read_text()).get("extra_state", {})


def load_checkpoint(path, model=None) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise ValueError(f"checkpoint {path} is incomplete (no valid {MARKER} marker); "
                         f"use CheckpointManager.latest() to pick the newest complete one")

    def _torch(name):
        f = path / name
        return torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else None

    def _json(name):
        f = path / name
        return json.loads(f.read_text()) if f.is_file() else None

    trainer_state = _json("trainer_state.json") or {}
    out = {
        "step": trainer_state.get("step"),
        "path": path,
        "model_dir": path / "model",
        "optimizer": _torch("optimizer.pt"),
        "scheduler": _torch("scheduler.pt"),
        "rng": _torch("rng_state.pt"),
        "dataloader": _json("dataloader_state.json"),
        "extra_state": trainer_state.get("extra_state", {}),
    }
    if model is not None:
        load_model_weights(model, path / "model")
    return out


def load_model_weights(model, model_dir) -> None:
    """Copy safetensors weights from an HF directory into `model` (tied weights allowed missing)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    state = {}
    for shard in shards:
        state.update(load_file(str(model_dir / shard), device="cpu"))
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"checkpoint {model_dir} has weights the model lacks: {result.unexpected_keys[:5]}; "
                         f"is it the same architecture?")
    # save_pretrained drops tied copies (lm_head = embed_tokens); they are fine if they share storage
    # with a loaded parameter.
    params = model.state_dict()
    loaded_ptrs = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in result.missing_keys if params[k].data_ptr() not in loaded_ptrs]
    if untied:
        raise ValueError(f"checkpoint {model_dir} lacks weights {untied[:5]}; is it the same architecture?")
