"""HFGenerator throughput and model-cache timings (a benchmark, not a test).

    python bench/generator_throughput.py                         # SmolLM2, batch 1 and 16, 1 and 2 threads
    python bench/generator_throughput.py --measure-conversion    # also time a fresh GGUF conversion
    python bench/generator_throughput.py --model tiny-random-qwen3 --batch-sizes 1 64

Generation ignores EOS so every row produces exactly --max-tokens tokens (temperature 1, seeded);
tokens/s = batch * max_tokens / wall seconds of one `generate` call (after one warm-up call);
tok/cpu-s divides by the process CPU time instead, which is less sensitive to other load on the host.
The conversion timing builds into a temporary $SEARCH_R1_HOME, so the real cache is left alone.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

QUESTIONS = [
    "What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
    "What is photosynthesis?", "Name a prime number larger than 10.", "Why is the sky blue?",
    "Who painted the Mona Lisa?", "What is the boiling point of water?", "What does DNA stand for?",
    "Which planet is the largest?", "What language is spoken in Brazil?", "What is 12 times 12?",
    "Who discovered penicillin?", "What is the tallest animal?", "When did World War II end?",
    "What is the chemical symbol for gold?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF directory or GGUF file")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="prompts per generate call")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch.set_num_threads values")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per row (EOS ignored)")
    parser.add_argument("--measure-conversion", action="store_true",
                        help="also convert the bundled SmolLM2 GGUF into a temp cache and time it")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from search_r1 import models
    from search_r1.prompts import apply_chat_template
    from search_r1.rollout.backends import HFGenerator, SamplingParams

    torch.set_num_threads(max(args.threads))
    if args.measure_conversion:
        real_home = os.environ.get("SEARCH_R1_HOME")
        with tempfile.TemporaryDirectory() as home:
            os.environ["SEARCH_R1_HOME"] = home
            start = time.perf_counter()
            models.resolve_model_path("smollm2-135m-instruct")
            print(f"GGUF -> safetensors conversion: {time.perf_counter() - start:.1f} s")
        if real_home is None:
            os.environ.pop("SEARCH_R1_HOME")
        else:
            os.environ["SEARCH_R1_HOME"] = real_home

    models.resolve_model_path(args.model)  # build the cache outside the timed load
    start = time.perf_counter()
    model, tok = models.load_model_and_tokenizer(args.model)
    print(f"cached load ({args.model}): {time.perf_counter() - start:.2f} s")

    gen = HFGenerator(model, tok, eos_token_ids=[])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print(f"{'threads':>7} {'batch':>5} {'seconds':>8} {'tokens/s':>9} {'tok/cpu-s':>9}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch_sizes:
            prompts = [apply_chat_template(tok, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                       for i in range(batch)]
            gen.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=1.0, seed=0))  # warm-up
            start, cpu_start = time.perf_counter(), time.process_time()
            outs = gen.generate(prompts, params)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            tokens = sum(len(o.token_ids) for o in outs)
            print(f"{threads:>7} {batch:>5} {seconds:>8.2f} {tokens / seconds:>9.1f} {tokens / cpu:>9.1f}")


if __name__ == "__main__":
    main()
