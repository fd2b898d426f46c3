"""Which floating-point type runs fast on this CPU: what `auto` means for the model dtypes.

Why measure: on CPUs with native bf16 matrix instructions (AVX512-BF16, AMX) a bf16 matmul runs
2-15x faster than fp32; on CPUs without them (AVX2-only laptops and cloud VMs) oneDNN emulates bf16
and the same matmul runs ~50x SLOWER (measured 1.0 vs 50 GFLOP/s on an AVX2-only AMD EPYC, where the
demo's warm-start then took 214 s per step instead of 11 s). CPU flags alone do not settle it (the
torch build, oneDNN's ISA cap `ONEDNN_MAX_CPU_ISA` and the thread count all matter), so `auto`
times the two kinds of work the trainer does and picks bf16 only where it is clearly faster:

    compute: Linear(576 -> 1536) on 512 rows, one layer: a training forward/backward (SmolLM2's MLP
             width), compute-bound
    rollout: 150 distinct such layers (135M weights, SmolLM2-135M's size) on 8 rows: one decoding
             step of a batch of 8, which reads every weight once, so memory traffic decides it

The rollout shape must stream a model's worth of weights: one small layer stays in cache and times
the arithmetic only. That is what the first version did, and on a 2-core Xeon with a 300 MiB L3 its
bf16 / fp32 ratio came out 0.95x, 1.34x and 1.46x in three fresh measurements, on both sides of the
margin, so two fresh homes on one machine sampled in different dtypes. fp32 and bf16 are timed in
alternation (best of the repeats), so a neighbour process slows both alike.

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
CACHE_VERSION = 2  # 2: the rollout shape streams 135M weights (version 1 timed one cached layer)
SHAPES = {"compute": (512, 1), "rollout": (8, 150)}  # (rows, distinct layers) of the timed Linear(576 -> 1536)


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


def _time_linear(rows: int, layers: int, repeats: int = 10) -> dict[str, float]:
    """Best-of-`repeats` seconds of `layers` distinct Linear(576 -> 1536) on `rows` rows, per dtype
    ("fp32", "bf16"), timed in alternation (inference mode)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=gen) for _ in range(layers)]
    x = torch.randn(rows, 576, generator=gen)
    stacks = {"fp32": (x, weights), "bf16": (x.bfloat16(), [w.bfloat16() for w in weights])}
    best = {name: float("inf") for name in stacks}
    with torch.inference_mode():
        for xs, ws in stacks.values():  # the first call builds oneDNN primitives
            torch.nn.functional.linear(xs, ws[0])
        for _ in range(repeats):
            for name, (xs, ws) in stacks.items():
                t0 = time.perf_counter()
                for w in ws:
                    torch.nn.functional.linear(xs, w)
                best[name] = min(best[name], time.perf_counter() - t0)
            if max(best.values()) > 0.2:  # emulated bf16 is slow enough to tell after one timing
                break
    return best


def measure() -> DtypeDecision:
    """Time both shapes in both dtypes now (~2 s where bf16 is native, a few s where it is emulated;
    the rollout stack holds ~800 MB of weights, fp32 and bf16, while it runs)."""
    t = {role: {name: sec * 1e6 for name, sec in _time_linear(rows, layers).items()}
         for role, (rows, layers) in SHAPES.items()}
    pick = {role: "bfloat16" if t[role]["bf16"] * BF16_MARGIN < t[role]["fp32"] else "float32" for role in SHAPES}
    return DtypeDecision(machine_description(), round(t["compute"]["fp32"], 1), round(t["compute"]["bf16"], 1),
                         round(t["rollout"]["fp32"], 1), round(t["rollout"]["bf16"], 1),
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
