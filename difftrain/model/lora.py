"""Adapting a trained model: LoRA, 4-bit NF4 base weights (QLoRA), and vocabulary growth.

LoRA (Hu et al., 2021): a frozen linear map W (out × in) gets a trainable low-rank update

    y = W x + (α / r) · B A dropout(x),     A ∈ R^{r×in} ~ kaiming-uniform,  B ∈ R^{out×r} = 0

so training starts at the base model; merging folds it in, W' = W + (α/r)·B A (a plain
`nn.Linear` again). QLoRA (Dettmers et al., 2023): W is stored in 4-bit NF4 by bitsandbytes'
`Linear4bit` and dequantised on the fly, so merging a QLoRA adapter folds the update into
dequant(NF4(W)), the function that was trained. A LoRA layer keeps the frozen layer as `.base`
and adds `.lora_A`, `.lora_B` (`model.layers.3.self_attn.q_proj.lora_A`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.errors import ConfigError

NF4_BLOCKSIZE = 64


class LoRALinear(nn.Module):
    """y = base(x) + (α/r) · B A dropout(x); `base` (nn.Linear or bnb Linear4bit) stays frozen."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank < 1:
            raise ConfigError(f"LoRA rank must be at least 1, got {rank}")
        self.base = base
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)  # type: ignore[arg-type]
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = next(base.parameters()).device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear (and peft) do

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        h = F.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A)
        return y + (F.linear(h, self.lora_B) * self.scaling).to(y.dtype)

    def merged(self) -> nn.Linear:
        """A plain nn.Linear with weight dense(W) + (α/r)·B A, in W's dense dtype."""
        w = dense_weight(self.base)
        delta = (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scaling
        out = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        out.weight = nn.Parameter((w.float() + delta.to(w.device)).to(w.dtype), requires_grad=False)
        return out

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or a bitsandbytes 4-bit linear (without importing bitsandbytes)."""
    return isinstance(module, nn.Linear) or type(module).__name__ in ("Linear4bit", "LinearNF4")


def linear_names(model: nn.Module) -> list[str]:
    """Names of the linear layers a LoRA target pattern may match, in model order."""
    return [n for n, m in model.named_modules() if n and is_linear(m)]


def pattern_matches(name: str, pattern: str) -> bool:
    """A target pattern matches a module name when it matches the whole name or a dotted suffix.

    fnmatch syntax: `q_proj` matches every `...self_attn.q_proj`; `mlp.*` every MLP projection;
    `layers.1[0-1].*` every linear of layers 10 and 11; `model.layers.0.self_attn.v_proj` one layer.
    """
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def short_names(names: Iterable[str]) -> list[str]:
    """Distinct names with the layer prefix removed (`self_attn.q_proj`, `mlp.up_proj`, `lm_head`)."""
    layer = [n.split(".", 3)[3] if n.startswith("model.layers.") and n.count(".") > 2 else n for n in names]
    return list(dict.fromkeys(layer))


def match_targets(
    model: nn.Module, patterns: Sequence[str], exclude: Iterable[str] = (), where: str = "patterns"
) -> list[str]:
    """Linear layers matched by any of `patterns` (minus `exclude`), in model order; a pattern
    that matches nothing is a ConfigError listing the names that could be targeted."""
    excluded = set(exclude)
    candidates = [n for n in linear_names(model) if n not in excluded]
    if not patterns:
        raise ConfigError(f"{where} is empty; name the layers to adapt, e.g. [q_proj, v_proj]")
    for p in patterns:
        if not any(pattern_matches(n, p) for n in candidates):
            raise ConfigError(
                f"{where}: pattern `{p}` matches no linear layer; available: "
                f"{', '.join(short_names(candidates))} (patterns match a full name such as "
                f"`{candidates[0] if candidates else 'model.layers.0.self_attn.q_proj'}` or a dotted suffix of it)"
            )
    return [n for n in candidates if any(pattern_matches(n, p) for p in patterns)]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_lora(
    model: nn.Module, targets: Sequence[str], rank: int, alpha: float, dropout: float = 0.0
) -> dict[str, LoRALinear]:
    """Wrap each named linear layer in a LoRALinear (in place), freezing its weight; returns them
    by name. Call after freezing the rest of the model (A and B are created trainable)."""
    out: dict[str, LoRALinear] = {}
    for name in targets:
        base = model.get_submodule(name)
        if not is_linear(base):  # (a LoRALinear too: merge it first)
            raise ConfigError(
                f"{name} is a {type(base).__name__}, not a linear layer; LoRA adapts linear layers"
            )
        for p in base.parameters():
            p.requires_grad_(False)
        out[name] = lora = LoRALinear(base, rank, alpha, dropout)
        _set_module(model, name, lora)
    return out


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA layer into a plain nn.Linear (in place); returns how many were merged."""
    layers = lora_layers(model)
    for name, layer in layers.items():
        _set_module(model, name, layer.merged())
    return len(layers)


def import_bitsandbytes():
    """bitsandbytes for 4-bit base weights, or a DeviceError that says to use plain LoRA."""
    from difftrain.runtime import import_bitsandbytes as load

    return load("4-bit base weights (finetune.method=qlora)", "use finetune.method=lora")


def dense_weight(module: nn.Module) -> Tensor:
    """The weight of a linear layer as a dense tensor (dequantised for a 4-bit layer)."""
    w = module.weight  # type: ignore[union-attr]
    if not is_4bit(module):
        return w.detach()
    bnb = import_bitsandbytes()
    return bnb.functional.dequantize_4bit(w.data, w.quant_state).detach()


def is_4bit(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit layer (a subclass of nn.Linear whose weight is packed)."""
    return getattr(getattr(module, "weight", None), "quant_state", None) is not None


def quantize_4bit(
    model: nn.Module,
    names: Sequence[str],
    *,
    device: torch.device | str,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """Replace the named nn.Linear layers by frozen bitsandbytes NF4 `Linear4bit` layers on `device`.

    NF4 with blocks of 64 and double quantisation (the QLoRA paper's settings). bitsandbytes'
    CPU repacking in a first no-grad forward is turned off: its layout has no backward.
    """
    bnb = import_bitsandbytes()
    device = torch.device(device)
    for name in names:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear) or is_4bit(lin) or lin.bias is not None:
            raise ConfigError(f"{name}: only bias-free nn.Linear layers can be stored in 4 bits")
        nf4 = dict(compress_statistics=True, quant_type="nf4")
        q = bnb.nn.Linear4bit(
            lin.in_features, lin.out_features, bias=False, compute_dtype=compute_dtype, device="meta", **nf4
        )
        q.weight = bnb.nn.Params4bit(
            lin.weight.detach().float().cpu(), requires_grad=False, blocksize=NF4_BLOCKSIZE, **nf4
        )
        q = q.to(device)  # quantises
        if hasattr(q, "support_avx512bf16_for_cpu"):
            q.support_avx512bf16_for_cpu = False
        _set_module(model, name, q)


def nf4_round_trip_(model: nn.Module, names: Sequence[str]) -> None:
    """W ← dequant(NF4(W)) for the named nn.Linear layers (in place): the dense weights a QLoRA
    run's base layers actually had, for merging and loading its adapter without 4-bit kernels."""
    for name in names:
        lin = model.get_submodule(name)
        assert isinstance(lin, nn.Linear) and not is_4bit(lin)
        tmp = nn.Module()
        tmp.add_module("w", nn.Linear(lin.in_features, lin.out_features, bias=False))
        with torch.no_grad():
            tmp.w.weight.copy_(lin.weight.float())
        quantize_4bit(tmp, ["w"], device="cpu")
        with torch.no_grad():
            lin.weight.copy_(dense_weight(tmp.w).to(lin.weight.device, lin.weight.dtype))


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) unique parameters; a packed 4-bit weight counts as its dense size."""
    total = trainable = 0
    for p in model.parameters():  # (each tensor once: a tied head is the embedding)
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n = math.prod(shape) if shape is not None else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def grow_vocab(model: nn.Module, new_ids: Sequence[int], vocab_size: int, used_rows: int) -> None:
    """Give the Transformer's embedding and (untied) head `vocab_size` rows, the new ones and
    those of `new_ids` set to the mean of the first `used_rows` rows (Hewitt, 2021); existing rows
    are kept bit for bit, a tied head stays tied, `model.config.vocab_size` follows."""
    emb: nn.Embedding = model.model.embed_tokens  # type: ignore[union-attr,assignment]
    head: nn.Linear = model.lm_head  # type: ignore[assignment]
    old = emb.num_embeddings
    if vocab_size < old:
        raise ConfigError(f"cannot shrink the vocabulary from {old} to {vocab_size} rows")
    tied = head.weight is emb.weight
    bad = [i for i in new_ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"token ids {bad} do not fit a vocabulary of {vocab_size}")

    def grown(weight: Tensor) -> Tensor:
        w = weight.detach()
        out = torch.empty(vocab_size, w.shape[1], dtype=w.dtype, device=w.device)
        out[:old] = w
        mean = w[:used_rows].float().mean(0).to(w.dtype)
        out[old:] = mean
        for i in new_ids:
            out[i] = mean
        return out

    new_emb = nn.Embedding(vocab_size, emb.embedding_dim, _weight=grown(emb.weight))
    model.model.embed_tokens = new_emb  # type: ignore[union-attr]
    new_head = nn.Linear(head.in_features, vocab_size, bias=False, device="meta")
    new_head.weight = new_emb.weight if tied else nn.Parameter(grown(head.weight))
    model.lm_head = new_head
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.vocab_size != vocab_size:
        model.config = cfg.replace(vocab_size=vocab_size)
