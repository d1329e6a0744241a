"""fp32 matrix products on the CPU through oneDNN where torch's default BLAS takes a slow path.

PyTorch's x86 wheels run fp32 `mm`/`addmm` (every `nn.Linear`, forward and backward) through
Intel MKL. MKL picks its AVX-512 kernels only on Intel CPUs; on AMD ones (Zen 4 and 5 have
AVX-512) it runs a generic path. oneDNN, which the same wheels carry, picks its kernels from the
CPU's instruction sets, whoever made it. On the 2-core AMD EPYC (Zen 5) this project is developed
on, one thread, the bench's quickstart products (4096 × 256 · 256 × 704 and their backward):
MKL 73-102 GFLOP/s, oneDNN 125-233 (`python benchmarks/cpu_gemm.py` prints the table).

`linear(layer, x)` is `layer(x)` with the three products of a linear layer (y = x Wᵀ, ∂x = g W,
∂W = gᵀ x) run by oneDNN when the backend is on and the call qualifies: fp32 CPU tensors, no
autocast, a product big enough to repay the call (`large_enough`), a plain `nn.Linear` without
hooks whose weight is row-major (the column-major weights `generate` lays out for MKL's
one-token products stay with MKL: oneDNN re-laid them at every call, 50 ms per token). Under torch.compile it is an opaque custom
op. Otherwise it is exactly `layer(x)`. `mm(a, b)` is the same for one product without autograd
(the fused loss uses it). Results equal torch's within fp32 rounding (another summation order;
tests/test_gemm.py).

The backend is chosen once per process by `DIFFTRAIN_CPU_GEMM`:

- `auto` (default): oneDNN on x86-64 CPUs not made by Intel, torch's default (MKL) on Intel
  ones, where MKL takes its fast path; torch's default wherever oneDNN is missing.
- `onednn`: oneDNN on any x86-64 CPU (an error where this torch has no oneDNN).
- `torch`: torch's default everywhere (to compare, or to rule this module out).

The choice is by vendor, not by timing at start-up, so a run and its resume use the same
kernels and a given machine always computes the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from difftrain.errors import ConfigError


def cpu_vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...), or "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    text = platform.processor()  # Windows: "AMD64 Family 25 Model 97 Stepping 2, AuthenticAMD"
    return text.rsplit(",", 1)[-1].strip() if "," in text else ""


@functools.cache
def _onednn_op() -> Any:
    """torch's dense-tensor oneDNN linear (y = x Wᵀ + b), or None where this build lacks it."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None:
        return None
    try:  # the op is internal: check it computes what we call it for before relying on it
        x = torch.arange(6, dtype=torch.float32).view(2, 3)
        w = torch.arange(12, dtype=torch.float32).view(4, 3)
        if not torch.equal(op(x, w, None, "none", [], ""), x @ w.t()):
            return None
    except (RuntimeError, TypeError):
        return None
    return op


MIN_ROWS = 16
MIN_MACS = 1 << 22
"""Smaller products stay with MKL: oneDNN's fixed cost per call (≈ 15 µs) loses below about 16
rows or 4M multiply-adds (one thread, MKL / oneDNN µs: 256 → 768 outputs, 1 row 12.5 / 29.9,
16 rows 80 / 64; 256 × 64 · 64 × 64 forward 25 / 39 and ∂W 29 / 57; at 2.9M multiply-adds the
three passes of a layer tie, 208 / 206; at 4.2M oneDNN wins, 316 / 270)."""


def large_enough(rows: int, k: int, n: int) -> bool:
    """Whether a (rows × k) · (k × n) product is worth oneDNN's call (MIN_ROWS, MIN_MACS)."""
    return rows >= MIN_ROWS and rows * k * n >= MIN_MACS


CPU_GEMM_ENV = "DIFFTRAIN_CPU_GEMM"
CPU_GEMM_CHOICES = ("auto", "onednn", "torch")
_override: list[str] = []


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run products by backend `name` ("onednn" or "torch") inside the block (the bench compares
    the two in one process; tests pin one). "onednn" where it is unavailable is a ConfigError."""
    if name not in ("onednn", "torch"):
        raise ValueError(f"unknown CPU GEMM backend {name!r}")
    if name == "onednn" and _onednn_op() is None:
        raise ConfigError(f"this torch has no oneDNN linear on this CPU ({platform.machine()})")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def backend() -> str:
    """The backend in use, "onednn" or "torch": `use_backend`'s inside one, else DIFFTRAIN_CPU_GEMM's.
    Under torch.compile a plain read of values resolved before (`Transformer` resolves the setting
    when it is built), so tracing it adds no graph break."""
    if _override:
        return _override[-1]
    resolved = _resolved.get("backend")
    return resolved if resolved is not None else configured_backend()


_resolved: dict[str, str] = {}


def configured_backend() -> str:
    """The process's backend from DIFFTRAIN_CPU_GEMM (see the module docstring), resolved once."""
    if "backend" not in _resolved:
        _resolved["backend"] = _resolve()
    return _resolved["backend"]


def forget_configured_backend() -> None:
    """Resolve DIFFTRAIN_CPU_GEMM again at the next use (tests change it)."""
    _resolved.clear()


def _resolve() -> str:
    raw = os.environ.get(CPU_GEMM_ENV, "")
    want = raw.strip().lower() or "auto"
    if want not in CPU_GEMM_CHOICES:
        raise ConfigError(
            f"{CPU_GEMM_ENV}={raw!r} is not a CPU matrix-product backend; "
            f"set it to one of {', '.join(CPU_GEMM_CHOICES)} (or unset it for auto)"
        )
    if want == "torch":
        return "torch"
    available = _onednn_op() is not None
    if want == "onednn":
        if not available:
            raise ConfigError(
                f"{CPU_GEMM_ENV}=onednn but this torch has no oneDNN linear on this CPU "
                f"({platform.machine()}); unset {CPU_GEMM_ENV} or set it to torch"
            )
        return "onednn"
    return "onednn" if available and cpu_vendor() not in ("GenuineIntel", "") else "torch"


@torch.library.custom_op("difftrain::onednn_mm_nt", mutates_args=())
def _dnn(x: Tensor, w: Tensor) -> Tensor:
    """x Wᵀ by oneDNN; x (..., K), w (N, K), either may be a strided view. A custom op, so that
    torch.compile calls it as it is (inductor's own lowering of the oneDNN op wants the weight
    frozen into the graph)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@_dnn.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def uses_onednn(*tensors: Tensor) -> bool:
    """Whether products of these tensors run by oneDNN here (fp32 CPU, no autocast, backend on)."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not torch.is_autocast_enabled("cpu")
        and backend() == "onednn"
    )


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for 2-D tensors, by oneDNN when the backend is on (no autograd through it)."""
    if (
        large_enough(a.shape[0], a.shape[1], b.shape[1])
        and uses_onednn(a, b)
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    ):
        return _dnn(a, b.t())
    return a @ b


def weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """gᵀ x (a linear layer's weight gradient, contiguous) by oneDNN; g (n, out), x (n, in). With
    more outputs than inputs, (xᵀ g)ᵀ is the faster order: at 4096 rows, (in, out) = (256, 704)
    takes 9.8 ms that way against 13.3, and (704, 256) 9.7 against 13.4 the other way round
    (one thread; `benchmarks/cpu_gemm.py` times the order chosen)."""
    if g.shape[1] > x.shape[1]:
        return _dnn(x.t(), g.t()).t().contiguous()
    return _dnn(g.t(), x.t())


class _Linear(torch.autograd.Function):
    """y = x Wᵀ (+ b) with all three products by oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = _dnn(x, weight)
        return y.add_(bias) if bias is not None else y

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _dnn(g, weight.t())  # g W
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                gw = weight_grad(g2, x.reshape(-1, x.shape[-1]))
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g2.sum(0)
        return gx, gw, gb


def linear(layer: nn.Module, x: Tensor) -> Tensor:
    """`layer(x)`, with a plain nn.Linear's products by oneDNN when they qualify (module docstring)."""
    if (
        type(layer) is nn.Linear
        and uses_onednn(x, layer.weight)
        and layer.weight.is_contiguous()  # not the column-major decode layout (model/fused.py)
        and large_enough(x.numel() // max(1, x.shape[-1]), x.shape[-1], layer.weight.shape[0])
        and not (layer._forward_hooks or layer._forward_pre_hooks)
        and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    ):
        return _Linear.apply(x, layer.weight, layer.bias)
    return layer(x)
