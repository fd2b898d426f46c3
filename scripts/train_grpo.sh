#!/usr/bin/env bash
# Train a search agent with GRPO. Arguments are Hydra overrides (key=value, -m sweeps) of the chosen
# config, plus two flags of this script:
#
#   bash scripts/train_grpo.sh                                   # CPU: the embedded trainer (~20 steps)
#   bash scripts/train_grpo.sh trainer.total_steps=5 rollout.n=2
#   bash scripts/train_grpo.sh -m optim.lr=1e-5,3e-5 trainer.experiment_name='lr${optim.lr}'   # sweep
#   bash scripts/train_grpo.sh --config-name grpo_verl           # GPUs: verl's trainer (verl_ext.main)
#   bash scripts/train_grpo.sh --config-name grpo_verl -m actor_rollout_ref.actor.optim.lr=1e-6,3e-6
#   bash scripts/train_grpo.sh --dry-run --config-name grpo_verl # check + print the resolved config, exit
#   bash scripts/train_grpo.sh --rehearse --config-name grpo_verl # run it on CPU at its own geometry
#   bash scripts/train_grpo.sh --config-name ppo_verl            # GPUs: PPO with a critic, as upstream's train_ppo.sh
#   bash scripts/train_grpo.sh --config-name grpo_verl_cpu       # verl's trainer on CPU, tiny model
#   bash scripts/train_grpo.sh --config-name grpo_verl_cpu_vllm  # ... with verl's vLLM server (.venv-vllm)
#
# Which trainer runs:
#   --config-name grpo_verl*          verl's own trainer (python -m verl_ext.main), any machine
#   --config-name ppo_verl*           the same, PPO with a critic (configs/ppo_verl.yaml)
#   no --config-name, GPU visible     verl's trainer with configs/grpo_verl.yaml
#   no --config-name, no GPU          the embedded CPU trainer (python -m search_r1.trainer.main,
#                                     configs/grpo_cpu.yaml); 2 cores / 8 GB are enough
#   any other --config-name           the embedded CPU trainer with that config
# With GPUs, trainer.n_gpus_per_node is set to the number of visible GPUs unless given: the entries
# of CUDA_VISIBLE_DEVICES when it is set, else the GPUs `nvidia-smi -L` lists.
# --dry-run: verl path: run the config checks and print the resolved config; CPU path: print the
# resolved config (Hydra's --cfg job --resolve). Nothing starts either way.
# --rehearse (verl configs): run the composed config through verl's trainer on this machine's CPU at
# the config's own geometry (one training worker per GPU of trainer.nnodes x n_gpus_per_node, the
# same batch, group size, mini- and micro-batches), with a tiny model of the same architecture, short
# lengths, a local retriever on the synthetic world, one step, a checkpoint and an auto-resume; it
# prints what it shrank and ends with `rehearsal passed: ...` or the failure and the key to change
# (verl_ext/rehearsal.py).
# Environment: PYTHON (default: ./.venv/bin/python if present, else python3; for *_vllm configs
# ./.venv-vllm/bin/python, the vLLM-on-CPU environment of `make install-vllm`, docs/vllm_cpu.md);
# SEARCH_R1_FORCE_CPU=1 runs the embedded CPU trainer even when a GPU is visible. The CPU paths (the
# embedded trainer and the grpo_verl*_cpu / grpo_verl*_cpu_* configs) load local models only and run
# with HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 unless you set them; the GPU path leaves them alone, so
# a hub id such as grpo_verl's Qwen/Qwen2.5-3B-Instruct downloads on a fresh node.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_GIVEN="${PYTHON:-}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export TOKENIZERS_PARALLELISM=false

offline() {  # the CPU paths never reach a model hub; an explicit setting of the user's wins
  export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
}

gpu_count() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then  # what this process may use, as CUDA and Ray see it
    local ids="${CUDA_VISIBLE_DEVICES// /}"
    if [[ -z "$ids" || "$ids" == -1* ]]; then echo 0; else awk -F, '{print NF}' <<<"$ids"; fi
    return
  fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | grep -c '^GPU' || true
    return
  fi
  "$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0
}

dry_run=0 rehearse=0 config_name="" has_gpus_key=0 args=()
prev=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1; prev=""; continue ;;
    --rehearse) rehearse=1; prev=""; continue ;;
    --config-name=*) config_name="${arg#--config-name=}" ;;
    trainer.n_gpus_per_node=*|+trainer.n_gpus_per_node=*|++trainer.n_gpus_per_node=*) has_gpus_key=1 ;;
  esac
  [[ "$prev" == "--config-name" || "$prev" == "-cn" ]] && config_name="$arg"
  args+=("$arg")
  prev="$arg"
done

n_gpus=0
if [[ "${SEARCH_R1_FORCE_CPU:-0}" != "1" ]]; then n_gpus="$(gpu_count)"; fi

verl=0
if [[ "$config_name" == grpo_verl* || "$config_name" == ppo_verl* ]]; then
  verl=1
elif [[ -z "$config_name" && ( "$n_gpus" -gt 0 || "$rehearse" == "1" ) ]]; then
  verl=1
  args=(--config-name grpo_verl "${args[@]}")
  config_name=grpo_verl
fi

if [[ "$verl" == "1" ]]; then
  # *_cpu and *_cpu_* configs run verl's trainer on verl_ext/cpu's platform; verl resolves it at import time.
  cpu_config=0
  if [[ "$config_name" == *_cpu || "$config_name" == *_cpu_* ]]; then
    cpu_config=1
    export VERL_PLATFORM="${VERL_PLATFORM:-cpu}"
    offline
  fi
  # *_vllm configs need vLLM, which lives in its own environment (docs/vllm_cpu.md).
  if [[ "$config_name" == *_vllm && -z "$PYTHON_GIVEN" ]]; then
    if [[ ! -x .venv-vllm/bin/python ]]; then
      echo "[train_grpo] --config-name $config_name needs the vLLM-on-CPU environment .venv-vllm;" \
           "build it with: make install-vllm (or set PYTHON to a python that has vLLM)" >&2
      exit 2
    fi
    PYTHON=.venv-vllm/bin/python
  fi
  if [[ "$n_gpus" -gt 0 && "$has_gpus_key" == "0" && "$cpu_config" == "0" ]]; then
    args+=("trainer.n_gpus_per_node=$n_gpus")
    echo "[train_grpo] $n_gpus GPU(s) visible: verl's trainer with trainer.n_gpus_per_node=$n_gpus" >&2
  fi
  if [[ "$dry_run" == "1" ]]; then
    exec "$PYTHON" -m verl_ext.main --dry-run "${args[@]}"
  fi
  if [[ "$rehearse" == "1" ]]; then
    offline  # the rehearsal loads local models only
    exec "$PYTHON" -m verl_ext.main --rehearse "${args[@]}"
  fi
  exec "$PYTHON" -m verl_ext.main "${args[@]}"
fi

offline
if [[ "$rehearse" == "1" ]]; then
  echo "[train_grpo] --rehearse is for verl configs (--config-name grpo_verl... or ppo_verl...), not $config_name" >&2
  exit 2
fi
if [[ "$dry_run" == "1" ]]; then
  exec "$PYTHON" -m search_r1.trainer.main --cfg job --resolve "${args[@]}"
fi
exec "$PYTHON" -m search_r1.trainer.main "${args[@]}"
