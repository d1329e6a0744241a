"""Attention cores: pure functions from projected, rotated heads to per-head outputs.

Each architecture has one core, and each core has interchangeable implementations chosen by
`attn_impl`; all of them compute the same function and are tested against `eager`:

- `eager`  materialises the softmax maps (fp32 softmax). The only one that can return the maps
           and logits (for probes) or apply a logit transform (quantisation probe).
- `sdpa`   `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels
           on CUDA, a fused kernel on CPU). GQA through `enable_gqa`, so K/V are never copied.
- `flex`   `torch.nn.attention.flex_attention` under `torch.compile` (compiled once per shape;
           the first call takes tens of seconds on CPU). Flex has no backward on CPU, so it is
           refused there when gradients are needed. `Transformer` decodes with a KV cache
           through sdpa instead (each step's new key length would recompile flex).
- `auto`   `sdpa` on every device: fastest on CPU in `benchmarks/attention_layer.py`, and on CUDA
           it dispatches to flash attention without flex's compile warm-up.

Shapes (B batch, T queries, S keys, d = head_dim, H = n_heads, Hkv = n_kv_heads):

    baseline  q (B, H, T, d)   k (B, Hkv, S, d)   v (B, Hkv, S, d)      → out (B, H, T, d)
    diff      q (B, H, T, d)   k (B, Hkv, S, d)   v (B, Hkv/2, S, 2d)   → out (B, H/2, T, 2d)
    diff2     q (B, 2H, T, d)  k (B, Hkv, S, d)   v (B, Hkv, S, d)      → out (B, H, T, d)

Masking (`AttnMask`): query t sits at key slot `q_offset + t` (the KV-cache length before this
chunk) and sees key slot s iff s ≤ q_offset + t and the key is a real token
(`key_padding_mask[b, s]`). A query always sees its own slot, so the rows of left-padding
tokens are never empty (no NaN); real tokens never see padding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from difftrain.errors import ConfigError, DeviceError

IMPLS = ("eager", "sdpa", "flex")
LogitTransform = Callable[[Tensor], Tensor]


class AttnResult(NamedTuple):
    """`out` per output head; `maps` the effective attention maps and `logits` the scaled scores
    that entered the softmax (eager with `return_maps=True` only, else None)."""

    out: Tensor
    maps: Tensor | None = None
    logits: Tensor | None = None


@dataclass
class AttnMask:
    """Causal mask with an offset and optional key padding; see the module docstring.

    q_len, kv_len: T and S. q_offset: slot of the first query (S − T when the queries are the
    newest tokens). key_padding_mask: (B, S) bool, True = real token.
    """

    q_len: int
    kv_len: int
    q_offset: int = 0
    key_padding_mask: Tensor | None = None
    _dense: Tensor | None = field(default=None, repr=False)
    _block: object | None = field(default=None, repr=False)

    @classmethod
    def slots(cls, allowed: Tensor) -> AttnMask:
        """One query per row over all S slots of a fixed-size KV cache: `allowed` (B, S) is True
        where the row may attend (its real tokens up to and including its own slot). The mask of
        a compiled decode step (`Transformer.decode_step`), whose shapes must not change from
        token to token. Every shortcut (`plain_causal`, `unmasked`, the causal-only paths) is off
        because `key_padding_mask` is set, and the dense mask is `allowed` itself."""
        S = allowed.shape[1]
        return cls(1, S, S - 1, allowed, _dense=allowed[:, None, None, :])

    @property
    def plain_causal(self) -> bool:
        """True when this is the ordinary lower-triangular mask (no cache prefix, no padding)."""
        return self.q_offset == 0 and self.q_len == self.kv_len and self.key_padding_mask is None

    @property
    def unmasked(self) -> bool:
        """True when every query sees every key: one new token after a cache without padding
        (the usual decode step), so no mask needs to be built or applied."""
        return self.q_len == 1 and self.q_offset == self.kv_len - 1 and self.key_padding_mask is None

    def dense(self, device: torch.device) -> Tensor:
        """Boolean (B or 1, 1, T, S) mask, True where attention is allowed (cached per forward)."""
        if self._dense is None or self._dense.device != device:
            q_slot = torch.arange(self.q_len, device=device)[:, None] + self.q_offset
            k_slot = torch.arange(self.kv_len, device=device)[None, :]
            allowed = (k_slot <= q_slot)[None, None]  # (1, 1, T, S)
            if self.key_padding_mask is not None:
                real = self.key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
                allowed = allowed & (real | (k_slot == q_slot)[None, None])
            self._dense = allowed
        return self._dense


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map `auto` to a concrete implementation for `device` (see module docstring)."""
    if impl == "auto":
        return "sdpa"
    if impl not in IMPLS:
        raise ConfigError(f"model.attn_impl={impl!r} is unknown; choose one of auto, {', '.join(IMPLS)}")
    return impl


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, h, S, e) → (B, h·n_rep, S, e) with head j reading head j // n_rep (GQA)."""
    if n_rep == 1:
        return x
    B, h, S, e = x.shape
    return x[:, :, None].expand(B, h, n_rep, S, e).reshape(B, h * n_rep, S, e)


# ----- eager -----------------------------------------------------------------------------------
def softmax_maps(
    q: Tensor, k: Tensor, mask: AttnMask, logit_transform: LogitTransform | None = None
) -> tuple[Tensor, Tensor]:
    """A = softmax(Q Kᵀ/√d + mask) in fp32, for q (B, h, T, d), k (B, h, S, d) with equal h.

    Returns (A, logits): both (B, h, T, S) fp32; logits are the scaled scores after the optional
    transform, with −inf where the mask forbids attention (the transform sees −inf there too,
    and cannot unmask them).
    """
    scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
    allowed = mask.dense(q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if logit_transform is not None:
        scores = logit_transform(scores).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1), scores


def _eager_baseline(q, k, v, mask, logit_transform):
    n_rep = q.shape[1] // k.shape[1]
    A, logits = softmax_maps(q, repeat_kv(k, n_rep), mask, logit_transform)
    return AttnResult(A.to(v.dtype) @ repeat_kv(v, n_rep), A, logits)


def _eager_diff(q, k, v, lam, mask, logit_transform):
    B, H, T, d = q.shape
    n_rep = H // k.shape[1]  # = (H/2) / (Hkv/2)
    # Key for query head j = 2i + c is key head 2·(i // n_rep) + c: expand both halves and
    # interleave them back into query-head order, so one softmax call (and one logit transform)
    # covers both maps.
    k_q = torch.stack((repeat_kv(k[:, 0::2], n_rep), repeat_kv(k[:, 1::2], n_rep)), dim=2)
    P, logits = softmax_maps(q, k_q.reshape(B, H, -1, d), mask, logit_transform)
    A = P[:, 0::2] - lam.float() * P[:, 1::2]  # A1 − λ·A2, (B, H/2, T, S)
    return AttnResult(A.to(v.dtype) @ repeat_kv(v, n_rep), A, logits)


def _eager_diff2(q, k, v, lam, mask, logit_transform):
    n_rep = q.shape[1] // k.shape[1]  # = 2H / Hkv, even: heads 2i and 2i+1 share a kv head
    P, logits = softmax_maps(q, repeat_kv(k, n_rep), mask, logit_transform)
    A = P[:, 0::2] - torch.sigmoid(lam.float())[..., None] * P[:, 1::2]  # (B, H, T, S)
    return AttnResult(A.to(v.dtype) @ repeat_kv(v, n_rep)[:, 0::2], A, logits)


# ----- sdpa ------------------------------------------------------------------------------------
def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: AttnMask, scale: float | None = None) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if mask.plain_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.dense(q.device), enable_gqa=gqa, scale=scale
    )


def diff_sdpa_two_calls(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """(A1 − λA2)V = A1·V − λ·A2·V: one sdpa call per map, each with the 2d-wide V (GQA: the
    n_rep differential heads of a group read key heads 2g, 2g+1 and value head g)."""
    o1 = _sdpa(q[:, 0::2], k[:, 0::2], v, mask)
    o2 = _sdpa(q[:, 1::2], k[:, 1::2], v, mask)
    return o1 - lam.to(o2.dtype) * o2


def diff_sdpa_one_call(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """The same in one sdpa call over H heads: queries reordered [maps 1 | maps 2], keys
    likewise, V duplicated, so GQA head j' = c·H/2 + i reads kv head c·Hkv/2 + i // n_rep."""
    qq = torch.cat((q[:, 0::2], q[:, 1::2]), dim=1)
    kk = torch.cat((k[:, 0::2], k[:, 1::2]), dim=1)
    o1, o2 = _sdpa(qq, kk, torch.cat((v, v), dim=1), mask).chunk(2, dim=1)
    return o1 - lam.to(o2.dtype) * o2


def diff_sdpa_split_v(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """The same with V split into its two d-wide halves (four sdpa calls, as the paper's
    flash-attention code does): every call has equal q/k/v head widths, which the fused flash
    kernels (CPU and CUDA) require; A1 and A2 are each computed twice."""
    v1, v2 = v.chunk(2, dim=-1)
    q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    o1 = torch.cat((_sdpa(q1, k1, v1, mask), _sdpa(q1, k1, v2, mask)), dim=-1)
    o2 = torch.cat((_sdpa(q2, k2, v1, mask), _sdpa(q2, k2, v2, mask)), dim=-1)
    return o1 - lam.to(o2.dtype) * o2


def diff_sdpa_padded(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """The same with q and k zero-padded from d to 2d features, so each map is one flash call
    with equal q/k/v widths: [q, 0]·[k, 0] = q·k exactly, and the scale stays 1/√d. Each map is
    computed once (half the exponentials of `split_v`) at the cost of QKᵀ over 2d features."""
    d = q.shape[-1]
    qp, kp = F.pad(q, (0, d)), F.pad(k, (0, d))
    scale = 1.0 / math.sqrt(d)
    o1 = _sdpa(qp[:, 0::2], kp[:, 0::2], v, mask, scale)
    o2 = _sdpa(qp[:, 1::2], kp[:, 1::2], v, mask, scale)
    return o1 - lam.to(o2.dtype) * o2


def diff_grouped_math(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """The same by explicit maps, (A1 − λ·A2)·V, with no copy of K or V: query heads are grouped
    by the key pair they read, q viewed as (B, Hkv/2, 2, n_rep·T, d) against k viewed as
    (B, Hkv/2, 2, S, d). Materialises (B, H, T, S) maps, so it is meant for a few queries over a
    long cache (decoding), where the fused kernels would copy the whole cache to pad or split it."""
    B, H, T, d = q.shape
    G = k.shape[1] // 2  # key pairs = value heads
    n_rep = H // (2 * G)
    qg = q.view(B, G, n_rep, 2, T, d).transpose(2, 3).reshape(B, G, 2, n_rep * T, d)
    scores = torch.matmul(qg, k.view(B, G, 2, -1, d).transpose(-2, -1)).float()
    scores = scores * (1.0 / math.sqrt(d))
    if not mask.unmasked:
        allowed = mask.dense(q.device)[:, :, None]  # (B|1, 1, 1, T, S)
        if n_rep > 1:
            allowed = allowed[:, :, :, None].expand(-1, -1, -1, n_rep, -1, -1).flatten(3, 4)
        scores = scores.masked_fill(~allowed, float("-inf"))
    P = torch.softmax(scores, dim=-1)
    A = torch.addcmul(P[:, :, 0], P[:, :, 1], -lam.float())  # (B, G, n_rep·T, S)
    out = torch.matmul(A.to(v.dtype), v)  # (B, G, n_rep·T, 2d)
    return out.view(B, G * n_rep, T, 2 * d)


# ----- diff on CPU: materialised maps in causal query blocks, with a hand-written backward -------
BLOCK_MIN_ROWS = 64
BLOCK_MAX_COUNT = 8


def query_blocks(q_len: int) -> list[tuple[int, int]]:
    """[t0, t1) query ranges of `_DiffBlockedMath`: up to BLOCK_MAX_COUNT blocks of at least
    BLOCK_MIN_ROWS queries. Blocks of 64 rows were fastest in interleaved A/B timings (one CPU
    thread, forward+backward): 4 blocks at T = 256 (16×256×8×32; fewer skip less of the causal
    triangle, more make the products too small) and 8 at T = 512 (8×512×16×32: 141-146 ms
    against 155 with 4, and a map of 9/16 of the square instead of 5/8)."""
    n = max(1, min(BLOCK_MAX_COUNT, q_len // BLOCK_MIN_ROWS))
    return [(q_len * i // n, q_len * (i + 1) // n) for i in range(n)]


BLOCK_MAP_BYTES = 4 << 20
"""Bytes of the two fp32 maps of one query block that `_DiffBlockedMath` aims to stay under,
taking the batch a few rows at a time: the maps of a block are then written, read by the softmax
and its backward, and read again while they are still in cache (about the L2 of the cores that
share the products). At the bench's quickstart shape (16×256×8×32, blocks of 64 queries),
forward+backward took, one thread (session 8): 43-44 ms in batches of 4 (2 MiB of maps) against
48-50 in one batch of 16, 46-48 in batches of 8 and 44-47 in batches of 2; two threads on an
Intel Xeon with 2 MiB of L2 per core (session 24, interleaved, medians): 22.4-22.7 ms in batches
of 8 (4 MiB) against 23.6-23.8 in batches of 4, 22.8-23.2 with 8 MiB and 29.0-29.7 with 1 MiB;
one thread there 42.5 against 43.1 with 2 MiB."""


def batch_chunks(batch: int, heads: int, q_len: int, kv_len: int) -> list[tuple[int, int]]:
    """[b0, b1) batch ranges of `_DiffBlockedMath`: as many rows as keep the two fp32 maps of a
    block (2 × heads × block rows × keys) within BLOCK_MAP_BYTES, at least one."""
    rows = q_len // len(query_blocks(q_len))
    per_row = 2 * heads * rows * kv_len * 4
    n = max(1, min(batch, BLOCK_MAP_BYTES // max(1, per_row)))
    return [(b0, min(batch, b0 + n)) for b0 in range(0, batch, n)]


class _DiffBlockedMath(torch.autograd.Function):
    """out = (A1 − λ·A2)·V with explicit fp32 maps, computed per block of queries against only the
    keys the block can see (slots < q_offset + t1): with n blocks a causal layer builds (n+1)/2n of
    the T×S maps (5/8 with 4, 9/16 with 8), and (A1 − λ·A2)·V costs one product over 2d features
    instead of two. Query heads are grouped by the key pair they read (K and V are not repeated
    per query head), as in `diff_grouped_math`.

    Per block (rows r = (rep, t), scaled queries q̂ = q/√d):
        S_c = q̂_c K_cᵀ (masked),  P_c = softmax(S_c),  A = P_1 − λ·P_2,  out = A·V
    Saved: P (both maps of every block), the scaled query blocks, K and V. Backward, G = ∂L/∂out:
        ∂V += Aᵀ·G (A rebuilt from P),  ∂A = G·Vᵀ,  ∂λ = −Σ ∂A ⊙ P_2,
        ∂S_1 = softmax′(∂A; P_1),  ∂S_2 = −λ·softmax′(∂A; P_2)   (softmax′ is linear in ∂A),
        ∂q_c = ∂S_c·K_c/√d,  ∂K_c += ∂S_cᵀ·q̂_c
    where the scalings by 1/√d and −λ are applied to the small (rows × d) products, never to a map.

    The batch is taken a few sequences at a time (`batch_chunks`) so that a block's maps stay in
    cache between the passes that write and read them.

    Layout: everything per map is stored map-major, (2, B, G, rows, ·), so each map, each scaled
    query block and each key half is contiguous: the softmax backward reads P_c in place (a
    strided P_c was copied, twice per block), and ∂q, ∂K of both maps are one product each. q and
    k are read in whatever layout they come (the projections' (B, T, heads, d)) and their
    gradients are written in that layout, so the views to and from the projections stay free.
    """

    @staticmethod
    def forward(ctx, q, k, v, lam, allowed, q_offset):  # type: ignore[override]
        B, H, T, d = q.shape
        G, S = k.shape[1] // 2, k.shape[2]
        n_rep = H // (2 * G)
        scale = 1.0 / math.sqrt(d)
        f32 = torch.float32
        qm = q.unflatten(1, (G, n_rep, 2)).permute(3, 0, 1, 2, 4, 5)  # (2, B, G, n_rep, T, d), a view
        km_all = k.unflatten(1, (G, 2)).permute(2, 0, 1, 3, 4)  # (2, B, G, S, d), a view
        v = v.to(f32).contiguous()
        neg = (-lam).to(f32)
        # written (B, T, H/2, 2d) like the flash kernels' output: subln and o_proj read it in place
        out = torch.empty(B, T, G, n_rep, 2 * d, dtype=f32, device=q.device).permute(0, 2, 3, 1, 4)
        blocks = query_blocks(T)
        chunks = batch_chunks(B, G * n_rep, T, S)
        keep = any(ctx.needs_input_grad[:4])  # without a backward (eval, prefill) no map outlives its block
        keys, maps, queries = [], [], []
        causal_bias: dict[tuple[int, int], Tensor] = {}
        for b0, b1 in chunks:
            Bc = b1 - b0
            # keys map-major and V contiguous: one copy each (the block products over a strided V
            # alone took 25 % longer than one copy of it, 16×256×8×32)
            km = torch.empty(2, Bc, G, S, d, dtype=f32, device=k.device)
            km.copy_(km_all[:, b0:b1])
            if keep:
                keys.append(km)
            for t0, t1 in blocks:
                rows, end = t1 - t0, min(S, q_offset + t1)
                qb = torch.empty(2, Bc, G, n_rep, rows, d, dtype=f32, device=q.device)
                torch.mul(qm[:, b0:b1, ..., t0:t1, :], scale, out=qb)
                qb = qb.view(2, Bc, G, n_rep * rows, d)
                scores = torch.matmul(qb, km[..., :end, :].transpose(-2, -1))  # (2, Bc, G, n_rep·rows, end)
                if allowed is None:  # causal only: the block's last `rows` keys hold its upper triangle
                    first = q_offset + t0
                    # adding 0 / −inf: 2.4× faster than masked_fill_ with the boolean triangle
                    # (x + 0 = x, so the same maps)
                    key = (rows, end - first)
                    if key not in causal_bias:
                        tri = torch.ones(key, dtype=torch.bool, device=q.device).triu_(1)
                        causal_bias[key] = (
                            torch.zeros(key, dtype=f32, device=q.device)
                            .masked_fill_(tri, float("-inf"))
                            .repeat(n_rep, 1)
                        )
                    scores[..., first:end].add_(causal_bias[key])
                else:
                    blk = allowed[b0:b1] if allowed.shape[0] > 1 else allowed
                    blk = blk[:, :, t0:t1, :end]  # (Bc|1, 1, rows, end)
                    blk = blk[:, :, None].expand(-1, -1, n_rep, -1, -1).flatten(2, 3)
                    scores.masked_fill_(~blk, float("-inf"))
                P = torch.softmax(scores, dim=-1)
                del scores
                A = torch.addcmul(P[0], P[1], neg)
                out[b0:b1, :, :, t0:t1] = torch.matmul(A, v[b0:b1, :, :end]).view(Bc, G, n_rep, rows, 2 * d)
                if keep:
                    maps.append(P)
                    queries.append(qb)
                del P, A, qb
        ctx.save_for_backward(v, neg, *keys, *maps, *queries)
        ctx.meta = (B, H, T, d, G, n_rep, scale, blocks, chunks, q_offset, lam.dtype)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.reshape(B, G * n_rep, T, 2 * d)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        v, neg, *rest = ctx.saved_tensors
        B, H, T, d, G, n_rep, scale, blocks, chunks, q_offset, lam_dtype = ctx.meta
        nc, nb = len(chunks), len(blocks)
        keys, maps, queries = rest[:nc], rest[nc : nc + nc * nb], rest[nc + nc * nb :]
        S = v.shape[2]
        g5 = g.reshape(B, G, n_rep, T, 2 * d)
        # ∂q and ∂K in the projections' layout, (B, T, heads, d) with heads = (G, n_rep, 2) and
        # (G, 2), viewed map-major for the block loop
        dq_proj = g.new_empty(B, T, G, n_rep, 2, d)
        dq6 = dq_proj.permute(4, 0, 2, 3, 1, 5)  # (2, B, G, n_rep, T, d)
        dk_proj = g.new_zeros(B, S, G, 2, d)
        dkm_all = dk_proj.permute(3, 0, 2, 1, 4)  # (2, B, G, S, d)
        dv = torch.zeros_like(v)
        dlam = torch.zeros((), dtype=torch.float32, device=g.device)
        kcoef = torch.stack((torch.ones_like(neg), neg)).view(2, 1, 1, 1, 1)  # map 2's ∂S carries −λ
        qcoef = kcoef * scale
        sm_bwd = torch.ops.aten._softmax_backward_data.out
        for c, (b0, b1) in enumerate(chunks):
            Bc, km, dkm = b1 - b0, keys[c], dkm_all[:, b0:b1]
            for i, (t0, t1) in enumerate(blocks):
                P, qb = maps[c * nb + i], queries[c * nb + i]
                rows, end = t1 - t0, min(S, q_offset + t1)
                gb = g5[b0:b1, :, :, t0:t1].reshape(Bc, G, n_rep * rows, 2 * d).contiguous()  # read twice
                A = torch.addcmul(P[0], P[1], neg)
                dv[b0:b1, :, :end] += torch.matmul(A.transpose(-2, -1), gb)
                dA = torch.matmul(gb, v[b0:b1, :, :end].transpose(-2, -1), out=A)
                dlam -= torch.dot(dA.view(-1), P[1].view(-1))
                dS = torch.empty_like(P)
                for m in (0, 1):
                    sm_bwd(dA, P[m], -1, torch.float32, grad_input=dS[m])
                del dA, A
                dq = torch.matmul(dS, km[..., :end, :]).mul_(qcoef)  # (2, Bc, G, n_rep·rows, d)
                dq6[:, b0:b1, ..., t0:t1, :] = dq.view(2, Bc, G, n_rep, rows, d)
                dkm[..., :end, :] += torch.matmul(dS.transpose(-2, -1), qb).mul_(kcoef)
                del dS, dq
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        dq = dq_proj.view(B, T, H, d).transpose(1, 2).to(q_dtype)
        dk = dk_proj.view(B, S, 2 * G, d).transpose(1, 2).to(k_dtype)
        return dq, dk, dv.to(v_dtype), dlam.to(lam_dtype), None, None


# torch._disable_dynamo is torch.compiler.disable that imports torch._dynamo on the first call
# instead of at import: that import is seconds on a small CPU, and every command imports this file.
_disable_dynamo = getattr(torch, "_disable_dynamo", torch.compiler.disable)


def eager_under_compile(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`fn` behind a graph break under torch.compile (torch.compiler.disable), and a plain call
    otherwise: the disabled wrapper imports torch._dynamo on its first call, 2.4 s on this 2-core
    CPU, which was the whole of `generate`'s first token (1.4-2 s instead of 10 ms) once a prompt
    reached the blocked core."""
    disabled = _disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        if torch.compiler.is_compiling():  # traced: a constant True, and dynamo is loaded
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


@eager_under_compile
def diff_blocked_math(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """`_DiffBlockedMath`: the diff core on materialised fp32 maps, causal query blocks (see the
    class). Any mask: with key padding (or queries that are not the newest keys) each block takes
    its slice of the dense mask. Other dtypes are computed in fp32 and cast back; q, k and v may
    be in any layout (the class copies what it needs once).

    Under torch.compile it runs as it does eagerly, behind a graph break. Traced, its backward's
    per-block writes into slices of ∂q and ∂K became one inductor kernel of 42 inputs with a
    masked load per element, 32 ms a layer: the compiled training step took 1.13× the eager
    step's time, and 0.96× with the break (`diff`, the bench's quickstart shape, one thread,
    Intel Xeon, interleaved; 0.95× at d512-seq512, which before did not finish warming up in
    10 minutes). See benchmarks/README.md, session 12."""
    causal_only = mask.key_padding_mask is None and mask.q_offset + mask.q_len == mask.kv_len
    allowed = None if causal_only else mask.dense(q.device)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    with torch.autocast(q.device.type, enabled=False):  # the maps stay fp32 under autocast too
        out = _DiffBlockedMath.apply(q, k, v, lam, allowed, mask.q_offset)
    return out.to(dtype)


# ----- diff on CPU: the flash kernel called directly, with a hand-written backward --------------
def _pair_view(x: Tensor) -> Tensor:
    """Heads in pair order (B, n, L, d) → (B, n/2, L, 2d) with features [x_2i, x_2i+1]: a view when
    x is laid out (B, L, n, d), as the projections write it (else one copy)."""
    B, n, L, d = x.shape
    return x.unflatten(1, (n // 2, 2)).transpose(2, 3).reshape(B, n // 2, L, 2 * d)


def _from_pairs(x: Tensor) -> Tensor:
    """Inverse of `_pair_view`: (B, n/2, L, 2d) → (B, n, L, d)."""
    B, half, L, two_d = x.shape
    return x.unflatten(-1, (2, two_d // 2)).transpose(2, 3).reshape(B, 2 * half, L, two_d // 2)


def _split_keys(k: Tensor) -> Tensor:
    """Keys in pair order (B, n, S, d) → (2, B, n/2, S, 2d): [k_2i, 0] for map 1 and [0, k_2i+1]
    for map 2, in one pass (a multiplication by 0/1 selectors, exact)."""
    kk = _pair_view(k)
    d = k.shape[-1]
    sel = kk.new_zeros(2, 1, 1, 1, 2 * d)
    sel[0, ..., :d] = 1
    sel[1, ..., d:] = 1
    return kk.unsqueeze(0) * sel


class _DiffFlashCPU(torch.autograd.Function):
    """out = A1·V − λ·A2·V with each map one call of the CPU flash kernel (equal q/k/v widths 2d).

    The kernel needs equal head widths and V is 2d wide, so q and k go in 2d wide. The queries of
    a differential head are used as they lie, [q1, q2] (no copy), and the keys are split by
    zero-padding: [q1, q2]·[k1, 0] = q1·k1 and [q1, q2]·[0, k2] = q2·k2, so

        flash([q1, q2], [k1, 0], V) → (o1, lse1),   flash([q1, q2], [0, k2], V) → (o2, lse2),
        out = o1 − λ·o2.

    Backward (g = ∂L/∂out): the flash backward is linear in its output gradient, so it runs with g
    for both maps and map 2's results are scaled by −λ:
        ∂L/∂[q1, q2] = dQ1 − λ·dQ2 (dQ1's second half and dQ2's first are exactly 0: the keys'
        padding), ∂L/∂k1 = dK1[:d], ∂L/∂k2 = −λ·dK2[d:], ∂L/∂V = dV1 − λ·dV2, ∂L/∂λ = −Σ g⊙o2.
    """

    @staticmethod
    def forward(ctx, q, k, v, lam, attn_mask, is_causal):  # type: ignore[override]
        scale = 1.0 / math.sqrt(q.shape[-1])
        qq, kp = _pair_view(q), _split_keys(k)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, lse1 = flash(qq, kp[0], v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
        o2, lse2 = flash(qq, kp[1], v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
        neg_lam = (-lam).to(o2.dtype)
        out = torch.addcmul(o1, o2, neg_lam)
        # k is saved unpadded and split again in backward: one pass, half the memory
        ctx.save_for_backward(q, k, v, o1, o2, lse1, lse2, neg_lam, attn_mask)
        ctx.is_causal, ctx.scale, ctx.lam_dtype = is_causal, scale, lam.dtype
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        q, k, v, o1, o2, lse1, lse2, neg_lam, attn_mask = ctx.saved_tensors
        qq, kp = _pair_view(q), _split_keys(k)
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        kw = dict(attn_mask=attn_mask, scale=ctx.scale)
        dq1, dk1, dv1 = flash_bwd(g, qq, kp[0], v, o1, lse1, 0.0, ctx.is_causal, **kw)
        dq2, dk2, dv2 = flash_bwd(g, qq, kp[1], v, o2, lse2, 0.0, ctx.is_causal, **kw)
        del qq, kp
        dlam = -_flat_dot(g, o2).to(ctx.lam_dtype)
        dq = _from_pairs(torch.addcmul(dq1, dq2, neg_lam))
        d = k.shape[-1]
        B, G, S, _ = dk1.shape
        dk = dk1.new_empty(B, S, G, 2, d)
        dk[:, :, :, 0].copy_(dk1[..., :d].transpose(1, 2))
        torch.mul(dk2[..., d:].transpose(1, 2), neg_lam, out=dk[:, :, :, 1])
        dk = dk.view(B, S, 2 * G, d).transpose(1, 2)
        return dq, dk, torch.addcmul(dv1, dv2, neg_lam), dlam, None, None


def _flat_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ a⊙b in fp32 for two (B, h, T, e) tensors (copy-free when both are laid out (B, T, h, e))."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.dot(a.transpose(1, 2).reshape(-1), b.transpose(1, 2).reshape(-1))
    return (a.float() * b.float()).sum()


_CPU_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def diff_flash_cpu(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """`_DiffFlashCPU`: the diff core on CPU as two flash-kernel calls (see the class).

    Under CPU autocast the inputs are cast to the autocast dtype, as autocast does for sdpa."""
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if mask.plain_causal:
        attn_mask, is_causal = None, True
    else:  # the CPU kernel takes an additive mask of the query's dtype
        allowed = mask.dense(q.device)
        attn_mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        attn_mask.masked_fill_(~allowed, float("-inf"))
        is_causal = False
    return _DiffFlashCPU.apply(q, k, v, lam, attn_mask, is_causal)


DIFF_SDPA_STRATEGIES: dict[str, Callable[..., Tensor]] = {
    "flash_cpu": diff_flash_cpu,
    "grouped_math": diff_grouped_math,
    "blocked_math": diff_blocked_math,
    "padded": diff_sdpa_padded,
    "split_v": diff_sdpa_split_v,
    "one_call": diff_sdpa_one_call,
    "two_calls": diff_sdpa_two_calls,
}
"""Every exact formulation of the diff core through fused attention kernels (tests check each
against eager; `difftrain bench` times them)."""

DIFF_SDPA_DEFAULT = {"cpu": "cpu_auto", "cuda": "padded"}
"""The strategy `diff_sdpa` uses per device type (others: `padded`); `cpu_auto` picks by shape
(`cpu_diff_core`). A benchmark may set a strategy by name."""


MATH_MAX_MAP_BYTES = 64 * 2**20


def cpu_diff_core(batch: int, n_heads: int, q_len: int, kv_len: int, dtype: torch.dtype) -> str:
    """The diff core CPU training uses at this shape: `blocked_math` or `flash_cpu`.

    Padded to 2d for the flash kernel, each map costs QKᵀ and PV over 2d features. Materialised
    maps in causal query blocks (`blocked_math`) cost QKᵀ over d and one PV over 2d for
    A1 − λ·A2, on 5/8 of the square (4 blocks; 9/16 with 8), in large matrix products: in fp32
    it is faster at every shape `difftrain bench` measures (B×T×H×d 16×256×8×32: 97 vs 180 ms,
    8×512×8×64: 337 vs 638 ms forward+backward, one thread, AVX2, session 4), but it keeps the
    maps for the backward pass, so it is taken only while a full (B, H, T, S) fp32 map would be at most MATH_MAX_MAP_BYTES (it keeps
    at most 5/8 of that per softmax). The memory planner follows the same rule (`plan.activations`)."""
    small = batch * n_heads * q_len * kv_len * 4 <= MATH_MAX_MAP_BYTES
    if dtype == torch.float32 and small:
        return "blocked_math"
    return "flash_cpu"


DECODE_MAX_QUERIES = 8
"""Without gradients, up to this many queries per call (decode steps, short prompts) take
`grouped_math`: it reads the KV cache in place instead of copying it."""


def diff_sdpa(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttnMask) -> Tensor:
    """The diff sdpa strategy for q's device (`DIFF_SDPA_DEFAULT`); `grouped_math` for decoding.

    CPU: `blocked_math` in fp32 while the maps are small, else `flash_cpu` (`cpu_diff_core`). The CPU flash
    kernel needs equal q/k/v head widths, so `one_call` and `two_calls` (V 2d wide) run sdpa's
    unfused math path, and `split_v` computes each map twice. `flash_cpu` computes each map once
    in the fused kernel, keys zero-padded to 2d and queries as they lie, with a hand-written
    backward (`_DiffFlashCPU`) instead of the glue autograd would add.
    `difftrain bench` (attention core, B=16, H=8, T=256, d=32, fwd+bwd, 2 shared cores, CPU
    time relative to the baseline core): see the README's performance table for the figures.
    CUDA: `padded` — flash kernels need equal widths too; padding costs QKᵀ over 2d features
    (the same FLOPs as `split_v`) but computes each softmax once, in half the kernel launches.
    `benchmarks/gpu_check.sh` times every strategy on a GPU.
    """
    if q.shape[2] <= DECODE_MAX_QUERIES and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, lam))
    ):
        return diff_grouped_math(q, k, v, lam, mask)
    name = DIFF_SDPA_DEFAULT.get(q.device.type, "padded")
    if name == "cpu_auto" and q.device.type == "cpu":
        B, H, T, _ = q.shape
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
        name = cpu_diff_core(B, H, T, k.shape[2], dtype)
    if name in ("flash_cpu", "cpu_auto") and (q.device.type != "cpu" or q.dtype not in _CPU_FLASH_DTYPES):
        name = "padded"
    return DIFF_SDPA_STRATEGIES[name](q, k, v, lam, mask)


# ----- flex ------------------------------------------------------------------------------------
@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(q_len: int, kv_len: int, device: str) -> object:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return create_block_mask(causal, None, None, q_len, kv_len, device=device)


def _block_mask(mask: AttnMask, device: torch.device) -> object:
    if mask.plain_causal:
        return _causal_block_mask(mask.q_len, mask.kv_len, str(device))
    if mask._block is None:
        from torch.nn.attention.flex_attention import create_block_mask

        off = mask.q_offset
        if mask.key_padding_mask is None:

            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + off

            batch = None
        else:
            real = mask.key_padding_mask.to(device=device, dtype=torch.bool)

            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx + off) & (real[b, kv_idx] | (kv_idx == q_idx + off))

            batch = real.shape[0]
        mask._block = create_block_mask(mask_mod, batch, None, mask.q_len, mask.kv_len, device=str(device))
    return mask._block


FLEX_CPU_MIN_KEYS = 16
"""Below this many keys CPU flex runs as sdpa with the same mask: torch 2.14.1's compiled CPU
flex kernel returns wrong values (even NaN) for 8 keys and head_dim ≤ 16 on an AVX2 machine (seen
here, not on 4, 9–15 or ≥ 16 keys); so short a sequence gains nothing from flex anyway."""


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: AttnMask) -> Tensor:
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise DeviceError(
                "attn_impl=flex has no backward pass on CPU in this torch; train on CPU with "
                "model.attn_impl=sdpa (or auto), or use flex on a CUDA GPU"
            )
        q, k, v = q.detach(), k.detach(), v.detach()  # flex refuses requires_grad inputs on CPU
        if mask.kv_len < FLEX_CPU_MIN_KEYS:
            allowed = mask.dense(q.device)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1]
            )
    return _compiled_flex()(
        q, k, v, block_mask=_block_mask(mask, q.device), enable_gqa=q.shape[1] != k.shape[1]
    )


# ----- the three cores -------------------------------------------------------------------------
def baseline_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttnMask,
    impl: str = "sdpa",
    *,
    return_maps: bool = False,
    logit_transform: LogitTransform | None = None,
) -> AttnResult:
    """out_h = softmax(Q_h K_gᵀ/√d + mask)·V_g with g = h // (H/Hkv)."""
    if impl == "eager" or return_maps or logit_transform is not None:
        r = _eager_baseline(q, k, v, mask, logit_transform)
        return r if return_maps else AttnResult(r.out)
    if impl == "sdpa":
        return AttnResult(_sdpa(q, k, v, mask))
    if impl == "flex":
        return AttnResult(_flex(q, k, v, mask))
    raise ConfigError(f"attn_impl={impl!r} is unknown; choose one of {', '.join(IMPLS)}")


def diff_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor,
    mask: AttnMask,
    impl: str = "sdpa",
    *,
    return_maps: bool = False,
    logit_transform: LogitTransform | None = None,
) -> AttnResult:
    """Differential attention (V1): out_i = (A1 − λ·A2)·V_g for differential head i, g = i // n_rep.

    A_c = softmax(Q_{2i+c−1} K_{2g+c−1}ᵀ/√d + mask), c = 1, 2; V_g is the g-th 2d-wide value
    head; λ a 0-d fp32 tensor. `maps` are A1 − λ·A2 (B, H/2, T, S); `logits` (B, H, T, S) in
    query-head order.
    """
    if impl == "eager" or return_maps or logit_transform is not None:
        r = _eager_diff(q, k, v, lam, mask, logit_transform)
        return r if return_maps else AttnResult(r.out)
    if impl == "sdpa":
        return AttnResult(diff_sdpa(q, k, v, lam, mask))
    if impl == "flex":
        o1 = _flex(q[:, 0::2], k[:, 0::2], v, mask)
        o2 = _flex(q[:, 1::2], k[:, 1::2], v, mask)
        return AttnResult(o1 - lam.to(o2.dtype) * o2)
    raise ConfigError(f"attn_impl={impl!r} is unknown; choose one of {', '.join(IMPLS)}")


def diff2_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor,
    mask: AttnMask,
    impl: str = "sdpa",
    *,
    return_maps: bool = False,
    logit_transform: LogitTransform | None = None,
) -> AttnResult:
    """Differential attention V2: out_i = a_{2i} − sigmoid(λ_{t,i})·a_{2i+1}.

    a_j = softmax(Q_j K_gᵀ/√d + mask)·V_g over the 2H query heads, g = j // (2H/Hkv); λ is
    (B, H, T) (sigmoid taken in fp32). `maps` are A_{2i} − σ(λ)·A_{2i+1} (B, H, T, S);
    `logits` (B, 2H, T, S).
    """
    if impl == "eager" or return_maps or logit_transform is not None:
        r = _eager_diff2(q, k, v, lam, mask, logit_transform)
        return r if return_maps else AttnResult(r.out)
    if impl == "sdpa":
        o = _sdpa(q, k, v, mask)
    elif impl == "flex":
        o = _flex(q, k, v, mask)
    else:
        raise ConfigError(f"attn_impl={impl!r} is unknown; choose one of {', '.join(IMPLS)}")
    gate = torch.sigmoid(lam.float()).to(o.dtype)[..., None]
    return AttnResult(o[:, 0::2] - gate * o[:, 1::2])
