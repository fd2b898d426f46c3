"""A tiny-random-qwen3 that searches: the real model plus a fixed logit bias keyed by (position, token).

The random model never writes `<search>` by itself. `scripted_policy` adds +`strength` to the logit of
the next token of a script, keyed by the (position id, token id) of the input, so the same bias
applies in KV-cache generation (one new token per step) and in a teacher-forced pass over the whole
sequence: log-probs stay those of one well-defined model. For each query the script is
`<search> veltra </search>`, then (after the inserted information) one of two answers; both answer
heads get the same bias, so the samples of a group differ (one right, one wrong).
"""
import types

import pytest
import torch

from search_r1.grpo import GRPOTrainer, MockSearchEngine, SearchR1Config
from search_r1.models import load_model_and_tokenizer

VELTRA = "Doc 1(Title: Veltra) Veltra was founded by Ana Osk.\n"
SEARCH = "<search> veltra </search>"
ANSWERS = (" <answer> Ana Osk </answer>", " <answer> Bob Rell </answer>")
QUERIES = ["Who founded Veltra?", "Who started the Veltra company?"]
GOLD = [["Ana Osk"], ["Ana Osk"]]


def tiny_config(**overrides) -> SearchR1Config:
    kwargs = dict(model_name_or_path="tiny-random-qwen3", device="cpu", max_tokens=64, group_size=4, update_times=2,
                  micro_batch_size=4, learning_rate=1e-3, progress=False, seed=0, max_obs_length=64)
    kwargs.update(overrides)
    return SearchR1Config(**kwargs)


def install_script(trainer: GRPOTrainer, queries, strength: float = 25.0) -> dict:
    """Bias trainer.model toward the script for each query; returns the (position, token) -> targets table."""
    tok = trainer.tokenizer

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    obs = trainer.manager.encoder.encode(["search"], [VELTRA], [10_000])[0]
    table: dict[tuple[int, int], set[int]] = {}
    for q in queries:
        for answer in ANSWERS:
            prompt = trainer.prompt_ids(q)
            seq = prompt + ids(SEARCH) + obs + ids(answer)
            predicted = set(range(len(prompt), len(prompt) + len(ids(SEARCH)))) | \
                set(range(len(seq) - len(ids(answer)), len(seq)))
            for p in sorted(predicted):  # the token at p is predicted from (p - 1, seq[p - 1])
                table.setdefault((p - 1, seq[p - 1]), set()).add(seq[p])
    inner = trainer.model.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        out = inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        k = out.logits.shape[1]
        bias = torch.zeros_like(out.logits)
        for b, (pos_row, tok_row) in enumerate(zip(position_ids[:, -k:].tolist(), input_ids[:, -k:].tolist())):
            for j, key in enumerate(zip(pos_row, tok_row)):
                for target in table.get(key, ()):
                    bias[b, j, target] = strength
        out.logits = out.logits + bias
        return out

    # An instance attribute: nn.Module.__call__ finds it, state_dict / save_pretrained are untouched.
    trainer.model.forward = types.MethodType(forward, trainer.model)
    return table


@pytest.fixture
def scripted_trainer():
    def make(config: SearchR1Config | None = None, queries=QUERIES) -> GRPOTrainer:
        model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
        trainer = GRPOTrainer(config or tiny_config(), search_engine=MockSearchEngine({"veltra": VELTRA}),
                              model=model, tokenizer=tokenizer)
        install_script(trainer, queries)
        return trainer
    return make
