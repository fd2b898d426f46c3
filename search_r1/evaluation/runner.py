"""Greedy evaluation of a model on Search-R1 parquet files: `evaluate(EvalConfig) -> results dict`.

Three modes, the comparisons of the Search-R1 paper:
  search     the data's own prompt; the model searches (up to max_turns rounds) and answers;
  no_search  the direct-answer prompt (`prompts.NO_SEARCH_INSTRUCTION`), one round, no search;
  rag        one retrieval with the question, the passages put in the prompt
             (`prompts.RAG_INSTRUCTION`), one round, no search.
Every mode runs `LLMGenerationManager.run_llm_loop(is_validation=True)` (greedy) in batches and
scores with the training metric functions (`search_r1.scoring.score_response`).

Output directory: `predictions.jsonl` (one line per question, appended after every batch, so an
interrupted run resumes where it stopped: ids already there are skipped), `run_config.json` (the
settings the predictions belong to, and what they resolved to: the model's weights, tokenizer,
template, data and retriever, `evaluation.identity`; a resume with other settings, or after the
checkpoint behind --model changed, is refused) and `results.json` (metrics per data_source and
overall, the settings, timing).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from search_r1.dtypes import DTYPE_CHOICES, resolve_dtype
from search_r1.scoring import aggregate, score_response

log = logging.getLogger("search_r1.evaluation")

MODES = ("search", "no_search", "rag")
PREDICTIONS = "predictions.jsonl"
RESULTS = "results.json"
RUN_CONFIG = "run_config.json"
# Settings that change what a prediction is; a resumed run must match them.
RESUME_KEYS = ("model", "data", "mode", "base_url", "protocol", "topk", "max_turns", "max_start_length",
               "max_prompt_length", "max_response_length", "max_obs_length", "max_tokens_per_turn", "dtype")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation settings (the CLI flags of `python -m search_r1.evaluation`).

    model: alias, HF directory, a checkpoint (checkpoints/global_step_N, or a run directory: its
        latest checkpoint), or with base_url the model name the server serves.
    data: Search-R1 parquet files. out: output directory.
    mode: search | no_search | rag (see the module docstring).
    retriever_urls / retriever_index: the retriever (URLs of running servers, or an index directory
        served for this run on a free loopback port); needed by search and rag.
    base_url: an OpenAI-compatible server (`vllm serve`); tokenizer: its tokenizer (default: model).
    allow_insecure_http: send the API key over plain http to a non-loopback base_url.
    limit / limit_per_source: evaluate the first N questions (overall / per data_source) of a
        seeded shuffle (seed); None = all.
    batch_size: questions per run_llm_loop call. protocol: tags | tool_call | auto (from the prompt).
    The remaining numbers are the rollout's GenerationConfig (upstream Search-R1's defaults); the
    no_search and rag modes generate one round of max_tokens_per_turn * (max_turns + 1) tokens.
    """

    model: str
    data: tuple[str, ...]
    out: str
    mode: str = "search"
    retriever_urls: tuple[str, ...] = ()
    retriever_index: str | None = None
    base_url: str | None = None
    tokenizer: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    allow_insecure_http: bool = False
    name: str | None = None
    limit: int | None = None
    limit_per_source: int | None = None
    seed: int = 0
    batch_size: int = 16
    protocol: str = "auto"
    topk: int = 3
    max_turns: int = 2
    max_start_length: int = 2048
    max_prompt_length: int = 4096
    max_response_length: int = 500
    max_obs_length: int = 500
    max_tokens_per_turn: int | None = None
    dtype: str = "auto"
    threads: int | None = None
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown; choose one of {list(MODES)}")
        if not self.data:
            raise ValueError("no --data file; pass one or more Search-R1 parquet files")
        for key in ("limit", "limit_per_source"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.protocol not in ("auto", "tags", "tool_call"):
            raise ValueError(f"--protocol {self.protocol!r}; choose auto, tags or tool_call")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype {self.dtype!r}; choose one of {list(DTYPE_CHOICES)}")
        if self.retriever_urls and self.retriever_index:
            raise ValueError("pass either --retriever-url or --retriever-index, not both")

    def resume_view(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: d[k] for k in RESUME_KEYS}


@dataclass(frozen=True)
class Example:
    """One question to evaluate: id (the parquet `id` column, else "file:row"), its tokenized prompt."""

    id: str
    data_source: str
    question: str | None
    golden_answers: tuple[str, ...]
    record: object  # search_r1.data.dataset.PromptRecord


# -- model and data ----------------------------------------------------------------------------
def resolve_model_dir(model: str) -> str:
    """A checkpoint directory -> its HF `model/` subdirectory; a training run directory -> the HF
    directory of its latest complete checkpoint; anything else unchanged (alias, HF dir, GGUF)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return model
    # A run directory holds the trainer's own config.json too, so look for checkpoints first.
    if (path / "model" / "config.json").is_file():
        return str(path / "model")
    if (path / "checkpoints").is_dir():
        from search_r1.trainer.checkpoint import CheckpointManager

        latest = CheckpointManager(path / "checkpoints", keep_last=None).latest()
        if latest is None:
            raise ValueError(f"{path} is a training run directory without a complete checkpoint; pass "
                             f"a checkpoint (checkpoints/global_step_N) or an HF model directory")
        return str(Path(latest) / "model")
    if (path / "config.json").is_file():
        return model
    raise ValueError(f"{path} is neither an HF model directory (config.json), a checkpoint "
                     f"(model/config.json) nor a training run directory (checkpoints/)")


# EvalConfig field -> (section, key) of the trainer config a checkpoint records.
ROLLOUT_FROM_CHECKPOINT = {
    "max_turns": ("rollout", "max_turns"), "max_start_length": ("rollout", "max_start_length"),
    "max_prompt_length": ("rollout", "max_prompt_length"), "max_response_length": ("rollout", "max_response_length"),
    "max_obs_length": ("rollout", "max_obs_length"), "max_tokens_per_turn": ("rollout", "max_tokens_per_turn"),
    "topk": ("retriever", "topk"), "protocol": ("data", "protocol"),
}


def checkpoint_rollout_settings(model: str) -> dict:
    """The rollout limits a checkpoint of ours was trained with (EvalConfig field names), or {}.

    Read from `trainer_state.json` next to the checkpoint's `model/` directory (the trainer stores
    its whole config there), so a checkpoint is evaluated with the limits it learned under.
    """
    try:
        model_dir = Path(resolve_model_dir(model))
    except ValueError:
        return {}
    state = model_dir.parent / "trainer_state.json"
    if model_dir.name != "model" or not state.is_file():
        return {}
    config = json.loads(state.read_text()).get("extra_state", {}).get("config")
    if not isinstance(config, dict):
        return {}
    out = {}
    for field_name, (section, key) in ROLLOUT_FROM_CHECKPOINT.items():
        value = (config.get(section) or {}).get(key)
        if value is not None:
            out[field_name] = value
    return out


def _question_id(path, file_index: int, row: int, ids: list[str] | None, seen: set[str]) -> str:
    """The parquet `id` of a row (else "file:row"), made unique across the files of one run."""
    qid = ids[row] if ids is not None else f"{Path(path).stem}:{row}"
    if qid in seen:  # the same id in two files (e.g. the same test set twice): keep them apart
        qid = f"{Path(path).name}#{file_index}:{qid}"
    seen.add(qid)
    return qid


def _id_column(path) -> list[str] | None:
    import pandas as pd
    import pyarrow.parquet as pq

    has_id = "id" in pq.read_schema(path).names
    return pd.read_parquet(path, columns=["id"])["id"].astype(str).tolist() if has_id else None


def load_examples(cfg: EvalConfig, tokenizer) -> list[Example]:
    """Every row of every data file (prompts longer than max_start_length dropped with a warning)."""
    from search_r1.data.dataset import PromptDataset

    protocol = "tags" if cfg.protocol == "auto" else cfg.protocol
    examples: list[Example] = []
    seen: set[str] = set()
    for i, path in enumerate(cfg.data):
        ds = PromptDataset([path], tokenizer, cfg.max_start_length, protocol=protocol, on_overlong="skip")
        ids = _id_column(path)
        for rec in ds.records:
            qid = _question_id(path, i, int(rec.uid.rsplit(":", 1)[1]), ids, seen)
            examples.append(Example(qid, rec.data_source, rec.question, rec.golden_answers, rec))
    return examples


def load_questions(data) -> list[Example]:
    """The questions of Search-R1 parquet files without tokenizing their prompts (agents build their
    own): same ids, sources and gold answers as `load_examples`; `record` is None. Rows whose
    question cannot be recovered (no `question` column, no "Question: ..." in the prompt) raise."""
    from search_r1.data.rows import parse_messages, parse_targets, read_frame, recover_question

    examples: list[Example] = []
    seen: set[str] = set()
    for i, path in enumerate(data):
        if not Path(path).is_file():
            raise FileNotFoundError(f"--data {path}: no such file (a Search-R1 parquet file)")
        ids = _id_column(path)
        for row, rec in enumerate(read_frame(Path(path)).to_dict("records")):
            question = recover_question(rec, parse_messages(rec["prompt"], Path(path), row))
            if not question:
                raise ValueError(f"{path} row {row}: no question text (no `question` column and no "
                                 "'Question: ...' in the prompt); agents need the question itself")
            examples.append(Example(_question_id(path, i, row, ids, seen), str(rec["data_source"]),
                                    question, tuple(parse_targets(rec["reward_model"], Path(path), row)), None))
    return examples


def select_examples(examples: list[Example], limit: int | None, limit_per_source: int | None,
                    seed: int) -> list[Example]:
    """The evaluated subset: a seeded shuffle, then the first `limit_per_source` of each source and
    the first `limit` overall. A larger limit with the same seed extends a smaller one (resume)."""
    if limit is None and limit_per_source is None:
        return examples
    order = list(examples)
    random.Random(seed).shuffle(order)
    if limit_per_source is not None:
        taken: dict[str, int] = {}
        kept = []
        for ex in order:
            if taken.get(ex.data_source, 0) < limit_per_source:
                taken[ex.data_source] = taken.get(ex.data_source, 0) + 1
                kept.append(ex)
        order = kept
    return order[:limit] if limit is not None else order


def detect_protocol(tokenizer, examples: list[Example]) -> str:
    """tool_call if the first prompt asks for <tool_call> JSON, else tags."""
    if not examples:
        return "tags"
    text = tokenizer.decode(list(examples[0].record.input_ids))
    return "tool_call" if "<tool_call>" in text else "tags"


# -- predictions file --------------------------------------------------------------------------
def read_predictions(path: Path) -> dict[str, dict]:
    """id -> record of every complete line (a line cut by a crash is ignored and rewritten)."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[rec["id"]] = rec
    return done


def _changes(saved, now, key: str = "") -> dict:
    """Dotted key -> (saved, now) for every leaf that differs (hashes shortened for the message)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out = {}
        for k in dict.fromkeys([*saved, *now]):
            out.update(_changes(saved.get(k), now.get(k), f"{key}.{k}" if key else str(k)))
        return out
    if saved == now:
        return {}
    short = [v[:12] if isinstance(v, str) and len(v) == 64 and key.endswith("sha256") else v for v in (saved, now)]
    return {key: tuple(short)}


def prepare_out_dir(cfg, identity: dict | None = None) -> dict[str, dict]:
    """Create the output dir `cfg.out`; return the predictions to reuse, after checking they were made
    with the same `cfg.resume_view()` and, when given, the same resolved model, tokenizer, template,
    data and retriever (`identity`, see evaluation.identity). `cfg.overwrite` discards them. Any config
    with `out`, `overwrite` and `resume_view()` (EvalConfig, the agents' configs) works."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    preds, run_cfg = out / PREDICTIONS, out / RUN_CONFIG
    if cfg.overwrite:
        preds.unlink(missing_ok=True)
        (out / RESULTS).unlink(missing_ok=True)
    done = read_predictions(preds)
    view = cfg.resume_view() if identity is None else {**cfg.resume_view(), "resolved": identity}
    mine = json.loads(json.dumps(view))  # tuples -> lists, as saved
    if done:
        saved = json.loads(run_cfg.read_text()) if run_cfg.is_file() else {}
        diff = _changes({k: saved.get(k) for k in mine}, mine)
        if diff:
            raise ValueError(f"{out} holds predictions made with other settings or another model, tokenizer, "
                             f"template, data or retriever: {diff} (saved, now). Fix: use another --out, or "
                             f"--overwrite to discard them")
        # Rewrite without a possibly cut last line, so appends start on a fresh line.
        with open(preds, "w", encoding="utf-8") as f:
            for rec in done.values():
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    write_atomic(run_cfg, json.dumps(mine, indent=2) + "\n")
    return done


# -- the run -----------------------------------------------------------------------------------
class NullSearchEngine:
    """The engine of the no-search and RAG modes: max_turns is 0 there, so the rollout never asks."""

    def batch_search(self, queries):
        raise RuntimeError("a search was requested in a mode without search (max_turns must be 0 here)")

    def close(self) -> None:
        pass


def _open_retriever(cfg: EvalConfig, stack, out: Path):
    """The RetrieverClient of the run (starting a server for --retriever-index), or None."""
    if cfg.mode == "no_search":
        return None
    if not cfg.retriever_urls and not cfg.retriever_index:
        raise ValueError(f"mode {cfg.mode} needs a retriever: pass --retriever-url URL (a running "
                         f"`python -m retriever_server serve`) or --retriever-index DIR (served for this "
                         f"run), or use --no-search")
    return open_retriever(cfg.retriever_urls, cfg.retriever_index, cfg.topk, stack, out / "retriever.log")


DEFAULT_INDEX = "default"


def resolve_index_arg(index: str | None) -> str | None:
    """An index directory from a --retriever-index value: `default` means the default synthetic
    world's BM25 index (generated and built when missing or stale); anything else is a directory."""
    if index == DEFAULT_INDEX:
        from retriever_server.indexes import ensure_default_index

        return str(ensure_default_index())
    return index


def open_retriever(urls, index: str | None, topk: int, stack, log_path: Path):
    """A RetrieverClient over `urls` (running servers), or over a server started now for the index
    directory `index` on a free loopback port; `stack` (an ExitStack) stops and closes them."""
    from search_r1.search import RetrieverClient

    urls = list(urls)
    if index:
        from retriever_server.launcher import ServerProcess

        server = ServerProcess([index], log_path, flags=["--torch-threads", "1", "--faiss-threads", "1"])
        server.start()
        stack.callback(server.stop)
        urls = [server.url]
        log.warning("serving %s at %s for this run", index, server.url)
    client = RetrieverClient(urls if len(urls) > 1 else urls[0], topk=topk)
    stack.callback(client.close)
    return client


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp sibling, then rename it over `path`: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _load_generator(cfg: EvalConfig, tokenizer):
    """HFGenerator over the local model (the weights resolve_model_dir(cfg.model) names), or
    OpenAIGenerator with --base-url; `tokenizer` is the one `_load_tokenizer` gave."""
    import os

    import torch

    from search_r1.models import load_model_and_tokenizer
    from search_r1.rollout.backends import HFGenerator, OpenAIGenerator

    if cfg.base_url:
        return OpenAIGenerator(cfg.base_url, cfg.model, tokenizer=tokenizer, api_key=os.environ.get(cfg.api_key_env),
                               allow_insecure_http=cfg.allow_insecure_http)
    dtype = torch.bfloat16 if resolve_dtype(cfg.dtype, "rollout", "--dtype") == "bfloat16" else torch.float32
    model, _ = load_model_and_tokenizer(resolve_model_dir(cfg.model), dtype=dtype)
    return HFGenerator(model, tokenizer)


def _load_tokenizer(cfg: EvalConfig):
    """The tokenizer of the model (or of --tokenizer with --base-url), before any weights load."""
    from search_r1.models import load_tokenizer

    return load_tokenizer(resolve_model_dir((cfg.tokenizer or cfg.model) if cfg.base_url else cfg.model))


def _baseline_prompts(cfg: EvalConfig, tokenizer, batch: list[Example], engine) -> tuple[list[list[int]], list]:
    """Prompt ids of the no-search / RAG baselines and the RAG context (None for no-search)."""
    from search_r1.prompts import apply_chat_template, baseline_messages, rag_documents

    missing = [ex.id for ex in batch if not ex.question]
    if missing:
        raise ValueError(f"rows {missing[:3]} have no recoverable question text (no `question` column and "
                         f"no 'Question: ...' in the prompt); the {cfg.mode} baseline needs it")
    contexts: list = [None] * len(batch)
    if cfg.mode == "rag":
        contexts = rag_documents(tokenizer, engine.batch_search([ex.question for ex in batch]), cfg.max_obs_length)
    prompts = [apply_chat_template(tokenizer, baseline_messages(ex.question, c)) for ex, c in zip(batch, contexts)]
    return prompts, contexts


def _start_budget(cfg: EvalConfig, per_turn: int | None) -> int:
    """Longest prompt the rollout keeps whole (longer ones lose their first tokens).

    The search mode's prompt is the data's, held to max_start_length when loaded. A baseline builds
    its own prompt, and RAG's carries up to max_obs_length tokens of passages after the instruction:
    with max_start_length alone the left cut took the instruction (five 320-token passages against
    256: EM 0, format 0, where the warm-start trained on whole prompts). A baseline answers in one
    round, so it may use whatever context that round's generation leaves.
    """
    if cfg.mode == "search":
        return cfg.max_start_length
    answer = min(per_turn or cfg.max_response_length, cfg.max_response_length)
    return max(cfg.max_start_length, cfg.max_prompt_length - answer)


def _policy_turns(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded runs of generated tokens (mask 1): one string per policy turn."""
    turns, run = [], []
    for t, m in zip(ids, mask):
        if m:
            run.append(t)
        elif run:
            turns.append(run)
            run = []
    if run:
        turns.append(run)
    return tokenizer.batch_decode(turns, skip_special_tokens=True) if turns else []


def _records(out, batch: list[Example], tokenizer, protocol: str, contexts: list) -> list[dict]:
    """One prediction record per rolled-out row of `out` (run_llm_loop's DataProto)."""
    from search_r1.protocol import parse_action

    responses = out.batch["responses"]
    width = responses.shape[1]
    lengths = out.batch["attention_mask"][:, -width:].sum(-1).tolist()
    masks = out.batch["response_mask"]
    meta = out.meta_info
    # Decoded as the trainer decodes responses for its rewards (special tokens dropped).
    texts = tokenizer.batch_decode([responses[i, :n].tolist() for i, n in enumerate(lengths)],
                                   skip_special_tokens=True)
    records = []
    for i, ex in enumerate(batch):
        n = lengths[i]
        turns = _policy_turns(tokenizer, responses[i, :n].tolist(), masks[i, :n].tolist())
        searches = int(meta["valid_search_stats"][i])
        queries = [a.content for a in (parse_action(t, protocol) for t in turns) if a.kind == "search"][:searches]
        rec = {"id": ex.id, "data_source": ex.data_source, "question": ex.question,
               "golden_answers": list(ex.golden_answers)}
        rec.update(score_response(texts[i], list(ex.golden_answers)))
        rec.update({"answered": float(not meta["active_mask"][i]), "turns": int(meta["turns_stats"][i]),
                    "searches": searches, "search_queries": queries,
                    "truncated": bool(meta["truncated_mask"][i]), "response": texts[i]})
        if contexts[i] is not None:
            rec["context"] = contexts[i]
        records.append(rec)
    return records


def evaluate(cfg: EvalConfig, generator=None, tokenizer=None, search_engine=None) -> dict:
    """Run (or resume) the evaluation; write predictions.jsonl and results.json; return the results.

    `generator` + `tokenizer` (any `Generator`) replace the model named by cfg.model, and
    `search_engine` (any `SearchEngine`) replaces the configured retriever: for tests and for callers
    that already hold them (cfg.model is then only a label).
    """
    if (generator is None) != (tokenizer is None):
        raise ValueError("pass generator and tokenizer together (the tokenizer must be the generator's)")
    import contextlib

    import torch

    from search_r1.data.dataset import collate_records
    from search_r1.rollout.generation import GenerationConfig, LLMGenerationManager

    from search_r1.evaluation.identity import resolved_identity

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        engine = search_engine if search_engine is not None else _open_retriever(cfg, stack, out)
        given = generator is not None
        if not given:
            tokenizer = _load_tokenizer(cfg)
        model_dir = None if given or cfg.base_url else resolve_model_dir(cfg.model)
        # before the weights load: a resume that would mix two models is refused at once
        done = prepare_out_dir(cfg, resolved_identity(cfg, tokenizer, model_dir, engine))
        if not given:
            generator = _load_generator(cfg, tokenizer)
            if hasattr(generator, "close"):
                stack.callback(generator.close)
        examples = select_examples(load_examples(cfg, tokenizer), cfg.limit, cfg.limit_per_source, cfg.seed)
        protocol = detect_protocol(tokenizer, examples) if cfg.protocol == "auto" else cfg.protocol
        per_turn = cfg.max_tokens_per_turn
        if cfg.mode != "search" and per_turn is not None:
            # The baselines answer in one round: give it the generation budget of all the search
            # mode's rounds, so a model that reasons at length is not cut short by the mode alone.
            per_turn *= cfg.max_turns + 1
        gen_cfg = GenerationConfig(
            max_turns=cfg.max_turns if cfg.mode == "search" else 0, max_start_length=_start_budget(cfg, per_turn),
            max_prompt_length=cfg.max_prompt_length, max_response_length=cfg.max_response_length,
            max_obs_length=cfg.max_obs_length, topk=cfg.topk,
            protocol=protocol if cfg.mode == "search" else "tags",
            max_tokens_per_turn=per_turn, seed=cfg.seed)
        manager = LLMGenerationManager(tokenizer, generator, gen_cfg,
                                       engine if cfg.mode == "search" else NullSearchEngine(),
                                       is_validation=True)
        pending = [ex for ex in examples if ex.id not in done]
        if done:
            log.warning("resuming: %d of %d questions already in %s", len(examples) - len(pending),
                        len(examples), out / PREDICTIONS)
        t_load = time.perf_counter() - t0
        pad = manager.pad_token_id
        from tqdm import tqdm

        bar = tqdm(total=len(pending), desc=f"eval {cfg.mode}", unit="q", disable=not cfg.progress,
                   dynamic_ncols=True)
        em: list[float] = []
        with open(out / PREDICTIONS, "a", encoding="utf-8") as f:
            for start in range(0, len(pending), cfg.batch_size):
                batch = pending[start:start + cfg.batch_size]
                if cfg.mode == "search":
                    prompts, contexts = [list(ex.record.input_ids) for ex in batch], [None] * len(batch)
                else:
                    prompts, contexts = _baseline_prompts(cfg, tokenizer, batch, engine)
                records = [dataclasses.replace(ex.record, input_ids=tuple(p)) for ex, p in zip(batch, prompts)]
                rollout = manager.run_llm_loop(collate_records(records, pad))
                for rec in _records(rollout, batch, tokenizer, protocol, contexts):
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    done[rec["id"]] = rec
                    em.append(rec["em"])
                f.flush()
                bar.update(len(batch))
                bar.set_postfix(em=f"{sum(em) / len(em):.3f}")
        bar.close()
    seconds = time.perf_counter() - t0
    selected = [done[ex.id] for ex in examples if ex.id in done]
    results = {
        "name": cfg.name or out.resolve().name, "model": cfg.model, "mode": cfg.mode, "protocol": protocol,
        "n": len(selected), "metrics": aggregate(selected),
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "timing": {"seconds": round(seconds, 2), "load_seconds": round(t_load, 2), "evaluated_now": len(pending),
                   "seconds_per_question": round((seconds - t_load) / max(1, len(pending)), 3)},
    }
    write_atomic(out / RESULTS, json.dumps(results, indent=2) + "\n")
    return results
