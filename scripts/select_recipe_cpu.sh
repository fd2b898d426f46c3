#!/usr/bin/env bash
# Choose the learning experiment's recipe on the dev split (never the test split): one GRPO run per
# candidate (Hydra overrides on top of the experiment's EXP_RECIPE), validated greedily on the dev questions carved
# from the training questions, then one table.
#
#   bash scripts/select_recipe_cpu.sh                                   # the candidates below
#   SELECT_CANDIDATES="lr1e-5=optim.lr=1e-5 n8=rollout.n=8,trainer.batch_size=2" bash scripts/select_recipe_cpu.sh
#   bash scripts/select_recipe_cpu.sh rollout.backend=vllm        # arguments: overrides for every candidate
#
# Each candidate is NAME=OVERRIDE[,OVERRIDE...]; "base=" is EXP_RECIPE unchanged. Every run goes through
# scripts/experiment_cpu.sh with EXP_TEST=0 (dev only), so it is the same code path the experiment
# takes; SELECT_SEEDS (default "0") and SELECT_OUT (outputs/select_recipe) are passed on, and any
# EXP_* knob applies (EXP_STEPS, EXP_DEV_VAL, ...). Output: $SELECT_OUT/selection.md. docs/results/
# (what-did-not-work.md too) lists what was tried and measured.
# Resources: about 20-40 minutes per candidate on 2 cores (one GRPO run plus dev validations).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${SELECT_OUT:-outputs/select_recipe}"
CANDIDATES="${SELECT_CANDIDATES:-base= lr3e-6=optim.lr=3e-6 plankl5=algorithm.plan_kl_coef=5.0}"
mkdir -p "$OUT"
for candidate in $CANDIDATES; do
  name="${candidate%%=*}"
  IFS=',' read -r -a overrides <<<"${candidate#*=}"
  echo "[select] candidate $name: ${overrides[*]:-(the shipped config)}"
  EXP_TEST=0 EXP_SEEDS="${SELECT_SEEDS:-0}" EXP_OUT="$OUT/$name" bash scripts/experiment_cpu.sh "${overrides[@]}" "$@"
done
{
  echo "# Recipe selection on the dev split"
  echo
  for candidate in $CANDIDATES; do
    name="${candidate%%=*}"
    echo "## $name: ${candidate#*=}"
    echo
    tail -n +2 "$OUT/$name/dev.md"
    echo
  done
} | tee "$OUT/selection.md"
