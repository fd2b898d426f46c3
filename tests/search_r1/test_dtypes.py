"""search_r1.dtypes: `auto` picks bf16 only where this CPU runs it faster, decided once per machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from search_r1 import dtypes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path))
    return tmp_path


def fake_timings(monkeypatch, us: dict):
    """_time_linear answers from `us[(rows, dtype name)]` microseconds and counts its calls."""
    calls = []

    def timed(rows, layers, repeats=10):
        calls.append((rows, layers))
        return {"fp32": us[(rows, "float32")] / 1e6, "bf16": us[(rows, "bfloat16")] / 1e6}

    monkeypatch.setattr(dtypes, "_time_linear", timed)
    return calls


def test_explicit_values_pass_through_and_bad_ones_name_the_key(home):
    assert dtypes.resolve_dtype("float32", "compute") == "float32"
    assert dtypes.resolve_dtype("bfloat16", "rollout") == "bfloat16"
    with pytest.raises(ValueError, match=r"model.compute_dtype='fp16'.*auto"):
        dtypes.resolve_dtype("fp16", "compute", "model.compute_dtype")
    assert not (home / "machine").exists()  # nothing measured for explicit values


def test_auto_picks_per_role_by_measured_speed_with_a_margin(home, monkeypatch, capsys):
    # compute: bf16 2x faster -> bf16; rollout: bf16 only 1.1x faster (inside the 1.25 margin) -> fp32
    calls = fake_timings(monkeypatch, {(512, "float32"): 1000.0, (512, "bfloat16"): 500.0,
                                       (8, "float32"): 110.0, (8, "bfloat16"): 100.0})
    assert dtypes.resolve_dtype("auto", "compute", "model.compute_dtype") == "bfloat16"
    assert dtypes.resolve_dtype("auto", "rollout", "model.rollout_dtype") == "float32"
    assert len(calls) == 2  # each role measured once, then read back from the cache
    cached = json.loads(dtypes.cache_path().read_text())
    assert (cached["compute"], cached["rollout"]) == ("bfloat16", "float32")
    err = capsys.readouterr().err
    assert "model.compute_dtype=auto -> bfloat16" in err and "2.00x" in err  # the decision is logged


def test_emulated_bf16_is_never_chosen(home, monkeypatch):
    # An AVX2-only CPU: bf16 ~50x slower than fp32 in both shapes.
    fake_timings(monkeypatch, {(512, "float32"): 1000.0, (512, "bfloat16"): 50000.0,
                               (8, "float32"): 30.0, (8, "bfloat16"): 1500.0})
    assert dtypes.resolve_dtype("auto", "compute") == "float32"
    assert dtypes.resolve_dtype("auto", "rollout") == "float32"


def test_the_decision_is_per_isa_setting(home, monkeypatch):
    first = dtypes.cache_path()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert dtypes.cache_path() != first  # capping oneDNN's ISA is another machine as far as speed goes


def test_a_corrupt_cache_is_measured_again(home, monkeypatch):
    calls = fake_timings(monkeypatch, {(512, "float32"): 1.0, (512, "bfloat16"): 9.0,
                                       (8, "float32"): 1.0, (8, "bfloat16"): 9.0})
    path = dtypes.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert dtypes.decide().compute == "float32"
    assert len(calls) == 2 and json.loads(path.read_text())["compute"] == "float32"


def test_real_measurement_refuses_bf16_when_onednn_is_capped_at_avx2(tmp_path):
    """The bug this guards against: bf16 chosen on a CPU without bf16 instructions. Capping oneDNN at
    AVX2 makes any x86 CPU emulate bf16, so the real timing must pick float32 for both roles."""
    env = dict(os.environ, SEARCH_R1_HOME=str(tmp_path), ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    code = ("from search_r1 import dtypes; d = dtypes.decide(); "
            "print(d.compute, d.rollout, d.compute_bf16_us / d.compute_fp32_us)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    compute, rollout, slowdown = out.stdout.split()
    assert (compute, rollout) == ("float32", "float32"), out.stdout
    assert float(slowdown) > 2.0  # emulated bf16 really is much slower, not a near-tie
