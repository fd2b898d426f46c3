"""`python -m search_r1.evaluation` end to end: a scripted policy with known answers (exact EM/F1 per
source), the no-search and RAG baselines, resume, tiny-random-qwen3 from a checkpoint, and the
OpenAI-compatible path against a fake vLLM server. Searches go to the real retriever server."""
import json
import re

import pytest

from search_r1.data.prepare import parse_spec, prepare
from search_r1.evaluation.cli import main
from search_r1.evaluation.runner import EvalConfig, evaluate
from search_r1.rollout.backends import GenOutput
from search_r1.search import RetrieverClient
from tests.search_r1.rollout.scripted import smollm2_tokenizer

QUESTIONS = [  # (source, id, question, golds, turns the policy writes)
    ("nq", "n1", "Who founded Velmora?", ["Ana Osk"],
     ["<think> look it up </think><search> Velmora founder </search>", "<answer> Ana Osk </answer>"]),
    ("nq", "n2", "Where is Osk?", ["the city of Brill", "Brill"], ["<answer> The Brill </answer>"]),
    ("nq", "n3", "When was Tarn built?", ["in 1820"], ["<answer> 1820 AD </answer>"]),
    ("hotpot", "h1", "Who directed Quon?", ["Mira Tel"], ["<answer> director Mira Tel </answer>"]),
    ("hotpot", "h2", "What river flows past Zed?", ["Lune"], ["I am not sure.", "<search> Zed river </search>"]),
]


class Oracle:
    """A policy scripted per question: it finds the question in the context ("Question: ...") and
    plays turn k after k observations (search results or invalid-action messages)."""

    def __init__(self, tokenizer, scripts: dict | None = None):
        self.tok = tokenizer
        self.scripts = scripts or {q: turns for _, _, q, _, turns in QUESTIONS}
        self.contexts: list[str] = []
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        self.max_tokens = params.max_tokens
        outs = []
        for ctx in prompts:
            text = self.tok.decode(ctx)
            self.contexts.append(text)
            prompt, _, response = text.rpartition("<|im_start|>assistant\n")
            question = re.findall(r"Question: ([^\n]*)", prompt)[-1]
            turn = response.count("</information>") + response.count("Let me try again.")
            script = self.scripts[question]
            ids = self.tok(script[turn] if turn < len(script) else "I give up.", add_special_tokens=False)["input_ids"]
            ids = ids[: params.max_tokens]
            outs.append(GenOutput(ids, [0.0] * len(ids), "stop"))
        return outs


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa")
    specs = []
    for source in ("nq", "hotpot"):
        path = root / f"{source}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "question": q, "golden_answers": g}) + "\n"
                                for s, i, q, g, _ in QUESTIONS if s == source))
        specs.append(parse_spec(f"{source}={path}"))
    prepare(specs, root / "data", test_fraction=0.0)
    return str(root / "data" / "train.parquet")


def _cfg(qa_file, out, **kw):
    return EvalConfig(model="oracle", data=(qa_file,), out=str(out), max_turns=2, progress=False, batch_size=2, **kw)


def _predictions(out):
    return {r["id"]: r for r in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}


def test_scripted_policy_exact_metrics(qa_file, tmp_path, retriever_server):
    tok = smollm2_tokenizer()
    client = RetrieverClient(retriever_server.url, topk=3)
    res = evaluate(_cfg(qa_file, tmp_path / "run"), Oracle(tok), tok, client)
    nq, hotpot, overall = res["metrics"]["per_source"]["nq"], res["metrics"]["per_source"]["hotpot"], res["metrics"]["overall"]
    # nq: n1 exact; n2 "The Brill" == "Brill" after dropping the article; n3 "1820 AD" vs "in 1820":
    # one common token of two each -> P = R = 1/2, F1 0.5
    assert nq["n"] == 3 and nq["em"] == pytest.approx(2 / 3) and nq["subem"] == pytest.approx(2 / 3)
    assert nq["f1"] == pytest.approx((1 + 1 + 0.5) / 3)
    # hotpot: h1 "director Mira Tel" contains the gold (sub-EM 1), F1 = 2 * (2/3 * 1) / (2/3 + 1) = 0.8;
    # h2 never answers (invalid, search, then no answer in the last round)
    assert hotpot["n"] == 2 and hotpot["em"] == 0.0 and hotpot["subem"] == 0.5
    assert hotpot["f1"] == pytest.approx(0.4)
    assert overall["n"] == 5 and overall["em"] == pytest.approx(0.4) and overall["f1"] == pytest.approx(0.66)
    assert nq["format_valid"] == 1.0 and hotpot["format_valid"] == 0.5
    assert nq["turns"] == pytest.approx(4 / 3) and hotpot["turns"] == 2.0  # h2: invalid, search, last round
    assert nq["searches"] == pytest.approx(1 / 3) and hotpot["searches"] == 0.5
    preds = _predictions(tmp_path / "run")
    assert preds["nq:n1"]["search_queries"] == ["Velmora founder"] and preds["nq:n1"]["prediction"] == "Ana Osk"
    assert "<information>Doc 1(Title:" in preds["nq:n1"]["response"]
    assert preds["hotpot:h2"]["search_queries"] == ["Zed river"] and preds["hotpot:h2"]["answered"] == 0.0
    assert preds["nq:n3"]["golden_answers"] == ["in 1820"] and preds["nq:n3"]["question"] == "When was Tarn built?"
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["metrics"] == json.loads(json.dumps(res["metrics"])) and saved["mode"] == "search"


def test_resume_skips_done_questions(qa_file, tmp_path, retriever_server):
    tok = smollm2_tokenizer()
    client = RetrieverClient(retriever_server.url, topk=3)
    out = tmp_path / "run"
    first = evaluate(_cfg(qa_file, out, limit=2, seed=7), Oracle(tok), tok, client)
    assert first["n"] == 2
    done = set(_predictions(out))
    with open(out / "predictions.jsonl", "a") as f:
        f.write('{"id": "nq:n9", "data_so')  # a line cut by a crash
    oracle = Oracle(tok)
    second = evaluate(_cfg(qa_file, out, seed=7), oracle, tok, client)
    asked = {re.findall(r"Question: ([^\n]*)", c.rpartition("<|im_start|>assistant")[0])[-1] for c in oracle.contexts}
    assert len(asked) == 3 and not asked & {q for _, i, q, _, _ in QUESTIONS if f"nq:{i}" in done or f"hotpot:{i}" in done}
    assert second["n"] == 5 and second["metrics"]["overall"]["em"] == pytest.approx(0.4)
    assert set(_predictions(out)) == {f"{s}:{i}" for s, i, *_ in QUESTIONS}
    with pytest.raises(ValueError, match="other settings.*max_turns"):
        evaluate(EvalConfig(model="oracle", data=(qa_file,), out=str(out), max_turns=1, progress=False),
                 Oracle(tok), tok, client)


def test_no_search_baseline(qa_file, tmp_path):
    tok = smollm2_tokenizer()
    oracle = Oracle(tok)
    res = evaluate(_cfg(qa_file, tmp_path / "ns", mode="no_search", max_tokens_per_turn=30), oracle, tok)
    # one round per question, the direct-answer prompt, no search possible: n1's search ends it unanswered
    assert len(oracle.contexts) == 5
    assert oracle.max_tokens == 30 * 3  # the one round gets the budget of the search mode's 2 + 1 rounds
    assert all("directly, without searching" in c and "<information>" not in c for c in oracle.contexts)
    preds = _predictions(tmp_path / "ns")
    assert preds["nq:n1"]["answered"] == 0.0 and preds["nq:n1"]["searches"] == 0
    assert res["metrics"]["per_source"]["nq"]["em"] == pytest.approx(1 / 3)  # n2 only
    assert res["metrics"]["overall"]["turns"] == 1.0


def test_rag_baseline_puts_retrieved_passages_in_the_prompt(synth_world, tmp_path, retriever_server):
    """Questions of the synthetic world (the served corpus): each prompt holds exactly what one
    retrieval with the question returns; the policy answers from it without searching."""
    rows = [json.loads(line) for line in (synth_world / "test.jsonl").read_text().splitlines()[:3]]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare([parse_spec(f"world={tmp_path / 'q.jsonl'}")], tmp_path / "data", test_fraction=0.0)
    tok = smollm2_tokenizer()
    client = RetrieverClient(retriever_server.url, topk=2)
    scripts = {r["question"]: [f"<answer> {r['golden_answers'][0]} </answer>"] for r in rows}
    oracle = Oracle(tok, scripts)
    res = evaluate(_cfg(str(tmp_path / "data" / "train.parquet"), tmp_path / "rag", mode="rag"), oracle, tok, client)
    preds = _predictions(tmp_path / "rag")
    assert len(preds) == len(oracle.contexts) == 3  # one round each
    for r in rows:
        rec = preds[f"world:{r['id']}"]
        docs = client.search(r["question"])
        assert rec["context"] == docs and docs.startswith("Doc 1(Title:") and "Doc 2(Title:" in docs
        prompt = next(c for c in oracle.contexts if f"Question: {r['question']}" in c)
        assert f"Documents:\n{docs}Question: {r['question']}" in prompt
    assert res["metrics"]["overall"]["em"] == 1.0 and res["metrics"]["overall"]["searches"] == 0.0


def test_rag_prompt_longer_than_max_start_length_is_kept_whole(synth_world, tmp_path, retriever_server):
    """The RAG prompt adds up to max_obs_length tokens of passages to the question: a start budget
    meant for the data's prompts must not cut its instruction off (it did: five 320-token passages
    against max_start_length=256 gave EM 0). Only the answer round's room is reserved."""
    rows = [json.loads(line) for line in (synth_world / "test.jsonl").read_text().splitlines()[:2]]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare([parse_spec(f"world={tmp_path / 'q.jsonl'}")], tmp_path / "data", test_fraction=0.0)
    tok = smollm2_tokenizer()
    client = RetrieverClient(retriever_server.url, topk=5)
    oracle = Oracle(tok, {r["question"]: [f"<answer> {r['golden_answers'][0]} </answer>"] for r in rows})
    cfg = _cfg(str(tmp_path / "data" / "train.parquet"), tmp_path / "rag", mode="rag", max_start_length=160,
               max_prompt_length=1024, max_obs_length=400, max_response_length=600, max_tokens_per_turn=20)
    res = evaluate(cfg, oracle, tok, client)
    lengths = [len(tok(c, add_special_tokens=False)["input_ids"]) for c in oracle.contexts]
    assert min(lengths) > 160  # the case under test: every prompt is longer than max_start_length
    for ctx in oracle.contexts:
        assert ctx.startswith("<|im_start|>") and "Answer the given question using the documents below" in ctx
    assert oracle.max_tokens == 20 * 3  # the answer round keeps its whole budget
    assert res["metrics"]["overall"]["em"] == 1.0 and res["metrics"]["overall"]["format_valid"] == 1.0


def test_retriever_is_required_for_search(qa_file, tmp_path, capsys):
    assert main(["--model", "tiny-random-qwen3", "--data", qa_file, "--out", str(tmp_path / "x")]) == 2
    assert "needs a retriever" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny():
    from search_r1.models import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny-random-qwen3")


TINY_FLAGS = ["--limit", "4", "--batch-size", "2", "--max-tokens-per-turn", "12", "--max-response-length", "80",
              "--max-obs-length", "40", "--max-turns", "1", "--no-progress"]


def test_tiny_model_from_a_checkpoint_end_to_end(tiny, synth_world, retriever_server, tmp_path, capsys):
    """The CLI on a training run directory (its latest checkpoint) gives the same greedy predictions as
    the model it was saved from."""
    from search_r1.trainer.checkpoint import CheckpointManager

    model, tok = tiny
    rollout = {"max_turns": 1, "max_start_length": 300, "max_prompt_length": 700, "max_response_length": 80,
               "max_obs_length": 40, "max_tokens_per_turn": 12}
    CheckpointManager(tmp_path / "train_run" / "checkpoints").save(
        3, model, tok, extra_state={"config": {"rollout": rollout, "retriever": {"topk": 2},
                                               "data": {"protocol": "tags"}}})
    (tmp_path / "train_run" / "config.json").write_text('{"trainer": {}}')  # the trainer writes its config here
    data = str(synth_world / "test.parquet")
    common = ["--data", data, "--retriever-url", retriever_server.base_url, *TINY_FLAGS]
    assert main(["--model", "tiny-random-qwen3", "--out", str(tmp_path / "alias"), *common]) == 0
    assert main(["--model", str(tmp_path / "train_run"), "--out", str(tmp_path / "ckpt"), *common]) == 0
    # unset rollout limits come from the checkpoint's training config, set ones from the flags
    assert main(["--model", str(tmp_path / "train_run"), "--out", str(tmp_path / "inherit"), "--data", data,
                 "--retriever-url", retriever_server.base_url, "--limit", "1", "--max-obs-length", "30",
                 "--no-progress"]) == 0
    used = json.loads((tmp_path / "inherit" / "results.json").read_text())["config"]
    assert {k: used[k] for k in rollout} == {**rollout, "max_obs_length": 30} and used["topk"] == 2
    printed = capsys.readouterr().out
    assert "| data_source | n | EM | sub-EM | F1 | format | turns | searches |" in printed
    a, b = _predictions(tmp_path / "alias"), _predictions(tmp_path / "ckpt")
    assert len(a) == 4 and a.keys() == b.keys()
    assert all(a[k]["response"] == b[k]["response"] and a[k]["response"] for k in a)
    results = json.loads((tmp_path / "ckpt" / "results.json").read_text())
    assert results["n"] == 4 and results["metrics"]["overall"]["n"] == 4
    assert results["config"]["model"].endswith("train_run") and results["name"] == "ckpt"
    assert main(["--compare", str(tmp_path / "alias"), str(tmp_path / "ckpt")]) == 0
    assert "| data_source | alias EM | alias F1 | ckpt EM | ckpt F1 |" in capsys.readouterr().out


def test_resume_is_refused_when_what_model_names_changed(tiny, synth_world, retriever_server, start_retriever,
                                                         tmp_path, capsys):
    """`--model RUN_DIR` resumed after a new training run wrote other weights under the same checkpoint
    path: refused, naming the weights fingerprint and the fix (it used to reuse the old predictions)."""
    import torch

    from search_r1.trainer.checkpoint import CheckpointManager

    model, tok = tiny
    run = tmp_path / "train_run"
    CheckpointManager(run / "checkpoints").save(3, model, tok)
    (run / "config.json").write_text('{"trainer": {}}')
    args = ["--model", str(run), "--out", str(tmp_path / "ev"), "--data", str(synth_world / "test.parquet"),
            "--retriever-url", retriever_server.base_url, *TINY_FLAGS]
    assert main(args) == 0
    assert main(args) == 0  # nothing changed: resumes (all done)
    other = type(model)(model.config)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    CheckpointManager(run / "checkpoints").save(3, other, tok)  # same path, other weights
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "resolved.model.weights_sha256" in err and "resolved.model.path" not in err
    assert "Fix: use another --out, or --overwrite" in err
    assert main([*args, "--overwrite"]) == 0
    saved = json.loads((tmp_path / "ev" / "run_config.json").read_text())["resolved"]
    assert saved["model"]["path"] == str((run / "checkpoints" / "global_step_3" / "model").resolve())
    assert saved["retriever"]["urls"] == [retriever_server.url] and saved["retriever"]["kind"] == "bm25"
    # another retriever (same index, another server): refused too
    second = start_retriever(retriever_server.index_dir)
    capsys.readouterr()
    assert main([*args[:-len(TINY_FLAGS) - 2], "--retriever-url", second.base_url, *TINY_FLAGS]) == 2
    assert "resolved.retriever.urls" in capsys.readouterr().err


def test_openai_endpoint_matches_local_model(tiny, synth_world, tmp_path):
    """--base-url against a fake vLLM /v1/completions server running the same tiny model: the same
    greedy predictions as the local HF path."""
    from search_r1.rollout.backends import HFGenerator
    from tests.search_r1.rollout.test_backends_openai import FakeVLLM

    model, tok = tiny
    data = str(synth_world / "test.parquet")
    server = FakeVLLM(HFGenerator(model, tok), tok)
    try:
        assert main(["--model", "tiny-served", "--base-url", server.base_url, "--tokenizer", "tiny-random-qwen3",
                     "--data", data, "--out", str(tmp_path / "api"), "--no-search", *TINY_FLAGS]) == 0
    finally:
        server.close()
    assert main(["--model", "tiny-random-qwen3", "--data", data, "--out", str(tmp_path / "local"), "--no-search",
                 *TINY_FLAGS]) == 0
    api, local = _predictions(tmp_path / "api"), _predictions(tmp_path / "local")
    assert len(api) == 4 and {k: r["response"] for k, r in api.items()} == {k: r["response"] for k, r in local.items()}
    assert server.requests and all(r["temperature"] == 0.0 and r["model"] == "tiny-served" for r in server.requests)
    assert all(r["stop"] == ["</search>", "</answer>"] for r in server.requests)
