"""The two installs resolve, checked with pip's own resolver (`pip install --dry-run --report`, nothing
installed, no GPU needed):

- GPU: `.[gpu]` -> verl's GPU stack as verl 0.9.1 declares it (vllm 0.24.0 with torch 2.11.0), which
  the old core pin torch==2.13.0 made impossible;
- CPU: `.[test]` with constraints-cpu.txt (what the Makefile installs) -> torch 2.13.0, no vllm.

pip reads package metadata from PyPI (PEP 658 metadata files; no wheel is downloaded for a dry run
when the index serves them) and this machine's local wheel directories. The GPU resolution takes ~2
minutes here, so the test is slow-marked; without PyPI it is skipped, saying so. A resolution is cached
under $SEARCH_R1_HOME/cache/pip-resolution, keyed by what decides it (setup.py, constraints-cpu.txt,
the extra, pip's and Python's versions): a rerun with those unchanged reads it back and prints that it
did (delete the directory to ask the index again).
"""
from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import sys

import pytest

from search_r1.paths import home
from tests.verl_ext.helpers import REPO

NETWORK_ERRORS = ("Could not fetch URL", "Max retries exceeded", "Temporary failure in name resolution",
                  "Network is unreachable", "No matching distribution found for vllm")


def resolution_key(spec: str, extra: tuple[str, ...]) -> str:
    """Everything pip's answer depends on besides the index: the project's declared dependencies, the
    CPU pins, the extra, pip and Python."""
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]
    h = hashlib.sha256()
    for part in ((REPO / "setup.py").read_bytes(), (REPO / "constraints-cpu.txt").read_bytes(),
                 json.dumps([spec, *[e for e in extra if not e.startswith("/")]]).encode(), pip.encode(),
                 platform.python_version().encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def resolve(tmp_path, spec: str, *extra: str) -> dict[str, str]:
    """{name: version} pip would install for `<copy of the project>[spec]`, ignoring what is installed;
    read from the cache when its inputs are unchanged."""
    cache = home() / "cache" / "pip-resolution" / f"{spec}-{resolution_key(spec, extra)}.json"
    if cache.is_file():
        print(f"\n[install resolution] .[{spec}]: inputs unchanged since {cache} was written; reusing it "
              f"(delete it to resolve against the index again)")
        return json.loads(cache.read_text())
    versions = _resolve_with_pip(tmp_path, spec, *extra)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".part")
    tmp.write_text(json.dumps(versions, indent=1, sort_keys=True))
    tmp.replace(cache)
    return versions


def _resolve_with_pip(tmp_path, spec: str, *extra: str) -> dict[str, str]:
    src = tmp_path / "src"
    if not src.exists():
        src.mkdir()
        shutil.copy(REPO / "setup.py", src / "setup.py")
        for pkg in ("search_r1", "verl_ext", "retriever_server"):
            shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    report = tmp_path / f"report_{spec}.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                          "--no-build-isolation", "--quiet", "--report", str(report), f"{src}[{spec}]", *extra],
                         capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    if out.returncode != 0 and any(e in out.stderr for e in NETWORK_ERRORS):
        pytest.skip(f"PyPI is not reachable for the resolver: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr[-3000:]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def test_resolution_key_changes_with_each_input():
    base = resolution_key("gpu", ())
    assert base == resolution_key("gpu", ())
    assert resolution_key("test", ()) != base
    assert resolution_key("test", ("-c", str(REPO / "constraints-cpu.txt"))) != resolution_key("test", ())


@pytest.mark.slow
def test_gpu_extra_resolves_to_verls_vllm_stack_and_cpu_install_keeps_its_pin(tmp_path, capsys):
    with capsys.disabled():  # whether it asked the index or reused a cached answer shows in the log
        gpu = resolve(tmp_path, "gpu")
        cpu = resolve(tmp_path, "test", "-c", str(REPO / "constraints-cpu.txt"))
    assert (gpu["vllm"], gpu["torch"], gpu["verl"]) == ("0.24.0", "2.11.0", "0.9.1")
    assert gpu["transformers"] == "5.9.0" and gpu["search-r1-verl"] == "0.1.0"
    assert cpu["torch"].startswith("2.13.0") and "vllm" not in cpu and cpu["verl"] == "0.9.1"
