"""LoRA / QLoRA adapter runs: a run directory that holds only its adapter and points at its base.

    runs/<finetune>/
      adapter.safetensors   LoRA matrices (…q_proj.lora_A, …q_proj.lora_B) + tensors trained in
                            full (λ; the embedding and head when the vocabulary grew)
      adapter.json          method, rank, alpha, targets, which layers were 4-bit, and the base run:
                            its path (relative to this run, and absolute) and the SHA-256 of its
                            weights file, so a changed or swapped base is detected, not silently used
      config.json, tokenizer.json, recipe.yaml, metrics.csv, summary.json, checkpoints/  (as usual)

This module plans and saves an adapter, and `merge_run` folds one into its base as a plain run
directory; reading one is `difftrain.rundir`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from difftrain.errors import ConfigError, RunDirError
from difftrain.io import (
    atomic_dir,
    atomic_save_safetensors,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
    uncreatable_reason,
)
from difftrain.layout import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECKPOINTS,
    CONFIG,
    METRICS,
    RECIPE,
    SUMMARY,
    TOKENIZER,
    WEIGHTS,
    holds_run,
)
from difftrain.rundir import (  # noqa: F401 - re-exported: `from difftrain.adapters import load_adapter_run`
    AdapterSpec,
    adapt_model,
    adapter_tensors,
    load_adapter_run,
    read_adapter_spec,
    require_run_dir,
    require_weights,
    resolve_base,
    save_weights,
    weights_file,
)

# the differential-attention λ parameters (diff: four vectors; diff2: a projection)
LAMBDA_SUFFIXES = tuple(f".self_attn.lambda_{n}" for n in ("q1", "k1", "q2", "k2", "proj.weight"))


def base_reference(base_dir: Path, run_dir: Path) -> dict[str, Any]:
    """How an adapter names its base: relative path (survives moving both), absolute path, hash."""
    base_abs = Path(base_dir).resolve()
    try:
        rel = os.path.relpath(base_abs, Path(run_dir).resolve())
    except ValueError:  # different drives (Windows)
        rel = str(base_abs)
    f = weights_file(base_abs)
    return {"path": rel, "abs_path": str(base_abs), "weights_file": f.name, "weights_sha256": sha256_file(f)}


def plan_finetune_adapter(model: nn.Module, ft: Any, *, train_embeddings: bool) -> AdapterSpec:
    """The adapter of a recipe's `finetune:` section on `model`: which layers get LoRA, which
    parameters train in full (λ unless frozen; the embedding and an untied head when
    `train_embeddings`) and which layers go 4-bit (QLoRA: the decoder blocks' linears but those)."""
    from difftrain.model.lora import linear_names, match_targets

    trained = (
        [n for n, _ in model.named_parameters() if n.endswith(LAMBDA_SUFFIXES)] if ft.train_lambdas else []
    )
    tied = model.lm_head.weight is model.model.embed_tokens.weight  # type: ignore[union-attr]
    if train_embeddings:
        trained += ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    full_layers = {n.rsplit(".", 1)[0] for n in trained if n.endswith(".weight")}
    lora = ft.lora
    targets = match_targets(
        model, lora.target_modules, exclude=full_layers, where="finetune.lora.target_modules"
    )
    if "lm_head" in targets and tied:
        raise ConfigError(
            "finetune.lora.target_modules matches lm_head, but the base ties lm_head to the embedding: a LoRA "
            "update of the head cannot be merged into one shared matrix; drop lm_head from the patterns"
        )
    quantized = (
        [n for n in linear_names(model) if n.startswith("model.layers.") and n not in full_layers]
        if ft.method == "qlora"
        else []
    )
    return AdapterSpec(
        method=ft.method,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        targets=targets,
        trained=trained,
        quantized=quantized,
    )


def rank_warning(model: nn.Module, spec: AdapterSpec) -> str | None:
    """A warning when the LoRA rank is above the smallest dimension of an adapted layer."""
    modules = dict(model.named_modules())
    dims = {t: min(modules[t].in_features, modules[t].out_features) for t in spec.targets if t in modules}
    if not dims:
        return None
    small = min(dims, key=dims.__getitem__)
    if spec.rank <= dims[small]:
        return None
    return (
        f"finetune.lora.rank={spec.rank} is above the size of adapted layers such as {small} ({dims[small]}): a "
        f"rank of {dims[small]} already spans every update of it, more only adds parameters; lower "
        "finetune.lora.rank"
    )


def save_adapter(run_dir: Path, model: nn.Module, step: int, spec: AdapterSpec) -> None:
    """Write adapter.safetensors, then adapter.json (both atomically)."""
    spec.step = step
    atomic_save_safetensors(
        Path(run_dir) / ADAPTER_WEIGHTS,
        {k: v.float() for k, v in adapter_tensors(model).items()},
        metadata={"format": "pt", "producer": "difftrain", "step": str(step)},
    )
    atomic_write_json(Path(run_dir) / ADAPTER_CONFIG, spec.to_json())


def _runs_read_by(run_dir: Path) -> list[Path]:
    """The adapter run and every base under it (a base may itself be an adapter run)."""
    runs, seen = [run_dir], {run_dir.resolve()}
    while (runs[-1] / ADAPTER_CONFIG).is_file():
        base = resolve_base(runs[-1], read_adapter_spec(runs[-1]))
        if base.resolve() in seen:
            break
        runs.append(base)
        seen.add(base.resolve())
    return runs


def merge_run(run_dir: Path | str, out_dir: Path | str | None = None, *, overwrite: bool = False) -> Path:
    """Fold a LoRA adapter into its base and write a plain run directory (no adapter, no
    checkpoints) to `out_dir` (default `<run_dir>-merged`); return it."""
    run_dir = require_run_dir(Path(run_dir))
    if not (run_dir / ADAPTER_CONFIG).is_file():
        if (run_dir / ADAPTER_WEIGHTS).is_file() and not (run_dir / WEIGHTS).is_file():
            require_weights(run_dir)  # an adapter that lost its adapter.json: says so, and how to restore it
        what = f"it has {WEIGHTS}" if (run_dir / WEIGHTS).is_file() else "it holds no adapter"
        raise RunDirError(
            f"nothing to merge in {run_dir}: {what} (only a LoRA fine-tune has an adapter to fold)"
        )
    if (run_dir / WEIGHTS).is_file():
        raise RunDirError(
            f"{run_dir} has both {ADAPTER_CONFIG} and {WEIGHTS}; it is already merged (or was overwritten): "
            "load it as a plain run"
        )
    out = Path(out_dir) if out_dir is not None else run_dir.parent / f"{run_dir.name}-merged"
    why = uncreatable_reason(out)
    if why is not None:
        raise RunDirError(f"cannot write OUT_DIR {out}: {why}; choose another OUT_DIR")
    if out.resolve() == run_dir.resolve():
        raise RunDirError(
            f"the merged run must go to a new directory, not {run_dir} itself (the adapter run stays resumable)"
        )
    for read in _runs_read_by(run_dir):  # --overwrite must never remove what the merge reads
        if out.resolve() == read.resolve() or out.resolve() in read.resolve().parents:
            what = "is" if out.resolve() == read.resolve() else "holds"
            raise RunDirError(
                f"OUT_DIR {out} {what} the run {read} that the merge reads (the adapter or its base); "
                "choose another OUT_DIR"
            )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (out.is_dir() and holds_run(out)):  # --overwrite would not help: say so at once
            raise RunDirError(
                f"{out} exists and is not a difftrain run directory"
                + (" (--overwrite replaces only runs)" if overwrite else "")
                + "; choose another OUT_DIR, or move it away yourself"
            )
        # what training wrote (checkpoints, an adapter) is never replaced: only an earlier merge
        # or import, which the command that made it can make again
        trained = [n for n in (CHECKPOINTS, ADAPTER_CONFIG, ADAPTER_WEIGHTS) if (out / n).exists()]
        if trained:
            raise RunDirError(
                f"{out} holds a trained run ({trained[0]}); merge writes a new run and never replaces "
                "one that training wrote"
                + (" (--overwrite replaces an earlier merge or import only)" if overwrite else "")
                + ": choose another OUT_DIR, or remove that run first"
            )
        if not overwrite:
            raise RunDirError(
                f"{out} holds a run already; choose another OUT_DIR or pass --overwrite to replace it"
            )
    run = load_adapter_run(run_dir, merge=True)
    spec = read_adapter_spec(run_dir)
    summary: dict[str, Any] = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):  # missing or damaged: a new one
        summary = json.loads((run_dir / SUMMARY).read_text())
    summary["merged_from"] = {
        "adapter_run": str(run_dir.resolve()),
        "base_run": spec.base.get("abs_path"),
        "method": spec.method,
        "step": spec.step,
    }
    with atomic_dir(out) as new:  # an earlier merge there is replaced only once this one is whole
        run.config.to_json(new / CONFIG)  # type: ignore[attr-defined]
        run.tokenizer.save(new / TOKENIZER)  # type: ignore[attr-defined]
        for name in (RECIPE, METRICS):
            if (run_dir / name).is_file():
                atomic_write_text(new / name, (run_dir / name).read_text(encoding="utf-8"))
        atomic_write_json(new / SUMMARY, summary)
        merged_from = str(Path(run_dir).resolve())
        save_weights(new / WEIGHTS, run.model, {"step": str(spec.step), "merged_from": merged_from})
    return out
