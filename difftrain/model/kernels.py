"""Attention cores: pure functions from projected, rotated heads to per-head outputs.

Shapes (B batch, T queries, S keys, d = head_dim, H = n_heads, Hkv = n_kv_heads):

    baseline  q (B, H, T, d)   k (B, Hkv, S, d)   v (B, Hkv, S, d)      → out (B, H, T, d)
    diff      q (B, H, T, d)   k (B, Hkv, S, d)   v (B, Hkv/2, S, 2d)   → out (B, H/2, T, 2d)
    diff2     q (B, 2H, T, d)  k (B, Hkv, S, d)   v (B, Hkv, S, d)      → out (B, H, T, d)

Every arch is one or two calls of `attend(q, k, v) = softmax(QKᵀ/√d + mask)·V` (GQA), combined by
the arch's equation (`attention_core`). `attn_impl` picks the primitive:

- `eager`  the reference: materialised fp32 maps; the only one that returns maps and logits or
           applies a logit transform (the probes).
- `sdpa`   torch's scaled_dot_product_attention (GQA through `enable_gqa`, K and V never copied).
- `flex`   flex_attention under torch.compile, plain causal mask only; for `diff` QKᵀ over d with
           the 2d-wide V (1.5× the baseline's FLOPs). No backward on CPU.

Masking (`AttnMask`): query t sits at key slot `q_offset + t` and sees key slot s iff
s ≤ q_offset + t and the key is a real token (`key_padding_mask[b, s]`). A query always sees its
own slot, so the rows of left-padding tokens are never empty (no NaN).
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
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from difftrain.errors import ConfigError, DeviceError

IMPLS = ("eager", "sdpa", "flex")
FLEX_MIN_CAPABILITY = (8, 0)  # flex's Triton kernels target Ampere and newer
FLEX_BLOCK = 128  # flex's block of queries and keys: sequences are padded to a multiple

LogitTransform = Callable[[Tensor], Tensor]


class AttnResult(NamedTuple):
    """`out` per output head; `maps` the effective attention maps and `logits` the scaled scores
    that entered the softmax (the eager core with maps asked for; else None)."""

    out: Tensor
    maps: Tensor | None = None
    logits: Tensor | None = None


@dataclass
class AttnMask:
    """Causal mask of T = q_len queries from slot `q_offset` over S = kv_len keys, with an optional
    key_padding_mask (B, S) (True = real token); `allowed` (B, 1, T, S), if given, is the whole mask."""

    q_len: int
    kv_len: int
    q_offset: int = 0
    key_padding_mask: Tensor | None = None
    allowed: Tensor | None = field(default=None, repr=False)
    _dense: Tensor | None = field(default=None, repr=False)

    @property
    def plain_causal(self) -> bool:
        """The ordinary lower-triangular mask: no cache prefix, no padding."""
        return (
            self.q_offset == 0
            and self.q_len == self.kv_len
            and self.key_padding_mask is None
            and self.allowed is None
        )

    @property
    def sees_all(self) -> bool:
        """Every query sees every key: one new token after an unpadded cache (a decode step)."""
        return self.q_len == 1 and self.key_padding_mask is None and self.allowed is None

    def dense(self, device: torch.device) -> Tensor:
        """Boolean (B or 1, 1, T, S), True where attention is allowed (computed once per forward)."""
        if self.allowed is not None:
            return self.allowed
        if self._dense is None:
            q_slot = torch.arange(self.q_len, device=device)[:, None] + self.q_offset
            k_slot = torch.arange(self.kv_len, device=device)[None, :]
            allowed = (k_slot <= q_slot)[None, None]
            if self.key_padding_mask is not None:
                real = self.key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
                allowed = allowed & (real | (k_slot == q_slot)[None, None])
            self._dense = allowed
        return self._dense


def pick_core(impl: str, device_type: str, capability: tuple[int, int] | None = None) -> str:
    """The core `impl` names on a device of `device_type` (a CUDA GPU of compute `capability`),
    for the plain causal mask."""
    if impl not in ("auto", *IMPLS):
        raise ConfigError(f"model.attn_impl={impl!r} is unknown; choose one of auto, {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    return "flex" if device_type == "cuda" and (capability or (0, 0)) >= FLEX_MIN_CAPABILITY else "sdpa"


def resolve_impl(impl: str, device: torch.device, mask: AttnMask | None = None) -> str:
    """The primitive that runs `impl` on `device` for `mask`: `auto` is flex on CUDA of capability
    ≥ 8.0, else sdpa; a mask other than the plain causal one (left padding, a cache prefix) runs sdpa."""
    cuda_auto = device.type == "cuda" and impl == "auto"
    impl = pick_core(impl, device.type, torch.cuda.get_device_capability(device) if cuda_auto else None)
    if impl == "flex" and mask is not None and not mask.plain_causal:
        impl = "sdpa"
    return impl


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, h, S, e) → (B, h·n_rep, S, e) with head j reading head j // n_rep (GQA)."""
    if n_rep == 1:
        return x
    B, h, S, e = x.shape
    return x[:, :, None].expand(B, h, n_rep, S, e).reshape(B, h * n_rep, S, e)


def attend_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: AttnMask) -> Tensor:
    """torch's scaled_dot_product_attention. Its fused kernels need equal q, k and v widths: for
    diff's 2d-wide V, q and k are zero-padded to 2d, which leaves QKᵀ (and the 1/√d scale) unchanged."""
    d, gqa = q.shape[-1], q.shape[1] != k.shape[1]
    if v.shape[-1] != d:
        q, k = F.pad(q, (0, v.shape[-1] - d)), F.pad(k, (0, v.shape[-1] - d))
    kw = dict(enable_gqa=gqa, scale=1.0 / math.sqrt(d))
    if mask.plain_causal or mask.sees_all:
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask.plain_causal, **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.device), **kw)


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    # dynamic=None: a second shape recompiles with the changed sizes dynamic, so new lengths never
    # reach Dynamo's recompile limit (past it, flex would silently run unfused)
    return torch.compile(flex_attention, dynamic=None)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@functools.lru_cache(maxsize=32)
def _causal_block_mask(n: int, device: str) -> BlockMask:
    return create_block_mask(_causal, None, None, n, n, device=device)


def attend_flex(q: Tensor, k: Tensor, v: Tensor, mask: AttnMask) -> Tensor:
    """Causal flex attention. T is padded to a multiple of FLEX_BLOCK: padded keys come after every
    real query, so the causal mask hides them, and the padded queries' rows are cut off."""
    if not mask.plain_causal:
        raise ValueError("attend_flex takes the plain causal mask only (resolve_impl routes the rest)")
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise DeviceError(
            "attn_impl=flex has no backward pass on CPU in torch; train on CPU with model.attn_impl=auto "
            "(or sdpa), or use flex on a CUDA GPU"
        )
    T = q.shape[2]
    n = -(-T // FLEX_BLOCK) * FLEX_BLOCK
    # fresh contiguous inputs: inductor computes flex wrongly over a view with a storage offset
    # made inside the compiled region (torch 2.13, e.g. diff's strided halves q[:, 1::2])
    q, k, v = (F.pad(t, (0, 0, 0, n - T)).contiguous() for t in (q, k, v))
    if torch.compiler.is_compiling():  # inside a compiled model: traced into its graph
        fn, block_mask = flex_attention, create_block_mask(_causal, None, None, n, n, device=str(q.device))
    else:
        fn, block_mask = _compiled_flex(), _causal_block_mask(n, str(q.device))
    out = fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, :T]


def _pairwise(arch: str, a: Tensor, b: Tensor, lam: Tensor) -> Tensor:
    """The differential combination of two maps or two outputs (the same equation for both):
    diff  a − λ·b  (λ a 0-d fp32 scalar);  diff2  a − σ(λ_t,i)·b  (λ (B, H, T), per token and head)."""
    if arch == "diff":
        return torch.addcmul(a, b, -lam.to(a.dtype))
    return a - torch.sigmoid(lam.float()).to(a.dtype)[..., None] * b


def attention_core(
    arch: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor | None,
    mask: AttnMask,
    impl: str,
    *,
    return_maps: bool = False,
    transform: LogitTransform | None = None,
) -> AttnResult:
    """The attention of `arch` on rotated q, k and (cached) v; `impl` a resolved primitive.

    baseline  out_h = softmax(Q_h K_gᵀ/√d + mask)·V_g,                    g = h // (H/Hkv)
    diff      out_i = (A1 − λ·A2)·V_g,  A_c = softmax(Q_{2i+c−1} K_{2g+c−1}ᵀ/√d + mask), c = 1, 2,
              over query heads 2i, 2i+1, key heads 2g, 2g+1 and the 2d-wide value head g = i // n_rep
    diff2     out_i = (A_2i − σ(λ_t,i)·A_2i+1)·V_g,  A_j = softmax(Q_j K_gᵀ/√d + mask) over 2H query
              heads, g = j // (2H/Hkv)

    `eager` forms the effective maps (fp32) and multiplies them into V once; with `return_maps`
    it returns them and the scaled scores of every query head. The fused primitives combine A1·V
    and A2·V instead, the same by linearity.
    """
    if impl == "eager" or return_maps or transform is not None:
        return _eager_core(arch, q, k, v, lam, mask, transform)
    attend = functools.partial({"sdpa": attend_sdpa, "flex": attend_flex}[impl], mask=mask)
    if arch == "baseline":
        return AttnResult(attend(q, k, v))
    assert lam is not None
    if arch == "diff":  # the two maps of differential head i read key heads 2g and 2g+1
        return AttnResult(
            _pairwise(arch, attend(q[:, 0::2], k[:, 0::2], v), attend(q[:, 1::2], k[:, 1::2], v), lam)
        )
    o = attend(q, k, v)  # diff2: query heads 2i and 2i+1 share kv head i // (H/Hkv): one call over 2H
    return AttnResult(_pairwise(arch, o[:, 0::2], o[:, 1::2], lam))


def _eager_core(arch, q, k, v, lam, mask, transform) -> AttnResult:
    """P = softmax(QKᵀ/√d + mask) in fp32 for every query head (the scores after the optional
    transform, −inf where masked: it cannot unmask them), then the arch's effective maps into V."""
    if arch == "diff":  # both maps in one softmax call: query head 2i + c reads key head 2g + c
        n_rep = q.shape[1] // k.shape[1]
        k = torch.stack((repeat_kv(k[:, 0::2], n_rep), repeat_kv(k[:, 1::2], n_rep)), dim=2).flatten(1, 2)
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
    allowed = mask.dense(q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if transform is not None:
        scores = transform(scores).masked_fill(~allowed, float("-inf"))
    P = torch.softmax(scores, dim=-1)
    A = P if arch == "baseline" else _pairwise(arch, P[:, 0::2], P[:, 1::2], lam.float())
    return AttnResult(A.to(v.dtype) @ repeat_kv(v, A.shape[1] // v.shape[1]), A, scores)
