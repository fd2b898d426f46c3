#!/usr/bin/env bash
# GRPO collapse stress test on CPU (issue 69; a bench-style command, not a test): a recipe harsher
# than the one that collapsed the old float32 demo (lr 3e-5, no supervised anchor), run per seed with
#   plain        GRPO alone,
#   llds         GRPO + LLDS (algorithm.llds_coef, action-level gate; arXiv 2512.04220),
#   safeguards   the project's safeguards at the same lr: the supervised anchor and on_alarm=rollback,
# then one table and one figure: dev EM at start and end, the step the first alarm fired, the
# likelihood diagnostics, and the update's time per step with and without LLDS.
#
#   bash scripts/stress_collapse_cpu.sh                               # 3 seeds x 3 arms
#   STRESS_SEEDS=0 STRESS_ARMS="plain llds" bash scripts/stress_collapse_cpu.sh
#   bash scripts/stress_collapse_cpu.sh optim.lr=5e-5                  # arguments: overrides for every arm
#
# The recipe (every arm): the demo's single-hop data and lengths, float32, lr STRESS_LR (3e-5), two
# policy updates per batch (trainer.mini_batch_size=1 of batch_size 2: LLDS acts only where pi_theta
# has moved from pi_old inside a batch, so the stress needs more than one update per batch, which
# also makes it harsher), STRESS_STEPS steps (16), a checkpoint every 4 steps (what a rollback
# restores), alarms on (warn in plain and llds: they report, the run goes on). Greedy validation on
# STRESS_VAL (48) dev questions before and after: only each seed's first arm validates before
# training; the others compare with it (trainer.val_baseline), the same warm-start and greedy
# sampler giving the same "before".
# Knobs: STRESS_SEEDS ("0 1 2"), STRESS_ARMS ("plain llds safeguards"), STRESS_STEPS, STRESS_LR,
# STRESS_VAL, STRESS_LLDS_COEF (0.1), STRESS_ANCHOR_COEF (4.0, the experiment's), STRESS_OUT
# (outputs/stress_collapse). A finished run (its final checkpoint and last validation present) is
# reused; an unfinished one resumes from its last checkpoint. Output: $STRESS_OUT/stress.md and
# stress.png. Resources: 2 cores, < 8 GB, about 15-25 minutes per run on a 2-core AVX2-only EPYC.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

OUT="${STRESS_OUT:-outputs/stress_collapse}"
SEEDS="${STRESS_SEEDS:-0 1 2}"
ARMS="${STRESS_ARMS:-plain llds safeguards}"
STEPS="${STRESS_STEPS:-16}"
LR="${STRESS_LR:-3e-5}"
VAL="${STRESS_VAL:-48}"
LLDS_COEF="${STRESS_LLDS_COEF:-0.1}"
ANCHOR_COEF="${STRESS_ANCHOR_COEF:-4.0}"

arm_overrides() {  # the arm's own overrides, one per line
  case "$1" in
    plain) ;;
    llds) echo "algorithm.llds_coef=$LLDS_COEF"; echo "algorithm.llds_gate=action" ;;
    safeguards) echo "algorithm.anchor_coef=$ANCHOR_COEF"; echo "trainer.on_alarm=rollback" ;;
    *) echo "[stress] unknown arm '$1': choose from plain llds safeguards" >&2; exit 2 ;;
  esac
}
for arm in $ARMS; do arm_overrides "$arm" >/dev/null; done

SYNTH_DIR="$("$PYTHON" -c 'from search_r1.paths import default_synth_dir; print(default_synth_dir())')"
"$PYTHON" -m search_r1.data.synth --out "$SYNTH_DIR" --seed 0 --if-stale
"$PYTHON" -c 'from retriever_server.indexes import ensure_default_index; ensure_default_index()'
# The demo's split (single-hop training questions; 100 dev questions carved from them).
"$PYTHON" -m search_r1.data.splits --train "$SYNTH_DIR/train.parquet" --out "$OUT/data" --per-source 100 \
  --sources synth_nq

COMMON=("data.train_files=['$OUT/data/train.parquet']" "data.test_files=['$OUT/data/dev.parquet']"
        "data.val_size=$VAL" trainer.val_batch_size=16 trainer.test_freq=0 trainer.save_freq=4 trainer.keep_last=3
        rollout.max_obs_length=192 rollout.max_response_length=384 model.compute_dtype=float32
        model.rollout_dtype=float32 "optim.lr=$LR" trainer.batch_size=2 trainer.mini_batch_size=1
        "trainer.total_steps=$STEPS" trainer.resume=auto)
start=$SECONDS
for seed in $SEEDS; do
  baseline=""
  for arm in $ARMS; do
    run="$OUT/seed$seed/$arm"
    mapfile -t own < <(arm_overrides "$arm")
    if [[ -z "$baseline" ]]; then before=(trainer.val_before_train=true); baseline="$run/metrics.jsonl"
    else before=(trainer.val_before_train=false "trainer.val_baseline=$baseline"); fi
    if "$PYTHON" scripts/stress_collapse_report.py --finished "$run" --steps "$STEPS"; then
      echo "[stress] seed $seed $arm: finished earlier, reusing $run"; continue
    fi
    echo "[stress] seed $seed $arm: ${own[*]:-(GRPO alone)} -> $run"
    # A run that stops (on_alarm=stop, or rollbacks used up) exits non-zero: that is a result, recorded.
    SEARCH_R1_FORCE_CPU=1 bash scripts/train_grpo.sh "trainer.experiment_name=stress_${arm}_seed$seed" \
      "trainer.output_dir=$run" "trainer.seed=$seed" "${COMMON[@]}" "${before[@]}" "${own[@]}" "$@" \
      || echo "[stress] seed $seed $arm: the trainer exited with $? (see $run)"
  done
done
"$PYTHON" scripts/stress_collapse_report.py --out "$OUT" --arms $ARMS --seeds $SEEDS \
  --command "STRESS_SEEDS=\"$SEEDS\" STRESS_ARMS=\"$ARMS\" STRESS_STEPS=$STEPS STRESS_LR=$LR STRESS_VAL=$VAL STRESS_LLDS_COEF=$LLDS_COEF STRESS_ANCHOR_COEF=$ANCHOR_COEF bash scripts/stress_collapse_cpu.sh $*"
echo "[stress] finished in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
