#!/usr/bin/env bash
# The main job, end to end on CPU (run by `make demo`): GRPO teaches a small model to use the search
# engine, in at most 20 minutes.
#   1. generate the synthetic QA world and its BM25 index (first run only, ~1 minute), and carve a
#      dev split of 100 single-hop questions from its training questions (search_r1.data.splits),
#   2. a short supervised format warm-start (search_r1/trainer/warmstart.py, ~2 min, cached under
#      $SEARCH_R1_HOME/warmstart; the 135M model never writes the tags by itself) on demonstrations of
#      which 70% answer from memory without searching (warmstart.no_search_share=0.7): the warm-started
#      model searches on about half the dev questions and is wrong on nearly all the others (the
#      world's facts are invented, so memory cannot answer them),
#   3. GRPO for 10 steps (configs/grpo_cpu.yaml: 2 prompts x 4 samples at temperature 0.7, one search
#      round, lr 1e-5, 192-token observations) on the remaining single-hop training questions, searching
#      through the real retriever server, which the trainer starts on a free loopback port and stops
#      after: the reward teaches the model that searching pays,
#   4. print the greedy validation (EM, F1, format, searches) on 64 dev questions before and after
#      training, whether the change is beyond chance, and example questions whose answer changed with
#      their searches before and after (python -m search_r1.evaluation.before_after).
# Time: DEMO_MINUTES (20) in all. The trainer measures this machine as it goes (its slowest step, its
# first validation) and starts no step that would end, with the final validation, past the budget
# (trainer.time_budget_minutes); it says so when it stops early. About 15-19 minutes on an AVX2-only
# AMD EPYC in float32 (docs/results/demo.md has the measured runs and CPU kinds). Resources: 2 CPU
# cores, < 8 GB RAM. Extra arguments are Hydra overrides (e.g. `bash scripts/demo.sh trainer.seed=1`).
# The run directory is outputs/demo, replaced by every demo run (scripts/train_grpo.sh resumes runs).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

SYNTH_DIR="$("$PYTHON" -c 'from search_r1.paths import default_synth_dir; print(default_synth_dir())')"
# Both steps do nothing when the world and its index are current (a world from another seed or an
# older generator is regenerated, and an index built from another corpus.jsonl is rebuilt).
"$PYTHON" -m search_r1.data.synth --out "$SYNTH_DIR" --seed 0 --if-stale
"$PYTHON" -c 'from retriever_server.indexes import ensure_default_index; ensure_default_index()'

if [[ -d outputs/demo ]]; then
  echo "[demo] removing the previous demo run outputs/demo (a fresh run each time)"
  rm -rf outputs/demo
fi
# Single-hop questions only: two-hop questions need two searches and the demo allows one
# (rollout.max_turns=1); scripts/experiment_cpu.sh is the multi-turn experiment. Validation: the first
# 64 of the 100 dev questions, greedy, before and after training (one question moves EM by 0.016;
# the binomial standard error is about 0.06). The test split is left to the experiment.
"$PYTHON" -m search_r1.data.splits --train "$SYNTH_DIR/train.parquet" --out outputs/demo_data --per-source 100 \
  --sources synth_nq
# The recipe (docs/results/demo.md, "Why this recipe"): a warm-start that searches on some questions
# only, so GRPO has something visible to learn; sampling at temperature 0.7 (at 1.0 this warm-start
# wrote broken tags on most samples and the reward fell); lr 1e-5 over 10 steps; 192-token
# observations, so the top-3 passages fit and the gold answer is in front of the model.
DEMO=("data.train_files=['outputs/demo_data/train.parquet']" "data.test_files=['outputs/demo_data/dev.parquet']"
      data.val_size=64 trainer.val_batch_size=32 trainer.test_freq=0 trainer.total_steps=10
      warmstart.no_search_share=0.7 warmstart.steps=12 optim.lr=1e-5 rollout.temperature=0.7
      rollout.max_obs_length=192 rollout.max_response_length=384)
# What is left of DEMO_MINUTES for the trainer, less 45 s for its start-up before the clock and the
# report after it.
MINUTES="${DEMO_MINUTES:-20}"
BUDGET="$(awk -v m="$MINUTES" -v s="$SECONDS" 'BEGIN { b = (m * 60 - s - 45) / 60; printf "%.2f", (b > 0.1 ? b : 0.1) }')"
echo "[demo] time budget: ${MINUTES} min in all (DEMO_MINUTES); ${BUDGET} min left for the trainer" \
     "(trainer.time_budget_minutes), which runs 10 GRPO steps or stops earlier if this machine would pass it"
echo "[demo] GRPO on CPU: configs/grpo_cpu.yaml, output in outputs/demo"
SEARCH_R1_FORCE_CPU=1 bash scripts/train_grpo.sh trainer.experiment_name=demo trainer.resume=none "${DEMO[@]}" \
  trainer.time_budget_minutes="$BUDGET" "$@"
# What changed, for a newcomer: the validations before and after side by side, whether the change is
# beyond chance on this many questions, and example questions with their searches before and after.
"$PYTHON" -m search_r1.evaluation.before_after outputs/demo | sed 's/^/[demo] /'
echo "[demo] finished in $(( SECONDS / 60 )) min $(( SECONDS % 60 )) s"
