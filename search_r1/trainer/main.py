"""Hydra entry of the embedded CPU GRPO trainer.

    python -m search_r1.trainer.main                                  # search_r1/trainer/configs/grpo_cpu.yaml
    python -m search_r1.trainer.main trainer.total_steps=5 rollout.n=2
    python -m search_r1.trainer.main -m optim.lr=1e-5,3e-5 trainer.experiment_name='lr${optim.lr}'

Order of work (each step fails fast with a message naming the fix): validate the config -> check
cores -> prepare the data (generate the synthetic world when data.dir=auto and it is missing) ->
reach the retriever (start one for the run when retriever.url=auto) -> supervised format warm-start
(warmstart.enabled; cached) -> start Ray and the workers (policy and KL reference both load the
warm-started model) ->
train -> plot -> print where metrics, plot and checkpoints are. The retriever started here and
the workers are stopped on the way out, also on errors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from retriever_server.manifest import index_matches_corpus
from retriever_server.launcher import ServerProcess, ServerStartError
from search_r1.logs import quiet_library_loggers
from search_r1.search.base import SearchError
from search_r1.search.retriever_client import check_reachable
from search_r1.trainer.config import AUTO, TrainConfig

log = logging.getLogger("search_r1.trainer")


class StartupError(RuntimeError):
    """A precondition of the run is not met (the message says what and how to fix it)."""


# -- data -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataPaths:
    dir: Path
    train_files: tuple[Path, ...]
    test_files: tuple[Path, ...]
    corpus: Path


def prepare_data(cfg: TrainConfig) -> DataPaths:
    """Resolve data files; with data.dir=auto generate the default synthetic world unless it is current."""
    from search_r1.paths import default_synth_dir

    d = cfg.data
    data_dir = default_synth_dir() if d.dir == AUTO else Path(d.dir).expanduser()
    if d.dir == AUTO:  # regenerated when missing, of another seed, or from an older generator
        from search_r1.data.synth import ensure_world

        ensure_world(data_dir, seed=d.synth_seed)
    train = tuple(Path(f).expanduser() for f in d.train_files) or (data_dir / "train.parquet",)
    test = tuple(Path(f).expanduser() for f in d.test_files) or (data_dir / "test.parquet",)
    for f in train + test:
        if not f.is_file():
            raise StartupError(f"data file {f} does not exist. Fix: set data.dir=auto, or generate it with "
                               f"`python -m search_r1.data.synth --out {f.parent}`")
    return DataPaths(data_dir, train, test, data_dir / "corpus.jsonl")


# -- retriever --------------------------------------------------------------------------------------
def check_retriever(url: str, timeout: float = 5.0, api_key: str | None = None) -> None:
    """GET /health and one tiny /retrieve with the rollouts' bearer token (api_key, default env
    RETRIEVER_API_KEY); StartupError naming the URL and the fix if either fails."""
    try:
        check_reachable(url, timeout=timeout, api_key=api_key)
    except SearchError as exc:
        if "refused /retrieve" in str(exc):
            raise StartupError(str(exc)) from None
        raise StartupError(
            f"{exc}. Fix: start it with `python -m retriever_server serve --index DIR --port PORT` and set "
            f"retriever.url=http://127.0.0.1:PORT/retrieve, or set retriever.url=auto to start one for this "
            f"run") from None


@contextlib.contextmanager
def retriever_for_run(cfg: TrainConfig, data: DataPaths, log_dir: Path):
    """Yield the retriever URL: the configured one (checked), or a server started for this run."""
    if cfg.retriever.url != AUTO:
        check_retriever(cfg.retriever.url)
        yield cfg.retriever.url
        return
    if cfg.retriever.index:  # the user's index: built only when missing, never replaced
        index = Path(cfg.retriever.index).expanduser()
        build = not (index / "manifest.json").is_file()
    else:  # ours: rebuilt when the world's corpus.jsonl has changed since
        index = data.dir / "index_bm25"
        build = not index_matches_corpus(index, data.corpus)
    if build:
        print(f"[trainer] building the BM25 index {index} ...", flush=True)
        subprocess.run([sys.executable, "-m", "retriever_server", "build", "--corpus", str(data.corpus),
                        "--kind", "bm25", "--out", str(index), "--force"], check=True)
    server = ServerProcess([index], log_dir / "retriever.log", flags=["--torch-threads", "1", "--faiss-threads", "1"])
    try:
        server.start(timeout=cfg.retriever.startup_timeout)
    except ServerStartError as exc:
        raise StartupError(f"{exc}\n(raise retriever.startup_timeout on a busy machine)") from None
    try:
        check_retriever(server.url)
        print(f"[trainer] retriever serving {index} at {server.url}", flush=True)
        yield server.url
    finally:
        server.stop()


# -- run --------------------------------------------------------------------------------------------
def check_paths(cfg: TrainConfig) -> None:
    """The files and directories the config names exist (ValueError naming the key and the fix)."""
    d = cfg.data
    for key in ("train_files", "test_files"):
        for f in getattr(d, key):
            if not Path(f).expanduser().is_file():
                raise ValueError(
                    f"config data.{key} lists {f!r}, which does not exist. Fix: generate the data "
                    f"(`python -m search_r1.data.synth --out DIR`) or point data.{key} at existing "
                    f"parquet files, or leave it empty ([]) to use data.dir")
    for f in cfg.warmstart.train_files:
        if not Path(f).expanduser().is_file():
            raise ValueError(f"config warmstart.train_files lists {f!r}, which does not exist. Fix: point it at "
                             f"existing parquet files, or leave it empty ([]) to draw the demonstrations from "
                             f"data.train_files")
    if cfg.trainer.val_baseline:
        from search_r1.trainer.alarms import first_validation

        try:
            first_validation(Path(cfg.trainer.val_baseline).expanduser())
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"config trainer.val_baseline: {exc}. Fix: point it at the metrics.jsonl (or "
                             f"output_dir) of a run that validated, or leave it empty") from None
    if d.dir != AUTO and not (d.train_files and d.test_files):
        for name in ("train.parquet", "test.parquet"):
            if not (Path(d.dir).expanduser() / name).is_file():
                raise ValueError(
                    f"config data.dir={d.dir!r} has no {name}. Fix: set data.dir=auto (generate "
                    f"the default synthetic world), generate one with `python -m search_r1.data.synth "
                    f"--out {d.dir}`, or set data.train_files/data.test_files")
    index = cfg.retriever.index
    if index and not Path(index).expanduser().is_dir():
        raise ValueError(f"config retriever.index={index!r} is not a directory. Fix: build one with "
                         f"`python -m retriever_server build --corpus C.jsonl --kind bm25 --out DIR` "
                         f"or leave retriever.index empty")
    resume = cfg.trainer.resume
    if resume not in (AUTO, "none") and not Path(resume).expanduser().exists():
        raise ValueError(f"config trainer.resume={resume!r} is invalid: allowed 'auto', 'none' or an existing "
                         f"checkpoint directory. Fix: point trainer.resume at a checkpoint (e.g. "
                         f"OUTPUT/checkpoints/global_step_10) or use auto")
    if cfg.rollout.backend == "vllm":  # before anything slow: vLLM lives in its own environment
        from search_r1.rollout.vllm_server import find_vllm_python

        find_vllm_python(cfg.rollout.vllm_python)


def check_cores(cfg: TrainConfig) -> None:
    t = cfg.trainer
    cores = os.cpu_count() or 1
    if t.n_workers * t.threads_per_worker > cores:
        raise ValueError(
            f"config trainer.n_workers * trainer.threads_per_worker = {t.n_workers} * {t.threads_per_worker} "
            f"exceeds the {cores} CPU cores: allowed a product <= {cores}. Fix: lower threads_per_worker "
            f"or n_workers (oversubscribed torch threads slow every step down)")


def resolve_dtypes(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with model.compute_dtype / model.rollout_dtype `auto` replaced by this machine's choice
    (search_r1.dtypes: bf16 only where the CPU runs it clearly faster), so the run directory's
    config.json, the warm-start cache key and the workers all see the dtype that actually runs."""
    from search_r1.dtypes import resolve_dtype

    m = cfg.model
    model = dataclasses.replace(m, compute_dtype=resolve_dtype(m.compute_dtype, "compute", "model.compute_dtype"),
                                rollout_dtype=resolve_dtype(m.rollout_dtype, "rollout", "model.rollout_dtype"))
    return dataclasses.replace(cfg, model=model)


def worker_spec(cfg: TrainConfig, model_path: str | None = None):
    """The workers' spec; `model_path` (the warm-started directory) replaces model.name for both the
    policy and the KL reference."""
    from search_r1.trainer.workers import WorkerSpec

    a, o, t, m = cfg.algorithm, cfg.optim, cfg.trainer, resolve_dtypes(cfg).model
    # With a vLLM sampler the workers keep no bf16 sampling copy (the server holds the rollout weights).
    rollout_dtype = "float32" if cfg.rollout.backend == "vllm" else m.rollout_dtype
    return WorkerSpec(
        model_name=model_path or cfg.model.name, compute_dtype=m.compute_dtype, rollout_dtype=rollout_dtype,
        threads=t.threads_per_worker,
        seed=t.seed, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
        grad_clip=o.grad_clip, clip_ratio=a.clip_ratio, kl_coef=a.kl_coef, kl_type=a.kl_type,
        entropy_coef=a.entropy_coef, loss_agg=a.loss_agg, temperature=cfg.rollout.temperature,
        rollout_is=a.rollout_is, rollout_is_threshold=a.rollout_is_threshold, ppo_epochs=t.ppo_epochs,
        micro_batch_size=t.micro_batch_size, use_ref=a.uses_ref, skip_zero_advantage=a.skip_zero_advantage,
        anchor_coef=a.anchor_coef, anchor_plan_weight=a.anchor_plan_weight, llds_coef=a.llds_coef,
        llds_gate=a.llds_gate,
        reuse_freed_memory=t.reuse_freed_memory, omp_spincount=t.omp_spincount)


def warm_start(cfg: TrainConfig, data: DataPaths, search_engine, url: str | None = None) -> str | None:
    """Run (or reuse) the supervised format warm-start; the HF directory the workers load, or None.

    With a retriever URL the SFT runs in a spawned child process, so its ~5 GB of optimizer state
    and activations are returned to the OS before the Ray workers load (glibc keeps freed heap in
    the driver otherwise); with an in-process search engine (tests) it runs here.
    """
    w = cfg.warmstart
    if not w.enabled:
        return None
    from search_r1.trainer.warmstart import ensure_warmstart, ensure_warmstart_with_url

    kwargs = dict(steps=w.steps, batch_size=w.batch_size, lr=w.lr, n_examples=w.n_examples, seed=w.seed,
                  max_obs_length=cfg.rollout.max_obs_length, max_tokens_per_turn=cfg.rollout.max_tokens_per_turn,
                  protocol=cfg.data.protocol, fmt=w.format, two_hop_share=w.two_hop_share, lr_schedule=w.lr_schedule,
                  batching=w.batching, no_search_share=w.no_search_share,
                  compute_dtype=resolve_dtypes(cfg).model.compute_dtype,
                  threads=cfg.trainer.threads_per_worker)
    files = warmstart_files(cfg, data)
    if url is None:
        return str(ensure_warmstart(cfg.model.name, search_engine, files, **kwargs)[0])
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    r = cfg.retriever
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        future = pool.submit(ensure_warmstart_with_url, cfg.model.name, url, r.topk, r.timeout, r.retries, files,
                             kwargs)
        try:
            return future.result()
        except BaseException:  # SIGTERM / Ctrl-C: stop the SFT now (leaving `with` would wait for it to finish)
            for child in multiprocessing.active_children():
                child.terminate()
            raise


def warmstart_files(cfg: TrainConfig, data: DataPaths) -> list[str]:
    """The training files demonstrations are drawn from: warmstart.train_files, else data.train_files."""
    return ([str(Path(f).expanduser()) for f in cfg.warmstart.train_files]
            or [str(f) for f in data.train_files])


def anchor_demos(cfg: TrainConfig, data: DataPaths, search_engine, tokenizer) -> list:
    """The supervised anchor's pool (algorithm.anchor_coef > 0; else []): anchor_examples
    demonstrations in the warm-start's format from its training files, drawn with seed
    warmstart.seed + 1 (another draw than the warm-start's own), anchor_two_hop_share of them two-hop."""
    a, w, r = cfg.algorithm, cfg.warmstart, cfg.rollout
    if a.anchor_coef <= 0:
        return []
    from search_r1.trainer.warmstart import build_demos

    demos = build_demos(tokenizer, search_engine, warmstart_files(cfg, data), n_examples=a.anchor_examples,
                        seed=w.seed + 1, max_obs_length=r.max_obs_length, max_tokens_per_turn=r.max_tokens_per_turn,
                        protocol=cfg.data.protocol, fmt=w.format, two_hop_share=a.anchor_two_hop_share)
    if len(demos) < a.anchor_batch_size:
        raise ValueError(f"algorithm.anchor_batch_size={a.anchor_batch_size} but only {len(demos)} anchor "
                         f"demonstrations qualified. Fix: lower algorithm.anchor_batch_size")
    print(f"[trainer] supervised anchor: {len(demos)} demonstrations ({sum(d.hops == 2 for d in demos)} two-hop), "
          f"{a.anchor_batch_size} per update at coefficient {a.anchor_coef}, first round weighted "
          f"{a.anchor_plan_weight}", flush=True)
    return demos


def init_ray(num_cpus: int) -> bool:
    """Start a local Ray with an explicit CPU count unless one is running; True if started here."""
    import ray

    if ray.is_initialized():
        return False
    # Ray runs workers at niceness 15 by default; on a shared CPU machine that starves the very
    # processes that do the training, so they run at the driver's priority instead.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                                       "TRANSFORMERS_OFFLINE": "1"}})
    return True


def run(cfg: TrainConfig, search_engine=None) -> dict:
    """Train with a validated config; returns the fit summary plus output locations."""
    import ray
    import torch

    from search_r1.data.dataset import PromptDataLoader, PromptDataset
    from search_r1.search import RetrieverClient
    from search_r1.trainer.metrics import MetricsLogger, plot_training_curves
    from search_r1.trainer.ray_trainer import RayGRPOTrainer
    from search_r1.trainer.workers import create_worker_group, shutdown_worker_group

    started_at = time.monotonic()  # trainer.time_budget_minutes counts from here (warm-start included)
    check_paths(cfg)
    check_cores(cfg)
    cfg = resolve_dtypes(cfg)
    torch.set_num_threads(1)  # the driver only decodes, scores and pads; the workers compute
    out = Path(cfg.trainer.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    old_metrics = out / "metrics.jsonl"
    if cfg.trainer.resume == "none" and old_metrics.is_file():
        # a fresh run must not append to an earlier run's record (a resumed run does, on purpose)
        kept = out / f"metrics.{int(old_metrics.stat().st_mtime)}.jsonl"
        old_metrics.rename(kept)
        print(f"[trainer] trainer.resume=none: moved the earlier {old_metrics.name} to {kept.name}", flush=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    data = prepare_data(cfg)

    with contextlib.ExitStack() as stack:
        url = None
        if search_engine is None:  # before anything slow: an unreachable retriever fails in seconds
            url = stack.enter_context(retriever_for_run(cfg, data, out))
            r = cfg.retriever
            search_engine = RetrieverClient(url, topk=r.topk, timeout=r.timeout, retries=r.retries)
        # Before Ray: the SFT has the cores to itself and its memory is freed before the workers load.
        model_path = warm_start(cfg, data, search_engine, url)
        from search_r1.models import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.name)
        train_ds = PromptDataset(list(data.train_files), tokenizer, cfg.data.max_prompt_length, cfg.data.protocol)
        val_ds = PromptDataset(list(data.test_files), tokenizer, cfg.data.max_prompt_length, cfg.data.protocol)
        loader = PromptDataLoader(train_ds, cfg.trainer.batch_size, seed=cfg.trainer.seed, shuffle=True,
                                  drop_last=True)
        on_sigterm = signal.getsignal(signal.SIGTERM)
        started_ray = init_ray(cfg.trainer.n_workers)
        if on_sigterm is stop_on_sigterm:  # ray.init installs its own (a bare sys.exit(15)); keep ours
            signal.signal(signal.SIGTERM, on_sigterm)
        if started_ray:
            stack.callback(ray.shutdown)
        group, pool = create_worker_group(worker_spec(cfg, model_path), cfg.trainer.n_workers)
        stack.callback(shutdown_worker_group, group, pool)
        logger = MetricsLogger(out, loggers=list(cfg.trainer.loggers), project=cfg.trainer.project,
                               experiment_name=cfg.trainer.experiment_name, config=cfg.to_dict())
        stack.callback(logger.close)
        rollout = None
        if cfg.rollout.backend == "vllm":
            from search_r1.models import resolve_model_path
            from search_r1.trainer.vllm_rollout import VLLMRollout

            r = cfg.rollout
            rollout = VLLMRollout(str(model_path or resolve_model_path(cfg.model.name)), out,
                                  dtype=cfg.model.rollout_dtype, seed=cfg.trainer.seed,
                                  max_model_len=r.max_prompt_length + r.max_tokens_per_turn,
                                  python=r.vllm_python, tokenizer=tokenizer)
            stack.callback(rollout.stop)
            rollout.start()
        trainer = RayGRPOTrainer(cfg, tokenizer, group, search_engine, loader, val_ds, logger,
                                 checkpoint_root=out / "checkpoints", rollout=rollout,
                                 anchor=anchor_demos(cfg, data, search_engine, tokenizer),
                                 started_at=started_at)
        summary = trainer.fit()
    metrics_path = out / "metrics.jsonl"
    plot_path = out / "training_curves.png"
    if metrics_path.is_file():
        plot_training_curves(metrics_path, plot_path)
    summary.update({"output_dir": str(out), "metrics": str(metrics_path), "plot": str(plot_path),
                    "tensorboard": str(out / "tensorboard")})
    return summary


def report(summary: dict) -> str:
    """The end-of-run text: where things are, the reward curve, validation before/after."""
    lines = ["", "=" * 72, "GRPO run finished",
             f"  metrics     {summary['metrics']}",
             f"  plot        {summary['plot']}",
             f"  checkpoint  {summary.get('checkpoint', '(none written)')}",
             f"  tensorboard {summary['tensorboard']}"]
    steps = [h for h in summary.get("history", []) if "reward/mean" in h]
    if steps:
        curve = " ".join(f"{h['reward/mean']:.2f}" for h in steps)
        lines.append(f"  reward/mean per step: {curve}")
    for tag in ("val_before", "val_after"):
        v = summary.get(tag)
        if v:
            lines.append(f"  {tag:<10}  EM {v.get('val/em', float('nan')):.3f}  F1 {v.get('val/f1', float('nan')):.3f}"
                         f"  reward {v.get('val/reward', float('nan')):.3f}  (n={int(v.get('val/n', 0))})")
    lines.append("=" * 72)
    return "\n".join(lines)


def stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (a scheduler's cancel, `kill`) unwinds the run like Ctrl-C does: run()'s ExitStack stops the
    retriever server, the vLLM server, the workers and Ray (Python's default would exit at once and leave
    those processes running). Checkpoints are written atomically, so the last complete one survives and
    trainer.resume=auto continues from it."""
    print("\n[trainer] SIGTERM: stopping the run, its retriever and its workers (a rerun with "
          "trainer.resume=auto continues from the last checkpoint)", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _hydra_main():
    import hydra
    from omegaconf import OmegaConf

    from search_r1.trainer.alarms import AlarmStop

    # The YAML ships inside the package (search_r1/trainer/configs), so `pip install .` without -e
    # finds it; configs/grpo_cpu.yaml at the repository root is a link to the same file.
    @hydra.main(config_path="configs", config_name="grpo_cpu", version_base="1.3")
    def main(raw) -> None:
        quiet_library_loggers()  # after Hydra's logging setup, which would reset them
        signal.signal(signal.SIGTERM, stop_on_sigterm)
        try:
            cfg = TrainConfig.from_dict(OmegaConf.to_container(raw, resolve=True))
            summary = run(cfg)
        except (ValueError, StartupError, FileNotFoundError) as exc:
            print(f"\n[trainer] error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
        except AlarmStop as exc:  # trainer.on_alarm=stop (or rollback with none left): the cause, non-zero
            print(f"\n[trainer] stopped: {exc}", file=sys.stderr, flush=True)
            sys.exit(AlarmStop.exit_code)
        print(report(summary), flush=True)

    main()


# Libraries that log every request or file access at INFO: between progress-bar updates the console
# would show one httpx line per retriever call. Hydra configures logging at INFO, so set them here.
if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _hydra_main()
