"""How sure is a model of the gold answer where it has to write it? A finer measure than greedy EM.

Greedy EM on a dev sample of 64 questions moves in steps of one question, and a question whose gold
answer's first token sits near probability 0.5 flips with any small change of the weights, whichever
way training moved the rest. This probe asks every model the same question in the same place: for each
question of a reference run whose response reached an answer, the context is the prompt plus that
response up to and including its last `<answer>` (its searches and passages, as the reference model saw
them), and the probe scores

    logp = log p(" " + gold | context) = sum over the gold's tokens t_i of log p(t_i | context, t_<i)
    p_first = p(t_0 | context)

(the first gold alias, with the space the protocol writes after `<answer>`). Printed per model: the
mean logp over the questions, the mean change from the first model and on how many questions logp
rose; then the questions near the greedy edge (the first model's p_first between 0.3 and 0.7) or that
moved by more than 0.3 nats, with p_first and logp under every model. Every model is scored in the
reference's contexts, so a change is the model's reading, not a different search.

    python -m search_r1.evaluation.answer_logprob --data dev.parquet --reference RUN_OR_EVAL_DIR \\
        --model WARMSTART_DIR --model RUN_DIR [--model ...] [--step 0] [--json OUT.json]

The reference is an output directory of `python -m search_r1.evaluation` (predictions.jsonl) or a training
run directory (val_predictions.jsonl; `--step` picks the validation, default the first). Models are HF
directories, checkpoints (checkpoints/global_step_N) or run directories (their latest checkpoint),
scored in float32 whatever dtype they were trained or validated in. Every model must share the first
one's tokenizer (vocabulary, special tokens, chat template): the prompts are its token ids.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ANSWER_OPEN = "<answer>"
EDGE = (0.3, 0.7)  # p_first range where greedy decoding's choice is near a coin flip
MOVED = 0.3  # nats of logp change worth listing


@dataclass(frozen=True)
class Case:
    """One question to score: its id, the question, the prompt's token ids, the context, the answer."""

    id: str
    question: str
    prompt_ids: tuple[int, ...]
    context: str
    answer: str


def answer_context(response: str) -> str | None:
    """The response up to and including its last `<answer>`; None when it never opened one."""
    at = response.rfind(ANSWER_OPEN)
    return None if at < 0 else response[: at + len(ANSWER_OPEN)]


def build_cases(records: list[dict], prompts: dict[str, tuple]) -> tuple[list[Case], int]:
    """Cases of the reference records that opened an answer, and how many records did not.

    `prompts` maps a question's ids and its text to (prompt token ids, question text); a record is
    matched by id when the question texts agree, else by its question.
    """
    cases, skipped = [], 0
    for rec in records:
        context = answer_context(rec["response"])
        if context is None:
            skipped += 1
            continue
        question = rec.get("question")
        by_id = prompts.get(rec["id"])
        if by_id is not None and question and by_id[1] and by_id[1] != question:
            by_id = None  # the same id names another question in --data (another file's row)
        found = by_id or prompts.get(question or "")
        if found is None:
            raise ValueError(f"question {rec['id']!r} ({rec.get('question')!r}) of the reference is not in "
                             f"--data: pass the parquet file(s) the reference was evaluated or validated on")
        cases.append(Case(rec["id"], question or "", found[0], context, " " + rec["golden_answers"][0]))
    return cases, skipped


def score(model, tokenizer, case: Case) -> tuple[float, float]:
    """(logp of the answer's tokens after the context, log p of its first token), one forward pass."""
    import torch

    context = tokenizer(case.context, add_special_tokens=False)["input_ids"]
    answer = tokenizer(case.answer, add_special_tokens=False)["input_ids"]
    start = len(case.prompt_ids) + len(context)
    ids = torch.tensor([list(case.prompt_ids) + context + answer])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, start - 1: -1].float()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None]).squeeze(1)
    return float(logp.sum()), float(logp[0])


def summarize(first: list[tuple[float, float]], other: list[tuple[float, float]]) -> dict:
    """Mean logp of `other`, its mean change from `first` and on how many questions it rose/fell."""
    deltas = [b[0] - a[0] for a, b in zip(first, other)]
    return {"n": len(other), "mean_logp": sum(s[0] for s in other) / len(other),
            "mean_change": sum(deltas) / len(deltas), "rose": sum(d > 0 for d in deltas),
            "fell": sum(d < 0 for d in deltas)}


def notable(cases: list[Case], scores: list[list[tuple[float, float]]]) -> list[int]:
    """Indices of questions near the greedy edge under the first model, or that moved > MOVED nats."""
    out = []
    for i in range(len(cases)):
        p_first = math.exp(scores[0][i][1])
        moved = max(abs(s[i][0] - scores[0][i][0]) for s in scores)
        if EDGE[0] <= p_first <= EDGE[1] or moved > MOVED:
            out.append(i)
    return out


def load_reference(path: str, step: int | None) -> list[dict]:
    from search_r1.evaluation.compare import Run

    ref = Path(path)
    if (ref / "predictions.jsonl").is_file():
        return list(Run.load(ref).records.values())
    if not (ref / "val_predictions.jsonl").is_file():
        raise ValueError(f"{ref} holds neither predictions.jsonl nor val_predictions.jsonl: pass an output "
                         f"directory of python -m search_r1.evaluation or a training run directory that validated")
    runs = Run.load_validations(ref)
    if step is None:
        step = next(iter(runs))
    if step not in runs:
        raise ValueError(f"{ref} has no validation at step {step}; validated steps: {list(runs)}")
    return list(runs[step].records.values())


def load_prompts(data: list[str], tokenizer) -> dict[str, tuple]:
    """(prompt token ids, question) by every name a reference may use: the eval's id, the trainer's
    uid ("file-stem:row") and the question text. A name two rows share is dropped (two files with one
    stem), so such records fall back to their question."""
    from search_r1.evaluation.runner import EvalConfig, load_examples

    prompts: dict[str, tuple] = {}
    shared: set[str] = set()
    for ex in load_examples(EvalConfig(model="", data=tuple(data), out=""), tokenizer):
        entry = (tuple(ex.record.input_ids), ex.question)
        for key in {ex.id, ex.record.uid, ex.question or ""} - {""}:
            if key in prompts and prompts[key] != entry:
                shared.add(key)
            prompts[key] = entry
    return {k: v for k, v in prompts.items() if k not in shared}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m search_r1.evaluation.answer_logprob",
        description="Score the gold answer's log-probability under several models, each in the contexts a "
                    "reference run reached (its prompt, searches and passages up to <answer>): a measure of "
                    "what training changed that does not move in whole questions like greedy EM.")
    parser.add_argument("--data", action="append", required=True,
                        help="parquet file(s) the reference was evaluated or validated on (repeatable)")
    parser.add_argument("--reference", required=True,
                        help="python -m search_r1.evaluation output directory, or a training run directory")
    parser.add_argument("--step", type=int, default=None,
                        help="validation step of a training-run reference (default: its first validation)")
    parser.add_argument("--model", action="append", required=True,
                        help="model to score (repeatable; the first is the one changes are measured from): "
                             "HF directory, registered name, checkpoint or training run directory")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (keep processes x threads <= cores)")
    parser.add_argument("--json", default=None, help="also write every score to this JSON file")
    args = parser.parse_args(argv)

    import torch

    from search_r1.evaluation.identity import tokenizer_identity
    from search_r1.evaluation.runner import resolve_model_dir
    from search_r1.models import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    try:
        records = load_reference(args.reference, args.step)
        scores, names, cases, first_tokenizer = [], [], None, None
        for name in args.model:
            model, tokenizer = load_model_and_tokenizer(resolve_model_dir(name), dtype=torch.float32)
            model.eval()
            fingerprint = tokenizer_identity(tokenizer)["sha256"]
            if first_tokenizer is None:
                first_tokenizer = fingerprint
            elif fingerprint != first_tokenizer:  # its ids would be scored as another vocabulary's
                raise ValueError(f"--model {name} has another tokenizer than --model {args.model[0]} "
                                 f"(vocabulary, special tokens or chat template differ); the prompts are "
                                 f"the first model's token ids, so compare only models that share it")
            if cases is None:
                cases, skipped = build_cases(records, load_prompts(args.data, tokenizer))
                if not cases:
                    raise ValueError(f"no response of {args.reference} opened {ANSWER_OPEN}: nothing to score")
                print(f"[answer_logprob] {len(cases)} questions ({skipped} of the reference never opened "
                      f"{ANSWER_OPEN}, skipped)")
            scores.append([score(model, tokenizer, c) for c in cases])
            names.append(name)
    except ValueError as err:
        parser.error(str(err))

    summaries = [summarize(scores[0], s) for s in scores]
    for name, s in zip(names, summaries):
        print(f"[answer_logprob] {name}: mean logp {s['mean_logp']:.4f}, change {s['mean_change']:+.4f}, "
              f"rose on {s['rose']}, fell on {s['fell']} of {s['n']}")
    print(f"[answer_logprob] near the greedy edge (first model's p_first in {EDGE}) or moved > {MOVED} nats; "
          f"p_first and logp per model, in --model order:")
    for i in notable(cases, scores):
        values = "  ".join(f"{math.exp(s[i][1]):.2f} {s[i][0]:+.3f}" for s in scores)
        print(f"[answer_logprob]   {cases[i].question[:60]!r:<62} {values}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "models": names, "summaries": summaries,
            "questions": [{"id": c.id, "question": c.question, "answer": c.answer.strip(),
                           "logp": [s[i][0] for s in scores], "logp_first": [s[i][1] for s in scores]}
                          for i, c in enumerate(cases)]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
