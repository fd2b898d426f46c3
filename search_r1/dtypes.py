"""Which floating-point type runs fast on this CPU: what `auto` means for the model dtypes.

Why measure: on CPUs with native bf16 matrix instructions (AVX512-BF16, AMX) a bf16 matmul runs
2-15x faster than fp32; on CPUs without them (AVX2-only laptops and cloud VMs) oneDNN emulates bf16
and the same matmul runs ~50x SLOWER (measured 1.0 vs 50 GFLOP/s on an AVX2-only AMD EPYC, where the
demo's warm-start then took 214 s per step instead of 11 s). CPU flags alone do not settle it (the
torch build, oneDNN's ISA cap `ONEDNN_MAX_CPU_ISA` and the thread count all matter), so `auto`
times the two shapes the trainer runs and picks bf16 only where it is clearly faster:

    compute: Linear(576 -> 1536) on 512 rows (a training forward/backward, SmolLM2's MLP width)
    rollout: the same Linear on 8 rows       (one decoding step of a batch of 8)

bf16 wins a role when its time is below fp32's / BF16_MARGIN. The decision is made once per machine
(CPU model, ISA flags, torch version and the environment variables that cap the ISA), cached as
JSON under `$SEARCH_R1_HOME/machine/`, and logged with its figures every time it is used.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

AUTO = "auto"
FLOAT_DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = (AUTO,) + FLOAT_DTYPES
# bf16 must be this much faster than fp32 to be chosen: near-ties go to fp32, the exact one.
BF16_MARGIN = 1.25
# Environment variables that change which kernels torch / oneDNN / MKL use (and so the answer).
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
CACHE_VERSION = 1
SHAPES = {"compute": 512, "rollout": 8}  # rows of the timed Linear(576 -> 1536)


@dataclass(frozen=True)
class DtypeDecision:
    """bf16 vs fp32 on this machine: microseconds per timed Linear, and the dtype chosen per role."""

    machine: str
    compute_fp32_us: float
    compute_bf16_us: float
    rollout_fp32_us: float
    rollout_bf16_us: float
    compute: str
    rollout: str
    decided: str

    def summary(self) -> str:
        return (f"compute {self.compute} (bf16 {self.compute_fp32_us / self.compute_bf16_us:.2f}x fp32's speed), "
                f"rollout {self.rollout} (bf16 {self.rollout_fp32_us / self.rollout_bf16_us:.2f}x) on {self.machine}")


def cpu_flags() -> set[str]:
    """The CPU's ISA flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """CPU model, torch's kernel level and the bf16-relevant flags, e.g. 'AMD EPYC, torch AVX512, avx512_bf16'."""
    import torch

    flags = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    capped = [f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k)]
    return ", ".join([cpu_model(), f"torch {torch.backends.cpu.get_cpu_capability()}"]
                     + [f for f in flags if f != "avx2" or len(flags) == 1] + capped)


def _fingerprint() -> str:
    import torch

    key = {"v": CACHE_VERSION, "cpu": cpu_model(), "flags": sorted(cpu_flags()), "torch": torch.__version__,
           "env": {k: os.environ.get(k, "") for k in ISA_ENV}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _time_linear(rows: int, dtype, repeats: int = 20) -> float:
    """Best-of-`repeats` seconds of Linear(576 -> 1536) on `rows` rows in `dtype` (inference mode)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(576, 1536).to(dtype)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        layer(x)  # first call builds oneDNN primitives
        for _ in range(repeats):
            t0 = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - t0)
            if best > 0.2:  # emulated bf16 is slow enough to tell after one timing
                break
    return best


def measure() -> DtypeDecision:
    """Time both shapes in both dtypes now (well under a second where bf16 is native, ~1 s where not)."""
    import torch

    t = {(role, name): _time_linear(rows, dt) * 1e6
         for role, rows in SHAPES.items() for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    pick = {role: "bfloat16" if t[(role, "bf16")] * BF16_MARGIN < t[(role, "fp32")] else "float32" for role in SHAPES}
    return DtypeDecision(machine_description(), round(t[("compute", "fp32")], 1), round(t[("compute", "bf16")], 1),
                         round(t[("rollout", "fp32")], 1), round(t[("rollout", "bf16")], 1),
                         pick["compute"], pick["rollout"], datetime.datetime.now().isoformat(timespec="seconds"))


def cache_path() -> Path:
    from search_r1.paths import home

    return home() / "machine" / f"dtype-{_fingerprint()}.json"


def decide(refresh: bool = False) -> DtypeDecision:
    """This machine's decision: read from the cache, or measured now and cached (atomic write)."""
    path = cache_path()
    if not refresh:
        try:
            return DtypeDecision(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
    decision = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(decision), indent=2))
    os.replace(tmp, path)
    return decision


def resolve_dtype(value: str, role: str, key: str = "dtype") -> str:
    """`value` itself when it is float32 / bfloat16; for `auto`, this machine's choice for `role`
    (compute: training passes; rollout: sampling), logged with the figures it rests on.

    Raises ValueError for any other value, naming `key` (the config key or flag being resolved).
    """
    if value in FLOAT_DTYPES:
        return value
    if value != AUTO:
        raise ValueError(f"{key}={value!r} is invalid: allowed {list(DTYPE_CHOICES)}. Fix: set {key} to one of them "
                         f"(auto picks bfloat16 only where this CPU runs it faster than float32)")
    if role not in SHAPES:
        raise ValueError(f"role {role!r}: allowed {sorted(SHAPES)}")
    decision = decide()
    chosen = getattr(decision, role)
    print(f"[dtype] {key}=auto -> {chosen}: {decision.summary()} (measured {decision.decided}, cached in "
          f"{cache_path()})", file=sys.stderr, flush=True)
    return chosen
