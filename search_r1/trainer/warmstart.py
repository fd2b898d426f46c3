"""Supervised format warm-start: teach a small policy a response format before GRPO.

Why: GRPO learns only from reward differences inside a group. SmolLM2-135M-Instruct never writes
`<search>`/`<answer>` on its own (measured: 0 valid actions over the whole demo), so every reward
is -1, every advantage is 0 and RL has nothing to follow. Upstream Search-R1 started from 3B+
models that already follow the instruction. A few dozen supervised steps on demonstrations of the
protocol give the small model the format; GRPO then has reward variance to work with.

Demonstrations come from training questions only (the test split is never touched), in one of three
formats, one per arm of the learning experiment (`warmstart.format`), so every arm gets a warm-start
of the same size and recipe in its own format:

  search (the Search-R1 protocol; `tags` or `tool_call` actions):
    single-hop:  <think> Look up {subject}. </think>\n<search> {question} </search>     <- policy
                 \n\n<information>{real retrieved passages}</information>\n\n        <- environment
                 <think> The passages give the answer. </think>\n<answer> {gold} </answer><|im_end|>
    two-hop:     <think> Two steps: first look up {subject}. </think>\n<search> {question} </search>, the
                 passages; then, from the passages naming the bridge entity,
                 <think> Now look up {bridge}. </think>\n<search> {follow-up question} </search>
                 \n\n<information>...</information>\n\n, then the answer turn
  no_search:   the eval's no-search prompt -> <think> I answer from what I know. </think>\n<answer> {gold} </answer>
  rag:         the eval's RAG prompt (passages retrieved with the question) ->
               <think> The documents give the answer. </think>\n<answer> {gold} </answer>

`warmstart.two_hop_share` of the demonstrations are two-hop questions (the search format then needs
`rollout.max_turns >= 2`). Searches run through the run's real retriever, and the observation ids come
from the rollout's own `ObservationEncoder` with the rollout's `max_obs_length` budget, so the text
the model is trained on is token for token what it reads at rollout time. A search demonstration is
kept only when what it needs is visible in the (possibly shortened) observation: the gold answer in
the last one and, on two-hop questions, the bridge entity in the first; so the model learns to read
evidence rather than to memorise answers. Every policy turn must fit `rollout.max_tokens_per_turn`.
With `protocol="tool_call"` a search is a `<tool_call>` in the JSON form the row's prompt shows
(`{"action": "web_search", "action_input": {...}}` when the prompt asks for that, e.g.
`search_r1.agents.toolcall`'s; `{"name": "search", ...}` otherwise) and observations are
`<tool_response>` blocks.

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

from search_r1.dtypes import machine_description
from search_r1.protocol import mentions_any

log = logging.getLogger("search_r1.trainer.warmstart")

META_FILE = "warmstart.json"
FORMAT_VERSION = 2
MICRO_BATCH = 2  # rows per forward/backward: ~0.8 GB of activations each for SmolLM2 at ~300 tokens
FORMATS = ("search", "no_search", "rag")
LR_SCHEDULES = ("constant", "linear")
BATCHINGS = ("shuffled", "stratified")
THINK_FIRST = "<think> Look up {subject}. </think>\n"
# A two-hop plan is stated in the first thought, where the question's wording decides it, so the second
# turn conditions on the model's own words rather than on a distant question (measured on dev: with
# the single-hop first thought for both kinds, the warm-started model searched twice on 18 of 19
# single-hop questions).
THINK_FIRST_TWO_HOP = "<think> Two steps: first look up {subject}. </think>\n"
THINK_BRIDGE = "<think> Now look up {bridge}. </think>\n"
THINK_ANSWER = {"search": "<think> The passages give the answer. </think>\n",
                "no_search": "<think> I answer from what I know. </think>\n",
                "rag": "<think> The documents give the answer. </think>\n"}
# the no_search answer under the run's own search prompt (warmstart.no_search_share)
THINK_ANSWER["memory"] = THINK_ANSWER["no_search"]
ANSWER = "<answer> {answer} </answer>"


def search_action(query: str, protocol: str, prompt_text: str = "") -> str:
    """The policy's search action for `query` under `protocol` (what `protocol.parse_action` reads);
    a tool call takes the JSON form the prompt shows: `{"action": "web_search", "action_input": {...}}`
    when it asks for that (search_r1.agents.toolcall's prompt), else `{"name": "search", ...}`."""
    if protocol != "tool_call":
        return f"<search> {query} </search>"
    if '"action": "web_search"' in prompt_text:
        call = {"action": "web_search", "action_input": {"query": query}}
    else:
        call = {"name": "search", "arguments": {"query": query}}
    return "<tool_call>" + json.dumps(call, ensure_ascii=False) + "</tool_call>"


@dataclass(frozen=True)
class Demo:
    """One tokenized demonstration.

    input_ids: prompt (chat template) + response ids; loss_mask: 1 on policy-written response tokens
    (every policy turn and the final EOS), 0 on prompt and observation tokens; same length as input_ids.
    """

    question: str
    golden_answers: tuple[str, ...]
    response_text: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    prompt_length: int
    hops: int = 1


def _train_rows(train_files) -> list[dict]:
    """Train rows: question, gold answers, hops, subject, bridge, follow-up question, prompt messages.

    Rows without `extra_info.hops` count as single-hop when their data_source is synth_nq (or absent);
    two-hop rows need the bridge and follow-up question the synthetic world records.
    """
    import pandas as pd

    rows = []
    for f in train_files:
        df = pd.read_parquet(f)
        for rec in df.to_dict("records"):
            extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
            hops = extra.get("hops")
            if hops is None:
                if rec.get("data_source") not in (None, "synth_nq"):
                    continue
                hops = 1
            gold = [str(a) for a in rec["reward_model"]["ground_truth"]["target"]]
            question = rec.get("question") or ""
            if not question or not gold or int(hops) not in (1, 2):
                continue
            if int(hops) == 2 and not (extra.get("bridge") and extra.get("follow_up")):
                continue
            rows.append({"question": question, "golden_answers": gold, "hops": int(hops),
                         "subject": extra.get("subject") or question, "bridge": extra.get("bridge") or "",
                         "follow_up": extra.get("follow_up") or "", "messages": [dict(m) for m in rec["prompt"]]})
    return rows


class _DemoWriter:
    """Tokenizes demonstrations of one format: policy turns (mask 1) between observations (mask 0)."""

    def __init__(self, tokenizer, search_engine, protocol: str, fmt: str, max_obs_length: int,
                 max_tokens_per_turn: int):
        from search_r1.protocol import ObservationEncoder

        self.tok, self.engine, self.protocol, self.fmt = tokenizer, search_engine, protocol, fmt
        self.max_obs, self.max_turn = max_obs_length, max_tokens_per_turn
        self.encoder = ObservationEncoder(tokenizer, protocol)
        self.stats = {"too_long": 0, "gold_not_retrieved": 0, "bridge_not_retrieved": 0}

    def observe(self, queries: list[str]) -> list[tuple[list[int] | None, str]]:
        """(observation ids, their text) of one search per query, exactly as the rollout builds them."""
        from search_r1.protocol import decode_ids

        passages = self.engine.batch_search(queries)
        obs = self.encoder.encode(["search"] * len(queries), passages, [self.max_obs] * len(queries))
        return list(zip(obs, decode_ids(self.tok, [o or [] for o in obs])))

    def prompts(self, rows: list[dict]) -> list[list[int]]:
        from search_r1.prompts import apply_chat_template, baseline_messages, rag_documents

        if self.fmt in ("search", "memory"):
            return [apply_chat_template(self.tok, r["messages"]) for r in rows]
        docs = [None] * len(rows)
        if self.fmt == "rag":  # the eval's RAG context: the question's passages, the observation budget
            docs = rag_documents(self.tok, self.engine.batch_search([r["question"] for r in rows]), self.max_obs)
        return [apply_chat_template(self.tok, baseline_messages(r["question"], d)) for r, d in zip(rows, docs)]

    def write(self, rows: list[dict]) -> list["Demo"]:
        """Demonstrations of `rows` (one search per hop for the search format); unqualified rows are
        counted in `stats` and skipped."""
        from search_r1.protocol import decode_ids, encode_texts

        final = THINK_ANSWER[self.fmt] + ANSWER
        # parts[i]: alternating policy texts (str) and observations ((ids, text)), policy first and last
        parts: list[list] = [[] for _ in rows]
        if self.fmt == "search":
            first = self.observe([r["question"] for r in rows])
            second_rows = [i for i, r in enumerate(rows) if r["hops"] == 2]
            second = dict(zip(second_rows, self.observe([rows[i]["follow_up"] for i in second_rows])))
            for i, r in enumerate(rows):
                think = THINK_FIRST_TWO_HOP if r["hops"] == 2 else THINK_FIRST
                shown = " ".join(str(m.get("content", "")) for m in r["messages"])
                parts[i] = [think.format(subject=r["subject"]) + search_action(r["question"], self.protocol, shown),
                            first[i]]
                if r["hops"] == 2:
                    parts[i] += [THINK_BRIDGE.format(bridge=r["bridge"]) + search_action(r["follow_up"], self.protocol, shown),
                                 second[i]]
        demos = []
        for r, p, prompt in zip(rows, parts, self.prompts(rows)):
            p = p + [final.format(answer=r["golden_answers"][0])]
            if not self._grounded(r, p):
                continue
            turns = iter(encode_texts(self.tok, [x for x in p if isinstance(x, str)]))
            response, mask, longest = [], [], 0
            for x in p:
                ids, m = (next(turns), 1) if isinstance(x, str) else (list(x[0]), 0)
                longest = max(longest, len(ids) * m)
                response += ids
                mask += [m] * len(ids)
            if longest > self.max_turn or len(ids) + 1 > self.max_turn:  # the last turn also ends in EOS
                self.stats["too_long"] += 1
                continue
            response.append(self.tok.eos_token_id)
            mask.append(1)
            demos.append(Demo(r["question"], tuple(r["golden_answers"]), decode_ids(self.tok, [response])[0],
                              tuple(prompt + response), tuple([0] * len(prompt) + mask), len(prompt), r["hops"]))
        return demos

    def _grounded(self, row: dict, parts: list) -> bool:
        """A search demonstration shows its evidence: the bridge in the first observation (two-hop)
        and the gold answer in the last; an observation that did not fit (None) disqualifies it."""
        observations = [x for x in parts if not isinstance(x, str)]
        if any(ids is None for ids, _ in observations):
            self.stats["too_long"] += 1
            return False
        if observations and row["hops"] == 2 and not mentions_any(observations[0][1], [row["bridge"]]):
            self.stats["bridge_not_retrieved"] += 1
            return False
        if observations and not mentions_any(observations[-1][1], row["golden_answers"]):
            self.stats["gold_not_retrieved"] += 1
            return False
        return True


def build_demos(tokenizer, search_engine, train_files, n_examples: int, seed: int, max_obs_length: int,
                max_tokens_per_turn: int, protocol: str = "tags", fmt: str = "search",
                two_hop_share: float = 0.0, no_search_share: float = 0.0) -> list[Demo]:
    """Up to `n_examples` demonstrations in format `fmt` (see the module docstring), of which
    round(two_hop_share * n_examples) two-hop; deterministic for a seed. The list interleaves the kinds
    in the order drawn.

    no_search_share (search format only): that share of the demonstrations are single-hop questions
    under the same search prompt answered without a search, from memory (the no_search format's
    answer). A model warm-started so searches on some questions only; GRPO can then learn from the
    reward that searching pays (the demo's recipe). Drawn from the other end of the shuffled
    single-hop pool, so no question is taught both ways.

    Raises ValueError naming the fix when none qualify (no usable rows, turns longer than the
    per-turn cap, or the retriever never shows the evidence), or for an unknown format or protocol.
    """
    from search_r1.protocol import check_protocol

    check_protocol(protocol)
    if fmt not in FORMATS:
        raise ValueError(f"warmstart.format={fmt!r} is invalid: allowed {list(FORMATS)}. Fix: set warmstart.format")
    for name, share in (("two_hop_share", two_hop_share), ("no_search_share", no_search_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"warmstart.{name}={share!r} is invalid: allowed a number in [0, 1]")
    if no_search_share and fmt != "search":
        raise ValueError(f"warmstart.no_search_share={no_search_share} needs warmstart.format=search (got "
                         f"{fmt!r}). Fix: set warmstart.no_search_share=0")
    if two_hop_share + no_search_share > 1.0:
        raise ValueError(f"warmstart.two_hop_share + warmstart.no_search_share = {two_hop_share + no_search_share} "
                         f"> 1. Fix: lower one of them")
    rows = _train_rows(train_files)
    n_two = round(two_hop_share * n_examples)
    n_memory = round(no_search_share * n_examples)
    # (format, hops) -> demonstrations wanted
    quota = {(fmt, 1): n_examples - n_two - n_memory, (fmt, 2): n_two, ("memory", 1): n_memory}
    pools = {h: [r for r in rows if r["hops"] == h] for h in (1, 2)}
    missing = [f"{'single' if h == 1 else 'two'}-hop" for h in (1, 2)
               if any(q and k[1] == h for k, q in quota.items()) and not pools[h]]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} rows in {list(map(str, train_files))} to build warm-start "
                         f"demonstrations from (two-hop rows need extra_info.bridge and follow_up, which the "
                         f"synthetic world writes). Fix: use the synthetic world's train.parquet, set "
                         f"warmstart.two_hop_share=0, or set warmstart.enabled=false")
    rng = random.Random(seed)
    for h in (1, 2):
        rng.shuffle(pools[h])
    pool_of = {(fmt, 1): pools[1], (fmt, 2): pools[2], ("memory", 1): pools[1][::-1]}
    writers = {f: _DemoWriter(tokenizer, search_engine, protocol, f, max_obs_length, max_tokens_per_turn)
               for f in {fmt, "memory"}}
    drawn = dict.fromkeys(quota, 0)
    demos: list[Demo] = []
    chunk = max(8, 2 * n_examples)
    for start in range(0, max(map(len, pools.values())), chunk):
        for kind, want in quota.items():
            rows_now = pool_of[kind][start:start + chunk]
            if want > drawn[kind] and rows_now:
                new = writers[kind[0]].write(rows_now)[:want - drawn[kind]]
                demos += new
                drawn[kind] += len(new)
        if all(drawn[k] >= q for k, q in quota.items()):
            break
    stats = writers[fmt].stats
    if not demos:
        raise ValueError(f"no warm-start demonstration qualified ({stats}). Fix: raise "
                         f"rollout.max_tokens_per_turn (turns must fit) or rollout.max_obs_length / "
                         f"retriever.topk (the evidence must be in the observation), or set "
                         f"warmstart.enabled=false")
    # one order for every kind, so a batch mixes them
    random.Random(seed + 1).shuffle(demos)
    log.info("warm-start demonstrations (%s): %d single-hop, %d two-hop, %d from memory kept, skipped %s", fmt,
             drawn[(fmt, 1)], drawn[(fmt, 2)], drawn[("memory", 1)], stats)
    return demos


def _batches(demos: list[Demo], batch_size: int, steps: int, seed: int, batching: str = "shuffled"):
    """`steps` batches cycling through shuffled epochs of the demonstrations.

    batching="stratified" (with both kinds present): every batch holds the same number of two-hop
    demonstrations, round(batch_size * their share), each kind cycling through its own shuffled
    epochs. Why: the first thought's one-or-two-search plan is one token per demonstration, so batches
    that happen to hold mostly one kind move the model's bias toward it; measured on dev with shuffled
    batches, the 12-step warm-start preferred the two-hop plan on 100% of single-hop questions and the
    24-step one the single-hop plan on 89% of two-hop ones, though both ranked the kinds apart
    (AUC 0.82-0.85).
    """
    if batching not in BATCHINGS:
        raise ValueError(f"warmstart.batching={batching!r} is invalid: allowed {list(BATCHINGS)}")
    rng = random.Random(seed)
    kinds = {h: [i for i, d in enumerate(demos) if d.hops == h] for h in (1, 2)}
    if batching == "shuffled" or not (kinds[1] and kinds[2]):
        kinds = {0: list(range(len(demos)))}
        quota = {0: batch_size}
    else:
        n_two = min(batch_size - 1, max(1, round(batch_size * len(kinds[2]) / len(demos))))
        quota = {1: batch_size - n_two, 2: n_two}
    orders: dict[int, list[int]] = {h: [] for h in kinds}
    for _ in range(steps):
        batch = []
        for h, pool in kinds.items():
            while len(orders[h]) < quota[h]:
                epoch = list(pool)
                rng.shuffle(epoch)
                orders[h] += epoch
            batch += orders[h][:quota[h]]
            del orders[h][:quota[h]]
        if len(kinds) > 1:
            rng.shuffle(batch)
        yield [demos[i] for i in batch]


def token_weights(demo: Demo, plan_weight: float = 1.0) -> list[float]:
    """Loss weight per position of `demo`: its loss_mask, with the first round's policy tokens (the
    plan, "<think> Look up ..." or "<think> Two steps: ...", and the first query: the first run of 1s)
    times plan_weight. Why: whether a demonstration searches once or twice is decided in a token or two
    of its first round, diluted among every supervised token of a token mean."""
    weights = [float(m) for m in demo.loss_mask]
    if plan_weight != 1.0 and 1 in demo.loss_mask:
        t = demo.loss_mask.index(1)
        while t < len(weights) and demo.loss_mask[t]:
            weights[t] *= plan_weight
            t += 1
    return weights


def collate(demos: list[Demo], pad_id: int, plan_weight: float = 1.0):
    """Right-padded (input_ids, attention_mask, loss weights) tensors of shape (B, T); the weights are
    `token_weights` (the loss_mask itself at plan_weight=1)."""
    import torch

    width = max(len(d.input_ids) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(demos), width), dtype=torch.long)
    mask = torch.zeros((len(demos), width), dtype=torch.float32)
    for i, d in enumerate(demos):
        n = len(d.input_ids)
        ids[i, :n] = torch.tensor(d.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(token_weights(d, plan_weight), dtype=torch.float32)
    return ids, attn, mask


def masked_sft_loss(model, ids, attn, mask):
    """Weighted token-mean CE over masked tokens: sum_t m_t * -log p(x_t | x_<t) / sum_t m_t.

    ids, attn, mask: (B, T); the mask (0/1, or `token_weights`) is on the target positions (token t is
    predicted at t-1). Only the masked positions go through the LM head (prompt and observation logits
    are never built: a (B, T, vocab) fp32 tensor is most of the memory of a full forward).
    """
    import torch.nn.functional as F

    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, T, H)
    weights = mask[:, 1:]
    sel = weights > 0
    logits = model.get_output_embeddings()(hidden[:, :-1][sel]).float()  # (N, vocab)
    nll = F.cross_entropy(logits, ids[:, 1:][sel], reduction="none")  # (N,)
    w = weights[sel].to(nll.dtype)
    return (w * nll).sum() / w.sum()


def supervised_tokens(demos: list[Demo], plan_weight: float = 1.0) -> float:
    """Total weight of the target positions the SFT loss averages over (the weights shifted by one):
    their number at plan_weight=1."""
    return sum(sum(token_weights(d, plan_weight)[1:]) for d in demos)


def token_mean_sft_backward(model, parts: list[list[Demo]], pad_id: int, total_tokens: float,
                            scale: float = 1.0, autocast=contextlib.nullcontext,
                            plan_weight: float = 1.0) -> float:
    """Backpropagate scale * L in micro-batches (grads accumulate), where

        L = sum_parts (n_part / total_tokens) * masked_sft_loss(part),
        n_part = supervised_tokens(part, plan_weight)

    i.e. the (weighted) token-mean NLL over every supervised token when total_tokens counts them all
    (supervised_tokens(batch, plan_weight)). Splitting a batch into parts bounds activation memory; a
    data-parallel rank passes only its own parts and the global count, so the all-reduced gradient is
    the whole batch's. `autocast` is a context factory. plan_weight: `token_weights`.
    Returns L (unscaled) as a float.
    """
    total = total_tokens if total_tokens > 0 else 1.0  # no supervised token: nothing to divide
    value = 0.0
    for part in parts:
        ids, attn, mask = collate(part, pad_id, plan_weight)
        n_part = float(mask[:, 1:].sum())  # supervised_tokens(part, plan_weight), off the collated weights
        with autocast():
            loss = masked_sft_loss(model, ids, attn, mask) * (n_part / total)
        (scale * loss).backward()
        value += float(loss.detach())
    return value


def lr_at(step: int, steps: int, lr: float, schedule: str) -> float:
    """Learning rate of optimizer step `step` (0-based) of `steps`: constant, or linear decay
    lr * (steps - step) / steps (the last step still moves: lr / steps)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"warmstart.lr_schedule={schedule!r} is invalid: allowed {list(LR_SCHEDULES)}")
    return lr if schedule == "constant" else lr * (steps - step) / steps


def train(model, demos: list[Demo], pad_id: int, steps: int, batch_size: int, lr: float, seed: int,
          compute_dtype: str = "bfloat16", progress: bool = True, lr_schedule: str = "constant",
          batching: str = "shuffled") -> list[float]:
    """Masked SFT in place; returns the loss per step."""
    import torch

    lr_at(0, steps, lr, lr_schedule)  # a bad schedule fails before any work
    torch.manual_seed(seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    autocast = ((lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if compute_dtype == "bfloat16"
                else contextlib.nullcontext)
    losses = []
    it = _batches(demos, batch_size, steps, seed, batching)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=steps, desc="warm-start SFT", mininterval=5)
    for step, batch in enumerate(it):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, lr_schedule)
        opt.zero_grad(set_to_none=True)
        parts = [batch[i:i + MICRO_BATCH] for i in range(0, len(batch), MICRO_BATCH)]
        with autocast():  # held over the parts: autocast casts each weight to bf16 once per step, not per part
            step_loss = token_mean_sft_backward(model, parts, pad_id, supervised_tokens(batch), autocast=autocast)
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


def other_machine_note(meta: dict) -> str:
    """A note when a cached warm-start was trained on another CPU kind (or an older cache that did not
    record one). The machine is not part of the cache key: the same settings are the same recipe, and a
    cache copied between machines stays usable. But SFT in bf16 on another CPU kind is another run (the
    same recipe gave dev EM 0.641 on an AMD EPYC and 0.734 on an Intel Xeon), so results say which."""
    here = machine_description()
    built = meta.get("machine")
    if built is None:
        return f"this warm-start does not record the machine it was trained on (this one: {here})"
    if built != here:
        return (f"this warm-start was trained on another machine ({built}; this one: {here}); bf16 SFT on "
                f"another CPU kind gives another model, so report where it was trained")
    return ""


def is_complete(directory: Path) -> bool:
    try:
        return json.loads((directory / META_FILE).read_text()).get("format_version") == FORMAT_VERSION
    except (OSError, ValueError):
        return False


def reused(target: Path, label: str) -> dict | None:
    """The meta of the complete warm-start at `target` (saying it is reused), or None to build it."""
    if not is_complete(target):
        return None
    meta = json.loads((target / META_FILE).read_text())
    print(f"[{label}] reusing {target} (loss {meta['loss_first']:.3f} -> {meta['loss_last']:.3f})", flush=True)
    return meta


def train_and_save(model_name: str, tokenizer, demos: list[Demo], target: Path, meta: dict, *, threads: int,
                   label: str, **train_kwargs) -> dict:
    """Masked SFT of `model_name` (loaded in float32) on `demos` with `threads` torch threads (`train`'s
    `train_kwargs`), saved with its tokenizer and `meta` plus the losses, seconds, machine and torch
    version into `target`: written to a temp sibling and renamed into place, so a crash never leaves a
    directory that `is_complete` accepts. Processes that start together (a sweep, parallel test workers)
    take turns on a lock beside `target`: the first trains, the others reuse its result. Returns the
    meta written (or reused)."""
    import torch

    from search_r1.models import file_lock, load_model_and_tokenizer, release_memory

    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        done = reused(target, label)  # another process finished it while this one waited
        if done is not None:
            return done
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            model, _ = load_model_and_tokenizer(model_name, dtype=torch.float32)
            losses = train(model, demos, tokenizer.pad_token_id, **train_kwargs)
            meta = {**meta, "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
                    "seconds": round(time.perf_counter() - t0, 1), "machine": machine_description(),
                    "torch": torch.__version__}
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
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
        print(f"[{label}] loss {losses[0]:.3f} -> {losses[-1]:.3f} in {meta['seconds']} s; saved {target}", flush=True)
        return meta


def ensure_warmstart(model_name: str, search_engine, train_files, *, steps: int, batch_size: int, lr: float,
                     n_examples: int, seed: int, max_obs_length: int, max_tokens_per_turn: int,
                     protocol: str = "tags", fmt: str = "search", two_hop_share: float = 0.0,
                     no_search_share: float = 0.0, compute_dtype: str = "bfloat16", threads: int = 2, lr_schedule: str = "constant",
                     batching: str = "shuffled", cache_root: Path | None = None,
                     progress: bool = True) -> tuple[Path, dict]:
    """Path of the warm-started HF directory (built now or reused) and its meta dict."""
    from search_r1.models import load_tokenizer
    from search_r1.paths import home

    tokenizer = load_tokenizer(model_name)
    demos = build_demos(tokenizer, search_engine, train_files, n_examples, seed, max_obs_length,
                        max_tokens_per_turn, protocol, fmt, two_hop_share, no_search_share)
    settings = dict(steps=steps, batch_size=batch_size, lr=lr, seed=seed, compute_dtype=compute_dtype, format=fmt,
                    two_hop_share=two_hop_share)
    # Knobs added later enter the key only when set away from their default, so the warm-starts cached
    # before they existed (built exactly that way) keep their keys.
    if lr_schedule != "constant":
        settings["lr_schedule"] = lr_schedule
    if batching != "shuffled":
        settings["batching"] = batching
    if no_search_share:
        settings["no_search_share"] = no_search_share
    key = settings_key(model_name, demos, **settings)
    target = (Path(cache_root) if cache_root is not None else home() / "warmstart") / key
    meta = reused(target, "warmstart")
    if meta is not None:
        note = other_machine_note(meta)
        if note:
            print(f"[warmstart] {note}", flush=True)
        return target, meta
    print(f"[warmstart] SFT on {len(demos)} format demonstrations, {steps} steps x {batch_size}, "
          f"lr {lr} ({lr_schedule}), {batching} batches", flush=True)
    meta = {"format_version": FORMAT_VERSION, "base_model": model_name, "n_demos": len(demos),
            **settings, "lr_schedule": lr_schedule, "batching": batching, "no_search_share": no_search_share,
            "max_obs_length": max_obs_length, "max_tokens_per_turn": max_tokens_per_turn,
            "example": demos[0].response_text}
    meta = train_and_save(model_name, tokenizer, demos, target, meta, threads=threads, label="warmstart",
                          steps=steps, batch_size=batch_size, lr=lr, seed=seed, compute_dtype=compute_dtype,
                          progress=progress, lr_schedule=lr_schedule, batching=batching)
    return target, meta


def ensure_warmstart_with_url(model_name: str, url: str, topk: int, timeout: float, retries: int,
                              train_files, kwargs: dict) -> str:
    """`ensure_warmstart` with its own retriever client (the entry of a spawned child process)."""
    from search_r1.search import RetrieverClient

    client = RetrieverClient(url, topk=topk, timeout=timeout, retries=retries)
    return str(ensure_warmstart(model_name, client, train_files, **kwargs)[0])
