"""Linear layers that read the same input, run as one matrix product (CPU inference).

Decoding one token is a chain of matrix-vector products, each of which streams its weight from
memory and pays a fixed call cost. `q_proj`, `k_proj`, `v_proj` (and `gate_proj`, `up_proj`)
read the same input, so `fuse_linears` stores their weights as row blocks of one column-major
matrix and the module computes all of them in one product (`fused_outputs`), which reads the
same bytes faster. The layers keep their own parameters, now views into the shared matrix, so
state dicts, saving and in-place loading are unchanged and nothing is stored twice.

The fused product is used only without gradients (the fused matrix is not a parameter) and only
while the layers are still the ones fused, holding the same memory: a layer wrapped by LoRA, a
model moved or cast (which gives its parameters new memory) falls back to one product per
layer, so a stale matrix is never read. `infer.device.cpu_inference_layout` applies it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ATTR = "_fused_linears"


class _Fused(NamedTuple):
    weight: Tensor  # (sum of out_features, in_features), column-major
    layers: tuple[nn.Linear, ...]
    pointers: tuple[int, ...]  # each layer's weight.data_ptr() when fused
    sizes: tuple[int, ...]  # each layer's out_features


def fuse_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Re-lay the weights of `module`'s child linears `names` as one column-major fp32 CPU matrix
    (see the module docstring). False, and nothing changed, unless they are plain bias-free
    nn.Linear layers on the CPU in fp32 with one input width and row-major weights."""
    layers = tuple(module._modules.get(n) for n in names)
    if not all(type(layer) is nn.Linear and layer.bias is None for layer in layers):
        return False
    weights = [layer.weight for layer in layers]  # type: ignore[union-attr]
    if len({w.shape[1] for w in weights}) != 1 or any(
        w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous() for w in weights
    ):
        return False
    with torch.no_grad():
        fused = torch.cat([w.data for w in weights]).t().contiguous().t()
        row = 0
        for w in weights:
            w.data = fused[row : row + w.shape[0]]
            row += w.shape[0]
    entry = _Fused(fused, layers, tuple(w.data_ptr() for w in weights), tuple(w.shape[0] for w in weights))  # type: ignore[arg-type]
    module.__dict__.setdefault(_ATTR, {})[names] = entry
    return True


def fused_outputs(module: nn.Module, names: tuple[str, ...], x: Tensor) -> tuple[Tensor, ...] | None:
    """The outputs of `module`'s linears `names` on x from one product, or None where they must
    run one by one (not fused, gradients on, or a layer replaced or given new memory since).
    Under torch.compile too: the pointer check would break the graph, and the compiled decode
    step took the same time with three products as with one (1.24-1.29 vs 1.23-1.32 ms per token
    at the bench's quickstart shape, interleaved runs, one thread)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    entry = fused_entry(module, names)
    return None if entry is None else F.linear(x, entry.weight).split(entry.sizes, dim=-1)


def fused_entry(module: nn.Module, names: tuple[str, ...]) -> _Fused | None:
    """The fusion of `module`'s linears `names`, while still valid: the same layers, holding the
    same memory (None otherwise, or if never fused)."""
    entries = module.__dict__.get(_ATTR)
    entry = None if entries is None else entries.get(names)
    if entry is None:
        return None
    for name, layer, ptr in zip(names, entry.layers, entry.pointers, strict=True):
        if module._modules.get(name) is not layer or layer.weight.data_ptr() != ptr:
            return None
    return entry
