#!/usr/bin/env bash
# Does GRPO teach multi-turn search? The learning experiment on CPU, one command:
#
#   bash scripts/experiment_cpu.sh                        # the full run: 3 GRPO seeds, 4 arms on the test split
#   bash scripts/experiment_cpu.sh optim.lr=2e-5          # extra Hydra overrides of configs/grpo_cpu.yaml
#   EXP_DTYPES="float32 bfloat16" EXP_TEST=0 bash scripts/experiment_cpu.sh     # robustness: both dtypes, dev only
#   EXP_SEEDS=0 EXP_STEPS=1 EXP_DEV_VAL=8 EXP_TEST_LIMIT=8 bash scripts/experiment_cpu.sh \
#       model.name=tiny-random-qwen3 warmstart.steps=1 warmstart.n_examples=4   # a smoke run (minutes)
#
# On the synthetic world (configs/grpo_cpu.yaml plus EXP_RECIPE: SmolLM2-135M-Instruct, rollout.max_turns=2,
# the world's single- and two-hop questions; 435 held-out test questions on the default world: 243
# single-hop synth_nq, 192 two-hop synth_hotpotqa whose answer needs a second search about an entity
# the first one finds):
#   1. the world, its BM25 index and a retriever for the whole experiment; a dev split carved from the
#      training questions (EXP_DEV_PER_SOURCE per data_source; search_r1.data.splits), never trained on;
#   2. three format warm-starts of the same size and recipe (configs/grpo_cpu.yaml's warmstart group,
#      half of the demonstrations two-hop): `search` (search once or twice, then answer: the model GRPO
#      starts from), `no_search` and `rag` (answer directly, or from passages retrieved with the
#      question: the paper's baselines, each taught its own format);
#   3. GRPO from the `search` warm-start, once per seed in EXP_SEEDS and dtype in EXP_DTYPES, on the
#      training questions minus dev of the EXP_GRPO_SOURCES kinds (both, two-hop thrice); the trainer
#      validates greedily on EXP_DEV_VAL dev questions before training (first seed of each dtype), every
#      EXP_DEMO_STEPS steps and after the last step, with the HF sampler (EXP_VAL_SAMPLER) so that the
#      same model always gets the same dev score;
#   4. (EXP_TEST=1) greedy evaluation of the test split, once per final model (python -m search_r1.evaluation):
#      no-search, RAG, warm-start alone (search, before GRPO) and every GRPO run (after GRPO);
#   5. the comparison (search_r1.evaluation.compare: EM per arm and source with the spread over seeds,
#      format validity, searches per question, two-hop questions answered after two searches, per-question
#      changes by number of searches, verdicts; search_r1.evaluation.hop_failures: why two-hop answers
#      fail: the bridge never shown by the first search, another entity searched, ...) in
#      $EXP_OUT/comparison.md, the dev tables of every run in $EXP_OUT/dev.md, and the figure
#      $EXP_OUT/comparison.png (scripts/plot_experiment.py).
# The recipe (lr, steps, group size, turns, warm-start demonstrations) is to be chosen on the dev split
# (scripts/select_recipe_cpu.sh runs candidates on dev only); the test split is evaluated once per final run.
#
# Resources: 2 CPU cores, < 8 GB RAM, no GPU, no network. Budget: at most 120 minutes with the world,
# index and warm-starts cached (docs/results/ has the measured time and what each knob saves).
# Environment knobs (default in parentheses):
#   EXP_RECIPE (the overrides above)        EXP_OUT (outputs/experiment_cpu)
#   EXP_SEEDS ("0 1 2"; set but empty with EXP_TEST=0: train the warm-starts only)
#   EXP_DTYPES ("auto")                     EXP_STEPS (the recipe's trainer.total_steps)
#   EXP_DEMO_STEPS (5: dev validation every N steps)   EXP_DEV_PER_SOURCE (100 dev questions per source)
#   EXP_DEV_VAL (64: dev questions per validation, the first N of the source-interleaved split; 0 = all)
#   EXP_TEST (1)   EXP_TEST_PER_SOURCE (100: a seeded sample per data source; 0 = all 435)
#   EXP_TEST_LIMIT (0: no overall cap)      EXP_EVAL_BATCH (32)     EXP_THREADS (2)
#   EXP_BACKEND (auto: vllm when the trainer's lookup finds a python with vLLM, else hf)
#   EXP_REUSE (1: a finished GRPO run trained with the same arguments is not trained again)   PYTHON
#   EXP_GRPO_SOURCES ("synth_hotpotqa:3 synth_nq:1": data_sources GRPO trains on, each optionally with an
#                     integer weight (here every two-hop question three times in the GRPO prompts, every
#                     single-hop one once); "synth_hotpotqa" = two-hop only; set but empty = every source
#                     once; the warm-start still draws from every training question)
#   EXP_VAL_SAMPLER (hf: the workers' HF sampler judges dev, the same score for the same model on one
#                    machine | rollout: the training sampler, faster with vLLM, but its batching moved dev
#                    two-hop EM by 2 of 32 between two runs of one model)
#   EXP_BEFORE (first: dev "before" validated by the first seed of each dtype | every: by every seed)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# The multi-turn recipe on top of configs/grpo_cpu.yaml (the demo's single-hop config), chosen on the dev
# split (docs/results/ has every candidate and what it measured):
# - two search rounds, 64-token turns (at 40 a two-hop first turn is cut mid </search>), 192-token
#   observations (at 96 the top-3 passages are cut inside the second), 600-token responses;
# - a warm-start of 48 steps x 8 over 384 demonstrations, half of them two-hop (search the subject, then
#   the bridge entity's attribute), stratified batches and linear lr decay: it tells the two kinds apart
#   (plan probe AUC 0.97);
# - GRPO on prompts from both kinds, every two-hop question three times (EXP_GRPO_SOURCES, below), 8
#   prompts x 4 samples at temperature 1.2, flat groups dropped, lr 1e-5, 12 steps, the plan (first
#   round) in the policy gradient and braked by its own KL coefficient (algorithm.plan_kl_coef=1.0): the
#   reward teaches the second search on two-hop questions while the brake limits the shift that the
#   single-hop questions' plans share;
# - a supervised anchor (algorithm.anchor_coef=4.0, algorithm.anchor_two_hop_share=0.5): every update
#   also fits 8 demonstrations built like the warm-start's, half single-hop (one search), half two-hop
#   (two), which holds both kinds' plans where the reward alone moves them together (chosen 2026-12-06
#   on dev: two-hop +10/+9/+13 of 100 in 3 seeds, single-hop 0.92 -> 0.923 on the mean; the coefficient
#   1.0 with single-hop demonstrations only, shipped before, gained +7/+2/+8);
# - dev validated in batches of 32 questions, as the demo does.
# EXP_RECIPE replaces it; the command line's overrides come after it and win.
read -r -a RECIPE <<<"${EXP_RECIPE:-rollout.max_turns=2 rollout.max_tokens_per_turn=64 rollout.max_obs_length=192 rollout.max_response_length=600 rollout.max_prompt_length=1024 warmstart.two_hop_share=0.5 warmstart.n_examples=384 warmstart.steps=48 warmstart.batch_size=8 warmstart.batching=stratified warmstart.lr_schedule=linear trainer.batch_size=8 trainer.mini_batch_size=8 rollout.n=4 rollout.temperature=1.2 algorithm.drop_flat_groups=true algorithm.pg_first_turn=true algorithm.plan_kl_coef=1.0 algorithm.anchor_coef=4.0 algorithm.anchor_two_hop_share=0.5 optim.lr=1e-5 trainer.total_steps=12 trainer.val_batch_size=32}"
# The sampler: vLLM (3x the HF sampler's rollout speed here, docs/benchmarks.md) when the trainer's
# own lookup (rollout.vllm_python=auto: this python, $SEARCH_R1_VLLM_PYTHON, .venv-vllm from `make
# install-vllm`) finds an interpreter with vLLM, else HF. EXP_BACKEND=hf|vllm forces one.
BACKEND="${EXP_BACKEND:-auto}"
if [[ "$BACKEND" == auto ]]; then
  if "$PYTHON" -c 'from search_r1.rollout.vllm_server import find_vllm_python; find_vllm_python()' 2>/dev/null; then
    BACKEND=vllm
  else
    BACKEND=hf
  fi
fi
echo "[experiment] rollout.backend=$BACKEND (EXP_BACKEND=hf|vllm to choose)"
set -- rollout.backend="$BACKEND" "${RECIPE[@]}" "$@"
OUT="${EXP_OUT:-outputs/experiment_cpu}"
SEEDS="${EXP_SEEDS-0 1 2}"  # set but empty: the warm-starts only (with EXP_TEST=0), e.g. to fill the cache
if [[ -z "${SEEDS// /}" && "${EXP_TEST:-1}" == 1 ]]; then
  echo "[experiment] EXP_SEEDS is empty: no GRPO run to compare on the test split. Fix: name seeds, or set" \
       "EXP_TEST=0 to train the warm-starts only" >&2; exit 2
fi
DTYPES="${EXP_DTYPES:-auto}"
DEMO_STEPS="${EXP_DEMO_STEPS:-5}"
DEV_PER_SOURCE="${EXP_DEV_PER_SOURCE:-100}"
DEV_VAL="${EXP_DEV_VAL:-64}"
TEST="${EXP_TEST:-1}"
TEST_LIMIT="${EXP_TEST_LIMIT:-0}"
TEST_PER_SOURCE="${EXP_TEST_PER_SOURCE:-100}"
REUSE="${EXP_REUSE:-1}"
EVAL_BATCH="${EXP_EVAL_BATCH:-32}"
THREADS="${EXP_THREADS:-2}"
VAL_SAMPLER="${EXP_VAL_SAMPLER:-hf}"
BEFORE="${EXP_BEFORE:-first}"
if [[ "$BEFORE" != first && "$BEFORE" != every ]]; then
  echo "[experiment] EXP_BEFORE=$BEFORE: allowed first | every" >&2; exit 2
fi
mkdir -p "$OUT/eval/test" "$OUT/data"
start_all=$SECONDS
phase() { echo; echo "[experiment] $* ($(( (SECONDS - start_all) / 60 )) min $(( (SECONDS - start_all) % 60 )) s)"; }

# The trainer's own config, data and warm-start code, so the evaluated models and limits are the ones
# GRPO trains with. `setup` prints KEY=VALUE lines; `warmstart URL` prints the model directory.
helper() {
  "$PYTHON" - "$@" <<'PY'
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from search_r1.trainer.config import TrainConfig
from search_r1.trainer.main import prepare_data, resolve_dtypes, warm_start

mode, rest = sys.argv[1], sys.argv[2:]
url = rest.pop(0) if mode == "warmstart" else None
with initialize_config_dir(config_dir=str(Path("configs").resolve()), version_base="1.3"):
    cfg = TrainConfig.from_dict(OmegaConf.to_container(compose("grpo_cpu", overrides=rest), resolve=True))
data = prepare_data(cfg)  # generates the default world when data.dir=auto and it is stale
if mode == "setup":
    from retriever_server.indexes import build_index
    from retriever_server.manifest import index_matches_corpus

    index = Path(cfg.retriever.index).expanduser() if cfg.retriever.index else data.dir / "index_bm25"
    if not cfg.retriever.index and not index_matches_corpus(index, data.corpus):
        print(f"[experiment] building the BM25 index {index}", file=sys.stderr)
        build_index(data.corpus, "bm25", index, force=True)
    r = cfg.rollout
    flags = [f"--topk={cfg.retriever.topk}", f"--max-turns={r.max_turns}", f"--max-start-length={r.max_start_length}",
             f"--max-prompt-length={r.max_prompt_length}", f"--max-response-length={r.max_response_length}",
             f"--max-obs-length={r.max_obs_length}", f"--protocol={cfg.data.protocol}"]
    if r.max_tokens_per_turn:
        flags.append(f"--max-tokens-per-turn={r.max_tokens_per_turn}")
    print(f"INDEX={index}")
    print("TRAIN_FILE=" + str(data.train_files[0]))
    print("TEST_FILES=" + " ".join(str(f) for f in data.test_files))
    print("EVAL_FLAGS=" + " ".join(flags))
    print(f"STEPS={cfg.trainer.total_steps}")
    print(f"PROTOCOL={cfg.data.protocol}")
else:
    # In this process (it exits right after, which returns the SFT's memory): warm_start's spawned
    # child cannot start from a script read on stdin.
    from search_r1.search import RetrieverClient

    r = cfg.retriever
    client = RetrieverClient(url, topk=r.topk, timeout=r.timeout, retries=r.retries)
    path = warm_start(resolve_dtypes(cfg), data, client)
    print(path or cfg.model.name)
PY
}

phase "1/5 world, index, retriever and the dev split"
declare -A SETUP
while IFS='=' read -r key value; do SETUP[$key]="$value"; done < <(helper setup "$@")
STEPS="${EXP_STEPS:-${SETUP[STEPS]}}"
"$PYTHON" -m search_r1.data.splits --train "${SETUP[TRAIN_FILE]}" --out "$OUT/data" --per-source "$DEV_PER_SOURCE"
TRAIN="$OUT/data/train.parquet"
DEV="$OUT/data/dev.parquet"
PORT="$("$PYTHON" -c 'from search_r1.net import free_port; print(free_port())')"
"$PYTHON" -m retriever_server serve --index "${SETUP[INDEX]}" --port "$PORT" --torch-threads 1 --faiss-threads 1 \
  >"$OUT/retriever.log" 2>&1 &
RETRIEVER_PID=$!
trap 'kill "$RETRIEVER_PID" 2>/dev/null || true' EXIT
URL="http://127.0.0.1:$PORT"
"$PYTHON" - "$URL" <<'PY'
import sys, time
import requests
for _ in range(240):
    try:
        if requests.get(sys.argv[1] + "/health", timeout=2).ok:
            sys.exit(0)
    except requests.RequestException:
        pass
    time.sleep(0.5)
sys.exit(f"[experiment] the retriever at {sys.argv[1]} did not become healthy; see its log")
PY
echo "[experiment] retriever serving ${SETUP[INDEX]} at $URL (log: $OUT/retriever.log)"
# Every run of this experiment trains on train-minus-dev and validates on dev (these and the knobs'
# settings come after the overrides, so they win). EXP_GRPO_SOURCES keeps only those data_sources for
# GRPO's prompts; the warm-start's demonstrations still come from every training question.
GRPO_TRAIN="$TRAIN"
GRPO_SOURCES="${EXP_GRPO_SOURCES-synth_hotpotqa:3 synth_nq:1}"  # unset: the recipe's; set to "": all
if [[ -n "$GRPO_SOURCES" ]]; then
  GRPO_TRAIN="$OUT/data/train_grpo.parquet"
  "$PYTHON" - "$TRAIN" "$GRPO_TRAIN" $GRPO_SOURCES <<'PY'
import sys

import pandas as pd

from search_r1.data.splits import weighted_sources

frame = pd.read_parquet(sys.argv[1])
try:
    keep = weighted_sources(frame, sys.argv[3:], sys.argv[1])
except ValueError as err:
    sys.exit(f"[experiment] EXP_GRPO_SOURCES: {err}")
keep.to_parquet(sys.argv[2], index=False)
counts = ", ".join(f"{s} {n}" for s, n in keep["data_source"].value_counts().sort_index().items())
print(f"[experiment] GRPO prompts: {len(keep)} rows ({counts}) from {len(frame)} training questions "
      f"({' '.join(sys.argv[3:])})")
PY
fi
COMMON=("data.train_files=['$GRPO_TRAIN']" "warmstart.train_files=['$TRAIN']" "data.test_files=['$DEV']"
        data.val_size="$DEV_VAL" retriever.url="$URL")

phase "2/5 format warm-starts (search, no_search, rag; dtypes: $DTYPES)"
declare -A WS
for dtype in $DTYPES; do
  for fmt in search no_search rag; do
    if [[ "$fmt" != search && ( "$TEST" != 1 || "$dtype" != "${DTYPES%% *}" ) ]]; then continue; fi
    WS[$fmt/$dtype]="$(helper warmstart "$URL" "$@" "${COMMON[@]}" warmstart.format="$fmt" model.compute_dtype="$dtype" \
                       model.rollout_dtype="$dtype" | tail -n 1)"
    echo "[experiment] warm-start $fmt ($dtype): ${WS[$fmt/$dtype]}"
  done
done

phase "3/5 GRPO (seeds: $SEEDS; dtypes: $DTYPES; $STEPS steps)"
RUN_DIRS=()
for dtype in $DTYPES; do
  first=1
  for seed in $SEEDS; do
    run="$OUT/grpo_${dtype}_seed$seed"
    # Validation before training is the same greedy pass for every seed: the first seed of a dtype runs it
    # (EXP_BEFORE=every: each seed, to see how far the judge itself repeats).
    # The overrides first: what the script sets from its knobs (steps, seed, dtype, dev split) wins.
    args=("$@" trainer.experiment_name="exp_cpu_${dtype}_seed$seed" trainer.output_dir="$run" trainer.seed="$seed"
          trainer.resume=none trainer.total_steps="$STEPS" trainer.val_before_train=$([[ $first == 1 || $BEFORE == every ]] && echo true || echo false)
          trainer.test_freq="$DEMO_STEPS" trainer.val_sampler="$VAL_SAMPLER" trainer.save_freq=0 trainer.keep_last=1 model.compute_dtype="$dtype"
          model.rollout_dtype="$dtype" "${COMMON[@]}")
    # A seed that skips the "before" validation gives its validation alarms the first seed's to compare with.
    if [[ $first == 0 && $BEFORE == first ]]; then args+=(trainer.val_baseline="$first_run/metrics.jsonl"); fi
    # A finished run trained with exactly these arguments (the retriever's port aside) is reused, so a
    # dev-only pass (EXP_TEST=0) followed by the full run trains each seed once; EXP_REUSE=0 retrains.
    record="$(printf '%s\n' "${args[@]}" | grep -v '^retriever.url=')"
    if [[ "$REUSE" == 1 && -d "$run/checkpoints/global_step_$STEPS" && -f "$run/exp_args.txt" \
          && "$(cat "$run/exp_args.txt")" == "$record" ]]; then
      echo "[experiment] reusing the finished run $run (same arguments; EXP_REUSE=0 retrains)"
    else
      rm -f "$run/exp_args.txt"
      SEARCH_R1_FORCE_CPU=1 bash scripts/train_grpo.sh "${args[@]}"
      printf '%s\n' "$record" >"$run/exp_args.txt"
    fi
    RUN_DIRS+=("$run")
    if [[ $first == 1 ]]; then first_run="$run"; fi
    first=0
  done
done
if [[ ${#RUN_DIRS[@]} == 0 ]]; then phase "done (EXP_SEEDS empty: the warm-starts only)"; exit 0; fi
"$PYTHON" - "$DEMO_STEPS" "${RUN_DIRS[@]}" <<'PY' | tee "$OUT/dev.md"
import json, sys
from pathlib import Path

demo_step, runs = int(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
print("### Dev EM (greedy validation by the trainer), per run\n")
print(f"| run | dtype | before | at step {demo_step} | after | two-hop before -> after | not below before (step {demo_step} and after) |")
print("|---|---|---|---|---|---|---|")
before = {}
for run in runs:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"val/em"' in line]
    dtype = json.loads((run / "config.json").read_text())["model"]["compute_dtype"]
    by_step = {r["step"]: r for r in rows}
    if 0 in by_step:
        before[dtype] = by_step[0]
    b, last = before.get(dtype), rows[-1]
    mid = by_step.get(demo_step) if demo_step != last["step"] else None  # not the final validation again
    two = "synth_hotpotqa"
    ok = "yes" if b is not None and last["val/em"] >= b["val/em"] and (mid is None or mid["val/em"] >= b["val/em"]) else "NO"
    mid_em = f"{mid['val/em']:.3f}" if mid else "-"
    print(f"| {run.name} | {dtype} | {b['val/em']:.3f} | {mid_em} | {last['val/em']:.3f} | "
          f"{b.get(f'val/{two}/em', float('nan')):.3f} -> {last.get(f'val/{two}/em', float('nan')):.3f} | {ok} |")

# Question by question (each run's val_predictions.jsonl; before = the first validation of the run's
# dtype, as above): a net change of a question or two can hide many flips either way.
from search_r1.evaluation.compare import Run, changed, count_flips
print("\n### Dev questions that changed, before -> after (EM)\n")
print("| run | data_source | wrong -> right | right -> wrong |")
print("|---|---|---|---|")
first = {}
for run in runs:
    vals = Run.load_validations(run) if (run / "val_predictions.jsonl").is_file() else {}
    if not vals:
        continue
    dtype = json.loads((run / "config.json").read_text())["model"]["compute_dtype"]
    if 0 in vals:
        first[dtype] = vals[0]
    if dtype not in first:
        continue
    flips = changed(first[dtype], list(vals.values())[-1])
    for source in sorted({a["data_source"] for _, a in flips}):
        up, down = count_flips(flips, source)
        print(f"| {run.name} | `{source}` | {up} | {down} |")
PY
# Why two-hop answers fail, before and after: the questions whose first search never shows the bridge
# entity are out of reach whatever GRPO teaches the later steps (the "reachable" column).
{
  echo; echo "### Two-hop dev answers by failure cause, before and after (search_r1.evaluation.hop_failures)"; echo
  "$PYTHON" -m search_r1.evaluation.hop_failures --data "$DEV" --protocol "${SETUP[PROTOCOL]}" "${RUN_DIRS[@]}"
} | tee -a "$OUT/dev.md"
if [[ "$TEST" != 1 ]]; then phase "done (EXP_TEST=0: no test evaluation): $OUT/dev.md"; exit 0; fi

phase "4/5 test evaluation (each final model once)"
read -r -a TEST_FILES <<<"${SETUP[TEST_FILES]}"
read -r -a EVAL_FLAGS <<<"${SETUP[EVAL_FLAGS]}"
first_dtype="${DTYPES%% *}"
EVAL=()
for f in "${TEST_FILES[@]}"; do EVAL+=(--data "$f"); done
EVAL+=("${EVAL_FLAGS[@]}" --retriever-url "$URL" --batch-size "$EVAL_BATCH" --dtype "$first_dtype" --threads "$THREADS" --overwrite)
if [[ "$TEST_LIMIT" != "0" ]]; then EVAL+=(--limit "$TEST_LIMIT"); fi
if [[ "$TEST_PER_SOURCE" != "0" ]]; then EVAL+=(--limit-per-source "$TEST_PER_SOURCE"); fi
evaluate() {  # name, then extra flags
  local name="$1"; shift
  echo "[experiment] test eval: $name"
  "$PYTHON" -m search_r1.evaluation --out "$OUT/eval/test/$name" --name "$name" "${EVAL[@]}" "$@"
}
evaluate no-search --model "${WS[no_search/$first_dtype]}" --no-search
evaluate rag --model "${WS[rag/$first_dtype]}" --rag
evaluate warm-start --model "${WS[search/$first_dtype]}"
GRPO=()
for seed in $SEEDS; do
  evaluate "grpo-s$seed" --model "$OUT/grpo_${first_dtype}_seed$seed"
  GRPO+=("$OUT/eval/test/grpo-s$seed")
done

phase "5/5 comparison"
{
  echo "# GRPO with multi-turn search on CPU: held-out test questions, greedy"
  echo
  echo "Command: bash scripts/experiment_cpu.sh $*  (EXP_SEEDS=\"$SEEDS\" EXP_DTYPES=\"$DTYPES\" STEPS=$STEPS EXP_TEST_LIMIT=$TEST_LIMIT EXP_TEST_PER_SOURCE=$TEST_PER_SOURCE)"
  echo
  "$PYTHON" -m search_r1.evaluation.compare --arm "no-search=$OUT/eval/test/no-search" --arm "rag=$OUT/eval/test/rag" \
    --arm "warm-start=$OUT/eval/test/warm-start" --arm "grpo=$(IFS=,; echo "${GRPO[*]}")" \
    --before warm-start --after grpo --baseline rag --json "$OUT/comparison.json"
  echo; echo "### Two-hop test answers by failure cause (search_r1.evaluation.hop_failures)"; echo
  "$PYTHON" -m search_r1.evaluation.hop_failures "${TEST_FILES[@]/#/--data=}" --protocol "${SETUP[PROTOCOL]}" \
    "$OUT/eval/test/warm-start" "${GRPO[@]}"
  cat "$OUT/dev.md"
  echo
  echo "- training curves: $OUT/grpo_*/training_curves.png; the figure: $OUT/comparison.png"
} | tee "$OUT/comparison.md"
"$PYTHON" scripts/plot_experiment.py "$OUT"
phase "done: $OUT/comparison.md"
