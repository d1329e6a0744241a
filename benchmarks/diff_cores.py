"""Candidate formulations of the `diff` attention core, timed by gpu_check's train section.

The core of a differential head i (DESIGN.md §3) takes query/key heads 2i and 2i+1 of width d and
the value slice i of width 2d:

    A1 = softmax(q_{2i} k_{2i}ᵀ / √d + causal),  A2 = softmax(q_{2i+1} k_{2i+1}ᵀ / √d + causal)
    out_i = (A1 − λ·A2) V_i

q: (B, H, T, d); k: (B, n_kv, T, d); v: (B, n_kv/2, T, 2d); λ: a 0-dim tensor; out:
(B, H/2, T, 2d). Under GQA (n_rep = H / n_kv) differential head i reads key heads 2g and 2g+1 and
value head g, g = i // n_rep, as the package's core does. The package's `flex` core computes QKᵀ over d and the values over
2d. torch's flash kernel wants one head width for q, k and v, which these two candidates meet at
a cost:

- `padded_sdpa`: q and k zero-padded to 2d (the scores are unchanged; the scale stays 1/√d), one
  call over H heads: QKᵀ costs twice what it needs;
- `split_v_sdpa`: V's two halves of width d in two calls over H heads: QKᵀ is computed twice.

`eager` is the reference, the equations line by line.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _per_query_head(k: Tensor, v: Tensor, n_heads: int) -> tuple[Tensor, Tensor]:
    """k and v repeated so that query head h = 2i + c sees key head 2g + c and value head g."""
    B, n_kv, S, d = k.shape
    n_rep = n_heads // n_kv
    pairs = k.view(B, n_kv // 2, 2, S, d).repeat_interleave(n_rep, dim=1).reshape(B, n_heads, S, d)
    return pairs, v.repeat_interleave(n_rep, dim=1).repeat_interleave(2, dim=1)


def _combine(o: Tensor, lam: Tensor) -> Tensor:
    """(B, H, T, 2d) per query head → (B, H/2, T, 2d): head 2i minus λ·head 2i+1."""
    return o[:, 0::2] - lam.to(o.dtype) * o[:, 1::2]


def eager(q: Tensor, k: Tensor, v: Tensor, lam: Tensor) -> Tensor:
    k, v = _per_query_head(k, v, q.shape[1])
    T, S = q.shape[-2], k.shape[-2]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    maps = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    diff = maps[:, 0::2] - lam.float() * maps[:, 1::2]  # (B, H/2, T, S)
    return (diff @ v[:, 0::2].float()).to(q.dtype)


def padded_sdpa(q: Tensor, k: Tensor, v: Tensor, lam: Tensor) -> Tensor:
    d = q.shape[-1]
    k, v = _per_query_head(k, v, q.shape[1])
    pad = (0, v.shape[-1] - d)
    o = F.scaled_dot_product_attention(
        F.pad(q, pad), F.pad(k, pad), v, is_causal=True, scale=1 / math.sqrt(d)
    )
    return _combine(o, lam)


def split_v_sdpa(q: Tensor, k: Tensor, v: Tensor, lam: Tensor) -> Tensor:
    k, v = _per_query_head(k, v, q.shape[1])
    halves = [F.scaled_dot_product_attention(q, k, part, is_causal=True) for part in v.chunk(2, dim=-1)]
    return _combine(torch.cat(halves, dim=-1), lam)


CANDIDATES = {"padded_sdpa": padded_sdpa, "split_v_sdpa": split_v_sdpa}
