"""`difftrain bench RECIPE`: a recipe's training speed and memory on this machine.

The recipe's model and the other arch at its shape (`baseline` for `diff` and `diff2`, `diff` for
`baseline`) train on random batches as the recipe trains. After `warmup` steps each, the archs
take turns, `steps` steps per repetition, so that a change of load hits both alike: tokens/s is
the median over repetitions, the ratio the median of per-repetition ratios.

Peak memory: on CUDA, max_memory_allocated above what was allocated before the arch was built;
on a CPU, weights, optimizer state and batch plus the profiled peak of one more step (the
resident set adds allocator slack and libraries: `python benchmarks/memory.py` measures it).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from difftrain.errors import ConfigError, RecipeError
from difftrain.model.config import vocab_rows
from difftrain.spec import resolve

Progress = Callable[[str], None]


def cuda_mark(device: torch.device) -> int:
    """Start a CUDA peak measurement: the bytes allocated now, with the peak statistics reset."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def cuda_peak(device: torch.device, before: int) -> int:
    """Bytes of the CUDA peak since `cuda_mark` returned `before`, above it."""
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def cpu_tensor_peak(step: Callable[[], None], model: Any, opt: Any, *batch: torch.Tensor) -> int:
    """What stays allocated between steps (weights, optimizer state, the batch) plus the peak that
    one `step` adds, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    from difftrain.train.optim import optimizer_state_bytes

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the profiler's native library logs its start and stop there
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    top = max(itertools.accumulate((nbytes for _, nbytes in events), initial=0))
    tensors = [*model.parameters(), *batch]
    return sum(t.numel() * t.element_size() for t in tensors) + optimizer_state_bytes(opt) + top


def training(cfg: Any, train: Any, optim: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any, Callable]:
    """A model of `cfg` on x's device, its optimizer, and one step as training takes it: forward,
    backward, clip, optimizer step (no loss scaling)."""
    from difftrain.model import Transformer
    from difftrain.train.optim import build_optimizer

    model = Transformer(cfg).to(x.device)
    if train.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    model.set_activation_checkpointing(train.activation_checkpointing)
    opt = build_optimizer(model, optim, x.device.type)
    forward = torch.compile(model) if train.compile else model
    params = [p for p in model.parameters() if p.requires_grad]
    amp = train.precision in ("bf16-mixed", "16-mixed")
    dtype = torch.bfloat16 if train.precision.startswith("bf16") else torch.float16

    def step() -> None:
        with torch.autocast(x.device.type, dtype=dtype) if amp else contextlib.nullcontext():
            loss = forward(x, y, return_logits=False).loss
        loss.backward()
        if train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def bench_recipe(
    recipe: Any,
    *,
    steps: int = 3,
    reps: int = 3,
    warmup: int = 2,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Tokens/s, MFU and peak memory of `recipe`'s training step and of the other arch at its
    shape; a JSON-ready document."""
    from difftrain.plan import tokenizer_size
    from difftrain.train.callbacks import flops_per_token, peak_flops

    say = progress or (lambda msg: None)
    if recipe.model is None:
        raise RecipeError(
            f"{recipe.source or recipe.name}: no model: section; `difftrain bench` measures a pretraining "
            "recipe (for a fine-tune, bench the recipe of its base)"
        )
    spec = resolve(recipe)
    r, device, seq_len, world = spec.recipe, torch.device(spec.accelerator), spec.seq_len, spec.world_size
    t, cfg, notes = r.train, spec.model, []
    if cfg.vocab_size == "auto":  # as training sizes it: the tokenizer's, rounded up to 64
        size = tokenizer_size(r)
        cfg = cfg.replace(vocab_size=vocab_rows(size))
        notes.append(f"model.vocab_size is auto: {cfg.vocab_size} (from the tokenizer's {size} tokens)")
    if world > 1:
        notes.append(f"one device measured; the run trains on {world}")
    B, T = t.micro_batch_size, seq_len
    peak = peak_flops(device, t.precision)
    g = torch.Generator().manual_seed(r.seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    archs = [cfg.arch, "diff" if cfg.arch == "baseline" else "baseline"]
    try:
        cfg.replace(arch=archs[1])
    except ConfigError as e:  # e.g. an odd n_heads has no diff twin
        notes.append(f"no {archs[1]} at this shape ({e}): {cfg.arch} alone")
        archs = archs[:1]
    fns: dict[str, Callable[[], None]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for arch in archs:
        say(f"building {arch} and taking {warmup} warm-up steps")
        cuda = device.type == "cuda"
        before = cuda_mark(device) if cuda else 0
        torch.manual_seed(r.seed)
        model, opt, fns[arch] = training(cfg.replace(arch=arch), t, r.optim, x, y)
        t0 = time.perf_counter()
        for _ in range(warmup):
            fns[arch]()
        peak_bytes = cuda_peak(device, before) if cuda else None  # (synchronizes the GPU)
        warmup_s = round(time.perf_counter() - t0, 2)
        if not cuda:
            peak_bytes = cpu_tensor_peak(fns[arch], model, opt, ids)
        counts = model.num_params()
        rows[arch] = {
            "params": counts["total"],
            "flops_per_token": flops_per_token(
                counts["total"] - counts["embedding"], cfg.n_layers, cfg.n_heads * model.config.head_dim, T
            ),
            "warmup_s": warmup_s,
            "peak_memory": peak_bytes,
            "step_s_reps": [],
        }
    say(f"timing {' and '.join(archs)} in turn: {reps} × {steps} steps each")
    for _ in range(reps):
        for arch, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rows[arch]["step_s_reps"].append((time.perf_counter() - t0) / steps)
    for row in rows.values():
        row["tokens_per_s"] = B * T / statistics.median(row["step_s_reps"])
        row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / peak if peak else None
    per_rep = [rows[a]["step_s_reps"] for a in archs]
    return {
        "recipe": str(r.source or r.name),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": _device(spec),
        "arch": archs[0],
        "other": archs[1] if len(archs) > 1 else None,
        "setup": {
            "micro_batch_size": B,
            "seq_len": T,
            "vocab_size": cfg.vocab_size,
            "precision": t.precision,
            "compile": bool(t.compile),
            "optimizer": r.optim.name,
            "activation_checkpointing": t.activation_checkpointing,
            "steps": steps,
            "reps": reps,
            "warmup": warmup,
        },
        "archs": rows,
        # the recipe arch's tokens/s ÷ the other's, per repetition
        "ratio": statistics.median(o / s for s, o in zip(*per_rep, strict=True)) if len(archs) > 1 else None,
        "peak_flops": peak,
        "notes": notes,
    }


def _device(spec: Any) -> dict[str, Any]:
    """The machine measured, as the run's start table names it (`spec.Machine`)."""
    from difftrain import __version__

    return {
        "type": spec.accelerator,
        "name": spec.machine.name,
        "threads": spec.machine.threads,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "difftrain": __version__,
    }


def measure_training_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """The peak memory of 3 training steps of `spec` (device, config, batch, seq_len, optimizer,
    checkpointing, precision): on CUDA `measured_peak` (max_memory_allocated growth), on a CPU
    `tensor_peak` (`cpu_tensor_peak`) and `measured_peak` None."""
    from difftrain.model import ModelConfig
    from difftrain.recipe import OptimConfig, TrainConfig

    device = torch.device(spec["device"])
    cfg = ModelConfig(**spec["config"])
    B, T = spec["batch"], spec["seq_len"]
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)
    cuda = device.type == "cuda"
    before = cuda_mark(device) if cuda else 0
    train = TrainConfig(
        max_steps=3,
        precision=spec["precision"],
        activation_checkpointing=spec["checkpointing"],
        compile=False,
    )
    model, opt, step = training(cfg, train, OptimConfig(name=spec["optimizer"], lr=1e-4), x, y)
    for _ in range(3):
        step()
    if cuda:
        return {"measured_peak": cuda_peak(device, before)}
    return {"measured_peak": None, "tensor_peak": cpu_tensor_peak(step, model, opt, x, y)}
