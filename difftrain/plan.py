"""Memory planner: what a training run will hold in memory, before anything runs.

`plan_recipe(recipe, target)` estimates, for the recipe's model and batch on a target device,
the bytes of

    weights       P · bytes(param dtype)                 (fp32, or bf16 under bf16-true)
    gradients     P_trained · bytes(param dtype)
    optimizer     per parameter tensor, as the optimizer allocates it (exact; see below)
    activations   what autograd saves for the backward pass (formulas below)
    loss          training computes the loss in chunks with the output layer (`model/loss.py`):
                  its saved ∂h and ∂W and one chunk's logits; without that (an adapted or
                  quantised output layer) the saved log-probabilities and two (B·T, V) buffers

and their peak, says whether it fits, and lists the cheapest changes that make it fit
(8-bit optimizer, activation checkpointing, smaller micro-batch at the same global batch,
bf16-true, shorter sequences). `pretrain` runs the same check and warns.

## Optimizer state (exact; `optimizer_state_bytes` in train/optim.py measures the same)

AdamW: two fp32 moments, 8 bytes/param (in the parameter's dtype under bf16-true: 4), and a 0-d
fp32 step count per tensor. bitsandbytes
8-bit optimizers keep tensors of fewer than 4096 elements in 32 bits; a larger tensor of n
elements holds one uint8 per moment and element, one fp32 absmax per moment and block of 256, and
a 256-entry fp32 quantisation map per moment:

    adamw8bit, paged_adamw8bit:  2n + 8·⌈n/256⌉ + 2048 bytes      lion8bit: n + 4·⌈n/256⌉ + 1024

Paged state lives in CUDA unified memory and may be evicted to host RAM under pressure; the plan
counts it on the GPU (the worst case).

## Activations (per decoder layer and token; exact for this code, eager mode)

D = d_model, F = ffn_hidden, H = n_heads, Hkv = n_kv_heads, d = head_dim. These are the bytes of
the tensors autograd saves, found by reading the code and checked by `saved_activation_bytes`
(tests compare both on every arch × precision). The MLP and norms cost, per layer:

    32-true     (6D + 4F + 2) · 4          (block input, 2 × RMSNorm (x, x̂, out), 4 MLP tensors)
    bf16-mixed  26D + 8F + 8               (fp32 residual and norm statistics, bf16 matmul inputs:
                                            autocast casts the norm output once per projection)
    bf16-true   16D + 8F + 8

and attention adds (the core `auto` runs: `sdpa` on CPU, `flex` on CUDA):

                          32-true (× 4 bytes)            bf16 (mixed and true)
    baseline              2Hd + 2Hkv·d + H                4Hd + 4Hkv·d + 4H
    diff (sdpa)           7Hd + 3Hkv·d + 1.5H             16Hd + 6Hkv·d + 6H
    diff (flex)           6Hd + 2Hkv·d + 1.5H             14Hd + 4Hkv·d + 6H
    diff2                 5Hd + 2Hkv·d + 3H               10Hd + 4Hkv·d + 14H (+2D mixed)

(q, k, v, the core's output and log-sum-exp; diff adds its second map's output and subln's
tensors; `sdpa` saves diff's q and k zero-padded to 2d, `flex` saves them d wide — the flex row
is derived, not measured: torch has no flex backward on CPU; diff2 has 2H query heads and its
gate.) bf16-mixed also keeps a bf16 copy of every projection weight (2 bytes per matmul
parameter) until the backward pass. `attn_impl: eager` materialises the maps: + 4·H·T bytes per
token and layer for baseline, 6·H·T for diff, 12·H·T for diff2 (fp32 maps), approximately.

Outside the layers, per token: the final norm and the rotary tables, (12D + 8d + 20) bytes in
32-true, (10D + 4d + 20) in bf16-mixed, (8D + 4d + 20) in bf16-true; with the chunked loss 8
bytes less (the targets are not kept; its ∂h takes the place of the output layer's saved input)
plus its ∂W (V·D, 4 bytes per element in 32-true, else 2), and without it the log-softmax
output, 4V bytes per token. With activation checkpointing a layer keeps only its input (4D bytes per token; 2D in
bf16-true), and one layer's activations are rebuilt at a time in the backward pass.

## Several devices

Under ddp every device holds all of the above. Under `train.strategy=fsdp` (`Sharding`) each
device holds 1/N of the weights, gradients, optimizer state and its temporaries (N: the devices,
or one node's under hybrid_shard; 1 under no_shard), plus the full weights FSDP gathers for the
passes in train.fsdp.param_dtype (the root and about two blocks with one unit per block under
full_shard, else all of them); with bf16 gathered weights autocast makes no copies. This follows
FSDP's design and has not been measured on GPUs. No 8-bit optimizer is suggested under FSDP
(training refuses one), and `difftrain plan` refuses what training refuses on the device it plans
for: the recipe is resolved there by `difftrain.spec.resolve`, as the run resolves it.

## Peak

The peak is the larger of the backward pass (weights, optimizer state, saved activations, and
either the gradients already accumulated plus the loss's buffers at its start (the chunked
loss: ∂h and ∂W scaled, or one chunk's logits and their exponentials in its forward if larger;
else two fp32 (B·T, V) buffers) or, later, a checkpointed layer being rebuilt with its gradient buffers next to the
parameter gradients) and the optimizer step (weights, gradients, state, and the fused/foreach AdamW temporaries,
≈ one fp32 copy of the parameters). Gradients count in full when micro-batches accumulate
(accumulate > 1), else only the output layer's. On CUDA the device also holds the CUDA context
(≈ 0.5 GiB, not in `torch.cuda.max_memory_allocated`) and the caching allocator rounds and
fragments (×1.10); on CPU the process itself (Python, torch, Lightning and the libraries loaded on
first use, ≈ 0.9 GiB) and glibc's free blocks (×1.25). The estimates are for eager execution:
torch.compile fuses and recomputes, and usually saves less.

How good it is (`python benchmarks/memory.py`, CPU fp32, fresh process per shape): the peak
estimate is within ±4 % of the tensors' own peak (tracked by the profiler's memory events) for
baseline/diff, with and without checkpointing, AdamW and 8-bit AdamW, up to d_model 512 / seq
512. The resident set grows 1.4–2.5× more than that peak (allocator blocks, lazily loaded
kernels), which the CPU overheads above cover. On CUDA `benchmarks/gpu_check.sh bench` compares
the estimate with torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from difftrain.errors import ConfigError, DeviceError, RecipeError
from difftrain.model.config import ModelConfig
from difftrain.spec import Machine, RunSpec, resolve

KiB, MiB, GiB = 2**10, 2**20, 2**30
CUDA_CONTEXT_BYTES = GiB // 2
CUDA_ALLOCATOR_FACTOR = 1.10
CPU_PROCESS_BYTES = 900 * MiB  # Python + torch + Lightning (≈ 600 MiB) + libraries loaded on first use
CPU_ALLOCATOR_FACTOR = 1.25  # glibc keeps freed blocks: the resident set exceeds the live tensors
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes, 8-bit absmax per 64, fp32 per 256 of those
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "lion8bit")


# ----- units -----------------------------------------------------------------------------------
_UNITS = {
    "": None,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": 2**40,
    "tb": 2**40,
    "tib": 2**40,
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
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or _UNITS[unit] is None:
        raise ConfigError(
            f"--gpu-mem {text!r}: give a size with a unit, e.g. 8GB, 11.5GiB or 24000MB (GB = GiB = 2^30 bytes)"
        )
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < MiB:
        raise ConfigError(f"--gpu-mem {text!r} is less than 1 MiB; give the GPU's memory, e.g. 8GB")
    if size > MAX_GPU_MEMORY:  # 8000GB typed for 80GB would otherwise fit anything
        raise ConfigError(
            f"--gpu-mem {text!r} is more than one GPU holds (the limit taken is 4 TiB); give one GPU's "
            "memory, e.g. 80GB"
        )
    return size


MAX_GPU_MEMORY = 4 * 2**40
"""The largest --gpu-mem taken: above any one GPU's memory (2026: 288 GB), so a slip of the
finger (8000GB for 80GB) is refused instead of planning for a GPU that does not exist."""


def fmt_bytes(n: float) -> str:
    """Bytes as '5.24 TiB' / '1.23 GiB' / '456.0 MiB' / '12.0 KiB'."""
    for unit, size in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("GiB", "TiB") else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# ----- parameters --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One parameter tensor: its name, element count, whether a matmul reads it (autocast makes
    a bf16 copy of those), and whether it is trained."""

    name: str
    numel: int
    matmul: bool
    trained: bool = True
    quantized: bool = False  # QLoRA: stored as 4-bit NF4, frozen
    head: bool = False  # the output layer's weight (the embedding too when they are tied)


def model_params(config: ModelConfig) -> list[Param]:
    """The model's parameter tensors (a tied head counted once), from a model built on the meta
    device: exact shapes, no memory. Every decoder layer has the same tensors, so the model is
    built with one and its tensors are repeated for the others (in the model's order): a build
    runs each layer's initialisers through the meta device's function mode, and a 1,000-layer
    plan took 6 s per build, 4 builds per `plan`."""
    import torch

    from difftrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config.replace(n_layers=min(1, config.n_layers)))
    one = _params_of(model)
    first = "model.layers.0."
    layer = [p for p in one if p.name.startswith(first)]
    if not layer or config.n_layers == 1:
        return one
    at = one.index(layer[0])
    rest = [p for p in one if not p.name.startswith(first)]
    layers = [
        replace(p, name=f"model.layers.{i}.{p.name.removeprefix(first)}")
        for i in range(config.n_layers)
        for p in layer
    ]
    return rest[:at] + layers + rest[at:]


def _params_of(model: Any, trained: set[str] | None = None, quantized: set[str] | None = None) -> list[Param]:
    import torch

    matmul_weights = {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "weight")
    }
    tied_head = getattr(model, "lm_head", None)
    out, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        matmul = id(p) in matmul_weights or (tied_head is not None and p is tied_head.weight)
        layer = name.rsplit(".", 1)[0]
        out.append(
            Param(
                name,
                p.numel(),
                matmul,
                trained=trained is None or name in trained,
                quantized=quantized is not None and layer in quantized,
                head=tied_head is not None and p is getattr(tied_head, "weight", None),
            )
        )
    return out


def optimizer_bytes(params: Iterable[Param], name: str, param_bytes: int = 4) -> int:
    """Bytes of optimizer state for the trained tensors (see the module docstring)."""
    total = 0
    for p in params:
        if not p.trained:
            continue
        n = p.numel
        if name == "adamw":
            total += 2 * n * param_bytes + 4  # + torch's 0-d fp32 `step` tensor
        elif name in ("adamw8bit", "paged_adamw8bit", "lion8bit"):
            moments = 1 if name == "lion8bit" else 2
            if n < BNB_MIN_8BIT_SIZE:
                total += moments * 4 * n
            else:
                total += moments * (n + 4 * math.ceil(n / BNB_BLOCK) + 4 * 256)
        else:
            raise ConfigError(
                f"optimizer {name!r} is unknown to the planner; choose one of {', '.join(OPTIMIZERS)}"
            )
    return total


# ----- activations -------------------------------------------------------------------------------
def _dtype_family(precision: str) -> str:
    if precision in ("bf16-mixed", "16-mixed"):
        return "mixed"
    if precision in ("bf16-true", "16-true"):
        return "true"
    return "fp32"


def diff_kernel(device_type: str, attn_impl: str = "auto") -> str:
    """The attention core training runs on a device type (`model.kernels.resolve_impl`'s table):
    `flex` on CUDA for auto and flex, else `sdpa` (eager keeps its maps on top of sdpa's row)."""
    return "flex" if device_type == "cuda" and attn_impl in ("auto", "flex") else "sdpa"


def attention_bytes_per_token(config: ModelConfig, precision: str, kernel: str = "sdpa") -> float:
    """Bytes autograd saves per token in one layer's attention (see the table)."""
    H, d, kv = config.n_heads, config.head_dim, config.n_kv_heads
    assert d is not None and kv is not None
    Hd, Kd = H * d, kv * d
    fam = _dtype_family(precision)
    arch = config.arch
    if fam == "fp32":
        elems = {
            "baseline": 2 * Hd + 2 * Kd + H,
            "diff": (6 * Hd + 2 * Kd + 1.5 * H) if kernel == "flex" else (7 * Hd + 3 * Kd + 1.5 * H),
            "diff2": 5 * Hd + 2 * Kd + 3 * H,
        }[arch]
        return 4 * elems
    out = {
        "baseline": 4 * Hd + 4 * Kd + 4 * H,
        "diff": (14 * Hd + 4 * Kd + 6 * H) if kernel == "flex" else (16 * Hd + 6 * Kd + 6 * H),
        "diff2": 10 * Hd + 4 * Kd + 14 * H + (2 * config.d_model if fam == "mixed" else 0),
    }[arch]
    return float(out)


def eager_maps_bytes_per_token(config: ModelConfig, seq_len: int) -> float:
    """Approximate extra bytes per token and layer when attn_impl=eager keeps the maps (fp32)."""
    per_head = {"baseline": 4, "diff": 6, "diff2": 12}[config.arch]
    return float(per_head * config.n_heads * seq_len)


def layer_bytes_per_token(
    config: ModelConfig, precision: str, kernel: str = "sdpa", seq_len: int = 0, attn_impl: str = "auto"
) -> float:
    """Bytes saved per token by one decoder layer (norms, MLP, attention)."""
    D, F = config.d_model, config.ffn_hidden
    assert F is not None
    fam = _dtype_family(precision)
    common = {"fp32": (6 * D + 4 * F + 2) * 4, "mixed": 26 * D + 8 * F + 8, "true": 16 * D + 8 * F + 8}[fam]
    extra = eager_maps_bytes_per_token(config, seq_len) if attn_impl == "eager" else 0.0
    return common + attention_bytes_per_token(config, precision, kernel) + extra


# LoRA dropout: the projections that read one tensor (the attention's input, ...), by name
_LORA_INPUTS = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "lambda_proj": "attn",
    "o_proj": "o",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "down",
    "lm_head": "head",
}


@dataclass(frozen=True)
class LoRADropout:
    """The LoRA-adapted projections of a fine-tune with lora dropout > 0, as (layer or None for
    the output layer, name, input features)."""

    adapted: tuple[tuple[int | None, str, int], ...]


def lora_dropout_of(model: Any) -> LoRADropout | None:
    """The adapted projections of `model` whose LoRA dropout is on (None when none is)."""
    import torch

    from difftrain.model.lora import LoRALinear

    out = []
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear) and isinstance(m.dropout, torch.nn.Dropout):
            layer = re.search(r"\.layers\.(\d+)\.", name)
            out.append((int(layer.group(1)) if layer else None, name.rsplit(".", 1)[-1], m.in_features))
    return LoRADropout(tuple(out)) if out else None


def lora_dropout_bytes_per_token(
    lora: LoRADropout, precision: str, device_type: str = "cpu"
) -> dict[int | None, float]:
    """Bytes per token that LoRA dropout adds, per layer (None: the output layer). Each adapted
    projection's dropout keeps its mask where its input needs a gradient (all but layer 0's
    attention inputs: the embeddings are frozen): on CPU a tensor in the input's dtype (fp32,
    except the bf16 input of down_proj under bf16-mixed), on CUDA one bool per element (torch's
    fused dropout kernel; not yet measured on a GPU). Its LoRA A then keeps the dropped copy
    instead of the input itself: new bytes in fp32 and bf16-true (the input, saved once for all
    the projections that read it without dropout, is no longer kept), the same bf16 cast under
    bf16-mixed. Exact for diff (the tests measure it on CPU); baseline's attention keeps its
    output and diff2's trained λ projection its input anyway, so there the figure is short by
    that tensor per layer (≈ 8 % of the dropout's bytes with all seven projections adapted)."""
    fam = _dtype_family(precision)
    width = 2 if fam == "true" else 4
    out: dict[int | None, float] = {}
    inputs: dict[int | None, dict[str, int]] = {}
    for layer, name, f in lora.adapted:
        group = _LORA_INPUTS.get(name, name)
        mask_width = 1 if device_type == "cuda" else (2 if fam == "mixed" and group == "down" else width)
        mask = 0 if layer == 0 and group == "attn" else mask_width * f
        copy = 0 if fam == "mixed" else width * f
        out[layer] = out.get(layer, 0.0) + mask + copy
        inputs.setdefault(layer, {})[group] = 0 if fam == "mixed" else width * f
    for layer, freed in inputs.items():
        out[layer] -= sum(freed.values())
    return out


def outside_bytes_per_token(config: ModelConfig, precision: str, fused_loss: bool = True) -> float:
    """Per token outside the layers: final norm, rotary tables, ids/targets, and the loss's saved
    tensors: the chunked loss's input gradient (in place of the output layer's saved input, the
    same bytes), or the targets and the log-softmax output (4V)."""
    D, d, V = config.d_model, config.head_dim, config.vocab_size
    assert d is not None and isinstance(V, int)
    fam = _dtype_family(precision)
    norm = {"fp32": 12 * D + 8 * d, "mixed": 10 * D + 4 * d, "true": 8 * D + 4 * d}[fam]
    if fused_loss:  # ∂h replaces the output layer's saved input; the targets are not kept
        return norm + 12
    return norm + 20 + 4 * V


def head_gradient_bytes(config: ModelConfig, precision: str) -> float:
    """The chunked loss's saved gradient of the output weight (V × D), computed in its forward."""
    assert isinstance(config.vocab_size, int)
    return config.vocab_size * config.d_model * (4 if _dtype_family(precision) == "fp32" else 2)


@dataclass
class Activations:
    """Activation memory of one micro-batch (bytes)."""

    per_layer: float  # one layer, all tokens of the micro-batch, without checkpointing
    layers: float  # what all layers keep during the forward pass (checkpointed: their inputs)
    outside: float  # final norm, rotary tables, log-softmax output
    weight_copies: float  # bf16-mixed: autocast's bf16 copies of the matmul weights
    recompute: float  # checkpointing: one layer rebuilt during its backward

    @property
    def total(self) -> float:
        return self.layers + self.outside + self.weight_copies + self.recompute


def activations(
    config: ModelConfig,
    params: list[Param],
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    kernel: str = "sdpa",
    attn_impl: str = "auto",
    fused_loss: bool = True,
    device_type: str = "cpu",
    lora_dropout: LoRADropout | None = None,
) -> Activations:
    """Activation memory of one micro-batch of `micro_batch_size` × `seq_len` tokens.

    fused_loss: the loss is computed in chunks with the output layer (what training does;
    `model/loss.py`), else from materialised logits (a LoRA-adapted or quantised output layer)."""
    N = micro_batch_size * seq_len
    L = config.n_layers
    per_layer = N * layer_bytes_per_token(config, precision, kernel, seq_len, attn_impl)
    fam = _dtype_family(precision)
    if checkpointing:
        layers = N * L * config.d_model * (2 if fam == "true" else 4)
        recompute = per_layer
    else:
        layers, recompute = L * per_layer, 0.0
    copies = 0.0
    if fam == "mixed":  # autocast's bf16 weight copies; checkpointed layers make theirs in recompute
        in_layers = 2.0 * sum(
            p.numel for p in params if p.matmul and not p.quantized and ".layers." in p.name
        )
        outside = 2.0 * sum(  # the chunked loss's copy of the output weight is not kept
            p.numel
            for p in params
            if p.matmul and not p.quantized and ".layers." not in p.name and not (fused_loss and p.head)
        )
        copies = outside + (0.0 if checkpointing else in_layers)
        if checkpointing:
            recompute += in_layers / L
    outside = N * outside_bytes_per_token(config, precision, fused_loss)
    if lora_dropout is not None:
        extra = lora_dropout_bytes_per_token(lora_dropout, precision, device_type)
        outside += N * extra.pop(None, 0.0)
        if checkpointing:  # one layer is rebuilt at a time
            recompute += N * max(extra.values(), default=0.0)
        else:
            layers += N * sum(extra.values())
    if fused_loss:
        outside += head_gradient_bytes(config, precision)
    return Activations(per_layer, layers, outside, copies, recompute)


# ----- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """The device a plan is for: `cuda` (GPU memory) or `cpu` (RAM)."""

    kind: str
    memory: int
    name: str
    machine: Machine | None = None  # this machine, when the target is its own GPU or RAM

    def machine_for(self, recipe: Any) -> Machine:
        """The machine a recipe is resolved on for this target: this one, or one described with
        as many GPUs as the recipe asks for (`plan --gpu-mem`, a target made by hand)."""
        if self.machine is not None:
            return self.machine
        if self.kind == "cuda":
            t = recipe.train
            return replace(Machine.gpu(self.name), cuda_devices=1 if t.devices == "auto" else int(t.devices))
        return Machine(mps=recipe.train.accelerator == "mps")

    @property
    def overhead(self) -> int:
        return CUDA_CONTEXT_BYTES if self.kind == "cuda" else CPU_PROCESS_BYTES


@dataclass(frozen=True)
class Sharding:
    """How FSDP divides a run over its devices (`train.fsdp`, `distributed.build_strategy`):
    `shards` devices each hold 1/shards of the fp32 weights, their gradients and the optimizer
    state (full_shard, shard_grad_op; hybrid_shard: the devices of one node; no_shard: 1).
    Forward and backward gather full weights in the gather dtype: the units in flight (the root
    with the embeddings and the output layer, and about two blocks: the one running and the one
    prefetched) with full_shard/hybrid_shard and one unit per block (auto_wrap), else the whole
    model (shard_grad_op keeps them gathered from forward to backward; one unit is all of it)."""

    strategy: str = "full_shard"
    shards: int = 1
    auto_wrap: bool = True
    param_dtype: str = "compute"  # or float32
    cpu_offload: bool = False


@dataclass(frozen=True)
class Settings:
    """The knobs a plan varies (a recipe resolved for its target)."""

    micro_batch_size: int
    seq_len: int
    global_batch_size: int
    world_size: int
    precision: str
    optimizer: str
    checkpointing: bool
    attn_impl: str = "auto"
    fsdp: Sharding | None = None  # train.strategy=fsdp
    lora_dropout: LoRADropout | None = None  # a LoRA/QLoRA fine-tune with finetune.lora.dropout > 0
    devices: int = 1  # training processes per machine: on the CPU they share its RAM

    @property
    def accumulate(self) -> int:
        return max(1, self.global_batch_size // (self.micro_batch_size * self.world_size))


@dataclass
class MemoryPlan:
    """Estimated bytes of a training run; `peak` is what the device must hold (see the module doc)."""

    config: ModelConfig
    settings: Settings
    target: Target
    params: int
    trained_params: int
    weights: float
    gradients: float
    optimizer: float
    optimizer_temporaries: float
    activations: Activations
    loss_buffers: float
    peak_backward: float
    peak_step: float
    method: str = "full"
    notes: list[str] = field(default_factory=list)
    gathered: float = 0.0  # FSDP: full weights gathered for the forward and backward passes

    @property
    def peak(self) -> float:
        """Bytes the training step itself allocates at its peak (what max_memory_allocated reports)."""
        return max(self.peak_backward, self.peak_step)

    @property
    def processes(self) -> int:
        """Training processes whose memory the target holds: each GPU its own; the CPU's RAM all
        of one machine's (train.devices processes, each with the whole step)."""
        return self.settings.devices if self.target.kind == "cpu" else 1

    @property
    def process_need(self) -> float:
        """What one process needs: the peak with allocator slack, plus the context/process."""
        factor = CUDA_ALLOCATOR_FACTOR if self.target.kind == "cuda" else CPU_ALLOCATOR_FACTOR
        return self.peak * factor + self.target.overhead

    @property
    def device_need(self) -> float:
        """What the device must have: every process it holds (`process_need` × `processes`)."""
        return self.process_need * self.processes

    @property
    def fits(self) -> bool:
        return self.device_need <= self.target.memory

    def breakdown(self) -> dict[str, float]:
        a = self.activations
        return {
            "weights": self.weights,
            "weights gathered by FSDP": self.gathered,
            "gradients": self.gradients,
            "optimizer state": self.optimizer,
            "activations (layers)": a.layers + a.recompute,
            "activations (outside layers)": a.outside,
            "autocast weight copies": a.weight_copies,
            "loss gradient buffers": self.loss_buffers,
            "optimizer temporaries": self.optimizer_temporaries,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "trained_params": self.trained_params,
            "method": self.method,
            "model": self.config.model_dump(mode="json"),
            "settings": asdict(self.settings),
            "target": asdict(self.target),
            "bytes": {k: round(v) for k, v in self.breakdown().items()},
            "peak_backward": round(self.peak_backward),
            "peak_step": round(self.peak_step),
            "peak": round(self.peak),
            "device_need": round(self.device_need),
            "processes": self.processes,
            "fits": self.fits,
            "notes": self.notes,
        }


def plan_memory(
    config: ModelConfig,
    settings: Settings,
    target: Target,
    params: list[Param] | None = None,
    *,
    method: str = "full",
    fused_loss: bool = True,
) -> MemoryPlan:
    """The memory plan of training `config` with `settings` on `target` (see the module doc).

    fused_loss: False when the output layer is LoRA-adapted or quantised (the loss then needs
    the materialised logits)."""
    if config.vocab_size == "auto":
        raise ConfigError("model.vocab_size is 'auto': resolve it before planning (plan_recipe does)")
    from difftrain.model.loss import chunk_rows

    params = model_params(config) if params is None else params
    # the model computes the loss fused with a plain (not adapted, not quantised) output layer
    fused_loss = fused_loss and any(p.head and not p.quantized for p in params)
    s = settings
    true_bf16 = _dtype_family(s.precision) == "true"
    pbytes = 2 if true_bf16 else 4
    n_params = sum(p.numel for p in params)
    trained = [p for p in params if p.trained]
    n_trained = sum(p.numel for p in trained)
    weights = sum(p.numel * (NF4_BYTES_PER_PARAM if p.quantized else pbytes) for p in params)
    grads = n_trained * pbytes
    opt = optimizer_bytes(params, s.optimizer, pbytes)
    temps = n_trained * 4.0 if s.optimizer == "adamw" else 0.0  # foreach/fused AdamW workspace
    shards, gathered = 1, 0.0
    if s.fsdp is not None:  # each device holds its shard of these (see `Sharding`)
        shards = s.fsdp.shards
        weights, grads, opt, temps = weights / shards, grads / shards, opt / shards, temps / shards
        gathered = _fsdp_gathered(params, s.fsdp, s.precision, pbytes)
    kernel = diff_kernel(target.kind, s.attn_impl)
    act = activations(
        config,
        params,
        micro_batch_size=s.micro_batch_size,
        seq_len=s.seq_len,
        precision=s.precision,
        checkpointing=s.checkpointing,
        kernel=kernel,
        attn_impl=s.attn_impl,
        fused_loss=fused_loss,
        device_type=target.kind,
        lora_dropout=s.lora_dropout,
    )
    assert isinstance(config.vocab_size, int)
    N = s.micro_batch_size * s.seq_len
    V, D = config.vocab_size, config.d_model
    if fused_loss:
        # Backward starts by scaling the saved ∂h and ∂W (new tensors; bf16-mixed also casts
        # them to fp32); the forward's largest moment is one chunk's logits and exponentials
        # (+ the half-precision copy of the gradient) beside an fp32 ∂W accumulator.
        hb = 4 if _dtype_family(s.precision) == "fp32" else 2
        scaled = N * D * hb + head_gradient_bytes(config, s.precision)
        if _dtype_family(s.precision) == "mixed":
            scaled += (N + V) * D * 4
        rows = min(N, chunk_rows(V))
        per_logit = 8 + (hb if hb != 4 else 0)
        chunk = rows * V * per_logit + (V * D * 4 if hb != 4 else 0)
        loss_buffers = float(max(scaled, chunk))
    else:
        loss_buffers = 2.0 * N * V * 4
    head = next((p for p in params if p.name in ("lm_head.weight", "model.embed_tokens.weight")), None)
    grads_at_backward = (
        grads if s.accumulate > 1 else (head.numel * pbytes / shards if head and head.trained else 0)
    )
    # At the start of the backward pass the loss's buffers sit on top of everything saved; a
    # checkpointed layer is rebuilt only later, once those are freed.
    # While a rebuilt layer runs backward, its gradient buffers (≈ one (B·T, F), two (B·T, D))
    # and most parameter gradients exist too.
    if s.fsdp is not None and s.fsdp.param_dtype == "compute" and _dtype_family(s.precision) == "mixed":
        # FSDP gathers bf16 weights: autocast has nothing to copy
        act = replace(act, weight_copies=0.0)
    saved = act.layers + act.weight_copies + gathered
    rebuild = 0.0
    if s.checkpointing:
        assert config.ffn_hidden is not None
        rebuild = (
            grads + act.recompute + N * (config.ffn_hidden + 2 * config.d_model) * (2 if true_bf16 else 4)
        )
    peak_backward = weights + opt + saved + max(grads_at_backward + act.outside + loss_buffers, rebuild)
    peak_step = weights + grads + opt + temps
    notes = []
    if s.attn_impl == "eager":
        notes.append("attn_impl=eager keeps the attention maps: the activation figure is approximate")
    if method != "full":
        notes.append(
            f"{method}: LoRA's own small intermediates are not counted"
            + ("; its dropout's masks and dropped inputs are" if s.lora_dropout is not None else "")
        )
    if s.fsdp is not None:
        notes.append(
            f"train.strategy=fsdp ({s.fsdp.strategy} over {shards} device{'s' if shards > 1 else ''}): weights, gradients and "
            f"optimizer state are 1/{shards} per device, plus the full weights gathered for the passes; "
            "an estimate from FSDP's design, not yet measured on GPUs"
            + (
                "; train.fsdp.cpu_offload moves the shards and the optimizer step to host RAM, counted "
                "here on the GPU (an upper bound)"
                if s.fsdp.cpu_offload
                else ""
            )
        )
    return MemoryPlan(
        gathered=gathered,
        config=config,
        settings=settings,
        target=target,
        params=n_params,
        trained_params=n_trained,
        weights=weights,
        gradients=grads,
        optimizer=opt,
        optimizer_temporaries=temps,
        activations=act,
        loss_buffers=loss_buffers,
        peak_backward=peak_backward,
        peak_step=peak_step,
        method=method,
        notes=notes,
    )


def _fsdp_gathered(params: list[Param], sh: Sharding, precision: str, pbytes: int) -> float:
    """Bytes of the full weights FSDP gathers for forward and backward (see `Sharding`)."""
    fam = _dtype_family(precision)
    gbytes = 2 if fam != "fp32" and (fam == "true" or sh.param_dtype == "compute") else 4
    if sh.shards == 1 and gbytes == pbytes:  # the weights themselves, nothing gathered
        return 0.0
    total = sum(p.numel for p in params)
    if sh.strategy in ("full_shard", "hybrid_shard") and sh.auto_wrap and sh.shards > 1:
        block = sum(p.numel for p in params if p.name.startswith("model.layers.0."))
        outside = sum(p.numel for p in params if ".layers." not in p.name)
        return float(gbytes * min(total, outside + 2 * block))
    return float(gbytes * total)


def kv_cache_bytes(
    config: ModelConfig, batch_size: int = 1, max_len: int | None = None, dtype_bytes: int = 4
) -> int:
    """KV cache for generation: keys and values of every layer, (B, Hkv, L, d) each (diff keeps
    Hkv/2 value heads of 2d: the same bytes)."""
    assert config.n_kv_heads is not None and config.head_dim is not None
    L = config.max_seq_len if max_len is None else max_len
    return 2 * config.n_layers * batch_size * config.n_kv_heads * L * config.head_dim * dtype_bytes


def activation_table(config: ModelConfig, settings: Settings, target: Target) -> list[dict[str, Any]]:
    """Activations of one micro-batch for every arch × precision × checkpointing, at this shape
    (the other archs built with the same fields)."""
    rows = []
    for arch in ("baseline", "diff", "diff2"):
        cfg = config.replace(arch=arch)
        params = model_params(cfg)
        for precision in ("32-true", "bf16-mixed", "bf16-true"):
            for ckpt in (False, True):
                a = activations(
                    cfg,
                    params,
                    micro_batch_size=settings.micro_batch_size,
                    seq_len=settings.seq_len,
                    precision=precision,
                    checkpointing=ckpt,
                    kernel=diff_kernel(target.kind, settings.attn_impl),
                    attn_impl=settings.attn_impl,
                    device_type=target.kind,
                )
                rows.append(
                    {"arch": arch, "precision": precision, "checkpointing": ckpt, "bytes": round(a.total)}
                )
    return rows


# ----- making it fit -----------------------------------------------------------------------------
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


# Relative cost of each change (≈ slowdown or change to the training, made up but ordered):
# the 8-bit optimizer costs nearly nothing; halving the micro-batch (same global batch, more
# accumulation) a little GPU efficiency per halving; checkpointing ≈ 30 % more compute; bf16-true
# drops fp32 master weights (a numerics change); shorter sequences change what the model learns.
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
    micros = []
    m = s0.micro_batch_size
    while m >= 1:
        micros.append(m)
        if m == 1:
            break
        m //= 2
    precisions = [s0.precision] + (["bf16-true"] if s0.precision == "bf16-mixed" and method == "full" else [])
    seqs = []
    t = s0.seq_len
    while t >= 64 and len(seqs) < 4:
        seqs.append(t)
        t //= 2
    seqs = seqs or [s0.seq_len]
    found: list[Suggestion] = []
    for opt in opts:
        for ck in ckpts:
            for micro in micros:
                for prec in precisions:
                    for seq in seqs:
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
                            why.append(
                                f"micro-batch {micro}, accumulating {s0.global_batch_size // (micro * s0.world_size)}× "
                                "(same global batch)"
                            )
                        if prec != s0.precision:
                            changes["train.precision"] = prec
                            cost += COSTS["bf16_true"]
                            why.append("bf16-true: bf16 weights without fp32 master copies")
                        if seq != s0.seq_len:
                            changes["train.seq_len"] = seq
                            cost += COSTS["seq_halving"] * math.log2(s0.seq_len / seq)
                            why.append(f"sequences of {seq} tokens (changes what the model learns)")
                        if not changes:
                            continue
                        if (s0.global_batch_size // s0.world_size) % micro:
                            continue
                        s = replace(
                            s0,
                            optimizer=opt,
                            checkpointing=ck,
                            micro_batch_size=micro,
                            precision=prec,
                            seq_len=seq,
                        )
                        p = plan_memory(config, s, target, params, method=method)
                        if p.fits:
                            found.append(Suggestion(changes, p, cost, why))
    found.sort(key=lambda x: (x.cost, x.plan.peak))
    kept: list[Suggestion] = []
    for sug in found:
        if any(
            _dominates(k.changes, sug.changes) or k.plan.device_need <= sug.plan.device_need for k in kept
        ):
            continue
        kept.append(sug)
        if len(kept) == limit:
            break
    return kept


def _dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when `a` changes no more than `b` does, each at most as far (a cheaper subset)."""
    for k, v in a.items():
        if k not in b:
            return False
        if k in ("train.micro_batch_size", "train.seq_len") and b[k] > v:
            return False
    return True


# ----- recipes -----------------------------------------------------------------------------------
def plan_target(recipe: Any, gpu_mem: str | None = None, device: str = "auto") -> Target:
    """The target `difftrain plan` plans for: `detect_target`'s, where train.accelerator allows it.
    A recipe pinned to the CPU (or MPS) is planned against the RAM, and --gpu-mem for it is
    refused; one pinned to CUDA needs --gpu-mem or a GPU here (training refuses it without)."""
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
    """The target of a plan: `--gpu-mem` → a CUDA GPU of that size; otherwise this machine's
    first CUDA GPU, or its RAM when it has none (or device == 'cpu')."""
    if gpu_mem is not None:
        return Target("cuda", parse_memory(gpu_mem), f"GPU with {gpu_mem}")
    import torch

    here = Machine.detect()
    if device != "cpu" and here.cuda_devices:
        props = torch.cuda.get_device_properties(0)
        return Target("cuda", int(props.total_memory), props.name, here)
    return Target("cpu", available_ram(), "this machine's RAM", here.cpu_only())


def available_ram() -> int:
    """Total RAM of this machine (bytes): /proc/meminfo, else os.sysconf."""
    import os

    try:
        text = Path("/proc/meminfo").read_text()
        kib = int(re.search(r"MemTotal:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
        return kib * KiB
    except (OSError, AttributeError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _vocab_size(recipe: Any) -> int:
    """model.vocab_size, resolving 'auto' as pretrain does: the tokenizer's size rounded up to 64."""
    m = recipe.model
    if isinstance(m.vocab_size, int):
        return m.vocab_size
    return 64 * math.ceil(tokenizer_size(recipe) / 64)


def tokenizer_size(recipe: Any) -> int:
    """Tokens of the run's tokenizer, known before training: the size of tokenizer.path's, or the
    size of the one the recipe trains (tokenizer.train.vocab_size)."""
    tok_file = recipe.tokenizer.file(recipe.recipe_dir)
    if tok_file is None:
        return int(recipe.tokenizer.train.vocab_size)
    from difftrain.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_file).vocab_size


@dataclass
class RecipePlan:
    """`plan_recipe`'s answer: the plan, the suggestions if it does not fit, and the context."""

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
    method = "full"
    trained: set[str] | None = None
    quantized: set[str] | None = None
    notes: list[str] = []
    if recipe.finetune is not None:
        config, base_note = _finetune_model(recipe)
        trained, quantized, method = set(), set(), recipe.finetune.method
        notes += [base_note] if base_note else []
    else:
        if recipe.model is None:
            raise RecipeError(f"{recipe.source or recipe.name}: no model: section to plan for")
        config = recipe.model.replace(vocab_size=_vocab_size(recipe))
    spec = resolve(recipe.model_copy(update={"model": config}), target.machine_for(recipe))
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
    if trained is None:
        params = model_params(config)
    else:
        params, lora_dropout = _finetune_params(config, spec.recipe, trained, quantized or set())
        settings = replace(settings, lora_dropout=lora_dropout)
    return spec, settings, params, method, notes


def _finetune_model(r: Any) -> tuple[ModelConfig, str | None]:
    """The model a fine-tune trains: its base run's, or, before that run exists, the model of the
    shipped recipe that writes it (with a note saying so), so a fine-tune can be planned first."""
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
    """The shipped pretraining recipe whose run directory is `run_dir` (runs/NAME from the current
    folder), or None."""
    from difftrain.recipe import load_recipe, shipped_recipes

    path = shipped_recipes().get(run_dir.name)
    if path is None:
        return None
    recipe = load_recipe(path)
    if recipe.finetune is not None or recipe.model is None:
        return None
    return recipe if recipe.run_dir.absolute() == run_dir.absolute() else None


def _finetune_params(
    config: ModelConfig, r: Any, trained: set[str], quantized: set[str]
) -> tuple[list[Param], LoRADropout | None]:
    """Parameters of a fine-tune: LoRA adapters (trained), λ (trained unless frozen), the base
    (frozen; 4-bit for QLoRA's decoder linears)."""
    import torch

    from difftrain.adapters import plan_finetune_adapter
    from difftrain.model.lora import apply_lora
    from difftrain.model.transformer import Transformer

    ft = r.finetune
    with torch.device("meta"):
        model = Transformer(config)
    if ft.method == "full":
        return _params_of(model), None
    spec = plan_finetune_adapter(model, ft, train_embeddings=False)
    with torch.device("meta"):
        apply_lora(model, spec.targets, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout)
    names = {n for n, _ in model.named_parameters()}
    trained_names = {n for n in names if ".lora_" in n} | set(spec.trained)
    quantized_layers = {f"{q}.base" if q in spec.targets else q for q in spec.quantized}
    return _params_of(model, trained=trained_names, quantized=quantized_layers), lora_dropout_of(model)


def plan_recipe(recipe: Any, target: Target) -> RecipePlan:
    """Plan `recipe` on `target`; suggestions when it does not fit."""
    spec, settings, params, method, notes = recipe_settings(recipe, target)
    config = spec.model
    plan = plan_memory(config, settings, target, params, method=method)
    plan.notes[:0] = notes
    suggestions = [] if plan.fits else suggest(config, settings, target, params, method=method)
    # generation as `generate --dtype auto` runs it: bf16 on a GPU, fp32 on the CPU (logits fp32)
    dtype, width = ("bfloat16", 2) if target.kind == "cuda" else ("float32", 4)
    kv = kv_cache_bytes(config, dtype_bytes=width)
    gen_bytes = int(sum(p.numel for p in params) * width + kv + config.vocab_size * 4)  # type: ignore[operator]
    table = activation_table(config, settings, target) if method == "full" else []
    return RecipePlan(plan, suggestions, table, kv, gen_bytes, dtype, spec)


def fit_warning(recipe: Any, accelerator: str) -> str | None:
    """One line for `pretrain` and `finetune` when the plan says the run will not fit the device it is about to
    use (CUDA: the GPU's memory; CPU: the RAM), with the cheapest fix; None when it fits."""
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


# ----- measuring what autograd saves (used by tests and the benchmark) -------------------------
def saved_activation_bytes(run_forward: Any, exclude: Iterable[Any] = ()) -> int:
    """Bytes of the distinct storages autograd saves while `run_forward()` runs (the tensors
    `exclude`, e.g. the parameters, are not counted)."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_forward()
    return sum(seen.values())
