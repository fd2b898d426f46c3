"""Generation speed: vLLM's CPU build against our HFGenerator, same model, dtype and cores (a benchmark,
not a test). Needs the vLLM-on-CPU environment (make install-vllm; docs/vllm_cpu.md):

    .venv-vllm/bin/python bench/vllm_generation.py                       # fp32 and bf16, batch 8 and 64, 128 tokens
    .venv-vllm/bin/python bench/vllm_generation.py --setting trainer     # the embedded trainer's rollout shape
    .venv-vllm/bin/python bench/vllm_generation.py --dtypes float32 --batch-sizes 8 --repeats 1

Every row generates exactly --max-tokens tokens (EOS ignored), temperature 1, seeded; prompts are
chat-templated questions (~30 tokens). tokens/s = rows x max_tokens / wall seconds of one generate call,
best of --repeats, after a warm-up call. Both sides use every core this process may run on: HF with
torch.set_num_threads(cores), vLLM with its OpenMP threads bound to those cores (the CPU platform's
rollout_env_vars()); the sides run one after the other, never together. On a host shared with
other jobs, torch's OpenMP threads spin-wait at every parallel region for a sibling thread that may
not be scheduled, which can make 2-thread figures 20-30x slower than 1-thread ones; --cores 1 avoids
that (one thread per side), and the load average printed before and after says how busy the host was.

--setting trainer measures what the embedded CPU trainer's rollout does per step (configs/grpo_cpu.yaml
with the demo's data: 2 prompts x 4 samples, max_turns 1): a first turn of up to 40 tokens from the
~200-token prompts, then a last turn of up to 40 tokens from contexts that grew by the first turn and
a ~96-token observation (synthetic filler here), i.e. 2 generate calls of 8 rows x 40 tokens. It
reports seconds per step of generation and the vLLM/HF speed ratio; the trainer would also pay a
weight sync into vLLM after every update (reported as the time of one `load_weights` of all
parameters through vLLM's collective RPC).

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


def prompt_sets(tok, setting: str, batch: int) -> list[list[list[int]]]:
    """The prompt lists of the generate calls one measurement makes."""
    from search_r1.prompts import apply_chat_template, make_messages

    if setting == "throughput":
        return [[apply_chat_template(tok, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                 for i in range(batch)]]
    # trainer: 2 prompts x 4 samples of the Search-R1 template, then the same contexts grown by a
    # 40-token turn and an observation.
    first = [apply_chat_template(tok, make_messages(QUESTIONS[i // 4])) for i in range(batch)]
    turn = tok("<think>I need to look this up.</think>\n<search> capital of France </search>",
               add_special_tokens=False)["input_ids"]
    obs = tok(f"\n\n<information>{FILLER}</information>\n\n", add_special_tokens=False)["input_ids"][:96]
    return [first, [p + turn + obs for p in first]]


def bench_hf(path: str, dtype: str, threads: int, sets, max_tokens: int, repeats: int) -> float:
    """Best wall seconds of all generate calls of one measurement, HFGenerator."""
    import torch

    from search_r1.models import load_model_and_tokenizer
    from search_r1.rollout.backends import HFGenerator, SamplingParams

    torch.set_num_threads(threads)
    model, tok = load_model_and_tokenizer(path)
    model = model.to(getattr(torch, dtype)).eval()
    gen = HFGenerator(model, tok, eos_token_ids=[])
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    gen.generate(sets[0][:1], SamplingParams(max_tokens=4, temperature=1.0, seed=0))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for prompts in sets:
            outs = gen.generate(prompts, params)
            assert all(len(o.token_ids) == max_tokens for o in outs)
        best = min(best, time.perf_counter() - start)
    del model, gen
    gc.collect()
    return best


def start_vllm(path: str, dtype: str, max_model_len: int):
    from vllm import LLM

    return LLM(model=path, dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=1 << 30,
               max_model_len=max_model_len, seed=0, enable_prefix_caching=False)


def bench_vllm(llm, sets, max_tokens: int, repeats: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=sets[0][0])], SamplingParams(max_tokens=4), use_tqdm=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for prompts in sets:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        best = min(best, time.perf_counter() - start)
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
                             "trainer's two 8 x 40 turns (module docstring)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"),
                        help="weight/compute dtype, the same on both sides")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64], help="rows per generate call")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens per row (default 128; 40 for --setting trainer)")
    parser.add_argument("--repeats", type=int, default=2, help="timed repetitions per cell (the best counts)")
    parser.add_argument("--cores", type=int, default=0,
                        help="cores for each side (default 0: every core this process may run on); 1 gives "
                             "figures that hold up on a busy host (module docstring)")
    parser.add_argument("--sides", nargs="+", default=["hf", "vllm"], choices=("hf", "vllm"), help="what to run")
    args = parser.parse_args()
    if __import__("importlib").util.find_spec("vllm") is None and "vllm" in args.sides:
        parser.error("vLLM is not installed in this python; run with .venv-vllm/bin/python (make install-vllm)")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from verl_ext.cpu.platform import PlatformCPU, cpu_list_spec

    allowed = sorted(os.sched_getaffinity(0))
    if args.cores:
        allowed = allowed[:args.cores]
        os.sched_setaffinity(0, allowed)  # HF's threads; vLLM's are bound by the variable below

    os.environ.update(PlatformCPU().rollout_env_vars())  # read by the vLLM engine processes
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
    batches = [8] if args.setting == "trainer" else args.batch_sizes
    print(f"CPU: {cpu_kind()}; cores used: {cores}; load average before: {os.getloadavg()[0]:.1f}")
    print(f"model {args.model}, setting {args.setting}, {max_tokens} new tokens per row per call")
    rows = []
    for dtype in args.dtypes:
        hf = {}
        if "hf" in args.sides:
            for b in batches:
                hf[b] = bench_hf(path, dtype, cores, prompt_sets(tok, args.setting, b), max_tokens, args.repeats)
                print(f"HF {dtype} rows {b}: {hf[b]:.2f} s", flush=True)
        vl, sync = {}, None
        if "vllm" in args.sides:
            start = time.perf_counter()
            llm = start_vllm(path, dtype, max_model_len=1024)
            print(f"vLLM engine start ({dtype}): {time.perf_counter() - start:.1f} s")
            for b in batches:
                vl[b] = bench_vllm(llm, prompt_sets(tok, args.setting, b), max_tokens, args.repeats)
                print(f"vLLM {dtype} rows {b}: {vl[b]:.2f} s", flush=True)
            if args.setting == "trainer":
                sync = weight_sync_seconds(llm, path)
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        for b in batches:
            calls = len(prompt_sets(tok, args.setting, b))
            tokens = b * max_tokens * calls
            rows.append((dtype, b, calls, hf.get(b), vl.get(b), tokens, sync))
    print(f"\n{'dtype':>8} {'rows':>5} {'calls':>5} {'HF s':>7} {'HF tok/s':>9} {'vLLM s':>7} {'vLLM tok/s':>10} "
          f"{'vLLM/HF':>7}" + (f" {'sync s':>6}" if args.setting == "trainer" else ""))
    for dtype, b, calls, h, v, tokens, sync in rows:
        cell = lambda s: (f"{s:>7.2f} {tokens / s:>9.1f}" if s else f"{'-':>7} {'-':>9}")  # noqa: E731
        ratio = f"{h / v:>7.2f}" if h and v else f"{'-':>7}"
        vcell = f"{v:>7.2f} {tokens / v:>10.1f}" if v else f"{'-':>7} {'-':>10}"
        extra = f" {sync:>6.2f}" if args.setting == "trainer" and sync is not None else ""
        print(f"{dtype:>8} {b:>5} {calls:>5} {cell(h)} {vcell} {ratio}{extra}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
