"""Rollout-loop benchmark: what `LLMGenerationManager.run_llm_loop` itself costs, and where a real
rollout's time goes.

Part 1 (overhead): an instant generator (canned 128-token turns, each ending in `</search>`) and an
in-process search engine (canned ~128-token passages), so everything measured is the loop's own
work: unpadding, context building, batched decode and action parsing, observation tokenization,
tensor assembly. Batch 64/256/512 x max_turns 2/4 x group size 1/5 (rows sharing a question, hence
queries and results, as in a GRPO group). Each run has max_turns search rounds plus the final
no-search round; ms/round is wall time, cpu_ms/round the process's CPU time minus the generator's and
engine's, so it stays meaningful on a loaded machine. Building the generator's input contexts counts
as loop work (it is outside the timed generate call). The best of --repeats runs is reported (the
manager persists across runs, as in training, so its tokenizer caches are warm); cold_ms/round is
the first run. Target: <= 100 ms of loop overhead per round at batch 512.

Part 2 (real): SmolLM2-135M-Instruct through `HFGenerator` on 16 questions of a synthetic world,
with the real BM25 retriever server (built and started here on a free 127.0.0.1 port); the prompt
opens with a one-shot demonstration turn so the untrained model issues searches at all. Reports
tokens sampled vs kept (target: nothing discarded beyond the stop string's final token) and the
wall-time split generation / search / loop.

    python bench/rollout_overhead.py                      # both parts
    python bench/rollout_overhead.py --skip-real --batches 64 512 --turns 2
    SEARCH_R1_BPE_CACHE=0 python bench/rollout_overhead.py --skip-real --batches 8 32 512 --turns 2 --groups 4
                                                          # without search_r1.bpe_cache (tokenizer only)

Measured (2 shared cores, load ~4.4; best of 3, ms/round wall / cpu): with the cache 0.9/0.9 at
batch 8 (the trainer's 2 prompts x 4), 3.2/2.0 at 32, 48.9/25.1 at 512; without it 2.1/1.2,
6.0/3.3, 89.3/45.5. It matters only at large batches (the 100 ms/round target at 512 is met
narrowly without it), so it stays, on by default, behind SEARCH_R1_BPE_CACHE.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from search_r1.prompts import apply_chat_template, make_messages  # noqa: E402
from search_r1.rollout.backends import GenOutput, SamplingParams  # noqa: E402
from search_r1.rollout.generation import GenerationConfig, LLMGenerationManager  # noqa: E402
from search_r1.rollout.tensor_helper import pad_ragged, strip_left_padding  # noqa: E402
from search_r1.search.base import SearchEngine  # noqa: E402
from retriever_server.launcher import ServerProcess  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def load_tokenizer():
    from search_r1.models import load_tokenizer as load
    return load("smollm2-135m-instruct")


def exact_length_text(tok, head: str, tail: str, n_tokens: int) -> list[int]:
    """Ids of head + filler + tail, exactly n_tokens long (filler words are one token each)."""
    head_ids = tok(head, add_special_tokens=False)["input_ids"]
    tail_ids = tok(tail, add_special_tokens=False)["input_ids"]
    word = tok(" data", add_special_tokens=False)["input_ids"]
    n_fill = n_tokens - len(head_ids) - len(tail_ids)
    if len(word) != 1 or n_fill < 0:
        raise ValueError("cannot build a canned turn of that length")
    return head_ids + word * n_fill + tail_ids


class InstantGenerator:
    """Answers every prompt at once with its canned turn: 128 tokens ending in `<search> query of
    its group </search>` (a generator that costs nothing; its own CPU time is tallied in `cpu_s`)."""

    def __init__(self, turns_by_prompt: dict[tuple, list[int]]):
        self.by_len: dict[int, dict[tuple, list[int]]] = {}
        for prompt, turn in turns_by_prompt.items():
            self.by_len.setdefault(len(prompt), {})[prompt] = turn
        self.cpu_s = 0.0

    def generate(self, prompts, params: SamplingParams):
        c0 = time.process_time()
        outs = []
        for ctx in prompts:
            turn = next(table[key] for n, table in self.by_len.items() if (key := tuple(ctx[:n])) in table)
            ids = turn[: params.max_tokens]
            outs.append(GenOutput(ids, [-0.5] * len(ids), "stop"))
        self.cpu_s += time.process_time() - c0
        return outs


class InstantEngine(SearchEngine):
    """Serves pre-rendered results from a pool: each distinct query of a call gets a fresh result,
    identical queries the same one (as a retriever would). With group size 1 no two rows of a round
    share a result, so every observation must really be tokenized."""

    def __init__(self, pool: list[str]):
        self.pool, self.next, self.cpu_s = pool, 0, 0.0

    def batch_search(self, queries):
        c0 = time.process_time()
        slot = {}
        for q in queries:
            if q not in slot:
                slot[q] = self.pool[self.next % len(self.pool)]
                self.next += 1
        self.cpu_s += time.process_time() - c0
        return [slot[q] for q in queries]


def passage_pool(tok, n: int, n_tokens: int, seed: int = 0) -> list[str]:
    """n distinct 3-document results of about n_tokens tokens, words drawn from a 3000-word vocabulary."""
    rng = np.random.default_rng(seed)
    syll = ["ka", "lo", "mi", "ren", "sta", "vel", "tor", "an", "is", "ud", "bra", "qu", "om", "ex", "fi"]
    vocab = ["".join(rng.choice(syll, size=rng.integers(1, 4))) for _ in range(3000)]
    per_word = np.mean([len(tok(" " + w, add_special_tokens=False)["input_ids"]) for w in vocab[:200]])
    n_words = max(1, int((n_tokens / 3 - 8) / per_word))
    return ["".join(f"Doc {d}(Title: {vocab[rng.integers(3000)].title()}) "
                    f"{' '.join(rng.choice(vocab, size=n_words))}\n" for d in (1, 2, 3)) for _ in range(n)]


DEMO = [{"role": "user", "content": make_messages("What is the capital of France")[0]["content"]},
        {"role": "assistant", "content": "<search> capital of France </search>"}]


def make_gen_batch(tok, questions, one_shot: bool = False):
    from verl import DataProto
    demo = DEMO if one_shot else []
    prompts = [apply_chat_template(tok, demo + make_messages(q)) for q in questions]
    ids, mask = pad_ragged(prompts, pad_value=tok.pad_token_id or 0, left=True)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": torch.clip(mask.cumsum(-1) - 1, 0)},
        non_tensors={"uid": np.array([str(i) for i in range(len(questions))], dtype=object)},
    )


def bench_overhead(tok, batches, turns_list, groups, turn_tokens, repeats):
    engine = InstantEngine(passage_pool(tok, 2 * max(batches) * max(turns_list), turn_tokens))
    rows = []
    for group in groups:
        for max_turns in turns_list:
            for b in batches:
                questions = [f"Who founded company number {i // group}" for i in range(b)]
                batch = make_gen_batch(tok, questions)
                turns = {}
                for i, ids in enumerate(strip_left_padding(batch.batch["input_ids"], batch.batch["attention_mask"])):
                    turns[tuple(ids)] = exact_length_text(
                        tok, "<think>", f"</think>\n<search> founder of company {i // group} </search>", turn_tokens)
                gen = InstantGenerator(turns)
                cfg = GenerationConfig(max_turns=max_turns, max_prompt_length=4096, max_start_length=1024,
                                       max_response_length=(max_turns + 1) * turn_tokens + max_turns * 2 * turn_tokens,
                                       max_obs_length=2 * turn_tokens, max_tokens_per_turn=turn_tokens)
                mgr = LLMGenerationManager(tok, gen, cfg, engine)
                best = cold = None
                for _ in range(repeats):
                    gen.cpu_s = engine.cpu_s = 0.0
                    cpu0 = time.process_time()
                    out = mgr.run_llm_loop(batch)
                    cpu = time.process_time() - cpu0 - gen.cpu_s - engine.cpu_s  # the loop's own CPU
                    t = out.meta_info["timing"]
                    if cold is None:  # first run: the tokenizer caches (lines, pieces) start empty
                        cold = 1000 * t["loop_s"] / out.meta_info["rollout_stats"]["rounds"]
                    if best is None or t["loop_s"] < best["loop_s"]:
                        best = dict(t, cpu=cpu, rounds=out.meta_info["rollout_stats"]["rounds"],
                                    resp=out.batch["responses"].shape[1],
                                    obs=int(np.mean(out.meta_info["observation_token_stats"])) // max(1, max_turns))
                rows.append((b, max_turns, group, best["rounds"], best["total_s"], best["loop_s"],
                             1000 * best["loop_s"] / best["rounds"], 1000 * best["cpu"] / best["rounds"],
                             best["resp"], best["obs"], peak_rss_mb(), cold))
                print(f"  batch {b:4d} max_turns {max_turns} group {group}: {best['total_s']:.3f} s", flush=True)
    print("\nPart 1: loop overhead (instant generator, in-process engine; best of %d runs; cold_ms/round = "
          "the first run, with empty tokenizer caches)" % repeats)
    print(f"{'batch':>6} {'max_turns':>9} {'group':>5} {'rounds':>6} {'run_s':>8} {'loop_s':>8} {'ms/round':>9} "
          f"{'cpu_ms/round':>12} {'cold_ms/round':>13} {'resp_w':>7} {'obs_tok':>7} {'peak_rss_MB':>11}")
    for r in rows:
        print(f"{r[0]:>6} {r[1]:>9} {r[2]:>5} {r[3]:>6} {r[4]:>8.3f} {r[5]:>8.3f} {r[6]:>9.1f} {r[7]:>12.1f} "
              f"{r[11]:>13.1f} {r[8]:>7} {r[9]:>7} {r[10]:>11.0f}")
    print(f"load average now: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          "(wall ms/round inflates with load; cpu_ms/round is the loop's own CPU time)")
    worst512 = [(r[6], r[7]) for r in rows if r[0] == 512]
    if worst512:
        wall, cpu = max(w for w, _ in worst512), max(c for _, c in worst512)
        print(f"target <= 100 ms/round at batch 512: worst wall {wall:.1f} ms, cpu {cpu:.1f} ms -> "
              f"{'MET' if wall <= 100 else 'MET on CPU time' if cpu <= 100 else 'MISSED'}")


# -- part 2 -----------------------------------------------------------------------------------------
def start_retriever(workdir: Path):
    """Synthetic world + BM25 index + server subprocess; returns (ServerProcess, url, test.jsonl path)."""
    py = sys.executable
    world = workdir / "world"
    subprocess.run([py, "-m", "search_r1.data.synth", "--out", str(world), "--seed", "0", "--n-entities", "120"],
                   check=True, stdout=subprocess.DEVNULL)
    index = workdir / "bm25"
    subprocess.run([py, "-m", "retriever_server", "build", "--corpus", str(world / "corpus.jsonl"),
                    "--kind", "bm25", "--out", str(index)], check=True, stdout=subprocess.DEVNULL)
    server = ServerProcess([index], workdir / "retriever.log").start(timeout=60)
    return server, server.url, world / "test.jsonl"


def bench_real(n: int, max_turns: int, tokens_per_turn: int, threads: int, one_shot: bool):
    import json

    from search_r1.models import load_model_and_tokenizer
    from search_r1.rollout.backends import HFGenerator
    from search_r1.search import RetrieverClient

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as tmp:
        server, url, test_path = start_retriever(Path(tmp))
        try:
            model, tok = load_model_and_tokenizer("smollm2-135m-instruct")
            model.eval()
            with open(test_path) as f:
                questions = [json.loads(line)["question"] for line, _ in zip(f, range(n))]
            batch = make_gen_batch(tok, questions, one_shot)
            cfg = GenerationConfig(max_turns=max_turns, max_tokens_per_turn=tokens_per_turn,
                                   max_response_length=(max_turns + 1) * tokens_per_turn + max_turns * 300,
                                   max_obs_length=300, seed=0)
            mgr = LLMGenerationManager(tok, HFGenerator(model, tok, batch_size=n), cfg, RetrieverClient(url, topk=3))
            out = mgr.run_llm_loop(batch)
        finally:
            server.stop()
    rs, t, m = out.meta_info["rollout_stats"], out.meta_info["timing"], out.meta_info
    print(f"\nPart 2: SmolLM2-135M-Instruct, {n} trajectories, max_turns {max_turns}, "
          f"{tokens_per_turn} tokens/turn cap, real BM25 retriever, {threads} torch threads, "
          f"{'one-shot search demo in the prompt' if one_shot else 'zero-shot prompt'}")
    print(f"{'sampled':>8} {'kept':>6} {'discarded':>9} {'overshoot':>9} {'obs_tok':>7} {'searches':>8} "
          f"{'answered':>8} {'gen_s':>7} {'search_s':>8} {'loop_s':>7} {'total_s':>7}")
    print(f"{rs['sampled_tokens']:>8} {rs['kept_generated_tokens']:>6} {rs['discarded_tokens']:>9} "
          f"{rs['overshoot_tokens']:>9} {rs['observation_tokens']:>7} {sum(m['valid_search_stats']):>8} "
          f"{rs['answered']:>8} {t['gen_s']:>7.2f} {t['search_s']:>8.3f} {t['loop_s']:>7.3f} {t['total_s']:>7.2f}")
    print(f"target: no discarded tail beyond the stop string -> "
          f"{'MET' if rs['discarded_tokens'] == 0 else 'MISSED'} ({rs['discarded_tokens']} tokens discarded)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512],
                   help="batch sizes for the overhead part (default: 64 256 512)")
    p.add_argument("--turns", type=int, nargs="+", default=[2, 4],
                   help="max_turns values for the overhead part (default: 2 4)")
    p.add_argument("--groups", type=int, nargs="+", default=[1, 5],
                   help="rows per question (GRPO group size): 1 = every row searches something different "
                        "(worst case: every observation is new text); 5 = upstream's n_agent (default: 1 5)")
    p.add_argument("--turn-tokens", type=int, default=128,
                   help="tokens per canned generation turn; observations are about as long (default: 128)")
    p.add_argument("--repeats", type=int, default=2, help="runs per overhead setting, best one reported (default: 2)")
    p.add_argument("--skip-overhead", action="store_true", help="skip part 1")
    p.add_argument("--skip-real", action="store_true", help="skip part 2 (the real SmolLM2 rollout)")
    p.add_argument("--real-n", type=int, default=16, help="trajectories in the real rollout (default: 16)")
    p.add_argument("--real-turns", type=int, default=2, help="max_turns of the real rollout (default: 2)")
    p.add_argument("--real-tokens", type=int, default=48,
                   help="max tokens per generation turn in the real rollout (default: 48)")
    p.add_argument("--zero-shot", action="store_true",
                   help="plain prompts; by default the prompt starts with a one-shot demonstration turn "
                        "(a question answered by '<search> ... </search>'), without which the untrained "
                        "135M model never searches")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, the machine is shared)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    if not args.skip_overhead:
        tok = load_tokenizer()
        bench_overhead(tok, args.batches, args.turns, args.groups, args.turn_tokens, args.repeats)
    if not args.skip_real:
        bench_real(args.real_n, args.real_turns, args.real_tokens, args.threads, not args.zero_shot)


if __name__ == "__main__":
    main()
