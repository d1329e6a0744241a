"""One decode step as a flat sequence of tensor operations (CPU inference).

Generating a token runs every layer on one row per sequence: matrix-vector products, and around
them a few hundred operations on a few hundred numbers each, whose fixed costs (the module calls,
the argument checks, the dispatch of each operation) are most of the time on a CPU. `FlatDecoder`
computes the same step as `Transformer.forward` with a KV cache, for every arch, from tensors
collected once per generation: no module calls, q and k rotated in one pass, the attention core
written for one query per sequence, and each RMSNorm as one layer_norm kernel (`pair_norm`).
At the bench's quickstart shape that is 28 % less time per token (`difftrain bench --only decode`:
"diff" against "diff (module forward)", 656 against 473 tokens/s).

It needs the layout of `infer.device.cpu_inference_layout` (q/k/v and gate/up as one product
each) and plain modules: `FlatDecoder.build` returns None (the caller keeps the module path) for a
model off the CPU or not in fp32, without that layout, with a layer replaced (LoRA, quantised),
with forward hooks (probes), or with an attention-logit transform. The weights are referenced,
not copied, so a decoder is built per generation and never outlives a change to the model.
Results equal the module path up to float rounding (tested per arch, with padding and GQA).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.model.attention import QKV, Diff2Attention, DiffAttention, RMSNorm, pair_norm, pair_weight
from difftrain.model.fused import fused_entry
from difftrain.model.transformer import GATE_UP, KVCache, Transformer


class _Layer(NamedTuple):
    norm1: Tensor  # pair weights of input_layernorm, post_attention_layernorm (see `pair_weight`)
    norm2: Tensor
    qkv: Tensor  # (nq·d + 2·nkv·d, D) column-major, the fused q/k/v product
    o: Tensor
    gate_up: Tensor
    down: Tensor
    subln: Tensor | None  # diff: pair weight of subln × (1 − λinit)
    subln_eps: float
    neg_lam: Tensor | None  # diff: −λ (fp32, 0-d)
    lam_proj: Tensor | None  # diff2: lambda_proj.weight


def _has_hooks(model: nn.Module) -> bool:
    from torch.nn.modules import module as m

    if m._global_forward_hooks or m._global_forward_pre_hooks:
        return True
    return any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())


class FlatDecoder:
    """`Transformer.forward(ids[:, None], cache=cache).logits[:, -1]` for one token per sequence,
    as flat operations on the model's tensors (see the module docstring). Use `build`."""

    def __init__(self, model: Transformer, layers: list[_Layer], norm: Tensor) -> None:
        c = model.config
        self.model, self.layers, self.norm = model, layers, norm
        self.arch = c.arch
        self.d, self.eps = c.head_dim, c.norm_eps
        first = model.model.layers[0].self_attn
        self.nq, self.nkv = first.n_q, first.n_kv
        self.ffn = c.ffn_hidden
        self.embed = model.model.embed_tokens.weight
        self.head = model.lm_head.weight

    enabled = True  # see `disabled`

    @classmethod
    @contextlib.contextmanager
    def disabled(cls, disable: bool = True) -> Iterator[None]:
        """Within the block (if `disable`), `build` returns None: decoding goes through the
        modules (the bench's reference for what the flat step buys)."""
        before = cls.enabled
        cls.enabled = before and not disable
        try:
            yield
        finally:
            cls.enabled = before

    @classmethod
    def build(cls, model: nn.Module) -> FlatDecoder | None:
        """A decoder for `model` (a `Transformer`), or None where it does not apply."""
        if not cls.enabled or type(model) is not Transformer or model._logit_transform is not None:
            return None
        head = model.lm_head
        if (
            type(head) is not nn.Linear
            or head.bias is not None
            or type(model.model.embed_tokens) is not nn.Embedding
        ):
            return None
        w = head.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or _has_hooks(model):
            return None
        layers = []
        with torch.no_grad():
            for block in model.model.layers:
                attn, mlp = block.self_attn, block.mlp
                qkv, gate_up = fused_entry(attn, QKV), fused_entry(mlp, GATE_UP)
                plain = [attn.o_proj, mlp.down_proj] + (
                    [attn.lambda_proj] if isinstance(attn, Diff2Attention) else []
                )
                norms = [block.input_layernorm, block.post_attention_layernorm]
                if isinstance(attn, DiffAttention):
                    norms.append(attn.subln)
                if (
                    qkv is None
                    or gate_up is None
                    or any(type(lin) is not nn.Linear or lin.bias is not None for lin in plain)
                    or any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in norms)
                ):
                    return None
                diff = isinstance(attn, DiffAttention)
                layers.append(
                    _Layer(
                        norm1=pair_weight(block.input_layernorm.weight),
                        norm2=pair_weight(block.post_attention_layernorm.weight),
                        qkv=qkv.weight,
                        o=attn.o_proj.weight,
                        gate_up=gate_up.weight,
                        down=mlp.down_proj.weight,
                        subln=pair_weight(attn.subln.weight, 1.0 - attn.lambda_init) if diff else None,
                        subln_eps=attn.subln.eps if diff else 0.0,
                        neg_lam=(-attn.lam()).float() if diff else None,
                        lam_proj=attn.lambda_proj.weight if isinstance(attn, Diff2Attention) else None,
                    )
                )
            if type(model.model.norm) is not RMSNorm:
                return None
            return cls(model, layers, pair_weight(model.model.norm.weight))

    @staticmethod
    def accepts(cache: KVCache) -> bool:
        """Whether the steps may go on in `cache`: fp32 CPU buffers, positions that follow the
        slots (no forward was given explicit positions since its reset)."""
        k = cache.keys[0]
        return cache.slot_positions and k.dtype == torch.float32 and k.device.type == "cpu"

    @staticmethod
    def _norm(x: Tensor, pair: Tensor, eps: float) -> Tensor:
        """RMSNorm of the rows of x (R, D): `pair_norm` for a few rows, F.rms_norm for many."""
        if x.shape[0] < RMSNorm.PAIR_NORM_ROWS:
            return pair_norm(x, pair, eps)
        return F.rms_norm(x, (x.shape[-1],), pair[: x.shape[-1]], eps)

    @torch.no_grad()
    def __call__(self, ids: Tensor, cache: KVCache) -> Tensor:
        """Logits (B, V) of the next token after ids (B,), one token per sequence, written to the
        cache at slot `cache.length` (which then advances, as `forward` does), a cache that it
        `accepts`."""
        B = ids.shape[0]
        cache.require_room(1)
        t = cache.length
        positions = cache.next_position
        rope = cache.rope_tables(self.model.model.rotary_emb, positions[:, None], torch.float32)
        cos, ssin = rope.cos.view(B, 1, -1), rope.signed_sin.view(B, 1, -1)  # (B, 1, d)
        cache.key_padding_mask[:, t] = True
        S = t + 1
        allowed = cache.key_padding_mask[:, :S] if cache.padded else None
        d, nq, nkv = self.d, self.nq, self.nkv
        scale = 1.0 / math.sqrt(d)
        x = F.embedding(ids, self.embed)  # (B, D)
        for i, ly in enumerate(self.layers):
            h = self._norm(x, ly.norm1, self.eps)
            qkv = F.linear(h, ly.qkv)  # (B, (nq + 2·nkv)·d)
            qk = qkv[:, : (nq + nkv) * d].view(B, nq + nkv, d)
            qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * ssin  # RoPE on q and k at once
            keys, values = cache.keys[i], cache.values[i]
            keys[:, :, t] = qk[:, nq:]
            values[:, :, t] = qkv[:, (nq + nkv) * d :].view(B, values.shape[1], values.shape[3])
            k, v = keys[:, :, :S], values[:, :, :S]
            q = qk[:, :nq]
            if self.arch == "diff":
                out = self._diff(q, k, v, ly, allowed, scale)
            else:
                out = self._grouped(q, k, v, allowed, scale)  # (B, nq, d)
                if self.arch == "diff2":
                    gate = torch.sigmoid(F.linear(h, ly.lam_proj))[..., None]  # (B, H, 1)
                    out = out[:, 0::2] - gate * out[:, 1::2]
            x = x + F.linear(out.reshape(B, -1), ly.o)
            gu = F.linear(self._norm(x, ly.norm2, self.eps), ly.gate_up)
            x = x + F.linear(F.silu(gu[:, : self.ffn]) * gu[:, self.ffn :], ly.down)
        cache.length = S
        cache.next_position += 1
        return F.linear(self._norm(x, self.norm, self.eps), self.head)

    @staticmethod
    def _grouped(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
        """softmax(q·Kᵀ/√d)·V per query head, heads grouped by the key head they read:
        q (B, nq, d), k, v (B, nkv, S, d) → (B, nq, d)."""
        B, nq, d = q.shape
        nkv = k.shape[1]
        s = torch.matmul(q.view(B, nkv, nq // nkv, d), k.transpose(-2, -1)).mul_(scale)  # (B, nkv, rep, S)
        if allowed is not None:
            s.masked_fill_(~allowed[:, None, None], float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v).view(B, nq, d)

    def _diff(
        self, q: Tensor, k: Tensor, v: Tensor, ly: _Layer, allowed: Tensor | None, scale: float
    ) -> Tensor:
        """(1 − λinit)·subln((A1 − λ·A2)·V) per differential head, (B, H/2·2d): query heads 2i+c
        read key heads 2g+c and value head g, g = i // rep (as `kernels.diff_grouped_math`)."""
        B, H, d = q.shape
        G = k.shape[1] // 2
        rep = H // (2 * G)
        S = k.shape[2]
        qg = q.view(B, G, rep, 2, d).transpose(2, 3)  # (B, G, 2, rep, d)
        s = torch.matmul(qg, k.view(B, G, 2, S, d).transpose(-2, -1)).mul_(scale)  # (B, G, 2, rep, S)
        if allowed is not None:
            s.masked_fill_(~allowed[:, None, None, None], float("-inf"))
        P = torch.softmax(s, dim=-1)
        A = torch.addcmul(P[:, :, 0], P[:, :, 1], ly.neg_lam)  # (B, G, rep, S)
        out = torch.matmul(A, v).view(B, G * rep, 2 * d)  # (B, H/2, 2d)
        assert ly.subln is not None
        return self._norm(out.view(B * G * rep, 2 * d), ly.subln, ly.subln_eps).reshape(B, -1)
