"""Pretraining, used by the CLI and by tests: `setup_pretrain` makes every check before the first
write (the run and its dry run alike), `pretrain` runs the recipe and returns the run's figures,
and `fit` is the loop (Lightning module, callbacks, loggers, Trainer, summary) that
`difftrain.train.finetune` shares.
"""

from __future__ import annotations

import logging
import math
import shlex
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from difftrain.devicecheck import has_tensorboard
from difftrain.errors import CheckpointError, RecipeError, StopRequested
from difftrain.io import atomic_write_json
from difftrain.model.config import vocab_rows
from difftrain.recipe import Recipe
from difftrain.rundir import METRICS, RECIPE, SUMMARY
from difftrain.spec import RunSpec, resolve
from difftrain.train.distributed import DistContext
from difftrain.train.preflight import (
    check_vocab_early,
    dry_run_warnings,
    memory_warnings,
    preflight,
    start_warnings,
    training_into,
)


@dataclass
class TrainResult:
    run_dir: Path
    summary: dict[str, Any]
    resumed_from: int | None = None
    warnings: list[str] = field(default_factory=list)
    is_global_zero: bool = True  # False in the other processes of a multi-device run
    finished_before: bool = False  # a resume of a run that had already reached its last step
    notes: list[str] = field(default_factory=list)  # what a finished run's resume did (restored weights)


@dataclass
class Hooks:
    """What the caller of a training run watches or adds: the progress bar (None: the recipe's
    logging.progress), the console it prints on, `on_start(StartInfo)` once everything is set up
    (the CLI prints the start table from it), Lightning callbacks, a test hook for the
    LightningModule (`fault_hook`) and the data preparation's progress callback."""

    progress: bool | None = None
    console: Any = None
    on_start: Callable[[StartInfo], None] | None = None
    extra_callbacks: list[Any] = field(default_factory=list)
    fault_hook: Any = None
    data_progress: Any = None


@dataclass
class FitOptions:
    """How `fit` trains what the entry point (pretrain, finetune) set up: `counts` to report;
    `export(run_dir, model, step)` writes instead of model.safetensors (LoRA: the adapter files);
    `save_frozen`, `step_seed`, `token_mean`: see LitLM; `validate_first` measures the val loss
    before a fresh run's first step (summary `initial_val_loss`); `tokens_per_micro_batch=0`
    counts each batch's tokens; `details`: the `PretrainSetup` / `FinetuneSetup`, for the start table."""

    counts: dict[str, int]
    has_val: bool
    resume_command: str
    warnings: Sequence[str] = ()
    details: Any = None
    export: Any = None
    save_frozen: bool = True
    step_seed: int | None = None
    validate_first: bool = False
    tokens_per_micro_batch: int = 0
    summary_extra: dict[str, Any] = field(default_factory=dict)
    token_mean: bool = False


@dataclass
class StartInfo:
    """What a run's start table shows: the spec it runs, where it resumes, its parameter counts,
    its start-up warnings and the entry point's `details`."""

    spec: RunSpec
    resumed_from: int | None
    counts: dict[str, int]
    trainable_params: int
    total_params: int
    warnings: list[str]
    details: Any


def start_processes(spec: RunSpec) -> DistContext:
    """Start or join the run's processes (one per device; see `difftrain.train.distributed`)."""
    from difftrain.train.distributed import start

    n = spec.recipe.train.num_nodes
    return start(spec.recipe, accelerator=spec.accelerator, devices=spec.devices, num_nodes=n)


def _quiet_lightning() -> None:
    """Silence Lightning's info logs and the warnings that do not apply to difftrain's runs."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ignored = (
        "does not have many workers|TensorBoard|LeafSpec|`isinstance.*treespec|Checkpoint directory.*exists "
        "and is not empty|`IterableDataset` has `__len__` defined|defined a `validation_step` but have no "
        "`val_dataloader`"
    )
    warnings.filterwarnings("ignore", message=f".*({ignored})")


def prepare_text(spec: RunSpec, dist: DistContext, progress: Any) -> Any:
    """The recipe's text tokenized into cached shards, by rank 0 first (the others hit its cache)."""
    from difftrain.data.shards import prepare_data

    r, progress = spec.recipe, progress if dist.is_global_zero else None
    return dist.rank_zero_first(
        lambda: prepare_data(r.data, r.tokenizer, seed=r.seed, base_dir=r.recipe_dir, progress=progress)
    )


@dataclass
class PretrainSetup:
    """What a pretraining run decides before its model is built (`setup_pretrain`): the spec (its
    vocabulary sized to the tokenizer once the data is prepared), the run folder's decision, the
    run's processes, the prepared data (None in a dry run) or, in a dry run, the index of data
    prepared already (None: not yet), and the start-up warnings known so far."""

    spec: RunSpec
    resuming: bool
    point: Any
    dist: DistContext | None = None
    prepared: Any = None
    tokenizer: Any = None
    index: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)


def setup_pretrain(
    recipe: Recipe,
    *,
    resume: bool | str | None,
    overwrite: bool,
    start: Callable[[RunSpec], DistContext] | None = None,
    data_progress: Any = None,
) -> PretrainSetup:
    """Every check a pretraining run makes before its first write: the recipe against this
    machine (`resolve`), the run folder (`preflight`), the data and the tokenizer's fit to the
    model. `start` starts the run's processes (`start_processes`); rank 0 decides the folder and
    prepares the data. Without it, the dry run: nothing is written, the tokenizer is checked as
    far as it exists (tokenizer.path, or the size the recipe trains) and data prepared already
    is checked against the sequence length."""
    from difftrain.data.shards import cached_index, check_split_sizes
    from difftrain.data.tokenizer import check_vocab_fits, load_tokenizer
    from difftrain.plan import tokenizer_size
    from difftrain.train.distributed import require_node_launcher

    if recipe.finetune is not None:
        raise RecipeError(
            f"{recipe.source or recipe.name} is a fine-tuning recipe (finetune.base: {recipe.finetune.base}); "
            f"run it with `difftrain finetune {recipe.command_arg}`"
        )
    spec = resolve(recipe)
    r = spec.recipe
    flag: bool | str = r.train.resume if resume is None else resume
    if start is None:
        require_node_launcher(r.train.num_nodes)  # (the run's `start` refuses it there)
        resuming, point = preflight(spec, resume=flag, overwrite=overwrite, dry_run=True)
        warnings = [] if resuming else [check_vocab_early(r, tokenizer_size(r))]  # (a resume's fits)
        index = cached_index(r.data, r.tokenizer, seed=r.seed, base_dir=r.recipe_dir)
        if index is not None and r.data.recall_specs is None:  # (recall: one example per sequence)
            check_split_sizes(
                index["train"]["tokens"], index["val"]["tokens"], spec.seq_len, r.data.val_windows
            )
        warnings = [w for w in warnings if w] + dry_run_warnings(spec, point)
        return PretrainSetup(spec, resuming, point, index=index, warnings=warnings)
    dist = start(spec)
    # rank 0 decides (and may clear the folder); the others learn the decision
    resuming, point = dist.on_rank_zero(lambda: preflight(spec, resume=flag, overwrite=overwrite))
    prepared = prepare_text(spec, dist, data_progress)  # data + tokenizer (a second run reuses both)
    tokenizer = load_tokenizer(prepared.tokenizer_path)
    if spec.model.vocab_size == "auto":  # (with_model keeps the recipe's folder and source)
        spec = spec.with_model(spec.model.replace(vocab_size=vocab_rows(tokenizer.vocab_size)))
    check_vocab_fits(tokenizer, spec.model.vocab_size)
    warned = memory_warnings(spec.recipe, spec.accelerator)
    return PretrainSetup(spec, resuming, point, dist, prepared, tokenizer, warnings=warned)


def pretrain(
    recipe: Recipe,
    *,
    resume: bool | str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    console: Any = None,
    on_start: Callable[[StartInfo], None] | None = None,
    extra_callbacks: Sequence[Any] = (),
    fault_hook: Any = None,
    data_progress: Any = None,
) -> TrainResult:
    """Train a model from scratch (or resume one) as the recipe says; returns the run's figures.
    The keyword arguments after `overwrite` are the run's `Hooks`."""
    import lightning as L

    from difftrain.data.modules import PretrainDataModule
    from difftrain.model import Transformer

    hooks = Hooks(progress, console, on_start, [*extra_callbacks], fault_hook, data_progress)
    _quiet_lightning()
    setup = setup_pretrain(
        recipe, resume=resume, overwrite=overwrite, start=start_processes, data_progress=data_progress
    )
    spec, r = setup.spec, setup.spec.recipe

    L.seed_everything(r.seed, workers=True, verbose=False)
    model = Transformer(spec.model)
    model.set_activation_checkpointing(r.train.activation_checkpointing)
    # checks the data against the sequence length: a split too short fails before anything is written
    dm = PretrainDataModule.from_config(
        setup.prepared, r.data, seq_len=spec.seq_len, micro_batch_size=r.train.micro_batch_size, seed=r.seed
    )
    opts = FitOptions(
        counts=model.num_params(),
        has_val=r.data.val_windows > 0,
        resume_command=f"difftrain pretrain {shlex.quote(str(spec.run_dir / RECIPE))} --resume",
        details=setup,
        warnings=[*setup.warnings, *([dm.val_note] if dm.val_note else [])],
        tokens_per_micro_batch=r.train.micro_batch_size * spec.seq_len,
    )
    with training_into(setup, replace=overwrite):
        return fit(spec, model, dm, setup.point, opts, hooks)


def fit(
    spec: RunSpec, model: torch.nn.Module, datamodule: Any, point: Any, opts: FitOptions, hooks: Hooks
) -> TrainResult:
    """The training loop shared by `pretrain` and `finetune`: Lightning module, callbacks, loggers,
    Trainer, fit (resuming from `point`, a ResumePoint or None), final validation, summary.json.
    The run directory holds recipe.yaml, config.json and tokenizer.json (`training_into`)."""
    import lightning as L

    from difftrain.model.lora import count_params
    from difftrain.train.callbacks import CallbackSettings, RunCallback, flops_per_token
    from difftrain.train.checkpoint import AtomicCheckpointIO
    from difftrain.train.distributed import build_strategy, is_global_zero
    from difftrain.train.lit import LitLM
    from difftrain.train.metrics import MetricsCSV, read_metrics

    r, model_cfg, run_dir = spec.recipe, spec.model, spec.run_dir
    t = r.train
    if point is not None and point.path.is_dir() and t.strategy != "fsdp":
        raise CheckpointError(
            f"{point.path} is a sharded FSDP checkpoint (train.fsdp.checkpoint=sharded), which only FSDP "
            "can load; resume with train.strategy=fsdp (on any number of GPUs)"
        )
    lit = LitLM(
        model,
        r.optim,
        total_steps=spec.max_steps,
        accumulate=spec.accumulate,
        grad_clip=t.grad_clip,
        nan_skip_limit=t.nan_skip_limit,
        compile=bool(t.compile),
        tokens_per_micro_batch=opts.tokens_per_micro_batch,
        check_grads=t.precision != "16-mixed",
        save_frozen=opts.save_frozen,
        step_seed=opts.step_seed,
        token_mean=opts.token_mean,
    )
    lit.fault_hook = hooks.fault_hook
    lit.resume_path = point.path if point else None
    if point is not None and point.step >= spec.max_steps:  # type: ignore[operator]
        done = _resume_finished(spec, lit, point, opts.export)
        if done is not None:
            return done
    # Training FLOPs per token: 6·N for trained weights, 4·N for frozen ones (forward + the
    # backward to their inputs, no weight gradient), embeddings excluded.
    n_total, n_trainable = count_params(model)
    emb = model.model.embed_tokens.weight  # type: ignore[union-attr]
    n_train = n_trainable - (emb.numel() if emb.requires_grad else 0)
    d_attn = model_cfg.n_heads * model_cfg.head_dim  # type: ignore[operator]
    fpt = flops_per_token(n_train, model_cfg.n_layers, d_attn, spec.seq_len) + 4 * (
        n_total - emb.numel() - n_train
    )
    has_val = opts.has_val
    settings = CallbackSettings(
        save_every=t.save_every,
        keep=t.keep_checkpoints,
        log_every=t.log_every,
        tokens_per_step=spec.tokens_per_step,
        flops_per_token=fpt,
        progress=r.logging.progress if hooks.progress is None else hooks.progress,
        console=hooks.console,
        resume_command=opts.resume_command,
        export=opts.export,
        spike_factor=t.spike_factor,
        spike_rollback=t.spike_rollback,
        spike_lr_factor=t.spike_lr_factor,
        warmup_steps=r.optim.warmup_steps,
        val_every=t.val_every if has_val else 0,
    )
    cb = RunCallback(run_dir, settings)
    loggers: list[Any] = [MetricsCSV(run_dir / METRICS, resume_step=point.step if point else None)]
    tb = r.logging.tensorboard
    if tb is True or (tb == "auto" and has_tensorboard()):
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version=""))
    if r.logging.wandb_project:  # (installed: `resolve` refuses the recipe otherwise)
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(
            WandbLogger(project=r.logging.wandb_project, entity=r.logging.wandb_entity, name=r.name)
        )
    trainer = L.Trainer(
        accelerator=spec.accelerator,
        devices=spec.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(r, spec.world_size),
        precision=t.precision,
        max_steps=spec.max_steps,
        max_epochs=-1,
        val_check_interval=t.val_every * spec.accumulate,
        check_val_every_n_epoch=None,
        limit_val_batches=1.0 if has_val else 0,
        num_sanity_val_steps=0,
        logger=loggers,
        log_every_n_steps=1,
        callbacks=[*hooks.extra_callbacks, cb],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(run_dir),
    )
    if hooks.on_start is not None and is_global_zero():
        warned = start_warnings(spec, point, opts.warnings)
        resumed = point.step if point else None
        hooks.on_start(StartInfo(spec, resumed, opts.counts, n_trainable, n_total, warned, opts.details))
    initial_val = None
    if opts.validate_first and point is None and has_val:
        trainer.validate(lit, datamodule=datamodule, verbose=False)
        initial_val = cb.state.last_val if math.isfinite(cb.state.last_val) else None
        cb.state.last_val, cb.state.best_val, cb.state.last_val_step = math.nan, math.inf, -1
    t0 = time.perf_counter()
    try:
        trainer.fit(
            lit, datamodule=datamodule, ckpt_path=str(point.path) if point else None, weights_only=True
        )
    except StopRequested:
        # stopped (and saved): summary.json says where the run stands, not what an earlier end said
        if trainer.is_global_zero and trainer.global_step > 0:
            wall = time.perf_counter() - t0
            atomic_write_json(run_dir / SUMMARY, _summary(spec, lit, cb, opts, n_trainable, wall, False))
        raise
    wall = time.perf_counter() - t0
    if trainer.global_step > 0 and has_val and cb.state.last_val_step != trainer.global_step:
        # (a run whose last step was a val_every step has its final loss already; `cb` records it)
        trainer.validate(lit, datamodule=datamodule, verbose=False)
    summary = _summary(spec, lit, cb, opts, n_trainable, wall, finished=True)
    if opts.validate_first:
        if initial_val is None and point is not None:  # a resumed run: logged at step 0
            rows = [x for x in read_metrics(run_dir / METRICS) if x.get("step") == 0 and "val/loss" in x]
            initial_val = rows[0]["val/loss"] if rows else None
        summary["initial_val_loss"] = initial_val
    if trainer.is_global_zero:
        atomic_write_json(run_dir / SUMMARY, summary)
    resumed, warned = (point.step, point.warnings) if point else (None, [])
    return TrainResult(run_dir, summary, resumed, warned, is_global_zero=trainer.is_global_zero)


def _resume_finished(spec: RunSpec, lit: Any, point: Any, export: Any) -> TrainResult | None:
    """A resume of a run whose last checkpoint is at train.max_steps: nothing to train. Rewrites
    the inference weights from that checkpoint where they are missing, damaged or of an older
    step, and returns the run's summary.json as it is; None without a final summary (`fit` then
    measures the final validation loss and writes one)."""
    from difftrain.rundir import read_summary
    from difftrain.train.distributed import is_global_zero

    run_dir, step, notes = spec.run_dir, point.step, []
    problem = _final_weights_problem(run_dir, step, adapter=export is not None)
    if problem is not None:
        if point.path.is_dir():
            raise CheckpointError(
                f"{problem}, and the last checkpoint ({point.path.name}) is sharded: rewrite the weights by "
                "resuming with train.strategy=fsdp on as many GPUs as wrote it"
            )
        if is_global_zero():
            from difftrain.train.callbacks import save_inference_weights
            from difftrain.train.checkpoint import load_checkpoint_file

            ckpt = load_checkpoint_file(point.path)
            lit.on_load_checkpoint(ckpt)
            lit.load_state_dict(ckpt["state_dict"], strict=lit.strict_loading)
            save_inference_weights(run_dir, lit.model, step, export)
        notes.append(f"{problem}: rewrote it from {point.path.parent.name}/{point.path.name}")
    summary = read_summary(run_dir)
    if not summary or summary.get("finished") is False or summary.get("steps") != step:
        return None  # none, or one of a stop before the end: the fit below writes the final one
    return TrainResult(
        run_dir, summary, step, point.warnings, is_global_zero(), finished_before=True, notes=notes
    )


def _final_weights_problem(run_dir: Path, step: int, *, adapter: bool) -> str | None:
    """What is wrong with a run's inference weights (model.safetensors, or adapter.safetensors +
    adapter.json of a LoRA fine-tune) as the weights of step `step`; None when nothing is."""
    from safetensors import safe_open

    from difftrain.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_spec
    from difftrain.errors import DifftrainError
    from difftrain.rundir import WEIGHTS, read_safetensors

    path = run_dir / (ADAPTER_WEIGHTS if adapter else WEIGHTS)
    if not path.is_file():
        return f"{path} is missing"
    try:
        read_safetensors(path)  # every tensor: a truncated file fails here
    except CheckpointError:
        return f"{path} is damaged"
    with safe_open(str(path), "pt") as f:  # the header only
        written = (f.metadata() or {}).get("step")
    if written != str(step):
        return f"{path} holds the weights of step {written or '?'}, not of step {step}"
    if adapter:
        try:
            spec_step = read_adapter_spec(run_dir).step
        except DifftrainError:
            return f"{run_dir / ADAPTER_CONFIG} is missing or damaged"
        if spec_step != step:
            return f"{run_dir / ADAPTER_CONFIG} is not of step {step}"
    return None


def _summary(
    spec: RunSpec, lit: Any, cb: Any, opts: FitOptions, trainable: int, wall: float, finished: bool
) -> dict[str, Any]:
    r = spec.recipe
    train_time = lit.train_time or wall
    tps = lit.tokens_seen / train_time if train_time > 0 else 0.0
    last_loss: float | None = lit.last_loss
    if not math.isfinite(lit.last_loss):  # no step ran in this process (a finished run's resume)
        from difftrain.train.metrics import read_metrics

        logged = [row["train/loss"] for row in read_metrics(spec.run_dir / METRICS) if "train/loss" in row]
        last_loss = logged[-1] if logged and math.isfinite(logged[-1]) else None
    return {
        "name": r.name,
        "arch": r.model.arch,
        "params": opts.counts["total"],
        "steps": lit.global_step,
        "tokens": lit.tokens_seen,
        "wall_time_s": round(wall, 2),
        "train_time_s": round(train_time, 2),
        "tokens_per_s": round(tps, 1),
        # compiled: the rate once compiled (the last logged window), which tokens_per_s, over the
        # whole run, mixes with the compilation
        "steady_tokens_per_s": round(cb.steady_tokens_per_s, 1)
        if r.train.compile and cb.steady_tokens_per_s
        else None,
        "mfu": tps * cb.flops_per_token / cb.peak_flops if cb.peak_flops else None,
        "peak_rss_mb": round(cb.state.peak_rss_mb, 1) if cb.state.peak_rss_mb > 0 else None,
        "peak_gpu_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if spec.accelerator == "cuda" else None,
        "final_train_loss": last_loss,
        "final_val_loss": cb.state.last_val if math.isfinite(cb.state.last_val) else None,
        "best_val_loss": cb.state.best_val if math.isfinite(cb.state.best_val) else None,
        "skipped_steps": lit.skipped_steps,
        "loss_spikes": cb.spikes,
        "spike_rollbacks": cb.rollbacks,
        "precision": r.train.precision,
        "optimizer": r.optim.name,
        "device": spec.device,
        "attention": spec.attention,
        "devices": spec.world_size,
        "torch": torch.__version__,
        "trainable_params": trainable,
        "finished": finished,
        **opts.summary_extra,
    }
