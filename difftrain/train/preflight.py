"""What a run checks and writes around its training, for `pretrain` and `finetune` alike: the
run folder's decision (`preflight`: a fresh start, a resume, or a refusal that says what to do),
the warnings a run gives at its start, the files a resume restores, and the run folder's
lifetime (`training_into`: the lock, recipe.yaml, config.json, tokenizer.json).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from difftrain.errors import ConfigError, RecipeError, RunDirError, TokenizerError
from difftrain.io import LOCK_FILE, RunLock, atomic_write_text, remove_stale_temps
from difftrain.recipe import Recipe
from difftrain.rundir import CHECKPOINTS, CONFIG, RECIPE, TOKENIZER
from difftrain.spec import RunSpec
from difftrain.train.runcheck import _global_batch, check_run_dir, in_use_message, require_not_in_use


def preflight(
    spec: RunSpec, *, resume: bool | str, overwrite: bool, dry_run: bool = False
) -> tuple[bool, Any]:
    """The run folder's checks, made before work starts by the run and its dry run alike: decide
    between a fresh start and a resume, and refuse to clobber a different run, to resume past the
    run's end, or to resume a run in use. Returns (resuming, ResumePoint | None); the point
    carries the resume's warnings. `dry_run`: decide and refuse the same way, remove nothing.
    """
    from difftrain.train.checkpoint import find_resume_checkpoint

    run_dir = spec.run_dir
    require_not_in_use(run_dir)  # before anything is removed
    # a run killed while it started (or saved) leaves temporary files, which must not block its restart
    for folder in () if dry_run else (run_dir, run_dir / CHECKPOINTS):
        remove_stale_temps(folder)
    old = check_run_dir(spec.recipe, resume=resume, overwrite=overwrite, batch=spec.batch)
    if old is None:
        return False, None
    point = find_resume_checkpoint(run_dir / CHECKPOINTS)
    if point is None:
        if resume is True:
            raise RunDirError(
                f"--resume: {run_dir} has no checkpoint to resume from (its {CHECKPOINTS}/ holds none); "
                "start it again with --overwrite"
            )
        from difftrain.adapters import ADAPTER_WEIGHTS
        from difftrain.rundir import WEIGHTS

        saved = next((n for n in (WEIGHTS, ADAPTER_WEIGHTS) if (run_dir / n).is_file()), None)
        if saved is not None:  # it trained and saved: starting over (train.resume: auto) would replace it
            raise RunDirError(
                f"{run_dir} holds a trained run ({saved}) but no checkpoint to resume it from (its "
                f"{CHECKPOINTS}/ holds none), and train.resume: auto would start it over; replace it with "
                "--overwrite, or train into another `name`"
            )
        if not dry_run:
            shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)
        return False, None
    if point.step > spec.max_steps:
        raise RecipeError(
            f"{run_dir} is at step {point.step} (its last checkpoint), past train.max_steps={spec.max_steps}: "
            f"a resume only trains on; raise train.max_steps above {point.step}, or start again with --overwrite"
        )
    if note := _schedule_note(old, spec, point.step, _global_batch(old)):
        point.warnings.append(note)
    old_data = old.get("data")
    windows = old_data.get("val_windows") if isinstance(old_data, dict) else None
    if isinstance(windows, int) and windows != spec.recipe.data.val_windows:
        point.warnings.append(
            f"data.val_windows changed from {windows} to {spec.recipe.data.val_windows}: validation losses "
            f"after step {point.step} are measured on other windows than those before it"
        )
    return True, point


def _schedule_note(old: dict[str, Any], spec: RunSpec, step: int, old_global: int | None) -> str | None:
    """A resume whose length changed (train.max_steps / max_tokens) recomputes the learning-rate
    schedule over the new length: the note says how far the lr of the next step moves from the
    one the run's own schedule had (a finished cosine run extended warms up again)."""
    from difftrain.train.optim import lr_multiplier

    t = old.get("train") if isinstance(old, dict) else None
    if not isinstance(t, dict):
        return None
    try:
        before = int(t["max_steps"]) if t.get("max_steps") else None
        if before is None and t.get("max_tokens") and old_global:
            before = -(-int(t["max_tokens"]) // (old_global * spec.seq_len))
    except (TypeError, ValueError):
        return None
    cfg = spec.recipe.optim
    if before is None or before == spec.max_steps or cfg.schedule == "constant":
        return None
    was, now = lr_multiplier(cfg, before)(step) * cfg.lr, lr_multiplier(cfg, spec.max_steps)(step) * cfg.lr
    if abs(now - was) <= 0.05 * was:
        return None
    return (
        f"the run's length changed from {before} to {spec.max_steps} steps: its {cfg.schedule} learning-rate "
        f"schedule now spans {spec.max_steps} steps, so step {step + 1} runs at lr {now:.2e} where the run's "
        f"own schedule had {was:.2e}"
    )


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def resumed_run_files(run_dir: Path, tokenizer: Any, point: Any) -> list[str]:
    """On a resume (rank 0, before anything is written): which of config.json and tokenizer.json
    `training_into` writes again because they are missing or unreadable, each with a start-up
    warning in `point`. RunDirError where tokenizer.json is readable but not `tokenizer` (the
    model's token ids would change meaning)."""
    from difftrain.data.tokenizer import load_tokenizer
    from difftrain.model import ModelConfig

    restore = []
    try:
        ModelConfig.from_json(run_dir / CONFIG)
    except ConfigError:  # missing, not JSON, not a model: the recipe's model is the run's
        restore.append(CONFIG)
    tok = run_dir / TOKENIZER
    try:
        theirs = load_tokenizer(tok).sha256
    except TokenizerError:
        restore.append(TOKENIZER)
    else:
        if theirs != tokenizer.sha256:
            raise RunDirError(
                f"{tok} is not the tokenizer this recipe trains with (the data or tokenizer settings changed "
                "since the run started, which would change what the model's token ids mean); restore them, "
                "or start again with --overwrite"
            )
    for name in restore:
        point.warnings.append(f"{run_dir / name} was missing or damaged: written again for this run")
    return restore


@contextlib.contextmanager
def training_into(setup: Any, *, replace: bool = False) -> Iterator[None]:
    """Around the training of a run set up by `setup_pretrain` or `setup_finetune`, after every
    check: rank 0 creates the run directory, holds its lock (`RunLock`) until the body ends, and on
    a fresh start writes recipe.yaml (absolute paths: resumable from any folder), config.json and
    tokenizer.json. The other ranks of a multi-process run write nothing of their own. A resume
    rewrites recipe.yaml where its resumable keys changed, and config.json and tokenizer.json where
    they are missing or damaged (`resumed_run_files`). `replace` (--overwrite on a fresh start):
    what the folder held is removed first, under the lock. Then waits for the ranks this process
    started."""
    spec, dist, tokenizer, fresh = setup.spec, setup.dist, setup.tokenizer, not setup.resuming
    run_dir, r = spec.run_dir, spec.recipe
    restore = [] if fresh else dist.on_rank_zero(lambda: resumed_run_files(run_dir, tokenizer, setup.point))
    lock = RunLock(run_dir)
    if dist.is_global_zero:
        holder = lock.acquire()
        if holder is not None:
            raise RunDirError(in_use_message(run_dir, holder))
    try:
        if dist.is_global_zero:
            if fresh and replace:
                _clear_run_dir(run_dir)
            (run_dir / CHECKPOINTS).mkdir(exist_ok=True)
            text = r.with_absolute_paths().to_yaml()
            if fresh or _read_text(run_dir / RECIPE) != text:
                # a resume may change what runcheck.RESUMABLE_CHANGES lists (train.max_steps, ...): the
                # folder's recipe is the run as it goes on, so resuming from it continues that run
                atomic_write_text(run_dir / RECIPE, text)
            assert r.model is not None
            if fresh or CONFIG in restore:
                r.model.to_json(run_dir / CONFIG)
            if fresh or TOKENIZER in restore:
                tokenizer.save(run_dir / TOKENIZER)
        yield
    finally:
        lock.release()
    dist.join()


def _clear_run_dir(run_dir: Path) -> None:
    """Remove everything in `run_dir` except its lock file (held by this process)."""
    for child in run_dir.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def start_warnings(spec: RunSpec, point: Any, warnings: Sequence[str] = ()) -> list[str]:
    """The warnings a run gives at its start: the resume's (a damaged checkpoint skipped, a
    changed schedule, ...), the caller's (`warnings`: the memory plan, ...), then, on a fresh
    start, the warm-up against the run's length."""
    return [*point.warnings, *warnings] if point else [*warnings, *_warmup_notes(spec)]


def dry_run_warnings(spec: RunSpec, point: Any) -> list[str]:
    """The start-up warnings a `--dry-run` can give without the data: those of `start_warnings`
    with the memory plan against this device."""
    return start_warnings(spec, point, memory_warnings(spec.recipe, spec.accelerator))


def _warmup_notes(spec: RunSpec) -> list[str]:
    """A warm-up as long as the run (`lr_multiplier` cuts it to max_steps - 1 steps)."""
    optim = spec.recipe.optim
    warmup, steps, schedule = optim.warmup_steps, spec.max_steps, optim.schedule
    if warmup < steps:
        return []
    if steps <= 1:
        return [
            f"optim.warmup_steps={warmup} with train.max_steps=1: the one step runs at the peak optim.lr "
            f"(no warm-up, no {schedule} decay)"
        ]
    return [
        f"optim.warmup_steps={warmup} is not below train.max_steps={steps}: warm-up is cut to "
        f"{steps - 1} step{'s' if steps != 2 else ''} and the {schedule} schedule to the last step; lower "
        "optim.warmup_steps"
    ]


def memory_warnings(r: Recipe, accelerator: str) -> list[str]:
    """`difftrain plan`'s warning when the run will not fit this device (the GPU's memory, or the
    RAM), for the start-up warnings: the planner only advises, it never stops a run."""
    from difftrain.plan import fit_warning

    try:
        warning = fit_warning(r, accelerator)
    except Exception as e:  # a planner failure must not cost the user a run
        logging.getLogger(__name__).debug("memory plan skipped: %s", e)
        return []
    return [warning] if warning else []


def check_vocab_early(r: Any, size: int) -> str | None:
    """The run's check of model.vocab_size before the tokenizer exists: a TokenizerError where
    tokenizer.path's `size` (or the fewest tokens a trained one has) does not fit, a warning where
    the `size` asked of the tokenizer to train may not."""
    vocab = r.model.vocab_size
    if vocab == "auto" or size <= vocab:
        return None
    if r.tokenizer.path is not None:
        raise TokenizerError(
            f"model.vocab_size is {vocab} but the tokenizer {r.tokenizer.path} has {size} tokens: ids past "
            f"{vocab - 1} would have no embedding; set model.vocab_size: auto (or at least {size})"
        )
    least = r.tokenizer.train.fixed_tokens  # the bytes and the special tokens
    if vocab < least:
        raise TokenizerError(
            f"model.vocab_size is {vocab} but the tokenizer this recipe trains has at least {least} tokens "
            f"(256 bytes and the special tokens; up to {size}, tokenizer.train.vocab_size): ids past "
            f"{vocab - 1} would have no embedding; set model.vocab_size: auto (or at least {size})"
        )
    return (
        f"model.vocab_size is {vocab} but the tokenizer this recipe trains may have up to {size} tokens "
        f"(tokenizer.train.vocab_size): the run stops if it has more than {vocab}; set model.vocab_size: "
        f"auto (or at least {size})"
    )
