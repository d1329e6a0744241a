"""Attention modules: projections, RoPE, the KV cache, the per-arch core (`kernels.attention_core`),
o_proj. x (B, T, D) is the normalised residual stream, H = n_heads, Hkv = n_kv_heads, d = head_dim:

    baseline  q_proj D → H·d    k/v_proj D → Hkv·d   o_proj H·d → D
    diff      q_proj D → H·d    k/v_proj D → Hkv·d   o_proj H·d → D   + λq1, λk1, λq2, λk2 (d,), subln (2d,)
    diff2     q_proj D → 2H·d   k/v_proj D → Hkv·d   o_proj H·d → D   + lambda_proj D → H
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.model.config import ModelConfig, lambda_init
from difftrain.model.kernels import AttnMask, AttnResult, attention_core
from difftrain.model.rope import apply_rotary

AttnLogitTransform = Callable[[Tensor, int], Tensor]
"""fn(scaled scores (B, heads, T, S) with −inf where masked, layer index) → transformed scores."""


class RMSNorm(nn.Module):
    """y = w ⊙ x / √(mean(x²) + ε) (`F.rms_norm`; statistics in fp32 for half-precision input)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """`scale` multiplies the output, folded into the weight (a product of d numbers)."""
        w = self.weight if scale == 1.0 else self.weight * scale
        if x.dtype == w.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        dtype = x.dtype  # HF Llama's order of casts: normalise in fp32, weight the result
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


class Cache(Protocol):
    """What an attention layer needs of a KV cache (`transformer.KVCache`)."""

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


class AttnOptions(NamedTuple):
    """Per-forward settings shared by all layers: the resolved core, and what the probes ask for."""

    impl: str = "sdpa"
    output_attentions: bool = False
    logit_transform: AttnLogitTransform | None = None


class Attention(nn.Module):
    """Projections → RoPE → (KV cache) → `attention_core` → o_proj, for every arch; the arch's
    own parameters and its λ come from the subclasses."""

    arch = "baseline"

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert config.head_dim is not None and config.n_kv_heads is not None
        self.layer_idx = layer_idx
        self.n_q, self.n_kv, self.d = config.n_query_heads, config.n_kv_heads, config.head_dim
        D, d = config.d_model, config.head_dim
        self.q_proj = nn.Linear(D, self.n_q * d, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(config.n_heads * d, D, bias=False)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: AttnMask, cache: Cache | None, opts: AttnOptions
    ) -> AttnResult:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_q, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.d).transpose(1, 2)
        v = self.values(self.v_proj(x).view(B, T, self.n_kv, self.d))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        fn, layer = opts.logit_transform, self.layer_idx
        transform = None if fn is None else lambda s: fn(s, layer)
        r = attention_core(
            self.arch, q, k, v, self.second_map_weight(x), mask, opts.impl,
            return_maps=opts.output_attentions, transform=transform,
        )  # fmt: skip
        out = self.head_outputs(r.out).transpose(1, 2).reshape(B, T, -1)
        return AttnResult(self.o_proj(out), r.maps, r.logits)

    def values(self, v: Tensor) -> Tensor:
        """V (B, T, Hkv, d) → the value heads the core reads, (B, heads, T, width)."""
        return v.transpose(1, 2)

    def second_map_weight(self, x: Tensor) -> Tensor | None:
        """The arch's λ, which weighs the second map (none for the baseline)."""
        return None

    def head_outputs(self, out: Tensor) -> Tensor:
        """What follows the core per head, before o_proj (nothing for the baseline)."""
        return out


class DiffAttention(Attention):
    """Differential attention V1 (Ye et al., ICLR 2025), eq. 1–3 of the paper. Differential head i
    (of H/2) reads query heads 2i, 2i+1, key heads 2g, 2g+1 and the 2d-wide value head g
    (V viewed as Hkv/2 heads of width 2d), g = i // n_rep:

        λ      = exp(λq1·λk1) − exp(λq2·λk2) + λinit,   λinit = 0.8 − 0.6·exp(−0.3·l)   (fp32)
        head_i = (A1 − λ·A2)·V_g,   A_c = softmax(Q_c K_cᵀ/√d + causal)
        out_i  = (1 − λinit) · subln(head_i)

    subln is an RMSNorm over the 2d features of each head (weight shared by the heads, ε = 1e-5).
    """

    arch = "diff"

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        d = self.d
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
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=self.lambda_std)

    def values(self, v: Tensor) -> Tensor:
        B, T, _, d = v.shape
        return v.reshape(B, T, self.n_kv // 2, 2 * d).transpose(1, 2)

    def second_map_weight(self, x: Tensor) -> Tensor:
        return self.lam()

    def lam(self) -> Tensor:
        """The layer's scalar λ, a 0-d fp32 tensor."""
        l1 = torch.exp(torch.dot(self.lambda_q1.float(), self.lambda_k1.float()))
        l2 = torch.exp(torch.dot(self.lambda_q2.float(), self.lambda_k2.float()))
        return l1 - l2 + self.lambda_init

    def head_outputs(self, out: Tensor) -> Tensor:
        return self.subln(out, scale=1.0 - self.lambda_init)


class Diff2Attention(Attention):
    """Differential attention V2: 2H query heads in one causal GQA attention, combined per pair

        out_i = a_2i − σ(λ_t,i)·a_2i+1,   λ = lambda_proj(x)  (per token t and head i)

    where a_j = softmax(Q_j K_gᵀ/√d + causal)·V_g, g = j // (2H/Hkv). No subln, no λinit.
    """

    arch = "diff2"

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.lambda_proj = nn.Linear(config.d_model, config.n_heads, bias=False)

    def second_map_weight(self, x: Tensor) -> Tensor:
        """λ (B, H, T), one per token and output head."""
        return self.lambda_proj(x).transpose(1, 2)


ATTENTION_CLASSES: dict[str, type[Attention]] = {
    "baseline": Attention,
    "diff": DiffAttention,
    "diff2": Diff2Attention,
}
