"""Attention modules: projections, RoPE, KV-cache bookkeeping, the per-arch core, o_proj.

Notation: x (B, T, D) the normalised residual stream, H = n_heads, Hkv = n_kv_heads,
d = head_dim. All three modules own `q_proj`, `k_proj`, `v_proj`, `o_proj` (no biases) with
HF Llama names; the arch-specific math lives in the `core` method and in `kernels.py`.

    baseline  q_proj D → H·d    k/v_proj D → Hkv·d   o_proj H·d → D
    diff      q_proj D → H·d    k/v_proj D → Hkv·d   o_proj H·d → D   + λq1, λk1, λq2, λk2 (d,), subln (2d,)
    diff2     q_proj D → 2H·d   k/v_proj D → Hkv·d   o_proj H·d → D   + lambda_proj D → H
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.optim.optimizer import register_optimizer_step_post_hook

from difftrain.model import ckernels
from difftrain.model.config import ModelConfig, lambda_init
from difftrain.model.fused import fused_outputs
from difftrain.model.gemm import linear, linears
from difftrain.model.kernels import (
    AttnMask,
    AttnResult,
    baseline_attention,
    diff2_attention,
    diff_attention,
)
from difftrain.model.rope import RopeTables, rotate

if TYPE_CHECKING:
    from difftrain.model.transformer import KVCache

# fn(scaled_scores (B, heads, T, S) with −inf where masked, layer_idx) -> transformed scores
AttnLogitTransform = Callable[[Tensor, int], Tensor]


QKV = ("q_proj", "k_proj", "v_proj")  # the projections `fused_outputs` may run as one


class RMSNorm(nn.Module):
    """y = w ⊙ x / √(mean(x²) + ε), the statistics in fp32 (HF Llama's order of casts)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """`scale` multiplies the output; it is folded into the weight (a 1-D product) rather than
        applied as another pass over x."""
        if self.cpu_inference and not torch.is_grad_enabled():
            y = self._pair_norm(x, scale)
            if y is not None:
                return y
        w = self.weight if scale == 1.0 else self.weight * scale
        if x.dtype == torch.float32 and w.dtype == torch.float32:  # same bits as the formula below
            if (
                x.device.type == "cpu"
                and (x.requires_grad or w.requires_grad)
                and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()
            ):
                return _RMSNormCPU.apply(x, w, self.eps)
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dtype)

    # CPU inference (`infer.device.cpu_inference_layout` sets `cpu_inference`). On the CPU,
    # F.rms_norm is a composite of a dozen small operations (pow, mean as sum and div, add, rsqrt,
    # two products, two copies), and a one-token decode step pays their fixed costs 13 times per
    # token at the bench's quickstart shape. layer_norm is one kernel, and over [x, −x] (mean 0,
    # variance mean(x²)) its first half is the same y = w ⊙ x / √(mean(x²) + ε), the statistics
    # summed in another order: equal to F.rms_norm within a few float ulps (tested). It reads
    # twice the bytes, so it pays only for a few rows: below PAIR_NORM_ROWS, where it is faster.
    cpu_inference = False
    PAIR_NORM_ROWS = 16

    def _pair_norm(self, x: Tensor, scale: float) -> Tensor | None:
        """The [x, −x] layer_norm form of forward(x, scale), or None where it does not apply."""
        w = self._parameters["weight"]
        D = x.shape[-1]
        if (
            x.numel() >= self.PAIR_NORM_ROWS * D
            or x.dtype != torch.float32
            or w.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.compiler.is_compiling()
        ):
            return None
        key = (scale, w._version, w.data_ptr(), optimizer_steps())
        cached = self.__dict__.get("_pair_weight")
        if cached is None or cached[0] != key:
            cached = (key, pair_weight(w, scale))
            self.__dict__["_pair_weight"] = cached
        return pair_norm(x, cached[1], self.eps)


# No-grad caches of values computed from parameters (λ, the pair-norm weight) are keyed on the
# parameters' memory and `_version`, and on the number of optimizer steps taken in this process:
# torch's fused AdamW (our default optimizer, on CUDA and CPU) updates parameters in place without
# bumping `_version`, which alone let validation and sampling read a λ from before the last step.
_OPTIMIZER_STEPS = [0]


def _count_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


def optimizer_steps() -> int:
    """How many optimizer steps (any torch optimizer) this process has taken."""
    return _OPTIMIZER_STEPS[0]


class _RMSNormCPU(torch.autograd.Function):
    """fp32 RMSNorm for CPU training, with a hand-written backward. With x̂ = x·r,
    r = 1/√(mean(x²) + ε) per row and y = w ⊙ x̂, g = ∂L/∂y:

        ∂x = r · (g⊙w − x̂ · mean(g⊙w ⊙ x̂)),   ∂w = Σ_rows g ⊙ x̂

    Forward is F.rms_norm's own sequence of operations (the same bits). On the CPU, F.rms_norm
    is a composite, and autograd through it runs about a dozen elementwise passes in backward (the
    two products', rsqrt's, mean's and pow's backward, and summing the two paths into x) and saves
    x and x̂. This backward saves only x̂ and r and makes six passes: g⊙x̂ once, for both ∂w (its
    row sum) and mean(g⊙w ⊙ x̂) (its product with w, a matrix-vector product that only reads),
    then g⊙w, the update and the scaling by r. At the bench's quickstart shape (16×256×256, one
    thread) forward+backward went from 5.6 to 3.2 ms per norm (session 7, seven passes, g⊙w⊙x̂
    written out for a mean) and to 3.3 from 4.0 in session 8's interleaved runs; every norm
    keeps one (rows × D) tensor less for the backward pass (`plan.py` counts it). CUDA has a
    fused rms_norm kernel, which is used there."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.fused = ckernels.usable(x, w)
        if ctx.fused:  # one pass (model/ckernels.py); keeps x, not x̂, and recomputes x̂ in backward
            y, r = ckernels.rms_norm(x, w, eps)
            ctx.save_for_backward(x, r, w)
            return y
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xhat = x * r
        ctx.save_for_backward(xhat, r, w)
        return xhat * w

    @staticmethod
    @once_differentiable  # x̂ and the statistics are saved without a graph
    def backward(ctx, g: Tensor):  # type: ignore[override]
        if ctx.fused:
            x, r, w = ctx.saved_tensors
            return (*ckernels.rms_norm_backward(g, x, w, r, *ctx.needs_input_grad[:2]), None)
        xhat, r, w = ctx.saved_tensors
        gx = gw = None
        gxhat = g * xhat  # serves both: ∂w sums its rows, mean(g⊙w ⊙ x̂) = (g⊙x̂)·w / D
        if ctx.needs_input_grad[1]:
            gw = gxhat.sum(dim=tuple(range(g.dim() - 1)))
        if ctx.needs_input_grad[0]:
            dot = torch.matmul(gxhat, w).div_(g.shape[-1]).unsqueeze(-1)  # one read of g⊙x̂
            gx = torch.mul(g, w).addcmul_(xhat, dot, value=-1).mul_(r)
        return gx, gw, None


def pair_weight(weight: Tensor, scale: float = 1.0) -> Tensor:
    """[w·scale, 0], the layer_norm weight of `pair_norm` (the second half is discarded)."""
    w = weight.detach()
    return torch.cat((w * scale, torch.zeros_like(w)))


def pair_norm(x: Tensor, pair: Tensor, eps: float) -> Tensor:
    """RMSNorm of x over its last dimension D as one layer_norm kernel over [x, −x] (mean 0,
    variance mean(x²)), weighted by `pair` = `pair_weight(w, scale)`: w·scale ⊙ x / √(mean(x²) + ε)
    up to float rounding. A view of the first D of 2D columns."""
    D = x.shape[-1]
    both = torch.cat((x, torch.neg(x)), dim=-1)
    return F.layer_norm(both, (2 * D,), pair, None, eps)[..., :D]


class AttnOptions(NamedTuple):
    """Per-forward settings shared by all layers."""

    impl: str = "sdpa"
    output_attentions: bool = False
    logit_transform: AttnLogitTransform | None = None


class _Attention(nn.Module, abc.ABC):
    """Shared projection / RoPE / cache logic; subclasses implement `core`."""

    def __init__(self, config: ModelConfig, layer_idx: int, n_q: int, n_v: int, v_dim: int) -> None:
        """n_q query heads of width d from q_proj; the core reads V as n_v heads of width v_dim."""
        super().__init__()
        assert config.head_dim is not None and config.n_kv_heads is not None
        self.layer_idx = layer_idx
        self.n_q, self.n_v, self.v_dim = n_q, n_v, v_dim
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        D, d = config.d_model, config.head_dim
        self.q_proj = nn.Linear(D, self.n_q * d, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, D, bias=False)

    def forward(
        self,
        x: Tensor,
        rope: RopeTables,
        mask: AttnMask,
        cache: KVCache | None = None,
        opts: AttnOptions = AttnOptions(),
    ) -> AttnResult:
        B, T, _ = x.shape
        d = self.head_dim
        qkv = fused_outputs(self, QKV, x)  # one product when fused for CPU inference
        xq, xk, xv = (
            qkv
            if qkv is not None
            else linears((self.q_proj, self.k_proj, self.v_proj), x)  # one ∂x accumulated in training
        )
        q = xq.view(B, T, self.n_q, d).transpose(1, 2)
        k = xk.view(B, T, self.n_kv, d).transpose(1, 2)
        v = xv.view(B, T, self.n_v, self.v_dim).transpose(1, 2)
        q, k = rotate(q, rope), rotate(k, rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        transform = None
        if opts.logit_transform is not None:
            fn, layer = opts.logit_transform, self.layer_idx
            transform = lambda s: fn(s, layer)  # noqa: E731
        r = self.core(x, q, k, v, mask, opts.impl, opts.output_attentions, transform)
        out = r.out.transpose(1, 2).reshape(B, T, self.n_heads * d)
        return AttnResult(linear(self.o_proj, out), r.maps, r.logits)

    @abc.abstractmethod
    def core(self, x, q, k, v, mask, impl, return_maps, transform) -> AttnResult:
        """The attention core of this architecture on RoPE'd q, k and cached v (B, heads, T, d)."""


class BaselineAttention(_Attention):
    """LLaMA attention: out_h = softmax(Q_h K_gᵀ/√d + causal)·V_g, g = h // (H/Hkv)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        assert config.head_dim is not None and config.n_kv_heads is not None
        super().__init__(config, layer_idx, config.n_heads, config.n_kv_heads, config.head_dim)

    def core(self, x, q, k, v, mask, impl, return_maps, transform) -> AttnResult:
        return baseline_attention(q, k, v, mask, impl, return_maps=return_maps, logit_transform=transform)


class DiffAttention(_Attention):
    """Differential attention V1 (Ye et al., ICLR 2025).

    Differential head i (of H/2) uses query heads 2i, 2i+1 and, with g = i // n_rep, key heads
    2g, 2g+1 and the 2d-wide value head g (V viewed as Hkv/2 heads of width 2d):

        λ     = exp(λq1·λk1) − exp(λq2·λk2) + λinit,   λinit = 0.8 − 0.6·exp(−0.3·l)   (fp32)
        out_i = (1 − λinit) · subln((A1 − λ·A2)·V_g),  A_c = softmax(Q_c K_cᵀ/√d + causal)

    subln is an RMSNorm over the 2d features of each head (weight shared across heads, ε = 1e-5).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        assert config.head_dim is not None and config.n_kv_heads is not None
        d = config.head_dim
        super().__init__(config, layer_idx, config.n_heads, config.n_kv_heads // 2, 2 * d)
        self.lambda_init = lambda_init(layer_idx)
        self.lambda_std = config.lambda_std
        self.lambda_q1 = nn.Parameter(torch.zeros(d))
        self.lambda_k1 = nn.Parameter(torch.zeros(d))
        self.lambda_q2 = nn.Parameter(torch.zeros(d))
        self.lambda_k2 = nn.Parameter(torch.zeros(d))
        self.subln = RMSNorm(2 * d, eps=1e-5)
        self.reset_lambda()

    def reset_lambda(self) -> None:
        """λ vectors ~ N(0, lambda_std²)."""
        for p in self._lambda_vectors():
            nn.init.normal_(p, mean=0.0, std=self.lambda_std)

    def lam(self) -> Tensor:
        """The layer's scalar λ as a 0-d fp32 tensor (without gradients: cached until one of the
        four vectors changes or an optimizer steps, which a decode step would otherwise recompute
        every token)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # compiled: fused, no cache
            return self._lam()
        key = (optimizer_steps(), *((p.data_ptr(), p._version) for p in self._lambda_vectors()))
        cached = self.__dict__.get("_lam_cache")
        if cached is None or cached[0] != key:
            cached = (key, self._lam().detach())
            self.__dict__["_lam_cache"] = cached
        return cached[1]

    def _lambda_vectors(self) -> tuple[Tensor, ...]:
        return (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)

    def _lam(self) -> Tensor:
        l1 = torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
        l2 = torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float()))
        return l1 - l2 + self.lambda_init

    def core(self, x, q, k, v, mask, impl, return_maps, transform) -> AttnResult:
        r = diff_attention(
            q, k, v, self.lam(), mask, impl, return_maps=return_maps, logit_transform=transform
        )
        # subln over each head's 2d features, × (1 − λinit) folded into its weight. It runs on the
        # (B, T, H/2, 2d) view: the fused kernels write their output in that layout, so the norm
        # reads contiguous rows and the reshape before o_proj is free.
        y = self.subln(r.out.transpose(1, 2), scale=1.0 - self.lambda_init)
        return AttnResult(y.transpose(1, 2), r.maps, r.logits)


class Diff2Attention(_Attention):
    """Differential attention V2: 2H query heads in one causal GQA attention, combined per pair

        out_i = a_{2i} − sigmoid(λ_{t,i})·a_{2i+1},   λ = lambda_proj(x)  (per token t and head i)

    where a_j = softmax(Q_j K_gᵀ/√d + causal)·V_g, g = j // (2H/Hkv). No subln, no λinit.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        assert config.head_dim is not None and config.n_kv_heads is not None
        super().__init__(config, layer_idx, 2 * config.n_heads, config.n_kv_heads, config.head_dim)
        self.lambda_proj = nn.Linear(config.d_model, config.n_heads, bias=False)

    def core(self, x, q, k, v, mask, impl, return_maps, transform) -> AttnResult:
        lam = linear(self.lambda_proj, x).transpose(1, 2)  # (B, H, T)
        return diff2_attention(q, k, v, lam, mask, impl, return_maps=return_maps, logit_transform=transform)


ATTENTION_CLASSES: dict[str, type[_Attention]] = {
    "baseline": BaselineAttention,
    "diff": DiffAttention,
    "diff2": Diff2Attention,
}
