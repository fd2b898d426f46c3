"""Generation speed: vLLM's CPU build against our HFGenerator, same model, dtype and cores (a benchmark,
not a test). Needs the vLLM-on-CPU environment (make install-vllm; docs/vllm_cpu.md):

    .venv-vllm/bin/python bench/vllm_generation.py                       # fp32 and bf16, batch 8, 16, 64, 128 tokens
    .venv-vllm/bin/python bench/vllm_generation.py --setting trainer     # the embedded trainer's rollout: 3 x 16 x 40
    .venv-vllm/bin/python bench/vllm_generation.py --dtypes float32 --batch-sizes 8 --repeats 1

Every row generates exactly --max-tokens tokens (EOS ignored), temperature 1, seeded. tokens/s = rows x
max_tokens x calls / wall seconds of one measured step, best of --repeats, after a warm-up call. Both
sides use the same cores: HF with torch.set_num_threads(cores), vLLM with its OpenMP threads bound to
those cores (search_r1.vllm_cpu.vllm_thread_binding()); the sides run one after the other, never
together. On a host shared with other jobs, OpenMP threads spin-wait at every parallel region for a
sibling thread that may not be scheduled, which can make 2-thread figures many times slower than
1-thread ones; --cores 1 gives figures that hold up better there (one thread per side), and the load
averages printed before and after say how busy the host was.

--setting throughput: one generate call of --batch-sizes rows (default 8, 16, 64) x 128 tokens from
chat-templated questions (~30 tokens).

--setting trainer: what the embedded CPU trainer's rollout asks of its generator per step in the demo's
multi-turn shape (configs/grpo_cpu.yaml with 4 prompts x 4 samples = 16 rows, rollout.max_turns 2,
40 tokens per turn): --rounds generate calls (max_turns + 1 = 3) of --batch-sizes rows (default 16)
x 40 new tokens; the first from the ~200-token Search-R1 prompts (groups of 4 rows share a prompt),
each later one from the previous contexts plus what that call generated plus a 96-token observation
(synthetic filler), as the rollout loop builds them. Real rollouts stop earlier at </search> or
</answer>, on both backends alike. Sides: hf, vllm (prefix cache off) and vllm-pc (prefix cache on,
emptied before each measured step: a step reuses only its own shared group prompts and earlier
rounds, which the embedded trainer's HFGenerator recomputes). A vLLM backend would also pay a weight
sync into the engine after every update: reported as the seconds of one `load_weights` of all
parameters through vLLM's collective RPC (vLLM's side only; the transfer from the trainer is extra).

vLLM runs in this process as `vllm.LLM` (its engine and worker are child processes); its start-up
(~20-40 s) is excluded from the timings and reported.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

QUESTIONS = [
    "What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
    "What is photosynthesis?", "Name a prime number larger than 10.", "Why is the sky blue?",
    "Who painted the Mona Lisa?", "What is the boiling point of water?",
]
SIDES = ("hf", "vllm", "vllm-pc")
FILLER = ("Doc 1(Title: Paris) Paris is the capital and largest city of France, on the Seine. "
          "Doc 2(Title: Seine) The Seine is a river in northern France. ") * 3


def cpu_kind() -> str:
    import torch

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} logical CPUs"


def first_prompts(tok, setting: str, batch: int) -> list[list[int]]:
    """The prompts of a measurement's first generate call."""
    from search_r1.prompts import apply_chat_template, make_messages

    if setting == "throughput":
        return [apply_chat_template(tok, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                for i in range(batch)]
    # trainer: groups of 4 samples of each Search-R1 prompt (rows 4g..4g+3 share question g)
    return [apply_chat_template(tok, make_messages(QUESTIONS[(i // 4) % len(QUESTIONS)])) for i in range(batch)]


def observation(tok) -> list[int]:
    """The 96 observation tokens appended after every generated turn (--setting trainer)."""
    return tok(f"\n\n<information>{FILLER}</information>\n\n", add_special_tokens=False)["input_ids"][:96]


def timed_step(generate, first: list[list[int]], rounds: int, obs: list[int], max_tokens: int) -> float:
    """Wall seconds of `rounds` generate calls, each from the previous call's contexts grown by what it
    generated and `obs` (the rollout loop's shape). `generate(prompts) -> token-id lists`."""
    contexts = first
    start = time.perf_counter()
    for _ in range(rounds):
        outs = generate(contexts)
        if any(len(o) != max_tokens for o in outs):
            raise RuntimeError(f"a row generated {min(map(len, outs))} tokens, not {max_tokens} (EOS not ignored?)")
        contexts = [c + o + obs for c, o in zip(contexts, outs)]
    return time.perf_counter() - start


def bench_hf(path: str, dtype: str, threads: int, first, rounds: int, obs, max_tokens: int, repeats: int) -> float:
    """Best wall seconds of one measurement, HFGenerator."""
    import torch

    from search_r1.models import load_model_and_tokenizer
    from search_r1.rollout.backends import HFGenerator, SamplingParams

    torch.set_num_threads(threads)
    model, tok = load_model_and_tokenizer(path)
    model = model.to(getattr(torch, dtype)).eval()
    gen = HFGenerator(model, tok, eos_token_ids=[])
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    gen.generate(first[:1], SamplingParams(max_tokens=4, temperature=1.0, seed=0))  # warm-up

    def generate(prompts):
        return [list(o.token_ids) for o in gen.generate(prompts, params)]

    best = min(timed_step(generate, first, rounds, obs, max_tokens) for _ in range(repeats))
    del model, gen
    gc.collect()
    return best


def start_vllm(path: str, dtype: str, max_model_len: int, prefix_cache: bool):
    from vllm import LLM

    return LLM(model=path, dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=1 << 30,
               max_model_len=max_model_len, seed=0, enable_prefix_caching=prefix_cache)


def bench_vllm(llm, first, rounds: int, obs, max_tokens: int, repeats: int) -> float:
    """Best wall seconds of one measurement, vLLM. The prefix cache (when on) is emptied before every
    repetition, so a step reuses only what it computed itself (shared group prompts, earlier rounds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # No per-request seed (the engine is seeded): with one, vLLM 0.27's CPU runner fails on any prompt
    # whose prefill is chunked ("CPU Generator does not use offset"), as the trainer setting's are.
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=first[0])], SamplingParams(max_tokens=4), use_tqdm=False)

    def generate(prompts):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    best = float("inf")
    for _ in range(repeats):
        llm.reset_prefix_cache()
        best = min(best, timed_step(generate, first, rounds, obs, max_tokens))
    return best


def weight_sync_seconds(llm, path: str) -> float:
    """One full weight load into the running engine (what a trainer's sync costs on vLLM's side)."""
    def load(worker, model_dir):
        import time as _time

        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        from verl_ext.cpu.vllm_worker import restore_packed_weights

        start = _time.perf_counter()
        model = worker.model_runner.model
        restore_packed_weights(model)
        model.load_weights(load_file(f"{model_dir}/model.safetensors").items())
        process_weights_after_loading(model, worker.model_runner.vllm_config.model_config, worker.device)
        return _time.perf_counter() - start

    return float(llm.collective_rpc(load, args=(path,))[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias or HF directory (head_dim >= 32)")
    parser.add_argument("--setting", choices=("throughput", "trainer"), default="throughput",
                        help="throughput: one call of --batch-sizes rows x --max-tokens; trainer: the embedded "
                             "trainer's --rounds calls of --batch-sizes rows x 40 tokens (module docstring)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"),
                        help="weight/compute dtype, the same on both sides")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="rows per generate call (default 8 16 64; 16 for --setting trainer)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--setting trainer: generate calls per step (rollout.max_turns + 1)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens per row (default 128; 40 for --setting trainer)")
    parser.add_argument("--repeats", type=int, default=2, help="timed repetitions per cell (the best counts)")
    parser.add_argument("--cores", type=int, default=0,
                        help="cores for each side (default 0: every core this process may run on); 1 gives "
                             "figures that hold up on a busy host (module docstring)")
    parser.add_argument("--sides", nargs="+", default=None, choices=SIDES,
                        help="what to run: hf (HFGenerator), vllm (prefix cache off), vllm-pc (prefix cache on); "
                             "default hf vllm, plus vllm-pc for --setting trainer")
    args = parser.parse_args()
    sides = args.sides or (["hf", "vllm", "vllm-pc"] if args.setting == "trainer" else ["hf", "vllm"])
    if __import__("importlib").util.find_spec("vllm") is None and set(sides) - {"hf"}:
        parser.error("vLLM is not installed in this python; run with .venv-vllm/bin/python (make install-vllm)")
    batches = args.batch_sizes or ([16] if args.setting == "trainer" else [8, 16, 64])
    if args.rounds < 1 or min(batches) < 1:
        parser.error("--rounds and --batch-sizes must be >= 1")
    rounds = args.rounds if args.setting == "trainer" else 1

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from search_r1.vllm_cpu import cpu_list_spec, vllm_thread_binding

    allowed = sorted(os.sched_getaffinity(0))
    if args.cores:
        allowed = allowed[:args.cores]
        os.sched_setaffinity(0, allowed)  # HF's threads; vLLM's are bound by the variable below
    os.environ.update(vllm_thread_binding())  # read by the vLLM engine processes
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list_spec(allowed)
    if args.setting == "trainer":
        # weight_sync_seconds sends a function to vLLM's worker, which vLLM allows only with this set
        # (read when the engine starts; a local engine running our own function).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    cores = len(allowed)
    from search_r1.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    max_tokens = args.max_tokens or (40 if args.setting == "trainer" else 128)
    obs = observation(tok) if rounds > 1 else []
    firsts = {b: first_prompts(tok, args.setting, b) for b in batches}
    print(f"CPU: {cpu_kind()}; cores used: {cores}; load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"model {args.model}, setting {args.setting}: {rounds} generate call(s) per step, {max_tokens} new "
          f"tokens per row per call, best of {args.repeats}", flush=True)
    seconds: dict[tuple[str, str, int], float] = {}
    sync: dict[tuple[str, str], float] = {}
    for dtype in args.dtypes:
        for side in sides:
            if side == "hf":
                for b in batches:
                    seconds[dtype, side, b] = bench_hf(path, dtype, cores, firsts[b], rounds, obs, max_tokens,
                                                       args.repeats)
                    print(f"{side} {dtype} rows {b}: {seconds[dtype, side, b]:.2f} s", flush=True)
                continue
            start = time.perf_counter()
            llm = start_vllm(path, dtype, max_model_len=1024, prefix_cache=side == "vllm-pc")
            print(f"{side} engine start ({dtype}): {time.perf_counter() - start:.1f} s", flush=True)
            try:
                for b in batches:
                    seconds[dtype, side, b] = bench_vllm(llm, firsts[b], rounds, obs, max_tokens, args.repeats)
                    print(f"{side} {dtype} rows {b}: {seconds[dtype, side, b]:.2f} s", flush=True)
                if args.setting == "trainer":
                    sync[dtype, side] = weight_sync_seconds(llm, path)
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
    print_table(seconds, sync, args.dtypes, sides, batches, rounds, max_tokens)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def print_table(seconds, sync, dtypes, sides, batches, rounds: int, max_tokens: int) -> None:
    """One line per dtype x rows: seconds and generated tokens/s of each side, each vLLM side's speed-up
    over HF, and (trainer setting) vLLM's weight-load seconds."""
    vllm_sides = [s for s in sides if s != "hf"]
    head = f"{'dtype':>8} {'rows':>5} {'calls':>5}" + "".join(f" {s + ' s':>10} {'tok/s':>7}" for s in sides)
    if "hf" in sides:
        head += "".join(f" {s + '/hf':>10}" for s in vllm_sides)
    if sync:
        head += "".join(f" {s + ' sync s':>14}" for s in vllm_sides)
    print("\n" + head)
    for dtype in dtypes:
        for b in batches:
            tokens = b * max_tokens * rounds
            line = f"{dtype:>8} {b:>5} {rounds:>5}"
            for side in sides:
                t = seconds.get((dtype, side, b))
                line += f" {t:>10.2f} {tokens / t:>7.1f}" if t else f" {'-':>10} {'-':>7}"
            if "hf" in sides:
                hf = seconds.get((dtype, "hf", b))
                for side in vllm_sides:
                    t = seconds.get((dtype, side, b))
                    line += f" {hf / t:>10.2f}" if hf and t else f" {'-':>10}"
            if sync:
                line += "".join(f" {sync[dtype, s]:>14.2f}" if (dtype, s) in sync else f" {'-':>14}"
                                for s in vllm_sides)
            print(line)


if __name__ == "__main__":
    main()
