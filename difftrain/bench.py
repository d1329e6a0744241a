"""`difftrain bench`: the performance figures of this machine, in one process and one run.

Sections (each may be run alone with `--only`):

    attention    attention core forward+backward, each attn_impl × arch over a grid of (B, T, H, d)
    train_step   one training step (forward, backward, clip, AdamW) in tokens/s for baseline, diff and
                 diff2 at matched parameter counts (diff2's MLP is narrowed by its extra q/λ weights),
                 with and without torch.compile
    lightning    the same step driven by the Lightning Trainer (LitLM) vs a minimal hand-written loop
    hf           transformers' LlamaForCausalLM / DiffLlamaForCausalLM training step and greedy
                 `generate`, on the same weights, against ours
    optimizer    optimizer step time and state bytes/param: adamw, adamw8bit, paged_adamw8bit
                 (CUDA only), lion8bit — the state bytes checked against `difftrain.plan`
    decode       cached greedy decode tokens/s per arch
    memory       `difftrain.plan`'s peak estimate against the measured peak of a training step in a
                 fresh process (CPU: growth of the peak RSS; CUDA: torch.cuda.max_memory_allocated)

How it measures. Every comparison runs its candidates round-robin (A B C A B C …) after a
warm-up, so a change of load on a shared machine hits all of them alike; each figure is the
median over repetitions, and each ratio is the median of the per-repetition ratios (paired);
the per-repetition times are kept in the JSON (`wall_ms_reps`, `cpu_ms_reps`; the hf section's
`reps`), so every figure can be recomputed and its spread seen.
CPU time (all threads of this process) is reported next to wall time: on a machine shared with
other jobs it is the steadier of the two. Read ratios, not absolute times.

Modes: `quick` (tiny shapes, seconds: a smoke test), `default` (the quickstart shape and
d_model 512 / seq 512; a few minutes on a 2-core CPU), `full` (adds torch.compile, flex
attention, a longer grid; on CUDA the 124M shapes). The result is a JSON document (schema in
`validate_result`); `bench_markdown` renders its tables from it. Both, the targets and
the options live in `difftrain.bench_report`, which loads no torch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from difftrain.bench_report import SCHEMA, SECTIONS, BenchOptions, evaluate_targets
from difftrain.errors import DeviceError

ARCHS = ("baseline", "diff", "diff2")

Progress = Callable[[str], None]


# ----- shapes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A model and batch shape: the model's fields plus micro-batch B and sequence length T."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    vocab_size: int
    tie_embeddings: bool = True

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def config(self, arch: str) -> Any:
        """The ModelConfig for `arch`, parameter-matched to baseline (see `matched_config`)."""
        from difftrain.model import ModelConfig

        base = ModelConfig(
            arch="baseline",
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            max_seq_len=self.seq_len,
            tie_embeddings=self.tie_embeddings,
        )
        return matched_config(base, arch)


def matched_config(base: Any, arch: str) -> Any:
    """`base` (a baseline ModelConfig) as `arch` with the same parameter count: diff has the
    baseline's projections (+6d λ/subln values per layer); diff2's q_proj is twice as wide and it
    adds lambda_proj, D·H·d + D·H weights per layer, taken out of its SwiGLU MLP (3·D per unit
    of ffn_hidden)."""
    cfg = base.replace(arch=arch)
    if arch != "diff2":
        return cfg
    D, H, d, F = base.d_model, base.n_heads, base.head_dim, base.ffn_hidden
    extra = D * H * d + D * H
    return cfg.replace(ffn_hidden=max(1, F - round(extra / (3 * D))))


QUICK = Shape("tiny", 64, 2, 4, 64, 4, 512)
QUICK_MEMORY = Shape("small", 128, 2, 4, 128, 16, 4096)  # big enough to rise above the imports' RSS
QUICKSTART = Shape("quickstart", 256, 4, 8, 256, 16, 4096)
D512 = Shape("d512-seq512", 512, 4, 8, 512, 8, 4096)
GPT2_SMALL = Shape("124m", 768, 12, 12, 1024, 16, 32768)
GPT2_SMALL_2K = Shape("124m-seq2048", 768, 12, 12, 2048, 8, 32768)  # the paper's context for the GPU target


@dataclass
class Plan:
    """The shapes, repetitions and switches of one bench run (derived from mode and device)."""

    device: torch.device
    mode: str
    precision: str
    compile: bool
    decode_compile: bool  # `generate --compile` rows (on by default on CPU too: seconds to compile)
    reps: int
    warmup: int
    step_shapes: list[Shape]
    attention_grid: list[tuple[int, int, int, int]]
    impls: list[str]
    decode_tokens: int
    memory_shapes: list[tuple[Shape, str, str, bool]]  # shape, arch, optimizer, checkpointing
    lightning_steps: int
    notes: list[str] = field(default_factory=list)


def make_plan(opts: BenchOptions) -> Plan:
    opts.check()
    device = opts.resolved_device()
    cuda = device.type == "cuda"
    precision = opts.precision or ("bf16-mixed" if cuda else "32-true")
    mode = opts.mode
    common = dict(device=device, mode=mode, precision=precision)
    if mode == "quick":
        p = Plan(
            **common,
            compile=bool(opts.compile),
            decode_compile=bool(opts.compile),
            reps=2,
            warmup=1,
            step_shapes=[QUICK],
            attention_grid=[(2, 64, 4, 16)],
            impls=["eager", "sdpa"],
            decode_tokens=16,
            memory_shapes=[(QUICK_MEMORY, "diff", "adamw", False)],
            lightning_steps=3,
        )
    elif cuda:  # the 124M recipes' shape, bf16, compiled; seq 2048 for the paper's comparison
        full = mode == "full"
        p = Plan(
            **common,
            compile=True if opts.compile is None else opts.compile,
            decode_compile=True if opts.compile is None else opts.compile,
            reps=10,
            warmup=3,
            step_shapes=[GPT2_SMALL_2K, GPT2_SMALL] if full else [GPT2_SMALL_2K],
            attention_grid=[(8, 1024, 12, 64), (4, 2048, 12, 64)] + ([(2, 4096, 16, 64)] if full else []),
            impls=["eager", "sdpa", "flex"],
            decode_tokens=256,
            memory_shapes=[(GPT2_SMALL, a, "adamw8bit", False) for a in ARCHS]
            + [(GPT2_SMALL, "diff", "adamw", True)],
            lightning_steps=20,
        )
    else:
        full = mode == "full"
        p = Plan(
            **common,
            compile=full if opts.compile is None else opts.compile,
            decode_compile=True if opts.compile is None else opts.compile,
            reps=5,
            warmup=1,
            step_shapes=[QUICKSTART, D512],
            attention_grid=[(16, 256, 8, 32), (8, 512, 8, 64)] + ([(4, 1024, 8, 64)] if full else []),
            impls=["eager", "sdpa"] + (["flex"] if full else []),
            decode_tokens=128,
            memory_shapes=[
                (QUICKSTART, "baseline", "adamw", False),
                (QUICKSTART, "diff", "adamw", False),
                (QUICKSTART, "diff", "adamw", True),
                (D512, "diff", "adamw", False),
            ],
            lightning_steps=5,
        )
    if opts.reps is not None:
        p.reps = opts.reps
    if opts.warmup is not None:
        p.warmup = opts.warmup
    return p


# ----- timing ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(
    fns: dict[str, Callable[[], Any]], *, warmup: int, reps: int, device: torch.device
) -> dict[str, dict[str, list[float]]]:
    """Warm every function up, then run them round-robin `reps` times; per name, the wall and
    process-CPU seconds of each repetition."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            _sync(device)
            times[name]["wall"].append(time.perf_counter() - t0)
            times[name]["cpu"].append(time.process_time() - c0)
    return times


def paired_ratio(ref: list[float], other: list[float]) -> float:
    """Median over repetitions of ref_r / other_r: other's speed relative to ref (>1 = faster)."""
    return statistics.median(a / b for a, b in zip(ref, other, strict=True) if b > 0)


def _summary(t: dict[str, list[float]]) -> dict[str, float]:
    return {"ms": 1e3 * statistics.median(t["wall"]), "cpu_ms": 1e3 * statistics.median(t["cpu"])}


def _reps(t: dict[str, list[float]]) -> dict[str, list[float]]:
    """The wall and CPU milliseconds of every repetition, in order: each median and paired ratio
    of the result can be recomputed (and its spread seen) from the JSON alone."""
    return {"wall_ms_reps": [1e3 * x for x in t["wall"]], "cpu_ms_reps": [1e3 * x for x in t["cpu"]]}


def _autocast(plan: Plan) -> contextlib.AbstractContextManager[Any]:
    if plan.precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if plan.precision.startswith("bf16") else torch.float16
        return torch.autocast(plan.device.type, dtype=dtype)
    return contextlib.nullcontext()


def _model_dtype(plan: Plan) -> torch.dtype:
    return torch.bfloat16 if plan.precision == "bf16-true" else torch.float32


# ----- environment ---------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, Any]:
    """Where the figures come from: device, versions, threads, load."""
    from difftrain import __version__

    env: dict[str, Any] = {
        "type": device.type,
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "difftrain": __version__,
        "cuda": torch.version.cuda,
    }
    from importlib import metadata

    for pkg in ("transformers", "bitsandbytes", "lightning"):  # installed versions, nothing imported
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    return env


# ----- sections ------------------------------------------------------------------------------------
def bench_attention(plan: Plan, progress: Progress) -> dict[str, Any]:
    """Attention core forward+backward per (B, T, H, d) × impl × arch."""
    # what the core sees: fp16 under 16-mixed (CUDA only), bf16 under the bf16 precisions
    dtype = {"32-true": torch.float32, "16-mixed": torch.float16}.get(plan.precision, torch.bfloat16)
    rows: list[dict[str, Any]] = []
    for B, T, H, d in plan.attention_grid:
        progress(f"attention B={B} T={T} H={H} d={d}")
        rows += _attention_point(plan, dtype, B, T, H, d)
        gc.collect()
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows}


def _attention_point(plan: Plan, dtype: torch.dtype, B: int, T: int, H: int, d: int) -> list[dict[str, Any]]:
    from difftrain.model.kernels import AttnMask, attention_core

    dev = plan.device
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_()

    mask = AttnMask(T, T)
    q, k, q2 = leaf(B, H, T, d), leaf(B, H, T, d), leaf(B, 2 * H, T, d)
    v_base, v_diff = leaf(B, H, T, d), leaf(B, H // 2, T, 2 * d)
    lam, lam2 = torch.tensor(0.3, device=dev, requires_grad=True), leaf(B, H, T)
    gb = torch.randn(B, H, T, d, generator=g).to(dev, dtype)
    gd = torch.randn(B, H // 2, T, 2 * d, generator=g).to(dev, dtype)
    cores: dict[str, Callable[[str], torch.Tensor]] = {
        "baseline": lambda impl: attention_core("baseline", q, k, v_base, None, mask, impl).out,
        "diff": lambda impl: attention_core("diff", q, k, v_diff, lam, mask, impl).out,
        "diff2": lambda impl: attention_core("diff2", q2, k, v_base, lam2, mask, impl).out,
    }
    grads = {"baseline": gb, "diff": gd, "diff2": gb}

    def run(arch: str, impl: str, fwd_only: bool) -> None:
        if fwd_only:
            with torch.no_grad():
                cores[arch](impl)
        else:
            cores[arch](impl).backward(grads[arch])

    fns: dict[str, Callable[[], Any]] = {}
    modes: dict[str, str] = {}
    for impl in plan.impls:
        fwd_only = impl == "flex" and dev.type == "cpu"  # flex has no CPU backward
        for arch in ARCHS:
            fns[f"{arch}/{impl}"] = lambda a=arch, i=impl, f=fwd_only: run(a, i, f)
            modes[f"{arch}/{impl}"] = "fwd" if fwd_only else "fwd+bwd"
    times = time_round_robin(fns, warmup=plan.warmup, reps=plan.reps, device=dev)
    rows = []
    for key, t in times.items():
        arch, impl = key.split("/")
        ref = times[f"baseline/{impl}"]
        rows.append(
            {
                "B": B,
                "T": T,
                "H": H,
                "d": d,
                "arch": arch,
                "impl": impl,
                "mode": modes[key],
                **_summary(t),
                **_reps(t),
                "vs_baseline": paired_ratio(ref["wall"], t["wall"]),
                "vs_baseline_cpu": paired_ratio(ref["cpu"], t["cpu"]),
            }
        )
    return rows


def _batch(shape: Shape, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len + 1), generator=g).to(device)
    return ids[:, :-1], ids[:, 1:]


def _build(cfg: Any, plan: Plan, seed: int = 0) -> Any:
    from difftrain.model import Transformer

    torch.manual_seed(seed)
    return Transformer(cfg).to(plan.device, _model_dtype(plan))


def _optimizer(model: Any, name: str, device: torch.device) -> Any:
    from difftrain.recipe import OptimConfig
    from difftrain.train.optim import build_optimizer

    return build_optimizer(model, OptimConfig(name=name, lr=1e-4, warmup_steps=0), device.type)


def train_step_fn(
    model: Any,
    opt: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    plan: Plan,
    forward: Any = None,
) -> Callable[[], None]:
    """One training step as a closure: forward, backward, clip the gradient norm to 1, AdamW."""
    x, y = batch
    fwd = model if forward is None else forward
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        with _autocast(plan):
            loss = fwd(x, y, return_logits=False).loss  # as training calls it
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench_train_step(plan: Plan, progress: Progress) -> dict[str, Any]:
    """Training-step tokens/s per arch at matched parameters (± torch.compile); MFU on known GPUs."""
    from difftrain.train.callbacks import flops_per_token, peak_flops

    peak = peak_flops(plan.device, plan.precision)
    rows: list[dict[str, Any]] = []
    for shape in plan.step_shapes:
        variants: dict[str, tuple[str, bool]] = {a: (a, False) for a in ARCHS}
        if plan.compile:  # compile warm-up is long: diff2 only in full mode
            for a in ARCHS if plan.mode == "full" else ("baseline", "diff"):
                variants[f"{a} +compile"] = (a, True)
        fns, info = {}, {}
        for name, (arch, compiled) in variants.items():
            cfg = shape.config(arch)
            model = _build(cfg, plan)
            opt = _optimizer(model, "adamw", plan.device)
            forward = torch.compile(model) if compiled else None
            fns[name] = train_step_fn(model, opt, _batch(shape, plan.device), plan, forward)
            counts = model.num_params()
            info[name] = {
                "arch": arch,
                "compile": compiled,
                "reference": "baseline" + (" +compile" if compiled else ""),
                "params": counts["total"],
                "ffn_hidden": cfg.ffn_hidden,
                "flops_per_token": flops_per_token(
                    counts["total"] - counts["embedding"],
                    cfg.n_layers,
                    cfg.n_heads * cfg.head_dim,
                    shape.seq_len,
                ),
            }
            if compiled:
                progress(f"train_step {shape.name}: compiling {name}")
                t0 = time.perf_counter()
                fns[name]()
                fns[name]()
                info[name]["compile_s"] = round(time.perf_counter() - t0, 1)
        reps = plan.reps if shape is plan.step_shapes[0] else max(2, plan.reps - 2)  # bigger, fewer
        progress(f"train_step {shape.name}: {len(fns)} variants × {reps} reps")
        times = time_round_robin(fns, warmup=plan.warmup, reps=reps, device=plan.device)
        for name, t in times.items():
            s = _summary(t)
            ref = times[info[name]["reference"]]
            rows.append(
                {
                    "shape": shape.name,
                    "variant": name,
                    **info[name],
                    **s,
                    "batch": shape.batch,
                    "seq_len": shape.seq_len,
                    "tokens_per_s": shape.tokens / (s["ms"] / 1e3),
                    "mfu": shape.tokens / (s["ms"] / 1e3) * info[name]["flops_per_token"] / peak
                    if peak
                    else None,
                    "vs_baseline": paired_ratio(ref["wall"], t["wall"]),
                    "vs_baseline_cpu": paired_ratio(ref["cpu"], t["cpu"]),
                    **_reps(t),
                }
            )
        fns.clear()
        gc.collect()
    return {"precision": plan.precision, "shapes": [vars(s) for s in plan.step_shapes], "rows": rows}


def bench_lightning(plan: Plan, progress: Progress) -> dict[str, Any]:
    """Per-step time of LitLM under the Lightning Trainer vs a minimal hand-written loop.

    Both run the same model, batches and optimizer; they alternate in chunks of steps (a fresh
    Trainer each chunk), and a step is the time between two consecutive batch starts, so the
    data loading and everything the loop does between steps count."""
    import lightning as L

    from difftrain.recipe import OptimConfig
    from difftrain.train.lit import LitLM
    from difftrain.train.optim import lr_multiplier

    shape = plan.step_shapes[0]
    cfg = shape.config("diff")
    optim = OptimConfig(name="adamw", lr=1e-4, warmup_steps=0)
    chunk = max(3, plan.lightning_steps)
    batches = [
        dict(zip(("input_ids", "targets"), _batch(shape, torch.device("cpu"), seed=i), strict=True))
        for i in range(chunk)
    ]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    hand_model = _build(cfg, plan)
    hand_opt = _optimizer(hand_model, "adamw", plan.device)
    sched = torch.optim.lr_scheduler.LambdaLR(hand_opt, lr_multiplier(optim, 10**6))
    params = list(hand_model.parameters())

    def hand_chunk() -> list[float]:
        starts = []
        for batch in loader:
            starts.append(time.perf_counter())
            x, y = batch["input_ids"].to(plan.device), batch["targets"].to(plan.device)
            with _autocast(plan):
                loss = hand_model(x, y, return_logits=False).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            if torch.isfinite(norm):
                hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)
            sched.step()
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            _sync(plan.device)
            self.starts.append(time.perf_counter())

    lit_model = _build(cfg, plan)
    lit = LitLM(lit_model, optim, total_steps=10**6, accumulate=1, grad_clip=1.0)
    from difftrain.train.run import _quiet_lightning

    _quiet_lightning()
    precision = {"32-true": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}.get(
        plan.precision, "32-true"
    )

    def lightning_chunk() -> list[float]:
        clock = StepClock()
        trainer = L.Trainer(
            accelerator=plan.device.type,
            devices=1,
            precision=precision,
            max_steps=chunk,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[clock],
            max_epochs=1,
        )
        trainer.fit(lit, train_dataloaders=loader)
        return [b - a for a, b in zip(clock.starts, clock.starts[1:-1], strict=False)]

    hand: list[float] = []
    light: list[float] = []
    ratios: list[float] = []
    # A 5 % overhead is smaller than a shared CPU's drift over a minute: alternate many short
    # rounds and take the median of the per-round ratios, each pair of chunks run back to back.
    rounds = max(2, plan.reps)
    progress(f"lightning: {rounds} rounds of {chunk} steps each way")
    hand_chunk()  # warm-up
    lightning_chunk()
    for _ in range(rounds):
        h_round = hand_chunk()[1:]  # the first step of a chunk pays for the loader's first batch
        l_round = lightning_chunk()[1:]
        hand += h_round
        light += l_round
        ratios.append(statistics.median(l_round) / statistics.median(h_round))
    h, li = statistics.median(hand), statistics.median(light)
    return {
        "shape": shape.name,
        "arch": "diff",
        "steps_timed": {"hand": len(hand), "lightning": len(light)},
        "hand_ms": 1e3 * h,
        "lightning_ms": 1e3 * li,
        "overhead": statistics.median(ratios) - 1.0,
        "overhead_per_round": [r - 1.0 for r in ratios],
        "note": "both compute the gradient norm once and use it for the finite check and the "
        "clipping (LitLM: its own norm and clip_grads_with_norm_; the hand loop: clip_grad_norm_)",
    }


def hf_model_for(model: Any) -> Any:
    """The same weights as a transformers model (Llama for baseline, DiffLlama for diff), or None
    when transformers is missing or has no class for the arch (diff2)."""
    try:
        import transformers

        from difftrain.errors import InteropError
        from difftrain.interop.hf import hf_config_dict, to_hf_state_dict
    except ImportError:
        return None
    c = model.config
    try:
        cfg = hf_config_dict(c, bos_id=0, eos_id=1, pad_id=2)
    except InteropError:
        return None
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    sd = {k: v.float().cpu() for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(sd, c), strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise RuntimeError(f"HF weights do not line up: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    return hf.to(model.lm_head.weight.device)


def bench_hf(plan: Plan, progress: Progress) -> dict[str, Any]:
    """Our training step and greedy decode against transformers' on the same shapes and weights."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed (pip install difftrain[hf])"}
    shape = plan.step_shapes[0]
    rows, decode_rows = [], []
    for arch in ("baseline", "diff"):
        ours = _build(shape.config(arch), plan)
        hf = hf_model_for(ours)
        if hf is None:
            continue
        rows.append(_train_vs_hf(ours, hf, shape, plan, progress))
        decode_rows.append(_decode_vs_hf(ours, hf, plan, progress))
        del ours, hf
        gc.collect()
    return {
        "shape": shape.name,
        "transformers": transformers.__version__,
        "train": rows,
        "decode": decode_rows,
    }


def _train_vs_hf(ours: Any, hf: Any, shape: Shape, plan: Plan, progress: Progress) -> dict[str, Any]:
    hf.train()
    x, y = _batch(shape, plan.device)
    with torch.no_grad():
        agree = (ours(x).logits.float() - hf(input_ids=x).logits.float()).abs().max().item()
    labels = torch.cat((x[:, :1], y[:, :-1]), dim=1)  # HF shifts labels left by one

    def hf_step_fn(model: Any, forward: Any) -> Callable[[], None]:
        params = list(model.parameters())
        # transformers' Trainer defaults to optim="adamw_torch_fused" with torch >= 2.8; so does ours
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step() -> None:
            with _autocast(plan):
                loss = forward(input_ids=x, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    fns = {
        "ours": train_step_fn(ours, _optimizer(ours, "adamw", plan.device), (x, y), plan),
        "hf": hf_step_fn(hf, hf),
    }
    if plan.compile:  # both models under torch.compile (ours: train.compile: true)
        twin = _build(ours.config, plan)
        fns["ours +compile"] = train_step_fn(
            twin, _optimizer(twin, "adamw", plan.device), (x, y), plan, torch.compile(twin)
        )
        hf_twin = copy.deepcopy(hf)
        fns["hf +compile"] = hf_step_fn(hf_twin, torch.compile(hf_twin))
        progress(f"hf: compiling the {ours.config.arch} training steps (ours and transformers')")
        for name in ("ours +compile", "hf +compile"):
            fns[name]()
            fns[name]()
    progress(f"hf: {ours.config.arch} training step vs {type(hf).__name__}")
    t = time_round_robin(fns, warmup=plan.warmup, reps=plan.reps, device=plan.device)
    return {
        **_variant_figures(t, shape.tokens),
        "arch": ours.config.arch,
        "hf_class": type(hf).__name__,
        "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "max_logit_diff": agree,
        "ours_ms": _summary(t["ours"])["ms"],
        "hf_ms": _summary(t["hf"])["ms"],
        "ours_tokens_per_s": shape.tokens / statistics.median(t["ours"]["wall"]),
        "hf_tokens_per_s": shape.tokens / statistics.median(t["hf"]["wall"]),
        "speedup": paired_ratio(t["hf"]["wall"], t["ours"]["wall"]),
        "speedup_cpu": paired_ratio(t["hf"]["cpu"], t["ours"]["cpu"]),
        "reps": {name: _reps(v) for name, v in t.items()},
    }


def _variant_figures(t: dict[str, dict[str, list[float]]], tokens: int) -> dict[str, Any]:
    """Each variant of our step timed against transformers': compiled against its eager step,
    and (when timed) both compiled."""
    out: dict[str, Any] = {}
    for prefix, ours, ref in (
        ("compiled", "ours +compile", "hf"),
        ("both_compiled", "ours +compile", "hf +compile"),
    ):
        if ours in t and ref in t:
            c, h = t[ours], t[ref]
            out |= {
                f"{prefix}_tokens_per_s": tokens / statistics.median(c["wall"]),
                f"{prefix}_speedup": paired_ratio(h["wall"], c["wall"]),
                f"{prefix}_speedup_cpu": paired_ratio(h["cpu"], c["cpu"]),
            }
            if ref != "hf":
                out[f"{prefix}_hf_tokens_per_s"] = tokens / statistics.median(h["wall"])
    return out


def _hf_compiled_generate(hf: Any) -> dict[str, Any] | None:
    """generate() keyword arguments for transformers' own compiled decoding (a static cache and
    torch.compile, also on CPU), or None when this transformers has no CompileConfig."""
    try:
        from transformers import CompileConfig
    except ImportError:
        return None
    config = CompileConfig(fullgraph=False, dynamic=False)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    return {"cache_implementation": "static", "compile_config": config}


def _decode_vs_hf(ours: Any, hf: Any, plan: Plan, progress: Progress) -> dict[str, Any]:
    from difftrain.infer.generate import GenerationConfig, generate_all
    from difftrain.infer.sampling import SamplingConfig

    ours.eval()
    hf.eval()
    n = plan.decode_tokens
    prompt = torch.randint(
        0, ours.config.vocab_size, (16,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    cfg = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(greedy=True), stop_at_eos=False)
    ids = torch.tensor([prompt], device=plan.device)
    out: dict[str, list[int]] = {}

    def ours_fn() -> None:
        out["ours"] = generate_all(ours, [prompt], cfg)[0].token_ids

    def hf_generate(name: str, **kwargs: Any) -> Callable[[], None]:
        def fn() -> None:
            with torch.inference_mode():
                r = hf.generate(
                    ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=2, **kwargs
                )
            out[name] = r[0, len(prompt) :].tolist()

        return fn

    hf_fn = hf_generate("hf")

    fns = {"ours": ours_fn, "hf": hf_fn}
    if plan.decode_compile:  # `generate --compile`: the static-shape decode step, compiled
        compiled_cfg = dataclasses.replace(cfg, compile=True)

        def compiled_fn() -> None:
            out["ours +compile"] = generate_all(ours, [prompt], compiled_cfg)[0].token_ids

        progress(f"hf: compiling our {ours.config.arch} decode step")
        compiled_fn()
        fns["ours +compile"] = compiled_fn
        hf_kwargs = _hf_compiled_generate(hf)
        if hf_kwargs is not None:
            fns["hf +compile"] = hf_generate("hf +compile", **hf_kwargs)
            progress(f"hf: compiling transformers' {type(hf).__name__} decoding (static cache)")
            fns["hf +compile"]()
    progress(f"hf: {ours.config.arch} greedy decode vs generate, {n} tokens")
    t = time_round_robin(fns, warmup=1, reps=max(3, plan.reps), device=plan.device)
    same = _common_prefix(out["ours"], out["hf"])
    compiled = _variant_figures(t, n)
    if "ours +compile" in t:
        compiled["compiled_equals_eager"] = out["ours +compile"] == out["ours"]
    if "hf +compile" in t:
        compiled["hf_compiled_equals_eager"] = out["hf +compile"] == out["hf"]
    return {
        **compiled,
        "arch": ours.config.arch,
        "new_tokens": n,
        "ours_tokens_per_s": n / statistics.median(t["ours"]["wall"]),
        "hf_tokens_per_s": n / statistics.median(t["hf"]["wall"]),
        "speedup": paired_ratio(t["hf"]["wall"], t["ours"]["wall"]),
        "speedup_cpu": paired_ratio(t["hf"]["cpu"], t["ours"]["cpu"]),
        "agreeing_tokens": same,
        "reps": {name: _reps(v) for name, v in t.items()},
    }


def bench_optimizer(plan: Plan, progress: Progress) -> dict[str, Any]:
    """Optimizer step time and state bytes/param (measured, and as `difftrain.plan` predicts)."""
    from difftrain.plan import model_params, optimizer_bytes
    from difftrain.train.optim import optimizer_state_bytes

    shape = plan.step_shapes[0]
    cfg = shape.config("diff")
    rows: list[dict[str, Any]] = []
    fns: dict[str, Callable[[], None]] = {}
    opts: dict[str, Any] = {}
    for name in ("adamw", "adamw8bit", "paged_adamw8bit", "lion8bit"):
        model = _build(cfg, plan)
        try:
            opt = _optimizer(model, name, plan.device)
        except DeviceError as e:
            rows.append({"optimizer": name, "available": False, "reason": str(e)})
            continue
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()  # allocates the state
        opts[name] = (opt, model)
        fns[name] = opt.step
    progress(f"optimizer: {', '.join(fns)} step × {plan.reps * 2}")
    times = time_round_robin(fns, warmup=plan.warmup, reps=plan.reps * 2, device=plan.device)
    predicted_params = model_params(cfg)
    n = sum(p.numel for p in predicted_params)
    for name, (opt, _model) in opts.items():
        state = optimizer_state_bytes(opt)
        rows.append(
            {
                "optimizer": name,
                "available": True,
                **_summary(times[name]),
                **_reps(times[name]),
                "state_bytes": state,
                "bytes_per_param": state / n,
                "planned_state_bytes": optimizer_bytes(predicted_params, name),
                "vs_adamw": paired_ratio(times["adamw"]["wall"], times[name]["wall"])
                if "adamw" in times
                else None,
            }
        )
    order = {"adamw": 0, "adamw8bit": 1, "paged_adamw8bit": 2, "lion8bit": 3}
    rows.sort(key=lambda r: order[r["optimizer"]])
    return {"shape": shape.name, "arch": "diff", "params": n, "rows": rows}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def bench_decode(plan: Plan, progress: Progress) -> dict[str, Any]:
    """Cached greedy decode tokens/s per arch (16-token prompt, no eos stop), round-robin."""
    from difftrain.infer.generate import GenerationConfig, generate_all
    from difftrain.infer.sampling import SamplingConfig

    shape = plan.step_shapes[0]
    n = plan.decode_tokens
    cfg_gen = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(greedy=True), stop_at_eos=False)
    fns = {}
    variants = {a: (a, False) for a in ARCHS}
    if plan.decode_compile:  # `generate --compile`
        variants |= {f"{a} +compile": (a, True) for a in ARCHS}
    models: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    for name, (arch, compiled) in variants.items():
        cfg = shape.config(arch).replace(max_seq_len=max(shape.seq_len, 16 + n))
        if arch not in models:
            models[arch] = _build(cfg, plan).eval()
        prompt = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1)).tolist()
        gen_cfg = dataclasses.replace(cfg_gen, compile=compiled)

        def run(m: Any = models[arch], p: list[int] = prompt, g: Any = gen_cfg, k: str = name) -> None:
            tokens[k] = generate_all(m, [p], g)[0].token_ids

        if compiled:
            progress(f"decode: compiling the {arch} decode step")
            run()
        fns[name] = run
    progress(f"decode: {n} tokens per arch × {max(3, plan.reps)}")
    times = time_round_robin(fns, warmup=1, reps=max(3, plan.reps), device=plan.device)
    rows = []
    for name, t in times.items():
        rows.append(
            {
                "arch": variants[name][0],
                "compiled": variants[name][1],
                # how many of the eager arch's tokens this variant reproduces before a difference
                "agreeing_tokens": _common_prefix(tokens[name], tokens[variants[name][0]]),
                "variant": name,
                "new_tokens": n,
                "tokens_per_s": n / statistics.median(t["wall"]),
                "cpu_ms_per_token": 1e3 * statistics.median(t["cpu"]) / n,
                "vs_baseline": paired_ratio(times["baseline"]["wall"], t["wall"]),
                "vs_baseline_cpu": paired_ratio(times["baseline"]["cpu"], t["cpu"]),
                **_reps(t),
            }
        )
    return {"shape": shape.name, "prompt_tokens": 16, "rows": rows}


# ----- memory: the planner against a measured peak ----------------------------------------------
def _proc_status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def measure_training_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """Run 3 training steps of `spec` and report the peak memory they added (call in a fresh
    process: `python -m difftrain.bench --measure-peak JSON`).

    CPU: the resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs) minus
    the resident set just before the model is built. (Not ru_maxrss: Linux carries the parent's
    peak into a child across fork and exec.) CUDA: torch.cuda.max_memory_allocated() minus the
    memory allocated before, after a reset of the peak."""
    from difftrain.model import ModelConfig, Transformer
    from difftrain.recipe import OptimConfig
    from difftrain.train.optim import build_optimizer

    device = torch.device(spec["device"])
    cfg = ModelConfig(**spec["config"])
    B, T = spec["batch"], spec["seq_len"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)  # type: ignore[arg-type]
    x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _proc_status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset VmHWM to the current resident set
    model = Transformer(cfg).to(device)
    model.set_activation_checkpointing(spec["checkpointing"])
    opt = build_optimizer(model, OptimConfig(name=spec["optimizer"], lr=1e-4), device.type)
    params = list(model.parameters())
    amp = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec["precision"] == "bf16-mixed"
        else contextlib.nullcontext()
    )

    def step() -> float:
        with amp:
            loss = model(x, y, return_logits=False).loss  # as training calls it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(3):
        loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"measured_peak": int(torch.cuda.max_memory_allocated(device) - before), "loss": loss}
    rss_peak = _proc_status_bytes("VmHWM") - before
    # What the tensors themselves hold at their peak: one more step under the profiler's memory
    # tracking, on top of what is resident between steps (weights, optimizer state, the batch).
    from torch.profiler import ProfilerActivity, profile

    from difftrain.train.optim import optimizer_state_bytes

    resident = sum(p.numel() * p.element_size() for p in params) + optimizer_state_bytes(opt)
    resident += 2 * x.numel() * x.element_size()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    current = top = 0
    for _, nbytes in events:
        current += nbytes
        top = max(top, current)
    return {"measured_peak": int(rss_peak), "tensor_peak": int(resident + top), "loss": loss}


def bench_memory(plan: Plan, progress: Progress) -> dict[str, Any]:
    """The planner's peak against the measured one, each shape in a fresh process."""
    from difftrain.plan import Settings, Target, plan_memory

    rows = []
    for shape, arch, optimizer, ckpt in plan.memory_shapes:
        cfg = shape.config(arch)
        precision = plan.precision if plan.device.type == "cuda" else "32-true"
        spec = {
            "device": str(plan.device),
            "config": cfg.model_dump(mode="json"),
            "batch": shape.batch,
            "seq_len": shape.seq_len,
            "optimizer": optimizer,
            "checkpointing": ckpt,
            "precision": precision,
        }
        progress(f"memory: {shape.name} {arch} {optimizer}{' +ckpt' if ckpt else ''} in a fresh process")
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        proc = subprocess.run(
            [sys.executable, "-m", "difftrain.bench", "--measure-peak", json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        if proc.returncode != 0:
            rows.append({"shape": shape.name, "arch": arch, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        measured = child["measured_peak"]
        settings = Settings(shape.batch, shape.seq_len, shape.batch, 1, precision, optimizer, ckpt)
        target = Target(plan.device.type, 0, str(plan.device))
        est = plan_memory(cfg, settings, target)
        tensor_peak = child.get("tensor_peak")
        rows.append(
            {
                "shape": shape.name,
                "arch": arch,
                "optimizer": optimizer,
                "checkpointing": ckpt,
                "precision": precision,
                "batch": shape.batch,
                "seq_len": shape.seq_len,
                "estimated_peak": round(est.peak),
                "measured_peak": measured,
                "error": est.peak / measured - 1.0 if measured > 0 else None,
                "tensor_peak": tensor_peak,
                "tensor_error": est.peak / tensor_peak - 1.0 if tensor_peak else None,
            }
        )
    what = (
        "torch.cuda.max_memory_allocated" if plan.device.type == "cuda" else "growth of the peak RSS (VmHWM)"
    )
    return {"measured_by": what, "rows": rows}


# ----- the run -------------------------------------------------------------------------------------
SECTION_FUNCS: dict[str, Callable[[Plan, Progress], dict[str, Any]]] = {
    "attention": bench_attention,
    "train_step": bench_train_step,
    "lightning": bench_lightning,
    "hf": bench_hf,
    "optimizer": bench_optimizer,
    "decode": bench_decode,
    "memory": bench_memory,
}


def run_bench(opts: BenchOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Run the sections of `opts` and return the result document (see `validate_result`)."""
    progress = progress or (lambda msg: None)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    plan = make_plan(opts)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": opts.command,
        "mode": plan.mode,
        "device": environment(plan.device),
        "setup": {
            "precision": plan.precision,
            "compile": plan.compile,
            "decode_compile": plan.decode_compile,
            "reps": plan.reps,
            "warmup": plan.warmup,
            "decode_tokens": plan.decode_tokens,
        },
        "sections": {},
    }
    for name in SECTIONS:
        if name not in opts.sections:
            continue
        s0 = time.perf_counter()
        try:
            section = SECTION_FUNCS[name](plan, progress)
        except Exception as e:  # a section that cannot run on this machine is a result too
            if isinstance(e, KeyboardInterrupt):
                raise
            section = {"error": f"{type(e).__name__}: {e}"}
        section["seconds"] = round(time.perf_counter() - s0, 1)
        result["sections"][name] = section
        gc.collect()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["device"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["targets"] = evaluate_targets(result)
    return result


# ----- targets -------------------------------------------------------------------------------------
def _main(argv: list[str]) -> int:
    """`python -m difftrain.bench --measure-peak SPEC` (the memory section's child process)."""
    if len(argv) == 2 and argv[0] == "--measure-peak":
        print(json.dumps(measure_training_peak(json.loads(argv[1]))))
        return 0
    print("usage: difftrain bench (this module's entry point only serves --measure-peak)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
