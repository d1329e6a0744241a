"""Rotary position embedding (RoPE), rotate-half convention exactly as HF Llama.

Inverse frequencies ω_i = θ^(−2i/d), i = 0 … d/2−1; a query or key x at position p becomes

    x·cos(p·[ω, ω]) + rotate_half(x)·sin(p·[ω, ω]),   rotate_half([x1, x2]) = [−x2, x1]

Angles are computed in fp32 from explicit positions (B, T) (left padding, KV-cache decoding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """(cos, sin) of shape (B, T, d) in fp32 for positions (B, T); the buffer is not saved."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> Tensor:
        d = self.head_dim
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `model.to(torch.bfloat16)` would round ω; recompute it in fp32 instead (as HF does).
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (B, T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] → [−x2, x1] over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, heads, T, d) by the angles of (B, T, d) tables, in x's dtype."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin
