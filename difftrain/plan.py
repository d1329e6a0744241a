"""Memory planning of a recipe: will its training run fit the device, and if not, what makes it fit.

`plan_recipe` resolves the recipe for the target as training would (what training refuses there,
the plan refuses), estimates its memory (`difftrain.memory`) and, when it does not fit, lists the
cheapest changes that do (`suggest`). `pretrain` and `finetune` warn with `fit_warning`.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from difftrain.errors import ConfigError, DeviceError, RecipeError
from difftrain.memory import (  # noqa: F401 - optimizer_bytes, saved_activation_bytes re-exported
    GiB,
    KiB,
    LoRADropout,
    MemoryPlan,
    MiB,
    Param,
    Settings,
    Sharding,
    Target,
    _params_of,
    activations,
    lora_dropout_of,
    model_params,
    optimizer_bytes,
    plan_memory,
    saved_activation_bytes,
    step_activations,
)
from difftrain.model.config import ModelConfig, vocab_rows
from difftrain.spec import Machine, RunSpec, resolve

MAX_GPU_MEMORY = 4 * 2**40  # above any one GPU: a slip of the finger (8000GB for 80GB) is refused
_UNITS = {"b": 1} | {
    u + s: size for u, size in (("k", KiB), ("m", MiB), ("g", GiB), ("t", 2**40)) for s in ("", "b", "ib")
}


def parse_memory(text: str) -> int:
    """'8GB', '8 GiB', '11.5G', '24000MB' → bytes. GB and GiB both mean 2³⁰ (GPU memory sizes are
    binary: an "8 GB" card has 8192 MiB)."""
    if str(text).strip().startswith("-"):
        raise ConfigError(f"--gpu-mem {text!r} is negative; give the GPU's memory, e.g. 8GB")
    if re.fullmatch(r"\s*[0-9.]+[eE][-+]?[0-9]+\s*[a-zA-Z]*\s*", str(text)):
        raise ConfigError(
            f"--gpu-mem {text!r}: exponents are not taken; write the size out, e.g. 1000GB or 8GB"
        )
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"--gpu-mem {text!r}: give a size with a unit, e.g. 8GB, 11.5GiB or 24000MB (GB = GiB = 2^30 bytes)"
        )
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if not MiB <= size <= MAX_GPU_MEMORY:
        what = "less than 1 MiB" if size < MiB else "more than one GPU holds (the limit taken is 4 TiB)"
        raise ConfigError(f"--gpu-mem {text!r} is {what}; give one GPU's memory, e.g. 8GB")
    return size


def fmt_bytes(n: float) -> str:
    """Bytes as '5.24 TiB' / '1.23 GiB' / '456.0 MiB' / '12.0 KiB'."""
    for unit, size in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("GiB", "TiB") else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def activation_table(config: ModelConfig, settings: Settings, target: Target) -> list[dict[str, Any]]:
    """Activations of one micro-batch for every arch × precision × checkpointing at this shape."""
    rows = []
    for arch in ("baseline", "diff", "diff2"):
        cfg = config.replace(arch=arch)
        params = model_params(cfg)
        for precision, ckpt in itertools.product(("32-true", "bf16-mixed", "bf16-true"), (False, True)):
            s = replace(settings, precision=precision, checkpointing=ckpt, lora_dropout=None)
            a = step_activations(cfg, params, s, target)
            rows.append(
                {"arch": arch, "precision": precision, "checkpointing": ckpt, "bytes": round(a.total)}
            )
    return rows


@dataclass
class Suggestion:
    """A set of recipe changes (dotted key → value) that makes the run fit, and its cost."""

    changes: dict[str, Any]
    plan: MemoryPlan
    cost: float
    why: list[str]

    @property
    def overrides(self) -> str:
        return " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.changes.items()
        )


# Relative cost of each change (made up but ordered): halving the micro-batch costs a little GPU
# efficiency per halving, checkpointing ≈ 30 % compute, bf16-true a numerics change, shorter
# sequences change what the model learns.
COSTS = {"optimizer": 1.0, "micro_halving": 1.5, "checkpointing": 3.0, "bf16_true": 5.0, "seq_halving": 10.0}


def suggest(
    config: ModelConfig,
    settings: Settings,
    target: Target,
    params: list[Param] | None = None,
    *,
    method: str = "full",
    limit: int = 3,
) -> list[Suggestion]:
    """The cheapest combinations of changes that make the plan fit, cheapest first; none that
    is a superset of a cheaper one, and none that needs as much memory as a cheaper one (halving
    the sequences saves what halving the micro-batch saves, and changes what the model learns)."""
    params = model_params(config) if params is None else params
    s0 = settings
    # no 8-bit optimizer under FSDP: training refuses it (`devicecheck.check_strategy`)
    opts = [s0.optimizer] + ([] if s0.optimizer != "adamw" or s0.fsdp is not None else ["adamw8bit"])
    ckpts = [s0.checkpointing] + ([] if s0.checkpointing else [True])
    micros = [s0.micro_batch_size >> i for i in range(s0.micro_batch_size.bit_length())]  # halvings
    precisions = [s0.precision] + (["bf16-true"] if s0.precision == "bf16-mixed" and method == "full" else [])
    seqs = [s0.seq_len >> i for i in range(4) if s0.seq_len >> i >= 64] or [s0.seq_len]
    found: list[Suggestion] = []
    for opt, ck, micro, prec, seq in itertools.product(opts, ckpts, micros, precisions, seqs):
        s = replace(s0, optimizer=opt, checkpointing=ck, micro_batch_size=micro, precision=prec, seq_len=seq)
        if s == s0 or (s0.global_batch_size // s0.world_size) % micro:
            continue
        changes: dict[str, Any] = {}
        why, cost = [], 0.0
        if opt != s0.optimizer:
            changes["optim.name"] = opt
            cost += COSTS["optimizer"]
            why.append("8-bit optimizer state (≈2 bytes/param instead of 8)")
        if ck != s0.checkpointing:
            changes["train.activation_checkpointing"] = True
            cost += COSTS["checkpointing"]
            why.append("activation checkpointing (≈30% more compute)")
        if micro != s0.micro_batch_size:
            changes["train.micro_batch_size"] = micro
            changes["train.global_batch_size"] = s0.global_batch_size
            cost += COSTS["micro_halving"] * math.log2(s0.micro_batch_size / micro)
            accumulate = s0.global_batch_size // (micro * s0.world_size)
            why.append(f"micro-batch {micro}, accumulating {accumulate}× (same global batch)")
        if prec != s0.precision:
            changes["train.precision"] = prec
            cost += COSTS["bf16_true"]
            why.append("bf16-true: bf16 weights without fp32 master copies")
        if seq != s0.seq_len:
            changes["train.seq_len"] = seq
            cost += COSTS["seq_halving"] * math.log2(s0.seq_len / seq)
            why.append(f"sequences of {seq} tokens (changes what the model learns)")
        p = plan_memory(config, s, target, params, method=method)
        if p.fits:
            found.append(Suggestion(changes, p, cost, why))
    found.sort(key=lambda x: (x.cost, x.plan.peak))
    kept: list[Suggestion] = []
    for sug in found:
        if not any(
            _dominates(k.changes, sug.changes) or k.plan.device_need <= sug.plan.device_need for k in kept
        ):
            kept.append(sug)
    return kept[:limit]


def _dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when `a` changes no more than `b` does, each at most as far (a cheaper subset)."""
    far = ("train.micro_batch_size", "train.seq_len")
    return all(k in b and not (k in far and b[k] > v) for k, v in a.items())


def plan_target(recipe: Any, gpu_mem: str | None = None, device: str = "auto") -> Target:
    """`detect_target`'s target where train.accelerator allows it: a recipe pinned to the CPU (or
    MPS) is planned against the RAM, one pinned to CUDA needs --gpu-mem or a GPU here."""
    from difftrain.devicecheck import NO_CUDA

    acc = recipe.train.accelerator
    if acc in ("cpu", "mps") and gpu_mem is not None:
        raise ConfigError(
            f"--gpu-mem plans for a CUDA GPU but train.accelerator={acc} trains on the {acc.upper()}; drop "
            "--gpu-mem (the plan is then for this machine's RAM), or set train.accelerator=auto or cuda"
        )
    if acc == "cuda" and device == "cpu":
        raise ConfigError(
            "--device cpu plans for this machine's RAM but train.accelerator=cuda trains on a GPU; drop "
            "--device cpu, or give the GPU's memory with --gpu-mem, e.g. 8GB"
        )
    target = detect_target(gpu_mem, "cpu" if acc in ("cpu", "mps") else device)
    if acc == "cuda" and target.kind != "cuda":
        raise DeviceError(f"{NO_CUDA} (or plan for a GPU elsewhere with --gpu-mem, e.g. 8GB)")
    return target


def detect_target(gpu_mem: str | None = None, device: str = "auto") -> Target:
    """A CUDA GPU of `gpu_mem`; else this machine's first GPU, or its RAM (none, or device cpu)."""
    if gpu_mem is not None:
        return Target("cuda", parse_memory(gpu_mem), f"GPU with {gpu_mem}")
    import torch

    here = Machine.detect()
    if device != "cpu" and here.cuda_devices:
        props = torch.cuda.get_device_properties(0)
        return Target("cuda", int(props.total_memory), props.name, here)
    return Target("cpu", available_ram(), "this machine's RAM", here.cpu_only())


def available_ram() -> int:
    import os

    try:
        return int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * KiB  # type: ignore[union-attr]
    except (OSError, AttributeError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _vocab_size(recipe: Any) -> int:
    """model.vocab_size, resolving 'auto' as pretrain does: the tokenizer's size rounded up to 64."""
    if isinstance(recipe.model.vocab_size, int):
        return recipe.model.vocab_size
    return vocab_rows(tokenizer_size(recipe))


def tokenizer_size(recipe: Any) -> int:
    """Tokens of the run's tokenizer before training: tokenizer.path's, or tokenizer.train.vocab_size."""
    tok_file = recipe.tokenizer.file(recipe.recipe_dir)
    if tok_file is None:
        return int(recipe.tokenizer.train.vocab_size)
    from difftrain.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_file).vocab_size


@dataclass
class RecipePlan:
    plan: MemoryPlan
    suggestions: list[Suggestion]
    activation_table: list[dict[str, Any]]
    kv_cache: int
    generation_bytes: int
    generation_dtype: str = "float32"  # what `generate --dtype auto` uses on the target
    spec: RunSpec | None = None  # the run planned

    @property
    def generation_logits(self) -> int:
        """The fp32 logits of one generated token, part of `generation_bytes`."""
        return int(self.plan.config.vocab_size) * 4  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.plan.to_dict(),
            "activation_table": self.activation_table,
            "kv_cache_bytes": self.kv_cache,
            "generation_bytes": self.generation_bytes,
            "generation_dtype": self.generation_dtype,
            "suggestions": [
                {
                    "overrides": s.overrides,
                    "changes": s.changes,
                    "peak": round(s.plan.peak),
                    "device_need": round(s.plan.device_need),
                    "why": s.why,
                }
                for s in self.suggestions
            ],
        }


def recipe_settings(recipe: Any, target: Target) -> tuple[RunSpec, Settings, list[Param], str, list[str]]:
    """The run a recipe resolves to on `target` (refused where training refuses it there), its
    memory settings, parameters and fine-tuning method, and notes on how they were found."""
    ft, notes = recipe.finetune, []
    if ft is not None:
        config, base_note = _finetune_model(recipe)
        notes += [base_note] if base_note else []
    elif recipe.model is None:
        raise RecipeError(f"{recipe.source or recipe.name}: no model: section to plan for")
    else:
        config = recipe.model.replace(vocab_size=_vocab_size(recipe))
    spec = resolve(recipe.model_copy(update={"model": config}), _machine(target, recipe))
    t = spec.recipe.train
    sharding = None
    if t.strategy == "fsdp":
        f, world = t.fsdp, spec.world_size
        shards = {"full_shard": world, "shard_grad_op": world, "hybrid_shard": spec.devices, "no_shard": 1}
        sharding = Sharding(
            f.sharding_strategy, shards[f.sharding_strategy], f.auto_wrap, f.param_dtype, f.cpu_offload
        )
    settings = Settings(
        micro_batch_size=t.micro_batch_size,
        seq_len=spec.seq_len,
        global_batch_size=spec.global_batch_size,
        world_size=spec.world_size,
        precision=t.precision,
        optimizer=spec.recipe.optim.name,
        checkpointing=t.activation_checkpointing,
        attn_impl=config.attn_impl,
        fsdp=sharding,
        devices=spec.devices,
    )
    if ft is None:
        return spec, settings, model_params(config), "full", notes
    params, lora_dropout = _finetune_params(config, spec.recipe.finetune)
    return spec, replace(settings, lora_dropout=lora_dropout), params, ft.method, notes


def _machine(target: Target, recipe: Any) -> Machine:
    """This machine, or (`plan --gpu-mem`) one with as many GPUs as the recipe asks for."""
    if target.machine is not None:
        return target.machine
    if target.kind == "cuda":
        devices = recipe.train.devices
        return replace(Machine.gpu(target.name), cuda_devices=1 if devices == "auto" else int(devices))
    return Machine(mps=recipe.train.accelerator == "mps")


def _finetune_model(r: Any) -> tuple[ModelConfig, str | None]:
    """The model a fine-tune trains: its base run's, or, before that run exists, the model of the
    shipped recipe that writes it (with a note saying so)."""
    from difftrain.rundir import apply_model_keys, base_run_dir, resolve_model

    ft = r.finetune
    base = Path(ft.base).expanduser()
    stand_in = None if base.exists() else _recipe_writing(base)
    if stand_in is None:
        return resolve_model(r, base_run_dir(ft)), None
    base_cfg = stand_in.model.replace(vocab_size=_vocab_size(stand_in))
    note = (
        f"finetune.base {ft.base} does not exist yet: planned with the model of the recipe that writes it "
        f"(`difftrain pretrain {stand_in.name}`)"
    )
    return apply_model_keys(r, base_cfg, f"recipe {stand_in.name}"), note


def _recipe_writing(run_dir: Path) -> Any:
    """The shipped pretraining recipe whose run directory is `run_dir`, or None."""
    from difftrain.recipe import load_recipe, shipped_recipes

    path = shipped_recipes().get(run_dir.name)
    recipe = None if path is None else load_recipe(path)
    if recipe is None or recipe.finetune is not None or recipe.model is None:
        return None
    return recipe if recipe.run_dir.absolute() == run_dir.absolute() else None


def _finetune_params(config: ModelConfig, ft: Any) -> tuple[list[Param], LoRADropout | None]:
    """Parameters of a fine-tune: LoRA adapters (trained), λ (trained unless frozen), the base
    (frozen; 4-bit for QLoRA's decoder linears)."""
    import torch

    from difftrain.adapters import plan_finetune_adapter
    from difftrain.model.lora import apply_lora
    from difftrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    if ft.method == "full":
        return _params_of(model), None
    spec = plan_finetune_adapter(model, ft, train_embeddings=False)
    with torch.device("meta"):
        apply_lora(model, spec.targets, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout)
    trained = {n for n, _ in model.named_parameters() if ".lora_" in n} | set(spec.trained)
    quantized = {f"{q}.base" if q in spec.targets else q for q in spec.quantized}
    return _params_of(model, trained=trained, quantized=quantized), lora_dropout_of(model)


def plan_recipe(recipe: Any, target: Target) -> RecipePlan:
    """Plan `recipe` on `target`; suggestions when it does not fit."""
    spec, settings, params, method, notes = recipe_settings(recipe, target)
    config = spec.model
    plan = plan_memory(config, settings, target, params, method=method)
    plan.notes[:0] = notes
    suggestions = [] if plan.fits else suggest(config, settings, target, params, method=method)
    # generation as `generate --dtype auto` runs it: bf16 on a GPU, fp32 on the CPU (logits fp32)
    dtype, width = ("bfloat16", 2) if target.kind == "cuda" else ("float32", 4)
    assert config.n_kv_heads is not None and config.head_dim is not None  # keys and values, every layer
    kv = 2 * config.n_layers * config.n_kv_heads * config.max_seq_len * config.head_dim * width
    gen_bytes = int(sum(p.numel for p in params) * width + kv + config.vocab_size * 4)  # type: ignore[operator]
    table = activation_table(config, settings, target) if method == "full" else []
    return RecipePlan(plan, suggestions, table, kv, gen_bytes, dtype, spec)


def fit_warning(recipe: Any, accelerator: str) -> str | None:
    """A warning, with the cheapest fix, when the run will not fit the device it is about to use."""
    target = detect_target(device="cpu" if accelerator != "cuda" else "auto")
    rp = plan_recipe(recipe, target)
    p = rp.plan
    if p.fits:
        return None
    fix = (
        f"; cheapest fix: {rp.suggestions[0].overrides}"
        if rp.suggestions
        else "; no change the planner tries makes it fit"
    )
    return (
        f"this run needs ≈{fmt_bytes(p.device_need)} but {target.name} has {fmt_bytes(target.memory)} "
        f"(`difftrain plan {recipe.command_args}` shows the breakdown){fix}"
    )
