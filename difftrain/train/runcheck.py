"""Whether a recipe may train into its run directory (a fresh start, a resume, or a refusal that
says what to do), decided from the folder's files and its recipe.yaml alone, without torch.
`early_check` runs it before torch loads, for the refusals that do not depend on the machine.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
from pathlib import Path
from typing import Any

from difftrain import devicecheck
from difftrain.errors import RecipeError, RunDirError
from difftrain.io import LOCK_FILE, TEMP_GLOB, RunLock
from difftrain.recipe import Recipe, global_batch, read_yaml, recipe_from_dict
from difftrain.rundir import CONFIG, RECIPE, TOKENIZER, holds_run, weights_metadata
from difftrain.spec import Batch, Machine, resolve

# what a run's start writes before its first step: a folder holding only these trained nothing
STARTUP_FILES = {RECIPE, CONFIG, TOKENIZER}

# Keys a resume may change: how long, how often, where to log; how a step's batch is split (free
# while the global batch stays, `_global_batch`); compile (its checkpoint holds no compiled state).
RESUMABLE_CHANGES = set(
    """
    train.max_steps train.max_tokens train.resume train.log_every train.val_every train.save_every
    train.keep_checkpoints train.nan_skip_limit train.spike_factor train.spike_rollback
    train.spike_lr_factor train.devices train.num_nodes train.micro_batch_size train.global_batch_size
    train.activation_checkpointing train.compile train.strategy train.fsdp data.val_windows logging
    description data.num_workers data.pin_memory data.cache_dir
    """.split()
)


def _within(key: str, prefixes: Any) -> bool:
    """Whether dotted `key` is one of `prefixes` or lies under one ("logging" holds logging.progress)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def resumable_change(key: str) -> bool:
    """Whether a resume may change recipe key `key` (`RESUMABLE_CHANGES`, sections included)."""
    return _within(key, RESUMABLE_CHANGES)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value}; a list of lists as a list of tuples (a YAML list equals a tuple field)."""
    if isinstance(d, dict):
        return {key: v for k, sub in d.items() for key, v in _flatten(sub, f"{prefix}{k}.").items()}
    return {prefix[:-1]: [tuple(x) if isinstance(x, list) else x for x in d] if isinstance(d, list) else d}


def recipe_differences(
    old: dict[str, Any],
    new: dict[str, Any],
    *,
    unresolved: bool = False,
    ignore: frozenset[str] = frozenset(),
) -> list[str]:
    """Dotted keys whose values differ, ignoring those a resume may change and `ignore` (keys, or
    sections). `unresolved`: `new`'s machine-dependent `auto` values are not resolved yet, and a
    key set to auto there is no difference."""
    a, b = _flatten(old), _flatten(new)
    diffs = []
    for k in sorted(set(a) | set(b)):
        if resumable_change(k) or _within(k, ignore):
            continue
        va, vb = a.get(k), b.get(k)
        if va != vb and not ((unresolved or k.startswith("model.")) and vb == "auto"):
            diffs.append(k)
    return diffs


def _global_batch(recipe: dict[str, Any]) -> int | None:
    """The sequences per optimizer step of a run's recipe.yaml (None where it cannot be read)."""
    try:  # (devices: auto, never in a run's own recipe.yaml: None)
        t = recipe["train"]
        if t.get("global_batch_size"):
            return int(t["global_batch_size"])
        return int(t["micro_batch_size"]) * int(t.get("devices", 1)) * int(t.get("num_nodes", 1))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _listed(diffs: list[str]) -> str:
    """'a differs' / 'a, b differ' / 'a, b, c, d… differ' for the keys in which two recipes differ."""
    more = "…" if len(diffs) > 4 else ""
    return f"{', '.join(diffs[:4])}{more} {'differs' if len(diffs) == 1 else 'differ'}"


def in_use_message(run_dir: Path, holder: int) -> str:
    """Why a run directory another process trains into (holds its lock) is refused."""
    who = f"process {holder}" if holder else "another process"
    return (
        f"{run_dir} is in use: {who} is training into it; wait for it to end, or stop it (Ctrl-C "
        "saves a checkpoint) and resume"
    )


def require_not_in_use(run_dir: Path) -> None:
    """RunDirError when another process trains into `run_dir` (holds its lock)."""
    holder = RunLock(run_dir).holder()
    if holder is not None:
        raise RunDirError(in_use_message(run_dir, holder))


def check_run_dir(
    recipe: Recipe,
    *,
    resume: bool | str,
    overwrite: bool,
    batch: Batch | None,
    early: bool = False,
    ignore: frozenset[str] = frozenset(),
) -> dict[str, Any] | None:
    """Refuse what may not train into `recipe.run_dir`; else the recipe.yaml of the run there when
    it may be resumed (`resume` True or "auto" and the same run), None for a fresh start.

    `batch` is None where the global batch is not known yet. `early` (`early_check`): auto values
    are not resolved, and where that or an unknown batch leaves the answer open it returns None
    (the full check runs later). `ignore`: keys not compared yet."""
    run_dir = recipe.run_dir
    existing = run_dir / RECIPE
    # how the user asked to resume: the flag, or the recipe's key (which the flag's absence leaves)
    asked = "--resume (or train.resume: true)" if recipe.train.resume is True else "--resume"
    require_not_in_use(run_dir)
    files = (
        [p for p in run_dir.rglob("*") if p.is_file() and p != run_dir / LOCK_FILE]
        if run_dir.is_dir()
        else []
    )
    if early:  # temporary files of unfinished writes, which the full check removes first
        files = [p for p in files if not fnmatch.fnmatch(p.name, TEMP_GLOB)]
    # only what a start writes before its first step: a start that failed trained nothing
    startup_only = existing.is_file() and all(p.parent == run_dir and p.name in STARTUP_FILES for p in files)
    has_files = bool(files) and not startup_only
    if overwrite and run_dir.exists():
        if resume is True:
            raise RecipeError(f"--overwrite and {asked} contradict each other; pick one")
        if files and not holds_run(run_dir):
            raise RunDirError(
                f"{run_dir} exists and is not a difftrain run directory (no {RECIPE}): --overwrite replaces "
                "only runs; choose another `name`/`out_dir`, or move its files away yourself"
            )
        return None  # removed after every check: a mistake found on the way must not cost the run
    if not has_files:
        if resume is True:
            raise RunDirError(f"{asked}: {run_dir} holds no run yet; start it without resuming")
        return None
    # a model written by import or merge: its recipe.yaml describes it, not a training to continue
    command = "finetune" if recipe.finetune is not None else "pretrain"
    made_by = weights_metadata(run_dir)  # one read of model.safetensors' header
    src, adapter = made_by.get("imported_from"), made_by.get("merged_from")
    if src is not None:
        raise RunDirError(
            f"{run_dir} holds a model imported from {src} by `difftrain import`, which has no training "
            f"to resume or {command} into; fine-tune it (finetune.base: {run_dir}), train into another "
            "`name`, or replace it with --overwrite"
        )
    if adapter is not None:
        raise RunDirError(
            f"{run_dir} holds the merge of the LoRA run {adapter} by `difftrain merge`, which has no training "
            f"to resume or {command} into; continue the LoRA run (`difftrain finetune {shlex.quote(adapter)} "
            f"--resume`, then merge again), fine-tune the merge (finetune.base: {run_dir}), or train into "
            "another `name`"
        )
    if not existing.is_file():
        if holds_run(run_dir):  # a run that lost its recipe (its config.json is there)
            raise RunDirError(
                f"{run_dir} holds a run ({CONFIG}) whose {RECIPE} is missing; restore it "
                f"(the recipe the run was started with, as {run_dir / RECIPE}) to resume, or start over with "
                "--overwrite"
            )
        raise RunDirError(
            f"{run_dir} exists and is not a difftrain run directory; choose another `name`/`out_dir` or remove it"
        )
    try:  # read as a resume reads it: a file cut short or edited into no recipe is no run to compare with
        old, _ = read_yaml(existing)
        recipe_from_dict(old, existing.parent)
    except RecipeError as e:
        raise RunDirError(
            f"the run's recipe is damaged ({e}); restore the recipe the run was started with as {existing} "
            "to resume it, or start again with --overwrite"
        ) from e
    old_ft = old.get("finetune")
    if (
        recipe.finetune is not None
        and isinstance(old_ft, dict)
        and isinstance(old_ft.get("base"), str)
        and os.path.realpath(os.path.expanduser(old_ft["base"]))
        == os.path.realpath(os.path.expanduser(str(recipe.finetune.base)))
    ):  # the same folder however it is written (a trailing /, .., a symbolic link to it)
        ignore = ignore | {"finetune.base"}
    # out_dir only says where the run folder is (this one, however it is written); recipe.yaml
    # paths may be absolute or as given: the same run either way
    ignore = ignore | {"out_dir"}
    diffs = min(
        (
            recipe_differences(old, r.model_dump(mode="json"), unresolved=early, ignore=ignore)
            for r in (recipe.with_absolute_paths(), recipe)
        ),
        key=len,
    )
    if "finetune.base" in diffs and recipe.finetune is not None and isinstance(old_ft, dict):
        raise RunDirError(
            f"{run_dir} was fine-tuned from {old_ft.get('base')}, not finetune.base={recipe.finetune.base}: a "
            "different base makes a different run; continue it from its own base with "
            f"`difftrain finetune {shlex.quote(str(run_dir))} --resume`, fine-tune the new base into another "
            "`name`, or replace the run with --overwrite"
        )
    if diffs:
        raise RunDirError(
            f"{run_dir} holds a different run ({_listed(diffs)}); continue it as it was with "
            f"`difftrain {command} {shlex.quote(str(run_dir))} --resume`, replace it with --overwrite, "
            "or choose another `name`"
        )
    if early and (batch is None or _has_auto(recipe)) and (recipe.finetune is None or resume is not False):
        return None  # the same run as far as can be told before the machine is known
    old_global = _global_batch(old)
    if batch is not None and old_global is not None and old_global != batch[0]:
        global_bs, micro, world, accumulate = batch
        raise RunDirError(
            f"{run_dir} trains with a global batch of {old_global} sequences per step, this recipe makes "
            f"{global_bs} (micro_batch_size {micro} × devices×nodes {world} × accumulation {accumulate}); "
            f"set train.global_batch_size={old_global} to resume it (micro-batch and devices may change), "
            "or start again with --overwrite"
        )
    if resume is False:
        raise RunDirError(
            f"{run_dir} already holds a run; continue it with --resume, start again with --overwrite, "
            "or choose another `name`"
        )
    return old


def _has_auto(recipe: Recipe) -> bool:
    """Whether a value `resolve_auto` fixes per machine is still auto in `recipe`."""
    t = recipe.train
    return "auto" in (t.precision, t.compile, recipe.optim.name)


def early_check(recipe: Recipe, *, resume: bool | None, overwrite: bool) -> None:
    """`check_run_dir` before torch loads: the refusals that do not depend on the machine. Where
    torch can see no GPU the recipe is resolved as the run resolves it there, so a GPU-only option
    is refused in the run's words. Decides nothing else and writes nothing."""
    resume = recipe.train.resume if resume is None else resume
    if recipe.finetune is not None:  # its model and tokenizer come from the base run, read later
        ignore = frozenset({"model", "tokenizer"})
        check_run_dir(recipe, resume=resume, overwrite=overwrite, batch=None, early=True, ignore=ignore)
        return
    devicecheck.check_loggers(recipe)  # a missing logger package: as the run refuses it, before torch
    t = recipe.train
    batch = None
    if t.accelerator != "mps" and devicecheck.no_cuda_here():
        spec = resolve(recipe, Machine())
        recipe, batch = spec.recipe, spec.batch
    elif t.devices != "auto":
        devices = int(t.devices)
        global_bs, accumulate = global_batch(t, devices)
        batch = (global_bs, t.micro_batch_size, devices * t.num_nodes, accumulate)
    check_run_dir(recipe, resume=resume, overwrite=overwrite, batch=batch, early=True)
