"""Optimizers and learning-rate schedules.

Weight decay only on matrices (≥ 2-D weights), never on norms, λ vectors or biases; embeddings
(and a tied head) only with `optim.decay_embeddings`. 8-bit optimizers come from bitsandbytes
(≈2 bytes of state per parameter for Adam, ≈1 for Lion, instead of 8 for fp32 AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from difftrain.errors import DeviceError
from difftrain.recipe import OptimConfig
from difftrain.train.distributed import clean_name

BNB_OPTIMIZERS = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit", "lion8bit": "Lion8bit"}


def param_groups(
    model: nn.Module,
    weight_decay: float,
    decay_embeddings: bool = False,
    ndims: Mapping[str, int] | None = None,
) -> list[dict]:
    """Split trainable parameters into a decayed group (matrices) and a non-decayed one.

    `ndims`: each parameter's number of dimensions by (clean) name, for a model whose parameters
    were flattened into shards (FSDP)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # (a tied lm_head is listed once, as the embedding)
        if not p.requires_grad:
            continue
        is_embedding = "embed_tokens" in name or (name.endswith("lm_head.weight") and _is_tied(model))
        ndim = ndims.get(clean_name(name), p.ndim) if ndims is not None else p.ndim
        (decay if ndim >= 2 and (decay_embeddings or not is_embedding) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _is_tied(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    return head is not None and emb is not None and head.weight is emb.weight


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device_type: str, ndims: Mapping[str, int] | None = None
) -> torch.optim.Optimizer:
    """The optimizer named by `cfg.name` ('auto' must already be resolved) over `model`'s groups
    (`ndims`: see `param_groups`)."""
    groups = [g for g in param_groups(model, cfg.weight_decay, cfg.decay_embeddings, ndims) if g["params"]]
    if cfg.name == "adamw":
        # fused on CUDA and CPU alike (on the CPU 4-5× faster than foreach at the quickstart shape)
        kwargs: dict = {"fused": True} if device_type in ("cuda", "cpu") else {"foreach": True}
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **kwargs)
    if cfg.name in BNB_OPTIMIZERS:
        if cfg.name == "paged_adamw8bit" and device_type != "cuda":
            raise DeviceError(
                "optim.name=paged_adamw8bit pages optimizer state between GPU and CPU memory and needs CUDA; "
                "on this machine use optim.name=adamw8bit or adamw"
            )
        from difftrain.runtime import import_bitsandbytes

        bnb_optim = import_bitsandbytes(f"optim.name={cfg.name}", "use optim.name=adamw").optim
        cls = getattr(bnb_optim, BNB_OPTIMIZERS[cfg.name])
        if cfg.stable_embedding:
            # StableEmbedding's 32-bit state for the embedding, without its extra LayerNorm
            manager = bnb_optim.GlobalOptimManager.get_instance()
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    manager.register_module_override(module, "weight", {"optim_bits": 32})
        kwargs = {"lr": cfg.lr, "betas": cfg.betas}
        if cfg.name != "lion8bit":
            kwargs["eps"] = cfg.eps
        return cls(groups, **kwargs)
    raise DeviceError(
        f"unknown optimizer `{cfg.name}`; resolve optim.name=auto before building the optimizer"
    )


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (for the 8-bit memory figures)."""
    tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(v.numel() * v.element_size() for v in tensors)


def lr_multiplier(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """step → lr / peak lr for the configured schedule.

    warmup: linear from 1/(warmup+1) to 1 over `warmup_steps`; then
      cosine:   min + (1 − min)·½(1 + cos(π·p)),  p = progress through the remaining steps
      linear:   min + (1 − min)·(1 − p)
      constant: 1
      wsd:      1 until the last `decay_fraction` of the steps, then linear to min
    """
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    floor = cfg.min_lr_ratio
    decay_steps = max(total_steps - warmup, 1)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        p = min(max((step - warmup) / decay_steps, 0.0), 1.0)
        if cfg.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
        if cfg.schedule == "linear":
            return floor + (1 - floor) * (1 - p)
        if cfg.schedule == "wsd":
            start = 1 - cfg.decay_fraction
            return 1.0 if p <= start else floor + (1 - floor) * (1 - (p - start) / cfg.decay_fraction)
        return 1.0

    return f
