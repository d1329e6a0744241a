"""The decoder LM: embeddings → N pre-norm blocks → RMSNorm → lm_head, plus a KV cache.

    h = embed_tokens(ids)
    for each block:  h = h + self_attn(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))

State-dict keys follow HF Llama (`model.layers.{i}.self_attn.q_proj.weight`, `lm_head.weight`).
With `tie_embeddings`, `lm_head.weight` is `model.embed_tokens.weight`; `load_state_dict`
accepts a dict without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from difftrain.errors import CheckpointError, ConfigError
from difftrain.model.attention import (
    ATTENTION_CLASSES,
    AttnLogitTransform,
    AttnOptions,
    DiffAttention,
    RMSNorm,
)
from difftrain.model.config import ModelConfig
from difftrain.model.kernels import AttnMask, resolve_impl
from difftrain.model.loss import IGNORE_INDEX, linear_cross_entropy
from difftrain.model.rope import RotaryEmbedding


@dataclass
class LMOutput:
    """What `Transformer.forward` returns: logits (B, T, V) (None with `return_logits=False`);
    loss, the mean cross-entropy over targets != -100; per layer, when asked, the effective
    attention maps (fp32, see `kernels.attention_core`), the scaled scores that entered the
    softmax (B, query heads, T, S), and the block outputs (before the final norm)."""

    logits: Tensor | None
    loss: Tensor | None = None
    attentions: tuple[Tensor, ...] | None = None
    attn_logits: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None


def padded_positions(key_padding_mask: Tensor) -> Tensor:
    """RoPE positions of a left-padded batch: each slot's count of real tokens before it."""
    return (key_padding_mask.long().cumsum(1) - 1).clamp(min=0)


class KVCache:
    """Preallocated keys and values for incremental decoding (use without gradients).

    Per layer: keys (B, Hkv, max_len, d); values (B, Hkv, max_len, d), or for `diff`
    (B, Hkv/2, max_len, 2d). A forward on T tokens writes slots [length, length+T), attends over
    [0, length+T), then advances `length`. `key_padding_mask` (B, max_len) marks real tokens
    (left-padded prompts) and `next_position` (B,) each sequence's next RoPE position.

    Static steps (`start_static`, for a compiled decode step): one token per sequence is written at
    `slot` (a 0-d tensor) and attention runs over all max_len slots, masked to the real tokens up
    to the slot, so one compiled graph serves every token; the caller advances with
    `static_step_done`.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor]) -> None:
        self.keys, self.values = keys, values
        B, _, L, _ = keys[0].shape
        device = keys[0].device
        self.key_padding_mask = torch.ones(B, L, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(B, dtype=torch.long, device=device)
        self.length = 0
        self.padded = False  # any slot marked as padding since the last reset
        self.slot: Tensor | None = None  # set by `start_static`

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def reset(self) -> None:
        """Forget all tokens (buffers are reused)."""
        self.length, self.padded, self.slot = 0, False, None
        self.key_padding_mask.fill_(True)
        self.next_position.zero_()

    def start_static(self) -> None:  # each forward from now on: one static step at slot `length`
        self.slot = torch.tensor(self.length, device=self.next_position.device)

    def static_step_done(self) -> None:  # past the token a static step wrote
        assert self.slot is not None
        self.length += 1
        self.next_position += 1
        self.slot += 1

    def prepare(
        self, T: int, key_padding_mask: Tensor | None, positions: Tensor | None
    ) -> tuple[AttnMask, Tensor]:
        """The mask and RoPE positions (B, T) of a chunk of T tokens appended to the cache."""
        device = self.next_position.device
        if self.slot is not None:
            if T != 1 or key_padding_mask is not None or positions is not None:
                raise ValueError("a static KV cache takes one token per sequence per step, nothing else")
            allowed = self.key_padding_mask & (torch.arange(self.max_len, device=device) <= self.slot)
            return AttnMask(1, self.max_len, allowed=allowed[:, None, None, :]), self.next_position[:, None]
        if self.length + T > self.max_len:
            raise ConfigError(
                f"KV cache is full: {self.length} cached + {T} new tokens > max_len={self.max_len}; "
                "create the cache with a larger max_len (model.new_cache(batch_size, max_len=...))"
            )
        offset, S = self.length, self.length + T
        if key_padding_mask is not None:
            self.key_padding_mask[:, :S] = key_padding_mask
            self.padded = self.padded or not bool(key_padding_mask.all())
            if positions is None:
                positions = padded_positions(key_padding_mask)[:, offset:]
        else:
            self.key_padding_mask[:, offset:S] = True
            if positions is None:
                positions = self.next_position[:, None] + torch.arange(T, device=device)
        self.next_position.copy_(positions[:, -1] + 1)
        kpm = self.key_padding_mask[:, :S] if self.padded else None
        return AttnMask(T, S, offset, kpm), positions

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this chunk's k, v and return the slots attention reads, in k's and v's dtype."""
        keys, values = self.keys[layer], self.values[layer]
        if self.slot is not None:
            keys.index_copy_(2, self.slot.view(1), k.to(keys.dtype))
            values.index_copy_(2, self.slot.view(1), v.to(values.dtype))
        else:
            start, end = self.length, self.length + k.shape[2]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            keys, values = keys[:, :, :end], values[:, :, :end]
        return keys.to(k.dtype), values.to(v.dtype)


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) ⊙ up_proj(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = ATTENTION_CLASSES[config.arch](config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttnMask,
        cache: KVCache | None = None,
        opts: AttnOptions = AttnOptions(),
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        r = self.self_attn(self.input_layernorm(x), (cos, sin), mask, cache, opts)
        x = x + r.out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, r.maps, r.logits


class DecoderModel(nn.Module):
    """The `model.` prefix of the HF Llama state dict: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert isinstance(config.vocab_size, int) and config.head_dim is not None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class Transformer(nn.Module):
    """Decoder-only LM for arch baseline | diff | diff2; `attn_impl` may be changed at any time."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.vocab_size == "auto":
            raise ConfigError(
                "model.vocab_size is 'auto': set it from the tokenizer first, "
                "e.g. config.replace(vocab_size=tokenizer.vocab_size)"
            )
        self.config = config
        self.attn_impl: str = config.attn_impl
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._logit_transform: AttnLogitTransform | None = None
        self._checkpointing = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, init_std) for linear and embedding weights; o_proj and down_proj use
        init_std/√(2·n_layers) (GPT-2's residual scaling); norms one; λ ~ N(0, lambda_std²)."""
        std = self.config.init_std
        resid_std = std / math.sqrt(2 * self.config.n_layers)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                s = resid_std if name.endswith(("o_proj", "down_proj")) else std
                nn.init.normal_(m.weight, mean=0.0, std=s)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, DiffAttention):
                m.reset_lambda()
        if self.config.tie_embeddings:  # the tied matrix is initialised as an embedding
            nn.init.normal_(self.model.embed_tokens.weight, mean=0.0, std=std)

    def set_attn_logit_transform(self, fn: AttnLogitTransform | None) -> None:
        """Apply fn(scores, layer_idx) to every layer's scaled scores (B, query heads, T, S, fp32,
        −inf where masked, masked again after) before softmax, on the eager core; None removes it."""
        self._logit_transform = fn

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block in backward (torch.utils.checkpoint, use_reentrant=False)."""
        self._checkpointing = enabled

    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A zeroed KV cache for `batch_size` sequences of up to `max_len` (default max_seq_len)
        tokens, on the model's device and in its parameter dtype unless given."""
        c = self.config
        assert c.head_dim is not None and c.n_kv_heads is not None
        w = self.model.embed_tokens.weight
        kw = {"device": w.device if device is None else torch.device(device), "dtype": dtype or w.dtype}
        L = c.max_seq_len if max_len is None else max_len
        d, kv = c.head_dim, c.n_kv_heads
        n_v, v_dim = (kv // 2, 2 * d) if c.arch == "diff" else (kv, d)
        keys = [torch.zeros(batch_size, kv, L, d, **kw) for _ in range(c.n_layers)]
        return KVCache(keys, [torch.zeros(batch_size, n_v, L, v_dim, **kw) for _ in range(c.n_layers)])

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_logits: bool = True,
    ) -> LMOutput:
        """Logits for input_ids (B, T); loss when targets (B, T) are given (−100 = ignore).

        cache: append this chunk to the KV cache and attend to everything in it (then advance).
        key_padding_mask: (B, S) bool, True = real token, S = T or cache.length + T (a cache
            remembers it). positions: (B, T) RoPE positions; default from the padding mask, else
            the cache's next positions, else 0 … T−1. output_attentions: runs the eager core.
        return_logits: False (with targets) fuses the loss with the LM head (`model/loss.py`).
        """
        B, T = input_ids.shape
        device = input_ids.device
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.to(device=device, dtype=torch.bool)
            S = T if cache is None else cache.length + T
            if tuple(key_padding_mask.shape) != (B, S):
                raise ValueError(
                    f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected (B, S) = ({B}, {S})"
                )
        if positions is not None:
            positions = positions.to(device)
        if cache is not None:
            mask, positions = cache.prepare(T, key_padding_mask, positions)
        else:
            mask = AttnMask(T, T, 0, key_padding_mask)
            if positions is None and key_padding_mask is not None:
                positions = padded_positions(key_padding_mask)
            elif positions is None:
                positions = torch.arange(T, device=device)[None].expand(B, T)
        opts = AttnOptions(
            resolve_impl(self.attn_impl, device, mask), output_attentions, self._logit_transform
        )
        h = self.model.embed_tokens(input_ids)
        # the tables in the dtype q and k will have (autocast's, else the model's): cast once here
        dt = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else h.dtype
        cos, sin = (t.to(dt) for t in self.model.rotary_emb(positions))
        maps, logits_per_layer, hidden = [], [], []
        ckpt = self._checkpointing and torch.is_grad_enabled() and cache is None and not output_attentions
        for block in self.model.layers:
            if ckpt:
                h, a, s = checkpoint(block, h, cos, sin, mask, None, opts, use_reentrant=False)
            else:
                h, a, s = block(h, cos, sin, mask, cache, opts)
            if output_attentions:
                maps.append(a)
                logits_per_layer.append(s)
            if output_hidden_states:
                hidden.append(h)
        if cache is not None and cache.slot is None:
            cache.length += T
        h = self.model.norm(h)
        if targets is not None and not return_logits and type(self.lm_head) is nn.Linear:
            logits, loss = None, linear_cross_entropy(h, self.lm_head.weight, targets)
        else:
            logits = self.lm_head(h)
            loss = None if targets is None else lm_loss(logits, targets)
        return LMOutput(
            logits=logits,
            loss=loss,
            attentions=tuple(maps) if output_attentions else None,
            attn_logits=tuple(logits_per_layer) if output_attentions else None,
            hidden_states=tuple(hidden) if output_hidden_states else None,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """As nn.Module's, but with tied embeddings `lm_head.weight` may be absent (it is the
        embedding); a present one must equal the embedding."""
        sd = dict(state_dict)
        if self.config.tie_embeddings and "model.embed_tokens.weight" in sd:
            emb = sd["model.embed_tokens.weight"]
            if "lm_head.weight" not in sd:
                sd["lm_head.weight"] = emb
            elif not torch.equal(sd["lm_head.weight"], emb):
                raise CheckpointError(
                    "weights have lm_head.weight different from model.embed_tokens.weight but the "
                    "config has tie_embeddings=true; set model.tie_embeddings=false to load them"
                )
        result = super().load_state_dict(sd, strict=strict, assign=assign)
        if self.config.tie_embeddings:  # `assign=True` replaces parameters: tie them again
            self.lm_head.weight = self.model.embed_tokens.weight
        return result

    def state_dict_for_safetensors(self) -> dict[str, Tensor]:
        """state_dict() without the tied duplicate `lm_head.weight` (safetensors forbids shared tensors)."""
        sd = self.state_dict()
        if self.config.tie_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    def num_params(self) -> dict[str, int]:
        """Parameter counts by group (see `config.num_params`), counted from the module."""
        counts = dict.fromkeys(("embedding", "attention", "lambda", "norms", "mlp", "head"), 0)
        for name, p in self.named_parameters():  # a tied lm_head is listed once, as the embedding
            counts[param_group(name)] += p.numel()
        counts["total"] = sum(counts.values())
        return counts

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Optimizer groups: decay on ≥2-D weights (matrices, embeddings), none on norms and λ vectors."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]


def param_group(name: str) -> str:
    """Group of a state-dict key: embedding | attention | lambda | norms | mlp | head."""
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "head"
    if ".lambda_" in name:
        return "lambda"
    if name.endswith("norm.weight") or ".subln." in name or "layernorm" in name:
        return "norms"
    if ".mlp." in name:
        return "mlp"
    if ".self_attn." in name:
        return "attention"
    raise KeyError(f"unknown parameter {name}")


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy (fp32) over targets != -100; 0 when every target is ignored."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / (flat != IGNORE_INDEX).sum().clamp(min=1)
