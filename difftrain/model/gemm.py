"""fp32 matrix products on the CPU through oneDNN where torch's default BLAS takes a slow path.

PyTorch's x86 wheels run fp32 `mm`/`addmm` (every `nn.Linear`, forward and backward) through
Intel MKL. MKL picks its AVX-512 kernels only on Intel CPUs; on AMD ones (Zen 4 and 5 have
AVX-512) it runs a generic path. oneDNN, which the same wheels carry, picks its kernels from the
CPU's instruction sets, whoever made it. On the 2-core AMD EPYC (Zen 5) this project is developed
on, one thread, the bench's quickstart products (4096 × 256 · 256 × 704 and their backward):
MKL 73-102 GFLOP/s, oneDNN 125-233 (`python benchmarks/cpu_gemm.py` prints the table).

`linear(layer, x)` is `layer(x)` with the three products of a linear layer (y = x Wᵀ, ∂x = g W,
∂W = gᵀ x) run here when the call qualifies: fp32 CPU tensors, no autocast, a product big enough
to repay the call (`large_enough`), a plain `nn.Linear` without hooks whose weight is row-major
(the column-major weights `generate` lays out for MKL's one-token products stay with MKL: oneDNN
re-laid them at every call, 50 ms per token). Otherwise it is exactly `layer(x)`. The products
run by oneDNN or, with the torch backend, by torch's own BLAS, and either way ∂W takes the
faster operand order (`weight_grad`). `linears(layers, x)` does the same for layers that read
one input (q, k, v): their input gradients accumulate into one product's result instead of being
summed in extra passes; `gated_up` for SwiGLU's gate and up. Under torch.compile the oneDNN
products are an opaque custom op, and torch's are left to inductor (the plain layers). `mm(a, b)`
is one product without autograd (the fused loss uses it). Results equal torch's within fp32
rounding (another summation order; tests/test_gemm.py). On an Intel Xeon (MKL, one thread) the
torch backend's path made the bench's quickstart diff step 0.7 % faster than plain layers.

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
import platform
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from difftrain.errors import ConfigError
from difftrain.model import ckernels
from difftrain.runtime import CPU_GEMM_ENV, cpu_gemm_setting


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
    want = cpu_gemm_setting()
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


def _fp32_cpu(*tensors: Tensor) -> bool:
    """Whether these are fp32 CPU tensors outside autocast: the products this module may run."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and not (
        torch.is_autocast_enabled("cpu")
    )


def uses_onednn(*tensors: Tensor) -> bool:
    """Whether products of these tensors run by oneDNN here (fp32 CPU, no autocast, backend on)."""
    return _fp32_cpu(*tensors) and backend() == "onednn"


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for 2-D tensors, by oneDNN when the backend is on (no autograd through it)."""
    if (
        large_enough(a.shape[0], a.shape[1], b.shape[1])
        and uses_onednn(a, b)
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    ):
        return _dnn(a, b.t())
    return a @ b


def weight_grad(g: Tensor, x: Tensor, dnn: bool = True) -> Tensor:
    """gᵀ x (a linear layer's weight gradient, contiguous), by oneDNN or (dnn=False) torch's BLAS;
    g (n, out), x (n, in). With more outputs than inputs, (xᵀ g)ᵀ is the faster order for both: at
    4096 rows, oneDNN takes 9.8 ms for (in, out) = (256, 704) that way against 13.3, and 9.7 for
    (704, 256) against 13.4 the other way round (AMD EPYC, one thread); MKL 154-170 GFLOP/s
    against 139-154 for (256, 704) and the reverse for (704, 256) (Intel Xeon; `benchmarks/cpu_gemm.py`
    times the order chosen)."""
    if g.shape[1] > x.shape[1]:
        return (_dnn(x.t(), g.t()) if dnn else x.t() @ g).t().contiguous()
    return _dnn(g.t(), x.t()) if dnn else g.t() @ x


def _xwt(x: Tensor, w: Tensor, dnn: bool) -> Tensor:
    """x Wᵀ for x (..., K), w (N, K)."""
    return _dnn(x, w) if dnn else torch.matmul(x, w.t())


def _gw(g: Tensor, w: Tensor, dnn: bool) -> Tensor:
    """g W for g (..., N), w (N, K): the input gradient of x Wᵀ."""
    return _dnn(g, w.t()) if dnn else torch.matmul(g, w)


class _Linear(torch.autograd.Function):
    """y = x Wᵀ (+ b), forward and backward (∂x = g W, ∂W = gᵀ x) by oneDNN or torch's BLAS."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, dnn: bool) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.dnn, ctx.has_bias = dnn, bias is not None
        y = _xwt(x, weight, dnn)
        return y.add_(bias) if bias is not None else y

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _gw(g, weight, ctx.dnn)
        if ctx.needs_input_grad[1]:
            gw = _weight_grad_nd(g, x, ctx.dnn)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.reshape(-1, g.shape[-1]).sum(0)
        return gx, gw, gb, None


def _weight_grad_nd(g: Tensor, x: Tensor, dnn: bool) -> Tensor:
    return weight_grad(g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]), dnn)


def _accumulate(out: Tensor | None, g: Tensor, w: Tensor, dnn: bool) -> Tensor:
    """out + g W (g W when out is None), in place in out: with torch's BLAS the product adds
    itself to out (β = 1), with no separate pass for the sum."""
    if out is None:
        return _gw(g, w, dnn)
    if dnn:  # oneDNN's products have no out= form: the sum is a pass of its own
        return out.add_(_gw(g, w, dnn))
    out.view(-1, out.shape[-1]).addmm_(g.reshape(-1, g.shape[-1]), w)
    return out


def _sum_input_grads(gs: list[Tensor | None], weights: tuple[Tensor, ...], dnn: bool) -> Tensor | None:
    """Σ gᵢ Wᵢ over the outputs that have a gradient, accumulated in one tensor (`_accumulate`)."""
    out = None
    for g, w in zip(gs, weights, strict=True):
        if g is not None:
            out = _accumulate(out, g, w, dnn)
    return out


class _Linears(torch.autograd.Function):
    """(x W₁ᵀ, x W₂ᵀ, …): bias-free linear layers that read the same x. Autograd through separate
    layers sums their input gradients with a pass over memory per extra layer; here the products
    accumulate into one another (`_sum_input_grads`), and each weight gradient takes the faster
    operand order (`weight_grad`)."""

    @staticmethod
    def forward(ctx, x: Tensor, dnn: bool, *weights: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.save_for_backward(x, *weights)
        ctx.dnn = dnn
        return tuple(_xwt(x, w, dnn) for w in weights)

    @staticmethod
    def backward(ctx, *gs: Tensor | None):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        gx = _sum_input_grads(list(gs), tuple(weights), ctx.dnn) if ctx.needs_input_grad[0] else None
        gws = [
            _weight_grad_nd(g, x, ctx.dnn) if g is not None and need else None
            for g, need in zip(gs, ctx.needs_input_grad[2:], strict=True)
        ]
        return gx, None, *gws


class _GatedUp(torch.autograd.Function):
    """h = silu(x W_gᵀ) ⊙ (x W_uᵀ), SwiGLU's input side. Saves what autograd through the formula
    saves (gate, up, silu(gate)) and makes as many elementwise passes; ∂x is one product
    accumulated into the other (`_accumulate`), each ∂W takes the faster operand order, and
    backward holds one (…, F) gradient at a time where autograd held three."""

    @staticmethod
    def forward(ctx, x: Tensor, dnn: bool, w_gate: Tensor, w_up: Tensor) -> Tensor:  # type: ignore[override]
        gate, up = _xwt(x, w_gate, dnn), _xwt(x, w_up, dnn)
        ctx.dnn = dnn
        ctx.fused = ckernels.usable(gate, up)
        if ctx.fused:  # one pass each way (model/ckernels.py), and silu(gate) is not kept
            ctx.save_for_backward(x, w_gate, w_up, gate, up)
            return ckernels.swiglu(gate, up)
        s = torch.nn.functional.silu(gate)
        ctx.save_for_backward(x, w_gate, w_up, gate, up, s)
        return s * up

    @staticmethod
    @once_differentiable  # its gradients are computed without a graph
    def backward(ctx, gh: Tensor):  # type: ignore[override]
        need_x, need_gate, need_up = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        if ctx.fused:
            x, w_gate, w_up, gate, up = ctx.saved_tensors
            g_gate, g_up = ckernels.swiglu_backward(gh, gate, up)
            gw_up = _weight_grad_nd(g_up, x, ctx.dnn) if need_up else None
            gw_gate = _weight_grad_nd(g_gate, x, ctx.dnn) if need_gate else None
            gx = _accumulate(_gw(g_up, w_up, ctx.dnn), g_gate, w_gate, ctx.dnn) if need_x else None
            return gx, None, gw_gate, gw_up
        x, w_gate, w_up, gate, up, s = ctx.saved_tensors
        gx = gw_gate = gw_up = None
        # one (…, F) gradient alive at a time: ∂up's products, then ∂gate's (made in place)
        g = gh * s  # ∂up = ∂h ⊙ silu(gate)
        if need_up:
            gw_up = _weight_grad_nd(g, x, ctx.dnn)
        if need_x:
            gx = _gw(g, w_up, ctx.dnn)
        g = torch.mul(gh, up, out=g)  # ∂silu(gate) = ∂h ⊙ up, then ∂gate, in place
        torch.ops.aten.silu_backward.grad_input(g, gate, grad_input=g)
        if need_gate:
            gw_gate = _weight_grad_nd(g, x, ctx.dnn)
        if need_x:
            gx = _accumulate(gx, g, w_gate, ctx.dnn)
        return gx, None, gw_gate, gw_up


def _own_path(x: Tensor, layers: tuple[nn.Module, ...]) -> bool | None:
    """Whether `linear`/`linears`/`gated_up` run the products of `layers` on x themselves: None
    (no: plain layer calls), else whether by oneDNN (True) or torch's BLAS (False). They do for
    plain hook-free nn.Linear layers with row-major fp32 CPU weights, fp32 x, no autocast, a
    product worth the call (`large_enough`), and not under torch.compile with torch's BLAS
    (inductor then sees, and may fuse, the plain products)."""
    if not all(type(layer) is nn.Linear for layer in layers):
        return None
    weights = [layer.weight for layer in layers]
    if not (
        _fp32_cpu(x, *weights)
        and all(w.is_contiguous() for w in weights)
        and large_enough(x.numel() // max(1, x.shape[-1]), x.shape[-1], min(w.shape[0] for w in weights))
    ):
        return None
    if any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers) or (
        nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
    ):
        return None
    dnn = backend() == "onednn"
    if not dnn and torch.compiler.is_compiling():
        return None
    return dnn


def linear(layer: nn.Module, x: Tensor) -> Tensor:
    """`layer(x)`, a plain nn.Linear's products run here when they qualify (module docstring)."""
    dnn = _own_path(x, (layer,))
    if dnn is None:
        return layer(x)
    return _Linear.apply(x, layer.weight, layer.bias, dnn)


def linears(layers: tuple[nn.Module, ...], x: Tensor) -> tuple[Tensor, ...]:
    """`tuple(layer(x) for layer in layers)` for bias-free linear layers that read the same x, with
    one input gradient accumulated across them where they qualify (see `_Linears`)."""
    dnn = _own_path(x, layers)
    if dnn is None or any(layer.bias is not None for layer in layers):
        return tuple(linear(layer, x) for layer in layers)
    return _Linears.apply(x, dnn, *(layer.weight for layer in layers))


def gated_up(gate: nn.Module, up: nn.Module, x: Tensor) -> Tensor:
    """silu(gate(x)) ⊙ up(x), with one input gradient accumulated across the two products where
    they qualify (see `_GatedUp`)."""
    dnn = _own_path(x, (gate, up))
    if dnn is None or gate.bias is not None or up.bias is not None:  # type: ignore[union-attr]
        g, u = linear(gate, x), linear(up, x)
        if g.shape == u.shape and ckernels.usable(g, u):
            return ckernels.SwiGLU.apply(g, u)
        return torch.nn.functional.silu(g) * u
    return _GatedUp.apply(x, dnn, gate.weight, up.weight)
