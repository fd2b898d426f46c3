"""Supervised format warm-start: teach a small policy the Search-R1 protocol before GRPO.

Why: GRPO learns only from reward differences inside a group. SmolLM2-135M-Instruct never writes
`<search>`/`<answer>` on its own (measured: 0 valid actions over the whole demo), so every reward
is -1, every advantage is 0 and RL has nothing to follow. Upstream Search-R1 started from 3B+
models that already follow the instruction. A few dozen supervised steps on demonstrations of the
protocol give the small model the format; GRPO then has reward variance to work with.

Demonstrations (single-hop train questions only, the test split is never touched):

    <think> Look up {subject}. </think>\n<search> {question} </search>      <- policy turn 1
    \n\n<information>{real retrieved passages}</information>\n\n           <- environment (masked)
    <think> The passages give the answer. </think>\n<answer> {gold} </answer><|im_end|>  <- turn 2

With `protocol="tool_call"` turn 1 is a tool call and the observation a `<tool_response>` block:

    <think> Look up {subject}. </think>\n<tool_call>{"name": "search", "arguments": {"query": "{question}"}}</tool_call>

in the JSON form the row's prompt shows (`{"action": "web_search", "action_input": {...}}` when the
prompt asks for that, e.g. `search_r1.agents.toolcall`'s; `{"name": "search", ...}` otherwise).

The search runs through the run's real retriever, and the observation ids come from the rollout's
own `ObservationEncoder` with the rollout's `max_obs_length` budget, so the text the model is
trained on is token for token what it reads at rollout time. A demonstration is kept only when the
gold answer is visible in that (possibly shortened) observation, so the model learns to copy from
evidence rather than to memorise answers; and only when each policy turn fits
`rollout.max_tokens_per_turn`.

Loss: token-mean cross entropy over the policy's tokens only (prompt and observation masked: the
info_mask idea of the RL update). AdamW, bf16 autocast optional, fixed seed.

Cache: the result is an HF directory (model + tokenizer) at
`search_r1.paths.home()/warmstart/<sha of settings + demonstration ids>`, written to a temp dir and
renamed into place, and reused by later runs with the same settings and data. The GRPO policy AND
the KL reference both load it (the standard choice: the reference is the RL initialisation, i.e.
the SFT model; a KL to the untuned model would pull the policy back to never using the tags).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("search_r1.trainer.warmstart")

META_FILE = "warmstart.json"
FORMAT_VERSION = 1
MICRO_BATCH = 2  # rows per forward/backward: ~0.8 GB of activations each for SmolLM2 at ~300 tokens
THINK_SEARCH = "<think> Look up {subject}. </think>\n<search> {query} </search>"
THINK_TOOL_CALL = "<think> Look up {subject}. </think>\n<tool_call>{call}</tool_call>"
THINK_ANSWER = "<think> The passages give the answer. </think>\n<answer> {answer} </answer>"


@dataclass(frozen=True)
class Demo:
    """One tokenized demonstration.

    input_ids: prompt (chat template) + response ids; loss_mask: 1 on policy-written response tokens
    (both turns and the final EOS), 0 on prompt and observation tokens; same length as input_ids.
    """

    question: str
    golden_answers: tuple[str, ...]
    response_text: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    prompt_length: int


def _train_rows(train_files, protocol: str) -> list[dict]:
    """Single-hop train rows: question, gold answers, subject, prompt messages."""
    import pandas as pd

    rows = []
    for f in train_files:
        df = pd.read_parquet(f)
        for rec in df.to_dict("records"):
            extra = rec.get("extra_info") or {}
            hops = extra.get("hops") if isinstance(extra, dict) else None
            if hops is not None and int(hops) != 1:
                continue
            if hops is None and rec.get("data_source") not in (None, "synth_nq"):
                continue
            gold = [str(a) for a in rec["reward_model"]["ground_truth"]["target"]]
            question = rec.get("question") or ""
            if not question or not gold:
                continue
            subject = (extra.get("subject") if isinstance(extra, dict) else None) or question
            rows.append({"question": question, "golden_answers": gold, "subject": subject,
                         "messages": [dict(m) for m in rec["prompt"]]})
    return rows


def build_demos(tokenizer, search_engine, train_files, n_examples: int, seed: int, max_obs_length: int,
                max_tokens_per_turn: int, protocol: str = "tags") -> list[Demo]:
    """Up to `n_examples` demonstrations (see the module docstring); deterministic for a seed.

    Raises ValueError when none qualify (no single-hop rows, turns longer than the per-turn cap, or
    the retriever never shows the gold answer) naming the fix.
    """
    from search_r1.prompts import apply_chat_template
    from search_r1.protocol import ObservationEncoder, decode_ids, encode_texts

    if protocol not in ("tags", "tool_call"):
        raise ValueError(f"warmstart demonstrations are written for data.protocol tags or tool_call, got "
                         f"{protocol!r}. Fix: set data.protocol, or warmstart.enabled=false")
    rows = _train_rows(train_files, protocol)
    if not rows:
        raise ValueError(f"no single-hop rows in {list(map(str, train_files))} to build warm-start "
                         f"demonstrations from. Fix: use the synthetic world's train.parquet or set "
                         f"warmstart.enabled=false")
    random.Random(seed).shuffle(rows)
    encoder = ObservationEncoder(tokenizer, protocol)
    eos = tokenizer.eos_token_id
    demos: list[Demo] = []
    stats = {"too_long": 0, "gold_not_retrieved": 0}
    chunk = max(8, 2 * n_examples)
    for start in range(0, len(rows), chunk):
        batch = rows[start:start + chunk]
        turn1 = [_search_turn(r, protocol) for r in batch]
        turn2 = [THINK_ANSWER.format(answer=r["golden_answers"][0]) for r in batch]
        ids1, ids2 = encode_texts(tokenizer, turn1), encode_texts(tokenizer, turn2)
        passages = search_engine.batch_search([r["question"] for r in batch])
        obs = encoder.encode(["search"] * len(batch), passages, [max_obs_length] * len(batch))
        obs_text = decode_ids(tokenizer, [o or [] for o in obs])
        for r, a, o, o_text, b in zip(batch, ids1, obs, obs_text, ids2):
            if len(a) > max_tokens_per_turn or len(b) + 1 > max_tokens_per_turn or o is None:
                stats["too_long"] += 1
                continue
            if not any(g.lower() in o_text.lower() for g in r["golden_answers"]):
                stats["gold_not_retrieved"] += 1
                continue
            prompt = apply_chat_template(tokenizer, r["messages"])
            response = list(a) + list(o) + list(b) + [eos]
            mask = [1] * len(a) + [0] * len(o) + [1] * (len(b) + 1)
            demos.append(Demo(r["question"], tuple(r["golden_answers"]),
                              decode_ids(tokenizer, [response])[0], tuple(prompt + response),
                              tuple([0] * len(prompt) + mask), len(prompt)))
            if len(demos) == n_examples:
                break
        if len(demos) == n_examples:
            break
    if not demos:
        raise ValueError(f"no warm-start demonstration qualified ({stats}). Fix: raise "
                         f"rollout.max_tokens_per_turn (turns must fit) or rollout.max_obs_length / "
                         f"retriever.topk (the gold answer must be in the observation), or set "
                         f"warmstart.enabled=false")
    log.info("warm-start demonstrations: %d kept, skipped %s", len(demos), stats)
    return demos


def _search_turn(row: dict, protocol: str) -> str:
    """The demonstration's first policy turn: a search for the question, in the protocol's syntax
    (for tool_call, in the JSON form the row's prompt shows)."""
    if protocol == "tags":
        return THINK_SEARCH.format(subject=row["subject"], query=row["question"])
    prompt = " ".join(m["content"] for m in row["messages"])
    if '"action": "web_search"' in prompt:
        call = {"action": "web_search", "action_input": {"query": row["question"]}}
    else:
        call = {"name": "search", "arguments": {"query": row["question"]}}
    return THINK_TOOL_CALL.format(subject=row["subject"], call=json.dumps(call, ensure_ascii=False))


def _batches(demos: list[Demo], batch_size: int, steps: int, seed: int):
    """`steps` batches cycling through shuffled epochs of the demonstrations."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            epoch = list(range(len(demos)))
            rng.shuffle(epoch)
            order += epoch
        yield [demos[i] for i in order[:batch_size]]
        del order[:batch_size]


def collate(demos: list[Demo], pad_id: int):
    """Right-padded (input_ids, attention_mask, loss_mask) tensors of shape (B, T)."""
    import torch

    width = max(len(d.input_ids) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(demos), width), dtype=torch.long)
    mask = torch.zeros((len(demos), width), dtype=torch.float32)
    for i, d in enumerate(demos):
        n = len(d.input_ids)
        ids[i, :n] = torch.tensor(d.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(d.loss_mask, dtype=torch.float32)
    return ids, attn, mask


def masked_sft_loss(model, ids, attn, mask):
    """Token-mean CE over masked tokens: sum_t m_t * -log p(x_t | x_<t) / sum_t m_t.

    ids, attn, mask: (B, T); the mask is on the target positions (token t is predicted at t-1).
    Only the masked positions go through the LM head (prompt and observation logits are never
    built: a (B, T, vocab) fp32 tensor is most of the memory of a full forward).
    """
    import torch.nn.functional as F

    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, T, H)
    sel = mask[:, 1:].bool()
    logits = model.get_output_embeddings()(hidden[:, :-1][sel]).float()  # (N, vocab)
    return F.cross_entropy(logits, ids[:, 1:][sel], reduction="mean")


def train(model, demos: list[Demo], pad_id: int, steps: int, batch_size: int, lr: float, seed: int,
          compute_dtype: str = "bfloat16", progress: bool = True) -> list[float]:
    """Masked SFT in place; returns the loss per step."""
    import torch

    torch.manual_seed(seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if compute_dtype == "bfloat16"
                else contextlib.nullcontext())
    losses = []
    it = _batches(demos, batch_size, steps, seed)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=steps, desc="warm-start SFT", mininterval=5)
    for batch in it:
        # Micro-batches of MICRO_BATCH rows (activation memory), each weighted by its share of the
        # batch's supervised tokens, so the gradient is the token mean over the whole batch.
        total = sum(sum(d.loss_mask[1:]) for d in batch)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for i in range(0, len(batch), MICRO_BATCH):
            part = batch[i:i + MICRO_BATCH]
            ids, attn, mask = collate(part, pad_id)
            weight = sum(sum(d.loss_mask[1:]) for d in part) / total
            with autocast:
                loss = masked_sft_loss(model, ids, attn, mask) * weight
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(step_loss)
    model.eval()
    del opt
    return losses


def settings_key(model_name: str, demos: list[Demo], **settings) -> str:
    """Hash of the base model, the training settings and the exact demonstration ids."""
    from search_r1.models import resolve_model_path

    h = hashlib.sha256()
    h.update(json.dumps({"v": FORMAT_VERSION, "model": str(resolve_model_path(model_name)), **settings},
                        sort_keys=True).encode())
    for d in demos:
        h.update(json.dumps([d.input_ids, d.loss_mask]).encode())
    return h.hexdigest()[:16]


def is_complete(directory: Path) -> bool:
    try:
        return json.loads((directory / META_FILE).read_text()).get("format_version") == FORMAT_VERSION
    except (OSError, ValueError):
        return False


def ensure_warmstart(model_name: str, search_engine, train_files, *, steps: int, batch_size: int, lr: float,
                     n_examples: int, seed: int, max_obs_length: int, max_tokens_per_turn: int,
                     protocol: str = "tags", compute_dtype: str = "bfloat16", threads: int = 2,
                     cache_root: Path | None = None, progress: bool = True) -> tuple[Path, dict]:
    """Path of the warm-started HF directory (built now or reused) and its meta dict."""
    import torch

    from search_r1.models import load_model_and_tokenizer, load_tokenizer, release_memory
    from search_r1.paths import home

    tokenizer = load_tokenizer(model_name)
    demos = build_demos(tokenizer, search_engine, train_files, n_examples, seed, max_obs_length,
                        max_tokens_per_turn, protocol)
    settings = dict(steps=steps, batch_size=batch_size, lr=lr, seed=seed, compute_dtype=compute_dtype)
    key = settings_key(model_name, demos, **settings)
    root = Path(cache_root) if cache_root is not None else home() / "warmstart"
    target = root / key
    if is_complete(target):
        meta = json.loads((target / META_FILE).read_text())
        print(f"[warmstart] reusing {target} (loss {meta['loss_first']:.3f} -> {meta['loss_last']:.3f})", flush=True)
        return target, meta
    root.mkdir(parents=True, exist_ok=True)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        model, _ = load_model_and_tokenizer(model_name, dtype=torch.float32)
        print(f"[warmstart] SFT on {len(demos)} format demonstrations, {steps} steps x {batch_size}, "
              f"lr {lr}", flush=True)
        losses = train(model, demos, tokenizer.pad_token_id, steps, batch_size, lr, seed, compute_dtype, progress)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            meta = {"format_version": FORMAT_VERSION, "base_model": model_name, "n_demos": len(demos),
                    **settings, "max_obs_length": max_obs_length, "max_tokens_per_turn": max_tokens_per_turn,
                    "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
                    "seconds": round(time.perf_counter() - t0, 1), "example": demos[0].response_text}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
            if target.exists():  # stale or partial: replace
                shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        del model
    finally:
        torch.set_num_threads(threads_before)
        release_memory()
    print(f"[warmstart] loss {losses[0]:.3f} -> {losses[-1]:.3f} in {meta['seconds']} s; saved {target}", flush=True)
    return target, meta


def ensure_warmstart_with_url(model_name: str, url: str, topk: int, timeout: float, retries: int,
                              train_files, kwargs: dict) -> str:
    """`ensure_warmstart` with its own retriever client (the entry of a spawned child process)."""
    from search_r1.search import RetrieverClient

    client = RetrieverClient(url, topk=topk, timeout=timeout, retries=retries)
    return str(ensure_warmstart(model_name, client, train_files, **kwargs)[0])
