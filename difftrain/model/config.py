"""ModelConfig: the shape of a baseline / Differential V1 / Differential V2 decoder.

Every field's `description` is its user documentation (`difftrain recipes explain`). Derived
fields (`n_kv_heads`, `head_dim`, `ffn_hidden`) are filled in by validation, so a validated
config, and the `config.json` written from it, is fully explicit. `from_dict` / `from_json` raise
a one-line ConfigError; `ModelConfig(**fields)` raises pydantic's ValidationError (the recipe
loader maps it to YAML lines); `replace(**updates)` is the validating `model_copy`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from difftrain.errors import ConfigError, validation_message
from difftrain.io import atomic_write_json, json_error_reason

Arch = Literal["baseline", "diff", "diff2"]
AttnImpl = Literal["auto", "eager", "sdpa", "flex"]


def vocab_rows(tokens: int) -> int:
    """Embedding rows for a tokenizer of `tokens` ids: rounded up to a multiple of 64."""
    return 64 * math.ceil(tokens / 64)


def lambda_init(layer_idx: int) -> float:
    """λinit = 0.8 − 0.6·exp(−0.3·l) for 0-based layer index l (Differential Transformer, eq. 2)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def config_error_from_validation(err: ValidationError, where: str = "model") -> ConfigError:
    """A ConfigError of one line for `err`: `where.field: message` for each error."""
    return ConfigError(validation_message(err, ModelConfig, prefix=where))


class ModelConfig(BaseModel):
    """Architecture of the decoder. Shapes are in the paper's symbols: H = n_heads, d = head_dim."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    arch: Arch = Field(
        "diff",
        description=(
            "Attention type. `baseline`: LLaMA-style multi-head attention. `diff`: Differential "
            "Transformer V1 (n_heads/2 differential heads, each the difference of two softmax maps, "
            "(A1 − λ·A2)·V, with per-head RMSNorm). `diff2`: Differential Transformer V2 (2·n_heads "
            "query heads in one attention call; head i = a_2i − sigmoid(λ_t,i)·a_2i+1 with a "
            "per-token λ)."
        ),
    )
    vocab_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description=(
            "Vocabulary size (rows of the embedding and lm_head). `auto` takes the tokenizer's "
            "vocabulary size when the run starts, rounded up to a multiple of 64 (faster products; "
            "the extra rows are never a token)."
        ),
    )
    d_model: int = Field(512, ge=1, description="Width of the residual stream.")
    n_layers: int = Field(8, ge=1, description="Number of decoder blocks.")
    n_heads: int = Field(
        8,
        ge=1,
        description=(
            "Number of attention heads H of width head_dim. For `diff` these are the query/key heads, "
            "paired into H/2 differential heads; for `diff2` the output heads (q_proj has 2·H query heads)."
        ),
    )
    n_kv_heads: int | None = Field(
        None,
        ge=1,
        description=(
            "Number of key/value heads (grouped-query attention); must divide n_heads. Default: n_heads "
            "(no grouping). `diff` needs it even (keys pair like queries)."
        ),
    )
    head_dim: int | None = Field(
        None, ge=1, description="Width d of one query/key head. Default: d_model / n_heads."
    )
    ffn_hidden: int | None = Field(
        None,
        ge=1,
        description="Hidden width of the SwiGLU MLP. Default: 8/3·d_model rounded up to a multiple of 64.",
    )
    max_seq_len: int = Field(
        1024, ge=1, description="Longest context the model is trained on (tokens per sequence)."
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base θ (inverse frequencies θ^(−2i/d)).")
    norm_eps: float = Field(
        1e-5,
        gt=0,
        description="Epsilon of the model's RMSNorms (the per-head subln of `diff` keeps 1e-5, as DiffLlama's groupnorm does; export compensates).",
    )
    tie_embeddings: bool = Field(
        False, description="Share the input embedding matrix with the output projection (lm_head)."
    )
    lambda_std: float = Field(
        0.1,
        ge=0,
        description="`diff` only: standard deviation of the normal init of the λ vectors λq1, λk1, λq2, λk2.",
    )
    attn_impl: AttnImpl = Field(
        "auto",
        description=(
            "Attention core. `eager`: explicit softmax maps (slowest; what the probes use). `sdpa`: "
            "torch scaled_dot_product_attention (fused kernels on CPU and GPU). `flex`: torch flex "
            "attention under torch.compile (compiles on first use; no backward on CPU; masks other than "
            "the plain causal one, as in KV-cache decoding, run sdpa). `auto`: flex on CUDA GPUs of "
            "compute capability 8.0 and newer, sdpa elsewhere. All give the same result to float rounding."
        ),
    )
    init_std: float = Field(
        0.02,
        gt=0,
        description=(
            "Standard deviation of the normal init of linear and embedding weights; o_proj and "
            "down_proj use init_std/√(2·n_layers)."
        ),
    )

    @model_validator(mode="after")
    def _fill_and_check(self) -> ModelConfig:
        H = self.n_heads
        if self.n_kv_heads is None:
            self.n_kv_heads = H
        if self.head_dim is None:
            if self.d_model % H:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={H}; "
                    "choose n_heads dividing d_model or set head_dim explicitly"
                )
            self.head_dim = self.d_model // H
        if self.ffn_hidden is None:
            # 8/3·d_model rounded up to a multiple of 64 (the 4·d_model MLP's parameter count)
            self.ffn_hidden = 64 * -(-8 * self.d_model // (3 * 64))
        kv, d = self.n_kv_heads, self.head_dim
        if H % kv:
            raise ValueError(f"n_heads={H} with n_kv_heads={kv}: n_heads must be a multiple of n_kv_heads")
        if d % 2:
            raise ValueError(f"head_dim={d} must be even: RoPE rotates pairs of features")
        if self.arch == "diff":
            if H % 2:
                raise ValueError(
                    f"n_heads={H} must be even for arch=diff: differential heads pair query heads 2i and 2i+1"
                )
            if kv % 2:
                raise ValueError(
                    f"n_kv_heads={kv} must be even for arch=diff: differential heads pair key heads "
                    "2j and 2j+1 and read V as n_kv_heads/2 heads of width 2·head_dim"
                )
        # diff2's query heads 2i and 2i+1 share a kv head: 2H/Hkv is even since Hkv | H
        return self

    @property
    def n_query_heads(self) -> int:
        """Heads of width d produced by q_proj: H (baseline, diff) or 2H (diff2)."""
        return 2 * self.n_heads if self.arch == "diff2" else self.n_heads

    def replace(self, **updates: Any) -> ModelConfig:
        """A validated copy with `updates` applied (derived fields are kept unless updated)."""
        return ModelConfig.from_dict({**self.model_dump(), **updates})

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> ModelConfig:
        """Validate a plain dict; errors become a ConfigError prefixed with `where`."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping of model settings, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise config_error_from_validation(e, where) from None

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Load a config.json written by `to_json` (ConfigError names the file and the field)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{p}: model config file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: cannot read model config: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{p}, line {e.lineno}: invalid JSON in model config: {json_error_reason(e)}"
            ) from None
        if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
            raise ConfigError(
                f"{p} is a transformers config ({data.get('model_type') or data.get('architectures')}), not a "
                f"difftrain one; turn the folder into a run with `difftrain import {p.parent} RUN_DIR`"
            )
        return cls.from_dict(data, where=str(p))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the fully explicit config atomically."""
        atomic_write_json(path, self.model_dump(mode="json"))


def num_params(config: ModelConfig) -> dict[str, int]:
    """Parameter counts by group from the config alone: `embedding`, `attention` (q/k/v/o),
    `lambda` (diff's λ vectors, diff2's lambda_proj), `norms` (subln included), `mlp`, `head`
    (0 when tied) and `total`. diff's total is the baseline's + n_layers·(4d + 2d)."""
    if config.vocab_size == "auto":
        raise ConfigError(
            "model.vocab_size is 'auto': resolve it from the tokenizer before counting parameters"
        )
    V, D, L = config.vocab_size, config.d_model, config.n_layers
    d, kv, F = config.head_dim, config.n_kv_heads, config.ffn_hidden
    assert d is not None and kv is not None and F is not None
    Hq = config.n_query_heads
    attn = D * Hq * d + 2 * D * kv * d + config.n_heads * d * D
    lam = {"baseline": 0, "diff": 4 * d, "diff2": D * config.n_heads}[config.arch]
    norms = 2 * D + (2 * d if config.arch == "diff" else 0)
    counts = {
        "embedding": V * D,
        "attention": L * attn,
        "lambda": L * lam,
        "norms": L * norms + D,
        "mlp": L * 3 * D * F,
        "head": 0 if config.tie_embeddings else V * D,
    }
    counts["total"] = sum(counts.values())
    return counts
