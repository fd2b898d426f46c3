#!/usr/bin/env bash
# Train a search agent with GRPO. Every argument is a Hydra override of configs/grpo_cpu.yaml:
#
#   bash scripts/train_grpo.sh                                   # the default CPU run (~20 steps)
#   bash scripts/train_grpo.sh trainer.total_steps=5 rollout.n=2
#   bash scripts/train_grpo.sh -m optim.lr=1e-5,3e-5 trainer.experiment_name='lr${optim.lr}'   # sweep
#
# Resources: no GPU -> the embedded CPU trainer (search_r1.trainer: Ray + verl single controller,
# HF policy); 2 cores / 8 GB are enough for the default config. With GPUs the verl engine path is
# meant to run instead; it arrives in a later issue, so this script says so and stops.
# Environment: PYTHON (default: ./.venv/bin/python if present, else python3); SEARCH_R1_FORCE_CPU=1
# runs the CPU trainer even when a GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM=false

has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && return 0
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

if [[ "${SEARCH_R1_FORCE_CPU:-0}" != "1" ]] && has_gpu; then
  echo "[train_grpo] GPU detected: the multi-GPU verl trainer (verl_ext) is not part of this release yet" >&2
  echo "[train_grpo] (it comes in a later issue). To train on CPU anyway: SEARCH_R1_FORCE_CPU=1 bash $0 $*" >&2
  exit 3
fi

exec "$PYTHON" -m search_r1.trainer.main "$@"
