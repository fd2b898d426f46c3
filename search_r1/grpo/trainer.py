"""`GRPOTrainer`: GRPO with search in one process, for notebooks and quick experiments.

    trainer = GRPOTrainer(SearchR1Config(model_name_or_path="smollm2-135m-instruct"),
                          search_engine=MockSearchEngine({"veltra": "Doc 1(Title: Veltra) ..."}))
    metrics = trainer.train_step(["Who founded Veltra?"], [["Ana Osk"]])

Nothing here is a second implementation of the rollout or the math: a step is
  1. rollout: `LLMGenerationManager.run_llm_loop` (search_r1.rollout) with `HFGenerator` (batched
     sampling over a KV cache, stop at `</search>` / `</answer>`, exact sampled ids and their
     log-probs) or, with use_openai, `OpenAIGenerator` (/v1/completions) or `OpenAIChatGenerator`
     (/v1/chat/completions, `config.openai_api`); searches go to any `SearchEngine`;
  2. reward: `search_r1.rewards` (format + answer tiers, values from the config);
  3. advantage: `search_r1.algos.compute_grpo_advantages` over the samples of each query
     (population std, eps 1e-8);
  4. update: `update_times` AdamW steps on `ppo_clip_loss(exp(new - old), A)` + beta * `k3_kl`,
     token mean over generated tokens (inserted information is context only), log-probs from one
     teacher-forced forward pass per micro-batch. Every log-prob (sampling, recomputed, updated)
     is of the distribution sampled from: logits / temperature, top-k / top-p filtered.
The KL term anchors the policy to the one that sampled the batch (old log-probs), not to a frozen
reference model: this API keeps one copy of the weights.

Precision: the weights and AdamW's moments are float32 (AdamW over float16 weights rounds its
second moment and eps to 0 and turns every weight inf/NaN after one step); `config.dtype` picks the
autocast dtype of every forward pass (sampling included, so the sampling log-probs are the
update's), bfloat16 where the device has it, float16 with a gradient scaler otherwise.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from search_r1.algos import agg_loss, compute_grpo_advantages, k3_kl, ppo_clip_loss, token_log_probs
from search_r1.grpo.config import SearchR1Config
from search_r1.grpo.data import synthetic_knowledge_base
from search_r1.grpo.records import TokenStep, Trajectory
from search_r1.prompts import apply_chat_template, chatml_prompt, grpo_messages
from search_r1.protocol import decode_ids, encode_texts
from search_r1.rewards import EOS_MARKERS, check_answer_correctness, check_format_correctness, extract_answer
from search_r1.search.base import SearchEngine, as_search_engine

logger = logging.getLogger(__name__)

STEP_SEED_STRIDE = 10007  # step s samples with seed + STEP_SEED_STRIDE * s: streams never overlap in practice


class PolicyUpdateUnavailable(RuntimeError):
    """The trainer generates through an API (use_openai=True): there are no local weights to update."""


def build_search_engine(config: SearchR1Config, check: bool = True) -> SearchEngine:
    """The engine `config.search_backend` names (used when GRPOTrainer gets no search_engine). The
    retriever must answer (`check`): without one, every search would be a "search failed"
    observation the policy is trained on."""
    if config.search_backend == "retriever":
        from search_r1.search import RetrieverClient
        from search_r1.search.base import SearchError
        from search_r1.search.retriever_client import check_reachable

        if check:
            try:
                check_reachable(config.retriever_url, timeout=min(config.search_timeout, 5.0))
            except SearchError as err:
                raise ValueError(
                    f"SearchR1Config.retriever_url: {err}. Fix: start one (`python -m retriever_server serve "
                    f"--index DIR --port 8000`; `python -m retriever_server build` makes DIR), or use "
                    f"SearchR1Config(search_backend='synthetic') for the built-in passages, or pass "
                    f"search_engine= to GRPOTrainer") from None
        return RetrieverClient(config.retriever_url, topk=config.topk, timeout=config.search_timeout,
                               retries=config.search_retries)
    if config.search_backend == "web":
        from search_r1.search.web import WebSearchEngine

        return WebSearchEngine(api_key=config.web_api_key or None, provider=config.web_provider,
                               cx=config.web_cx or None, topk=config.topk, timeout=config.search_timeout,
                               retries=config.search_retries, rate_limit=config.web_rate_limit)
    from search_r1.search import MockSearchEngine

    return MockSearchEngine(synthetic_knowledge_base(max_docs=config.topk))


def final_answer_of(text: str) -> str:
    """The last complete `<answer>` of a response; failing that, the unfinished answer a length limit
    (or an EOS) cut off: the text after the last `<answer>` when no closing tag or environment block
    follows it; otherwise ""."""
    answer = extract_answer(text)
    if answer is not None:
        return answer
    head, tag, tail = text.rpartition("<answer>")
    if not tag or any(t in tail for t in ("</answer>", "<information>", "</information>")):
        return ""
    for marker in EOS_MARKERS:
        tail = tail.split(marker)[0]
    return tail.strip()


def config_reward(trajectory: Trajectory | str, ground_truth, config: SearchR1Config) -> float:
    """The seed reward (`search_r1.rewards`) with the config's values: format `format_reward` (well
    formed) or `format_penalty`, plus answer `exact_match_bonus` (exact), `answer_reward` (similar),
    0.5 (the no-answer string) or 0.0. Reads the response only (`generated_text`), never the prompt."""
    text = trajectory if isinstance(trajectory, str) else trajectory.generated_text
    fmt = check_format_correctness(text, valid=config.format_reward, invalid=config.format_penalty)
    tier = check_answer_correctness(extract_answer(text), ground_truth)
    # search_r1.rewards scores an exact answer 2.0 and a similar one 1.0; map those tiers to the config.
    return fmt + {2.0: config.exact_match_bonus, 1.0: config.answer_reward}.get(tier, tier)


class GRPOTrainer:
    """GRPO trainer over local weights (or rollouts only, through an OpenAI-compatible API).

    Args:
        config: SearchR1Config (default: all defaults).
        search_engine: any `SearchEngine`; None builds the one `config.search_backend` names.
        model, tokenizer: an already loaded policy and its tokenizer (both, or neither: then
            `config.model_name_or_path` is loaded with `search_r1.models`).
    """

    def __init__(self, config: SearchR1Config | None = None, search_engine: SearchEngine | None = None,
                 model=None, tokenizer=None):
        from search_r1.models import load_model_and_tokenizer, load_tokenizer
        from search_r1.grpo.openai_chat import OpenAIChatGenerator
        from search_r1.rollout.backends import HFGenerator, OpenAIGenerator
        from search_r1.rollout.generation import LLMGenerationManager

        config = SearchR1Config() if config is None else config
        if not isinstance(config, SearchR1Config):
            raise ValueError(f"config must be a SearchR1Config, got {type(config).__name__}")
        if search_engine is not None:  # an engine with search(query) -> str alone is accepted too
            search_engine = as_search_engine(search_engine)
        self.config = cfg = config
        self.model = self.optimizer = None
        if cfg.use_openai:
            if model is not None:
                raise ValueError("use_openai=True generates through the API; do not pass model= "
                                 "(set use_openai=False to train local weights)")
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model_name_or_path)
            if cfg.resolved_openai_api == "chat":
                self.generator = OpenAIChatGenerator(cfg.openai_base_url, cfg.openai_model, self.tokenizer,
                                                     api_key=cfg.openai_api_key or None,
                                                     allow_insecure_http=cfg.openai_allow_insecure_http)
            else:
                self.generator = OpenAIGenerator(cfg.openai_base_url, cfg.openai_model, tokenizer=self.tokenizer,
                                                 api_key=cfg.openai_api_key or None,
                                                 allow_insecure_http=cfg.openai_allow_insecure_http)
        else:
            if (model is None) != (tokenizer is None):
                raise ValueError("pass both model= and tokenizer= (or neither, to load config.model_name_or_path)")
            if model is None:
                model, tokenizer = load_model_and_tokenizer(cfg.model_name_or_path, dtype=torch.float32)
            low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
            if low:
                logger.warning("model= has %s parameters; training keeps float32 master weights, so they are "
                               "converted (model.float()); forward passes run in %s", ", ".join(low), cfg.compute_dtype)
                model = model.float()
            self.model, self.tokenizer = model.to(cfg.device), tokenizer
            # eval mode throughout: these models have no dropout in use, and eval makes the update's
            # first forward pass reproduce the sampling log-probs (ratio 1 before the first step).
            self.model.eval()
            self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                               lr=cfg.learning_rate)
            # float16 gradients under- and overflow without a loss scale; bf16 / fp32 need none
            self.scaler = torch.amp.GradScaler(self._device_type, enabled=cfg.compute_dtype == torch.float16)
            # "processed": log-probs of the distribution actually sampled from (logits / temperature,
            # top-k, top-p), the policy `_forward_logprobs` scores too, so the update is on-policy.
            self.generator = HFGenerator(self.model, self.tokenizer, batch_size=cfg.generation_batch_size,
                                         logprobs_mode="processed")
            self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.search_engine = search_engine if search_engine is not None else build_search_engine(cfg)
        self.manager = LLMGenerationManager(self.tokenizer, self.generator, self._generation_config(cfg.max_tokens, None),
                                            self.search_engine)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_token_id = int(pad or 0)
        self.micro_batch_size = cfg.micro_batch_size
        self.global_step = 0  # policy updates made (train_step calls), names checkpoints
        self.data_step = 0  # batches `train` has consumed: its position in the epoch schedule
        self.rollout_calls = 0
        self.history: list[dict] = []
        self.stats = {"oom_retries": 0, "skipped_trajectories": 0}

    # ------------------------------------------------------------------ precision

    @property
    def _device_type(self) -> str:
        return str(self.config.device).split(":")[0]

    def _autocast(self):
        """The forward passes' precision (config.compute_dtype); no-op for float32 or without weights."""
        dtype = self.config.compute_dtype
        if self.model is None or dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=dtype)

    # ------------------------------------------------------------------ rollout

    def _generation_config(self, max_tokens: int, seed: int | None):
        from search_r1.rollout.generation import GenerationConfig

        cfg = self.config
        return GenerationConfig(max_turns=cfg.max_turns, max_start_length=cfg.max_prompt_length,
                                max_prompt_length=cfg.max_prompt_length + max_tokens,
                                max_response_length=max_tokens, max_obs_length=cfg.max_obs_length, topk=cfg.topk,
                                temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=seed)

    def _next_seed(self) -> int | None:
        self.rollout_calls += 1
        return None if self.config.seed is None else self.config.seed + STEP_SEED_STRIDE * self.rollout_calls

    def prompt_ids(self, query: str) -> list[int]:
        """Token ids of the prompt for `query` (see `config.chat_format`)."""
        if self.config.chat_format == "chatml":
            return encode_texts(self.tokenizer, [chatml_prompt(query)])[0]
        return apply_chat_template(self.tokenizer, grpo_messages(query))

    def rollout(self, queries: list[str], max_tokens: int | None = None) -> list[Trajectory]:
        """One trajectory per query, all generated together (one batched multi-turn rollout).

        Blank queries give empty trajectories without generating anything.
        """
        from verl import DataProto

        from search_r1.rollout.tensor_helper import pad_ragged, strip_left_padding

        max_tokens = self.config.max_tokens if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise ValueError(f"queries[{i}] must be a string, got {type(q).__name__}: {q!r}")
        trajectories = [Trajectory(query=q) for q in queries]
        live = [i for i, q in enumerate(queries) if q.strip()]
        if not live:
            return trajectories
        cache: dict[str, list[int]] = {}
        for i in live:  # a GRPO group repeats its query: tokenize each prompt once
            if queries[i] not in cache:
                cache[queries[i]] = self.prompt_ids(queries[i])
        prompts = [cache[queries[i]] for i in live]
        if hasattr(self.generator, "register_prompt"):  # a chat API takes the prompt as messages
            for q, ids in cache.items():
                self.generator.register_prompt(ids, grpo_messages(q))
        ids, mask = pad_ragged(prompts, pad_value=self.pad_token_id, left=True)  # (B, P) left-padded
        batch = DataProto.from_dict(tensors={"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)})
        self.manager.config = self._generation_config(max_tokens, self._next_seed())
        with self._autocast():
            out = self.manager.run_llm_loop(batch)
        # a prompt longer than max_prompt_length was rolled out on its last max_prompt_length tokens
        width = out.batch["prompts"].shape[1]  # P
        prompts = strip_left_padding(out.batch["prompts"], out.batch["attention_mask"][:, :width])
        resp_len = out.batch["attention_mask"][:, width:].sum(-1).tolist()  # (B,) generated + observation
        responses = [out.batch["responses"][r, :n].tolist() for r, n in enumerate(resp_len)]
        masks = [out.batch["response_mask"][r, :n].tolist() for r, n in enumerate(resp_len)]
        logps = [out.batch["rollout_log_probs"][r, :n].tolist() for r, n in enumerate(resp_len)]
        texts = decode_ids(self.tokenizer, responses)
        generated = [[t for t, m in zip(resp, mk) if m] for resp, mk in zip(responses, masks)]
        pieces = decode_ids(self.tokenizer, [[t] for g in generated for t in g])  # one batched decode
        meta = out.meta_info
        k = 0
        for r, i in enumerate(live):
            offset = len(prompts[r])
            positions = [offset + j for j, m in enumerate(masks[r]) if m]
            steps = []
            for p, j in zip(positions, (j for j, m in enumerate(masks[r]) if m)):
                steps.append(TokenStep(responses[r][j], pieces[k], float(logps[r][j]), p))
                k += 1
            t = trajectories[i]
            t.token_steps, t.generated_text, t.generated_positions = steps, texts[r], positions
            t.full_input_ids = prompts[r] + responses[r]
            t.final_answer = final_answer_of(texts[r])
            t.num_searches = int(meta["valid_search_stats"][r])
            t.truncated = bool(meta["truncated_mask"][r])
        return trajectories

    def generate_trajectory(self, query: str, max_tokens: int | None = None, ground_truth=None) -> Trajectory:
        """One trajectory for `query`: generate until `</search>` (search, insert `<information>`,
        continue), `</answer>`, EOS or the `max_tokens` response budget. With `ground_truth` the
        reward is filled in too. An empty query gives an empty trajectory."""
        if not isinstance(query, str):
            raise ValueError(f"query must be a string, got {type(query).__name__}")
        trajectory = self.rollout([query], max_tokens)[0]
        if ground_truth is not None:
            trajectory.reward = self.compute_reward(trajectory, ground_truth)
        return trajectory

    # ------------------------------------------------------------------ reward and advantage

    def compute_reward(self, trajectory: Trajectory | str, ground_truth) -> float:
        """`config_reward` with this trainer's config."""
        return config_reward(trajectory, ground_truth, self.config)

    @staticmethod
    def compute_advantages(rewards) -> torch.Tensor:
        """A_i = (r_i - mean(r)) / (std(r) + 1e-8), population std; one reward gives [0.0].

        Shapes: rewards (G,) -> (G,) float32. One group: the samples of one query.
        """
        r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        if r.numel() == 0:
            return r
        return compute_grpo_advantages(r, [0] * r.numel(), eps=1e-8, std="population")

    @staticmethod
    def compute_kl_divergence(old_log_probs, new_log_probs) -> torch.Tensor:
        """K3 estimate of KL: ratio = exp(old - new), mean(ratio - log(ratio) - 1) over tokens.

        Shapes: (T,) and (T,) (or any equal shapes) -> () scalar; `search_r1.algos.k3_kl` without
        its output clamp (its +-20 clamp on old - new keeps exp finite).
        """
        old, new = torch.as_tensor(old_log_probs, dtype=torch.float32), torch.as_tensor(new_log_probs, dtype=torch.float32)
        if old.shape != new.shape:
            raise ValueError(f"old_log_probs {tuple(old.shape)} and new_log_probs {tuple(new.shape)} differ in shape")
        if old.numel() == 0:
            return torch.zeros(())
        return k3_kl(new, old, clamp=None).mean()

    # ------------------------------------------------------------------ log-probs

    def _require_weights(self, what: str) -> None:
        if self.model is None:
            raise PolicyUpdateUnavailable(
                f"{what} needs local model weights, but this trainer generates through the API at "
                f"{self.config.openai_base_url} (use_openai=True), and no gradient flows through an API. "
                "Set use_openai=False (and model_name_or_path) to train, or use generate_trajectory / "
                "compute_reward only.")

    def _forward_logprobs(self, trajectories: list[Trajectory]) -> list[torch.Tensor]:
        """log pi(token) at each trajectory's generated positions inside [1, len(full_input_ids)), one
        teacher-forced forward pass for the whole list (gradients flow when enabled).

        Layout: each sequence is split where its first generated token starts; the prompt parts are
        left-padded to P, the response parts right-padded to R, so the logits of the last R + 1
        columns (`logits_to_keep`) cover every generated token. Position ids skip the left padding.
        The policy is the sampling distribution: logits / temperature, then top-k / top-p
        (`backends.filtered_logits`, as HFGenerator samples); temperature 0 (greedy) scores raw logits.
        """
        from search_r1.rollout.backends import filtered_logits

        cfg = self.config
        device = next(self.model.parameters()).device
        rows, out = [], [None] * len(trajectories)
        for i, t in enumerate(trajectories):
            n = len(t.full_input_ids)
            pos = [p for p in t.generated_positions if 1 <= p < n]
            if pos:
                rows.append((i, min(pos), pos))
            else:
                out[i] = torch.zeros(0, device=device)
        if rows:
            P = max(s for _, s, _ in rows)
            R = max(len(trajectories[i].full_input_ids) - s for i, s, _ in rows)
            ids = torch.full((len(rows), P + R), self.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(rows), P + R), dtype=torch.long)
            for r, (i, s, _) in enumerate(rows):
                full = torch.as_tensor(trajectories[i].full_input_ids, dtype=torch.long)
                ids[r, P - s:P + len(full) - s] = full
                attn[r, P - s:P + len(full) - s] = 1
            pos_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # (m, P + R)
            ids, attn, pos_ids = ids.to(device), attn.to(device), pos_ids.to(device)
            extra = {"logits_to_keep": R + 1} if self._keeps_logits else {}
            with self._autocast():
                logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos_ids, use_cache=False,
                                    **extra).logits[:, -(R + 1):-1]  # (m, R, V): column P + k predicted at k
            for r, (i, s, pos) in enumerate(rows):
                k = torch.as_tensor(pos, device=device) - s  # (n_i,) response-relative columns
                z = logits[r, k].float()  # (n_i, V)
                if cfg.temperature > 0:
                    z = filtered_logits(z, cfg.temperature, cfg.top_p, cfg.top_k)  # sampled tokens stay finite
                target = ids[r, P + k]  # (n_i,)
                out[i] = token_log_probs(z, target)[0]
        return out

    def _with_oom_halving(self, fn):
        """Run `fn(micro_batch_size)`; on out-of-memory halve the micro-batch and run it again."""
        while True:
            try:
                return fn(self.micro_batch_size)
            except torch.OutOfMemoryError as exc:
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if self.micro_batch_size == 1:
                    raise RuntimeError("out of memory with micro_batch_size=1; lower max_tokens or "
                                       "max_obs_length, or use a smaller model") from exc
                old, self.micro_batch_size = self.micro_batch_size, max(1, self.micro_batch_size // 2)
                self.stats["oom_retries"] += 1
                logger.warning("out of memory with micro-batch %d; retrying with micro-batch %d", old,
                               self.micro_batch_size)

    def recompute_log_probs(self, trajectories: list[Trajectory]) -> list[torch.Tensor]:
        """log-probs of each trajectory's generated tokens under the current weights (no gradient),
        inserted information as context only; one forward pass per micro-batch. A tensor is shorter
        than `token_steps` when positions fall outside `full_input_ids` (a corrupted record)."""
        self._require_weights("recompute_log_probs")

        def run(mb: int) -> list[torch.Tensor]:
            with torch.no_grad():
                return [lp.cpu() for s in range(0, len(trajectories), mb)
                        for lp in self._forward_logprobs(trajectories[s:s + mb])]
        return self._with_oom_halving(run)

    # ------------------------------------------------------------------ update

    def update_policy(self, trajectories: list[Trajectory]) -> dict:
        """`update_times` AdamW steps of PPO-clip + beta * K3 on the generated tokens.

            ratio = exp(new - old);  pg = token-mean(max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)))
            loss  = pg + beta * token-mean(k3(new, old)),   k3 = exp(old - new) - (old - new) - 1

        old = the log-probs recorded at sampling; A = trajectory.advantage on all its generated tokens.
        Gradients are clipped to `max_grad_norm`. A trajectory whose positions do not line up with its
        sequence (its recomputed log-probs would not match its token steps) is skipped and counted.
        With config.skip_zero_advantage, a batch whose advantages are all 0 takes no step.
        Returns loss, kl_div (means over the iterations), avg_reward, beta, skipped, clip_frac, grad_norm,
        update_skipped (1.0 when no step was taken for lack of a non-zero advantage).
        """
        self._require_weights("update_policy")
        cfg = self.config
        usable, skipped = [], 0
        for t in trajectories:
            problem = t.layout_problem()
            if problem is None and not all(math.isfinite(lp) for lp in t.old_log_probs):
                problem = "log-probs missing (NaN)"
            if problem is not None:
                skipped += 1
                logger.warning("skipping trajectory for %r: %s", t.query[:60], problem)
            elif t.token_steps:
                usable.append(t)
        self.stats["skipped_trajectories"] += skipped
        metrics = {"loss": 0.0, "kl_div": 0.0, "beta": cfg.beta, "skipped": skipped, "clip_frac": 0.0,
                   "grad_norm": 0.0, "avg_reward": sum(t.reward for t in trajectories) / max(len(trajectories), 1),
                   "update_skipped": 0.0}
        if not usable:
            return metrics
        if cfg.skip_zero_advantage and all(t.advantage == 0 for t in usable):
            metrics["update_skipped"] = 1.0
            return metrics
        old = [torch.tensor(t.old_log_probs, dtype=torch.float32) for t in usable]
        tokens = float(sum(len(o) for o in old))
        sums = {"loss": 0.0, "kl_div": 0.0, "clip_frac": 0.0, "grad_norm": 0.0}
        for _ in range(cfg.update_times):
            step = self._with_oom_halving(lambda mb: self._policy_step(usable, old, tokens, mb))
            for key in sums:
                sums[key] += step[key]
        if str(cfg.device).startswith("cuda"):
            torch.cuda.empty_cache()
        # + 0.0 turns the -0.0 of an all-zero-advantage batch into 0.0 for display
        metrics.update({key: value / cfg.update_times + 0.0 for key, value in sums.items()})
        return metrics

    def _policy_step(self, usable: list[Trajectory], old: list[torch.Tensor], tokens: float, mb: int) -> dict:
        """One optimizer step over all usable trajectories, accumulated over micro-batches of `mb`."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = kl_sum = clip_sum = 0.0
        for s in range(0, len(usable), mb):
            chunk = usable[s:s + mb]
            new = torch.cat(self._forward_logprobs(chunk))[None]  # (1, T_mb) generated tokens only
            device = new.device
            old_mb = torch.cat(old[s:s + mb]).to(device)[None]  # (1, T_mb)
            adv = torch.cat([torch.full((len(t.token_steps),), float(t.advantage)) for t in chunk]).to(device)[None]
            mask = torch.ones_like(new)
            # normalizer = tokens of the whole batch, so summed micro-batch losses equal the batch loss
            pg, st = ppo_clip_loss(new, old_mb, adv, mask, clip=cfg.clip_epsilon, agg="token-mean",
                                   clip_ratio_c=None, normalizer=tokens)
            kl = agg_loss(k3_kl(new, old_mb), mask, "token-mean", normalizer=tokens)
            loss = pg + cfg.beta * kl
            self.scaler.scale(loss).backward()
            loss_sum += loss.item()
            kl_sum += kl.item()
            clip_sum += st["actor/pg_clipfrac"] * new.shape[1]
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.scaler.unscale_(self.optimizer)  # clip the true gradient (no-op without float16)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        if math.isfinite(grad_norm):
            self.scaler.step(self.optimizer)
        elif not self.scaler.is_enabled():  # a non-finite gradient would poison AdamW's moments
            logger.warning("non-finite gradient norm; optimizer step skipped")
        # (float16: an overflow at this loss scale; the step is skipped and update() lowers the scale)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum, "kl_div": kl_sum, "clip_frac": clip_sum / tokens,
                "grad_norm": grad_norm}

    # ------------------------------------------------------------------ training

    def train_step(self, queries: list[str], ground_truths: list, group_size: int | None = None) -> dict:
        """Roll out `group_size` samples per query, reward, GRPO advantages per query, update.

        Returns loss, kl_div, avg_reward, avg_tokens (generated per trajectory), search_trajectories
        (fraction that searched at least once), skipped, update_skipped, step, timing (gen_s, update_s)
        and the trajectories themselves.
        """
        from search_r1.rewards import gold_answers

        self._require_weights("train_step")
        if isinstance(queries, str) or not isinstance(queries, (list, tuple)) or not queries:
            raise ValueError("queries must be a non-empty list of strings")
        if isinstance(ground_truths, str) or len(ground_truths) != len(queries):
            raise ValueError(f"ground_truths must be a list with one entry per query ({len(queries)}), got "
                             f"{ground_truths!r:.200}")
        for g in ground_truths:
            gold_answers(g)  # a bad ground truth fails here, before any generation
        g = self.config.group_size if group_size is None else group_size
        if not isinstance(g, int) or g < 2:
            raise ValueError(f"group_size must be an int >= 2 (GRPO compares samples of one query), got {g!r}")
        t0 = time.perf_counter()
        trajectories = self.rollout([q for q in queries for _ in range(g)])
        t1 = time.perf_counter()
        rewards = [self.compute_reward(t, ground_truths[i // g]) for i, t in enumerate(trajectories)]
        advantages = compute_grpo_advantages(torch.tensor(rewards), [i // g for i in range(len(rewards))],
                                             eps=1e-8, std="population")
        for t, r, a in zip(trajectories, rewards, advantages.tolist()):
            t.reward, t.advantage = float(r), float(a)
        update = self.update_policy(trajectories)
        t2 = time.perf_counter()
        self.global_step += 1
        n = len(trajectories)
        return {"step": self.global_step, "loss": update["loss"], "kl_div": update["kl_div"],
                "avg_reward": update["avg_reward"], "avg_tokens": sum(t.num_generated_tokens for t in trajectories) / n,
                "search_trajectories": sum(t.num_searches > 0 for t in trajectories) / n,
                "skipped": update["skipped"], "update_skipped": update["update_skipped"],
                "clip_frac": update["clip_frac"], "grad_norm": update["grad_norm"],
                "gen_s": t1 - t0, "update_s": t2 - t1, "trajectories": trajectories}

    def train(self, queries: list[str], ground_truths: list, num_epochs: int | None = None,
              batch_size: int | None = None) -> list[dict]:
        """`num_epochs` passes over the data in batches of `batch_size` queries (config defaults).

        Continues from `data_step`, the batches earlier `train` calls consumed (after `load`, a run
        resumes where the checkpoint left off; the data order of each epoch is a function of
        config.seed and the epoch; `train_step` calls made by hand do not move it). Prints a metrics line
        every `log_interval` steps, saves to `output_dir` every `save_interval` steps. Returns the
        per-step metrics (without trajectories), also appended to `self.history`.
        """
        cfg = self.config
        epochs = cfg.num_epochs if num_epochs is None else num_epochs
        bs = cfg.batch_size if batch_size is None else batch_size
        if len(queries) != len(ground_truths) or not queries:
            raise ValueError(f"need equally many queries and ground truths (at least one), got "
                             f"{len(queries)} and {len(ground_truths)}")
        per_epoch = math.ceil(len(queries) / bs)
        total = epochs * per_epoch
        out = []
        bar = tqdm(total=total, initial=min(self.data_step, total), desc="GRPO", disable=not cfg.progress)
        with contextlib.closing(bar):
            while self.data_step < total:
                epoch, b = divmod(self.data_step, per_epoch)
                order = list(range(len(queries)))
                random.Random(f"{cfg.seed}:{epoch}").shuffle(order) if cfg.seed is not None else random.shuffle(order)
                idx = order[b * bs:(b + 1) * bs]
                metrics = self.train_step([queries[i] for i in idx], [ground_truths[i] for i in idx])
                self.data_step += 1
                metrics.pop("trajectories")
                metrics["epoch"] = epoch
                out.append(metrics)
                self.history.append(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['avg_reward']:.2f}", loss=f"{metrics['loss']:.3f}")
                if cfg.log_interval and self.data_step % cfg.log_interval == 0:
                    bar.write(f"step {self.data_step}/{total} epoch {epoch} reward {metrics['avg_reward']:.3f} "
                              f"loss {metrics['loss']:.4f} kl {metrics['kl_div']:.4f} tokens "
                              f"{metrics['avg_tokens']:.1f} searched {metrics['search_trajectories']:.2f} "
                              f"({metrics['gen_s'] + metrics['update_s']:.1f}s)")
                if cfg.save_interval and self.data_step % cfg.save_interval == 0:
                    self.save(cfg.output_dir)
        return out

    # ------------------------------------------------------------------ checkpoints

    def save(self, path) -> Path:
        """Checkpoint weights, tokenizer, optimizer, RNG and progress under `path/global_step_N`
        (atomic, `search_r1.trainer.checkpoint`); returns the checkpoint directory."""
        from search_r1.trainer.checkpoint import CheckpointManager

        self._require_weights("save")
        extra = {"global_step": self.global_step, "data_step": self.data_step, "rollout_calls": self.rollout_calls,
                 "micro_batch_size": self.micro_batch_size, "config": self.config.to_dict(),
                 "history": self.history, "grad_scaler": self.scaler.state_dict()}
        return CheckpointManager(path, keep_last=None).save(self.global_step, self.model, self.tokenizer,
                                                            optimizer_state=self.optimizer.state_dict(),
                                                            extra_state=extra)

    def load(self, path) -> dict:
        """Restore a checkpoint: `path` is one checkpoint directory or a root holding several (the
        newest complete one is used). Weights, optimizer, RNG, step counters and history come back,
        so `train` resumes where the run stopped."""
        from search_r1.trainer.checkpoint import CheckpointManager, is_complete, load_checkpoint, restore_rng_state

        self._require_weights("load")
        path = Path(path)
        state = load_checkpoint(path, self.model) if is_complete(path) else CheckpointManager(path).load(model=self.model)
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state["rng"] is not None:
            restore_rng_state(state["rng"])
        extra = state["extra_state"] or {}
        self.global_step = int(extra.get("global_step", state["step"] or 0))
        self.data_step = int(extra.get("data_step", self.global_step))
        self.rollout_calls = int(extra.get("rollout_calls", 0))
        self.micro_batch_size = int(extra.get("micro_batch_size", self.micro_batch_size))
        self.history = list(extra.get("history", []))
        if extra.get("grad_scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(extra["grad_scaler"])
        return state
