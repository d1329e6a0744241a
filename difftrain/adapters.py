"""LoRA / QLoRA adapter runs: a run directory that holds only its adapter and points at its base.

    runs/<finetune>/
      adapter.safetensors   LoRA matrices (…q_proj.lora_A, …q_proj.lora_B) + tensors trained in
                            full (λ; the embedding and head when the vocabulary grew)
      adapter.json          method, rank, alpha, targets, which layers were 4-bit, and the base run:
                            its path (relative to this run, and absolute) and the SHA-256 of its
                            weights file, so a changed or swapped base is detected, not silently used
      config.json, tokenizer.json, recipe.yaml, metrics.csv, summary.json, checkpoints/  (as usual)

`load_adapter_run` rebuilds the fine-tuned model from base + adapter (what `load_run` does for
such a directory), `merge_run` folds the adapter into the base and writes a plain run directory,
and `adapt_model` turns a loaded base into the model a LoRA fine-tune trains. The model-side
pieces (LoRALinear, 4-bit layers, vocabulary growth) are in `difftrain.model.lora`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from difftrain.errors import CheckpointError, ConfigError, RunDirError
from difftrain.io import atomic_save_safetensors, atomic_write_json, atomic_write_text, uncreatable_reason
from difftrain.rundir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECKPOINTS,
    CONFIG,
    METRICS,
    RECIPE,
    SUMMARY,
    TOKENIZER,
    WEIGHTS,
    Run,
    holds_run,
    is_adapter_run,
    load_config,
    read_safetensors,
    require_run_dir,
    require_weights,
    save_weights,
)

FORMAT = "difftrain-lora"
VERSION = 1

# Names of the differential-attention λ parameters (diff: four vectors; diff2: a projection).
LAMBDA_SUFFIXES = (
    ".self_attn.lambda_q1",
    ".self_attn.lambda_k1",
    ".self_attn.lambda_q2",
    ".self_attn.lambda_k2",
    ".self_attn.lambda_proj.weight",
)


@dataclass
class AdapterSpec:
    """What adapter.json records: enough to rebuild the trained model from its base run."""

    method: str  # lora | qlora
    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]  # the patterns as written in the recipe
    targets: list[str]  # the linear layers they matched
    trained: list[str] = field(default_factory=list)  # parameters trained in full
    quantized: list[str] = field(default_factory=list)  # layers held in 4-bit NF4 (qlora)
    base: dict[str, Any] = field(default_factory=dict)  # path, abs_path, weights_file, weights_sha256
    vocab: dict[str, Any] = field(default_factory=dict)  # base_vocab_size, vocab_size, new_ids, used_rows
    step: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any, where: Path) -> AdapterSpec:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RunDirError(f"{where} is not a difftrain adapter file (format {FORMAT!r} expected)")
        if data.get("version", 0) > VERSION:
            raise RunDirError(
                f"{where} was written by a newer difftrain (adapter format {data['version']}); upgrade difftrain"
            )
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        try:
            return cls(**fields)
        except TypeError as e:
            raise RunDirError(f"{where} is incomplete ({e}); fine-tune again or restore the file") from e


def read_adapter_spec(run_dir: Path) -> AdapterSpec:
    f = Path(run_dir) / ADAPTER_CONFIG
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{run_dir} has no {ADAPTER_CONFIG}; it is not a LoRA fine-tune") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{f} is not valid JSON ({e}); restore it or fine-tune again") from e
    return AdapterSpec.from_json(data, f)


def weights_file(run_dir: Path) -> Path:
    """The file that holds a run's own weights: model.safetensors, or its adapter."""
    d = Path(run_dir)
    return d / ADAPTER_WEIGHTS if is_adapter_run(d) else d / WEIGHTS


def weights_sha256(run_dir: Path) -> str:
    from difftrain.io import sha256_file  # (train.checkpoint would load Lightning)

    return sha256_file(weights_file(run_dir))


def base_reference(base_dir: Path, run_dir: Path) -> dict[str, Any]:
    """How an adapter names its base: relative path (survives moving both), absolute path, hash."""
    base_abs = Path(base_dir).resolve()
    try:
        rel = os.path.relpath(base_abs, Path(run_dir).resolve())
    except ValueError:  # different drives (Windows)
        rel = str(base_abs)
    f = weights_file(base_abs)
    return {
        "path": rel,
        "abs_path": str(base_abs),
        "weights_file": f.name,
        "weights_sha256": weights_sha256(base_abs),
    }


def resolve_base(run_dir: Path, spec: AdapterSpec) -> Path:
    """The base run of an adapter run, verified to hold the weights the adapter was trained on."""
    run_dir = Path(run_dir)
    ref = spec.base
    candidates = []
    if ref.get("path"):
        candidates.append((run_dir / ref["path"]).resolve())
    if ref.get("abs_path"):
        candidates.append(Path(ref["abs_path"]))
    base = next((c for c in candidates if c.is_dir()), None)
    if base is None:
        shown = ", ".join(dict.fromkeys(str(c) for c in candidates)) or "(none recorded)"
        raise RunDirError(
            f"{run_dir} is a LoRA adapter whose base run is gone (looked in {shown}); put the base run back "
            f'there, or, if you moved it, set "path" under "base" in {run_dir / ADAPTER_CONFIG} to its new '
            "folder (its weights' SHA-256 is checked)"
        )
    expected = ref.get("weights_sha256")
    if expected:
        f = weights_file(base)
        if not f.is_file():
            raise RunDirError(
                f"the base run {base} of adapter {run_dir} has no {f.name}; restore the base run's weights"
            )
        actual = weights_sha256(base)
        if actual != expected:
            raise CheckpointError(
                f"the base run {base} has changed since {run_dir} was fine-tuned from it ({f.name} sha256 "
                f"{actual[:12]}…, adapter expects {expected[:12]}…); restore the base weights it was trained "
                "on, or fine-tune again from the current base"
            )
    return base


# --------------------------------------------------------------------------------------------
# building the adapted model


def lambda_params(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(LAMBDA_SUFFIXES)]


def quantizable_layers(model: nn.Module, exclude: set[str]) -> list[str]:
    """The linear layers of the decoder blocks a QLoRA base stores in 4 bits (embeddings, the
    output head and layers trained in full stay dense)."""
    from difftrain.model.lora import linear_names

    return [n for n in linear_names(model) if n.startswith("model.layers.") and n not in exclude]


def plan_adapter(
    model: nn.Module,
    *,
    method: str,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    train_lambdas: bool,
    train_embeddings: bool,
) -> AdapterSpec:
    """Decide which layers get LoRA, which parameters train in full and which layers go 4-bit."""
    from difftrain.model.lora import match_targets

    trained = lambda_params(model) if train_lambdas else []
    if train_embeddings:
        trained.append("model.embed_tokens.weight")
        head = getattr(model, "lm_head", None)
        if head is not None and head.weight is not model.model.embed_tokens.weight:  # type: ignore[union-attr]
            trained.append("lm_head.weight")
    full_layers = {n.rsplit(".", 1)[0] for n in trained if n.endswith(".weight")}
    targets = match_targets(model, target_modules, exclude=full_layers, where="finetune.lora.target_modules")
    tied = model.lm_head.weight is model.model.embed_tokens.weight  # type: ignore[union-attr]
    if "lm_head" in targets and tied:
        raise ConfigError(
            "finetune.lora.target_modules matches lm_head, but the base ties lm_head to the embedding: a LoRA "
            "update of the head cannot be merged into one shared matrix; drop lm_head from the patterns"
        )
    quantized = quantizable_layers(model, full_layers) if method == "qlora" else []
    return AdapterSpec(
        method=method,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        target_modules=list(target_modules),
        targets=targets,
        trained=trained,
        quantized=quantized,
    )


def plan_finetune_adapter(model: nn.Module, ft: Any, *, train_embeddings: bool) -> AdapterSpec:
    """`plan_adapter` with a recipe's `finetune:` section (method, LoRA settings, λ)."""
    return plan_adapter(
        model,
        method=ft.method,
        rank=ft.lora.rank,
        alpha=ft.lora.alpha,
        dropout=ft.lora.dropout,
        target_modules=ft.lora.target_modules,
        train_lambdas=ft.train_lambdas,
        train_embeddings=train_embeddings,
    )


def rank_warning(model: nn.Module, spec: AdapterSpec) -> str | None:
    """A warning when the LoRA rank is above the smallest dimension of an adapted layer: a rank
    of min(in, out) already spans every update of that layer, so the rest only costs parameters."""
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


def adapt_model(
    model: nn.Module,
    spec: AdapterSpec,
    *,
    quantize_on: torch.device | str | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """Freeze `model`, put LoRA on `spec.targets`, and make `spec.trained` trainable (in place).

    quantize_on: a device to hold `spec.quantized` in 4-bit NF4 (training a QLoRA run). None
    instead rounds those weights through NF4 and keeps them dense (loading a QLoRA adapter: the
    same function without 4-bit kernels).
    """
    from difftrain.model.lora import apply_lora, nf4_round_trip_, quantize_4bit

    model.requires_grad_(False)
    if spec.quantized:
        if quantize_on is not None:
            quantize_4bit(model, spec.quantized, device=quantize_on, compute_dtype=compute_dtype)
        else:
            nf4_round_trip_(model, spec.quantized)
    apply_lora(model, spec.targets, spec.rank, spec.alpha, spec.dropout)
    params = dict(model.named_parameters())
    for name in spec.trained:
        if name not in params:
            raise CheckpointError(f"the adapter trains `{name}`, which this model does not have")
        params[name].requires_grad_(True)


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What adapter.safetensors holds: every trainable parameter (LoRA matrices and ones trained in full)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def save_adapter(run_dir: Path, model: nn.Module, spec: AdapterSpec, step: int) -> None:
    """Write adapter.safetensors, then adapter.json (both atomically)."""
    spec.step = step
    atomic_save_safetensors(
        Path(run_dir) / ADAPTER_WEIGHTS,
        {k: v.float() for k, v in adapter_tensors(model).items()},
        metadata={"format": "pt", "producer": "difftrain", "step": str(step)},
    )
    atomic_write_json(Path(run_dir) / ADAPTER_CONFIG, spec.to_json())


# --------------------------------------------------------------------------------------------
# loading and merging


def load_adapter_run(
    path: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    merge: bool = True,
) -> Run:
    """Rebuild a LoRA fine-tune from its base run + adapter files.

    merge=True folds the adapter into the weights (in fp32, before any cast to `dtype`): plain
    linear layers, full speed. merge=False keeps the LoRA layers (base + B·A at every call).
    """
    from difftrain.model.lora import grow_vocab, merge_lora
    from difftrain.rundir import load_run, load_run_tokenizer

    path = require_run_dir(Path(path))
    spec = read_adapter_spec(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise RunDirError(
            f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; restore it, or resume the fine-tune with "
            f"`difftrain finetune {path / RECIPE} --resume`"
        )
    base_dir = resolve_base(path, spec)
    base = load_run(base_dir)  # fp32 on CPU; an adapter base is merged
    model = base.model
    config = load_config(path)
    base_cfg = base.config
    for key in (
        "arch",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "ffn_hidden",
        "tie_embeddings",
    ):
        if getattr(config, key) != getattr(base_cfg, key):
            raise RunDirError(
                f"{path / CONFIG} has {key}={getattr(config, key)} but its base run {base_dir} has "
                f"{getattr(base_cfg, key)}; the adapter belongs to another base"
            )
    if config.vocab_size != base_cfg.vocab_size or spec.vocab.get("new_ids"):
        grow_vocab(
            model,
            spec.vocab.get("new_ids", []),
            config.vocab_size,
            int(spec.vocab.get("used_rows", base_cfg.vocab_size)),
        )
    model.config = config  # attn_impl / max_seq_len as the fine-tune set them
    model.attn_impl = config.attn_impl
    adapt_model(model, spec)
    sd = read_safetensors(weights)
    expected = adapter_tensors(model)
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise CheckpointError(
            f"{weights} does not match {ADAPTER_CONFIG} ({what}); the two files come from different fine-tunes"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in sd.items():
            if tuple(v.shape) != tuple(params[k].shape):
                raise CheckpointError(
                    f"{weights}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(params[k].shape)}"
                )
            params[k].copy_(v.to(params[k].dtype))
    model.requires_grad_(False)
    if merge:
        merge_lora(model)
    tokenizer = load_run_tokenizer(path)
    model.to(device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    model.eval()
    return Run(path=path, model=model, config=config, tokenizer=tokenizer)


def default_merge_dir(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    return run_dir.parent / f"{run_dir.name}-merged"


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
    """Fold a LoRA adapter into its base and write a plain run directory (no adapter, no checkpoints).

    out_dir defaults to `<run_dir>-merged`. Returns it.
    """
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
    out = Path(out_dir) if out_dir is not None else default_merge_dir(run_dir)
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
    if out.is_dir():  # removed once the merged model is in memory
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    run.config.to_json(out / CONFIG)  # type: ignore[attr-defined]
    run.tokenizer.save(out / TOKENIZER)  # type: ignore[attr-defined]
    for name in (RECIPE, METRICS):
        if (run_dir / name).is_file():
            atomic_write_text(out / name, (run_dir / name).read_text(encoding="utf-8"))
    summary: dict[str, Any] = {}
    if (run_dir / SUMMARY).is_file():
        try:
            summary = json.loads((run_dir / SUMMARY).read_text())
        except (OSError, json.JSONDecodeError):
            summary = {}
    summary["merged_from"] = {
        "adapter_run": str(run_dir.resolve()),
        "base_run": spec.base.get("abs_path"),
        "method": spec.method,
        "step": spec.step,
    }
    atomic_write_json(out / SUMMARY, summary)
    save_weights(
        out / WEIGHTS, run.model, {"step": str(spec.step), "merged_from": str(Path(run_dir).resolve())}
    )
    return out
