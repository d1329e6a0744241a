"""What a training step holds in memory, computed before anything runs (`plan_memory`):

    weights       P · bytes(param dtype)   (fp32, or bf16 under bf16-true; QLoRA's base: 4-bit NF4)
    gradients     P_trained · bytes(param dtype)
    optimizer     per trained tensor, as the optimizer allocates it (`optimizer_bytes`, exact)
    activations   what autograd saves for the backward pass, per token in each decoder layer
                  (`layer_bytes_per_token`) and outside them (`activations`): exact for eager
                  execution, compared with `saved_activation_bytes` by the tests. Checkpointing
                  keeps each layer's input and rebuilds one layer at a time in the backward.
    loss          the chunked loss (`model/loss.py`): its saved ∂h and ∂W and one chunk's logits;
                  without it (an adapted or quantised output layer) the saved log-probabilities
                  and two (B·T, V) buffers

The peak is the larger of the backward pass (weights, optimizer state, saved activations, and
either the accumulated gradients plus the loss's buffers, or a rebuilt checkpointed layer with
its gradient buffers beside the parameter gradients) and the optimizer step (weights, gradients,
state, AdamW's temporaries ≈ one fp32 copy of the parameters). Gradients count in full when
micro-batches accumulate, else only the output layer's. A process needs the peak with allocator
slack plus the CUDA context or the process itself (constants below); `benchmarks/memory.py` (CPU)
finds it within ±4 % up to d_model 512 / seq 512. FSDP: see `Sharding`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from difftrain.errors import ConfigError
from difftrain.model.config import ModelConfig

if TYPE_CHECKING:
    from difftrain.spec import Machine

KiB, MiB, GiB = 2**10, 2**20, 2**30
CUDA_CONTEXT_BYTES = GiB // 2  # not in torch.cuda.max_memory_allocated
CUDA_ALLOCATOR_FACTOR = 1.10
CPU_PROCESS_BYTES = 900 * MiB  # Python + torch + Lightning (≈ 600 MiB) + libraries loaded on first use
CPU_ALLOCATOR_FACTOR = 1.25  # glibc keeps freed blocks: the resident set exceeds the live tensors
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes, 8-bit absmax per 64, fp32 per 256 of those
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "lion8bit")


@dataclass(frozen=True)
class Param:
    """One parameter tensor; `matmul`: a matmul reads it (autocast makes a bf16 copy of it)."""

    name: str
    numel: int
    matmul: bool
    trained: bool = True
    quantized: bool = False  # QLoRA: stored as 4-bit NF4, frozen
    head: bool = False  # the output layer's weight (the embedding too when they are tied)


def model_params(config: ModelConfig) -> list[Param]:
    """The model's parameter tensors (a tied head once), in the model's order: one decoder layer
    is built on the meta device and its tensors repeated for the others (fast for 1,000 layers)."""
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
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    return [
        Param(
            name,
            p.numel(),
            id(p) in matmul_weights or p is head,
            trained=trained is None or name in trained,
            quantized=quantized is not None and name.rsplit(".", 1)[0] in quantized,
            head=p is head,
        )
        for name, p in model.named_parameters()  # (a tied weight once, under its first name)
    ]


def optimizer_bytes(params: Iterable[Param], name: str, param_bytes: int = 4) -> int:
    """Bytes of optimizer state for the trained tensors. AdamW: two moments in the parameter's
    dtype and a 0-d fp32 step per tensor. bitsandbytes (8-bit): fp32 state below 4096 elements;
    else per moment one uint8 per element, an fp32 absmax per block of 256 and a 256-entry map."""
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer {name!r} is unknown to the planner; choose one of {', '.join(OPTIMIZERS)}"
        )
    moments = 1 if name == "lion8bit" else 2

    def state(n: int) -> int:
        if name == "adamw":
            return 2 * n * param_bytes + 4
        if n < BNB_MIN_8BIT_SIZE:
            return moments * 4 * n
        return moments * (n + 4 * math.ceil(n / BNB_BLOCK) + 4 * 256)

    return sum(state(p.numel) for p in params if p.trained)


def _dtype_family(precision: str) -> str:
    return {"bf16-mixed": "mixed", "16-mixed": "mixed", "bf16-true": "true", "16-true": "true"}.get(
        precision, "fp32"
    )


def layer_bytes_per_token(
    config: ModelConfig, precision: str, kernel: str = "sdpa", seq_len: int = 0, attn_impl: str = "auto"
) -> float:
    """Bytes autograd saves per token in one decoder layer, with D = d_model, F = ffn_hidden,
    Hd = n_heads·head_dim, Kd = n_kv_heads·head_dim: the block input, two RMSNorms (x, x̂, out) and
    four MLP tensors (bf16-mixed: fp32 residual and norm statistics, the norm output cast to bf16
    once per projection); attention's q, k, v, the core's output and log-sum-exp (diff adds its
    second map's output and subln's tensors; `sdpa` saves diff's q and k zero-padded to 2d, `flex`
    d wide, derived, not measured: torch has no flex backward on CPU; diff2 has 2H query heads and
    its gate). `attn_impl: eager` also keeps the fp32 maps, approximately."""
    D, F, H, d, kv = config.d_model, config.ffn_hidden, config.n_heads, config.head_dim, config.n_kv_heads
    assert F is not None and d is not None and kv is not None
    Hd, Kd = H * d, kv * d
    fam = _dtype_family(precision)
    flex = kernel == "flex"
    fp32 = {  # elements of 4 bytes
        "baseline": 2 * Hd + 2 * Kd + H,
        "diff": (6 * Hd + 2 * Kd + 1.5 * H) if flex else (7 * Hd + 3 * Kd + 1.5 * H),
        "diff2": 5 * Hd + 2 * Kd + 3 * H,
    }
    bf16 = {
        "baseline": 4 * Hd + 4 * Kd + 4 * H,
        "diff": (14 * Hd + 4 * Kd + 6 * H) if flex else (16 * Hd + 6 * Kd + 6 * H),
        "diff2": 10 * Hd + 4 * Kd + 14 * H + (2 * D if fam == "mixed" else 0),
    }
    attention = 4 * fp32[config.arch] if fam == "fp32" else bf16[config.arch]
    common = {"fp32": (6 * D + 4 * F + 2) * 4, "mixed": 26 * D + 8 * F + 8, "true": 16 * D + 8 * F + 8}[fam]
    maps = {"baseline": 4, "diff": 6, "diff2": 12}[config.arch] * H * seq_len if attn_impl == "eager" else 0
    return float(common + attention + maps)


# LoRA dropout: the projections that read one tensor (the attention's input, the MLP's)
_SAME_INPUT = dict.fromkeys(("q_proj", "k_proj", "v_proj", "lambda_proj"), "attn") | dict.fromkeys(
    ("gate_proj", "up_proj"), "mlp"
)


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
    """Bytes per token that LoRA dropout adds, per layer (None: the output layer): each adapted
    projection's mask where its input needs a gradient (not layer 0's attention inputs), in the
    input's dtype on CPU (one bool per element on CUDA, not measured), and its dropped copy, saved
    in place of the input that the projections reading it shared (under bf16-mixed the bf16 cast
    is saved either way). Exact for diff; for baseline and diff2 short by one tensor per layer."""
    fam = _dtype_family(precision)
    width = 2 if fam == "true" else 4
    out: dict[int | None, float] = {}
    inputs: dict[int | None, dict[str, int]] = {}
    for layer, name, f in lora.adapted:
        group = _SAME_INPUT.get(name, name)
        mask_width = 1 if device_type == "cuda" else (2 if fam == "mixed" and name == "down_proj" else width)
        mask = 0 if layer == 0 and group == "attn" else mask_width * f
        copy = 0 if fam == "mixed" else width * f
        out[layer] = out.get(layer, 0.0) + mask + copy
        inputs.setdefault(layer, {})[group] = copy
    for layer, freed in inputs.items():
        out[layer] -= sum(freed.values())
    return out


def head_gradient_bytes(config: ModelConfig, precision: str) -> float:
    """The chunked loss's saved gradient of the output weight (V × D), computed in its forward."""
    assert isinstance(config.vocab_size, int)
    return config.vocab_size * config.d_model * (4 if _dtype_family(precision) == "fp32" else 2)


@dataclass
class Activations:
    """Activation memory of one micro-batch (bytes)."""

    layers: float  # what all layers keep during the forward pass (checkpointed: their inputs)
    outside: float  # final norm, rotary tables, the loss's saved tensors
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

    fused_loss: the loss is computed in chunks with the output layer (what training does), else
    from materialised logits (a LoRA-adapted or quantised output layer)."""
    N, L, D = micro_batch_size * seq_len, config.n_layers, config.d_model
    per_layer = N * layer_bytes_per_token(config, precision, kernel, seq_len, attn_impl)
    fam = _dtype_family(precision)
    if checkpointing:
        layers, recompute = N * L * D * (2 if fam == "true" else 4), per_layer
    else:
        layers, recompute = L * per_layer, 0.0
    copies = 0.0
    if fam == "mixed":  # autocast's bf16 weight copies; checkpointed layers make theirs in recompute
        copied = [p for p in params if p.matmul and not p.quantized]
        in_layers = 2.0 * sum(p.numel for p in copied if ".layers." in p.name)
        # the chunked loss's copy of the output weight is not kept
        copies = 2.0 * sum(
            p.numel for p in copied if ".layers." not in p.name and not (fused_loss and p.head)
        )
        if checkpointing:
            recompute += in_layers / L
        else:
            copies += in_layers
    # outside the layers: the final norm, the rotary tables, and the loss's saved tensors
    assert config.head_dim is not None and isinstance(config.vocab_size, int)
    d, V = config.head_dim, config.vocab_size
    norm = {"fp32": 12 * D + 8 * d, "mixed": 10 * D + 4 * d, "true": 8 * D + 4 * d}[fam]
    # the chunked loss: ∂h replaces the output layer's saved input, the targets are not kept, its ∂W
    # is saved (below); else the targets and the log-softmax output (4V)
    outside = N * (norm + 12 if fused_loss else norm + 20 + 4 * V)
    if lora_dropout is not None:
        extra = lora_dropout_bytes_per_token(lora_dropout, precision, device_type)
        outside += N * extra.pop(None, 0.0)
        if checkpointing:  # one layer is rebuilt at a time
            recompute += N * max(extra.values(), default=0.0)
        else:
            layers += N * sum(extra.values())
    if fused_loss:
        outside += head_gradient_bytes(config, precision)
    return Activations(layers, outside, copies, recompute)


@dataclass(frozen=True)
class Target:
    """The device a plan is for: `cuda` (GPU memory) or `cpu` (RAM)."""

    kind: str
    memory: int
    name: str
    machine: Machine | None = None  # this machine, when the target is its own GPU or RAM

    @property
    def overhead(self) -> int:
        return CUDA_CONTEXT_BYTES if self.kind == "cuda" else CPU_PROCESS_BYTES


@dataclass(frozen=True)
class Sharding:
    """How FSDP divides a run over its devices (`train.fsdp`): each holds 1/shards of the weights,
    gradients and optimizer state. The passes gather full weights in the gather dtype: the units
    in flight (root and about two blocks) with full/hybrid_shard and auto_wrap, else the model."""

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
    """Estimated bytes of a training run; `peak` is what the step allocates at its peak."""

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
        """What max_memory_allocated would report."""
        return max(self.peak_backward, self.peak_step)

    @property
    def processes(self) -> int:
        """Training processes the target's memory holds: a GPU one, the RAM all of train.devices."""
        return self.settings.devices if self.target.kind == "cpu" else 1

    @property
    def process_need(self) -> float:
        """What one process needs: the peak with allocator slack, plus the context/process."""
        factor = CUDA_ALLOCATOR_FACTOR if self.target.kind == "cuda" else CPU_ALLOCATOR_FACTOR
        return self.peak * factor + self.target.overhead

    @property
    def device_need(self) -> float:
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
            **{k: round(getattr(self, k)) for k in ("peak_backward", "peak_step", "peak", "device_need")},
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
) -> MemoryPlan:
    """The memory plan of training `config` with `settings` on `target` (see the module doc)."""
    if config.vocab_size == "auto":
        raise ConfigError("model.vocab_size is 'auto': resolve it before planning (plan_recipe does)")
    from difftrain.model.loss import chunk_rows

    params = model_params(config) if params is None else params
    # the model computes the loss fused with a plain (not adapted, not quantised) output layer
    fused_loss = any(p.head and not p.quantized for p in params)
    s = settings
    fam = _dtype_family(s.precision)
    pbytes = 2 if fam == "true" else 4
    n_params = sum(p.numel for p in params)
    n_trained = sum(p.numel for p in params if p.trained)
    weights = sum(p.numel * (NF4_BYTES_PER_PARAM if p.quantized else pbytes) for p in params)
    grads = n_trained * pbytes
    opt = optimizer_bytes(params, s.optimizer, pbytes)
    temps = n_trained * 4.0 if s.optimizer == "adamw" else 0.0  # foreach/fused AdamW workspace
    shards, gathered = 1, 0.0
    if s.fsdp is not None:  # each device holds its shard of these (see `Sharding`)
        shards = s.fsdp.shards
        weights, grads, opt, temps = weights / shards, grads / shards, opt / shards, temps / shards
        gathered = _fsdp_gathered(params, s.fsdp, s.precision, pbytes)
    act = step_activations(config, params, s, target, fused_loss)
    assert isinstance(config.vocab_size, int) and config.ffn_hidden is not None
    N, V, D = s.micro_batch_size * s.seq_len, config.vocab_size, config.d_model
    if fused_loss:
        # Backward starts by scaling the saved ∂h and ∂W (new tensors; bf16-mixed also casts
        # them to fp32); the forward's largest moment is one chunk's logits and exponentials
        # (+ the half-precision copy of the gradient) beside an fp32 ∂W accumulator.
        hb = 4 if fam == "fp32" else 2
        scaled = (
            N * D * hb + head_gradient_bytes(config, s.precision) + ((N + V) * D * 4 if fam == "mixed" else 0)
        )
        half = hb != 4
        chunk = min(N, chunk_rows(V)) * V * (8 + (hb if half else 0)) + (V * D * 4 if half else 0)
        loss_buffers = float(max(scaled, chunk))
    else:
        loss_buffers = 2.0 * N * V * 4
    head = next((p for p in params if p.name in ("lm_head.weight", "model.embed_tokens.weight")), None)
    grads_at_backward = (
        grads if s.accumulate > 1 else (head.numel * pbytes / shards if head and head.trained else 0)
    )
    if s.fsdp is not None and s.fsdp.param_dtype == "compute" and fam == "mixed":
        act = replace(act, weight_copies=0.0)  # FSDP gathers bf16 weights: autocast copies nothing
    saved = act.layers + act.weight_copies + gathered
    # The loss's buffers come at the start of the backward pass; a checkpointed layer is rebuilt
    # later, with its gradient buffers (≈ one (B·T, F), two (B·T, D)) and most parameter gradients.
    rebuild = 0.0
    if s.checkpointing:
        rebuild = grads + act.recompute + N * (config.ffn_hidden + 2 * D) * pbytes
    peak_backward = weights + opt + saved + max(grads_at_backward + act.outside + loss_buffers, rebuild)
    notes = []
    if s.attn_impl == "eager":
        notes.append("attn_impl=eager keeps the attention maps: the activation figure is approximate")
    if method != "full":
        notes.append(
            f"{method}: LoRA's own small intermediates are not counted"
            + ("; its dropout's masks and dropped inputs are" if s.lora_dropout is not None else "")
        )
    if s.fsdp is not None:
        offload = "; train.fsdp.cpu_offload moves the shards and the optimizer step to host RAM, counted here on the GPU (an upper bound)"
        notes.append(
            f"train.strategy=fsdp ({s.fsdp.strategy} over {shards} device{'s' if shards > 1 else ''}): weights, "
            f"gradients and optimizer state are 1/{shards} per device, plus the full weights gathered for the "
            f"passes; an estimate from FSDP's design, not yet measured on GPUs{offload if s.fsdp.cpu_offload else ''}"
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
        peak_step=weights + grads + opt + temps,
        method=method,
        notes=notes,
    )


def step_activations(
    config: ModelConfig, params: list[Param], s: Settings, target: Target, fused_loss: bool = True
) -> Activations:
    """`activations` of one micro-batch of `s` on `target`, with the attention core training runs
    there (as `model.kernels.resolve_impl`)."""
    flex = target.kind == "cuda" and s.attn_impl in ("auto", "flex")
    return activations(
        config,
        params,
        micro_batch_size=s.micro_batch_size,
        seq_len=s.seq_len,
        precision=s.precision,
        checkpointing=s.checkpointing,
        kernel="flex" if flex else "sdpa",
        attn_impl=s.attn_impl,
        fused_loss=fused_loss,
        device_type=target.kind,
        lora_dropout=s.lora_dropout,
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
