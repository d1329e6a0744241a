"""Export runs to Hugging Face transformers (Llama, DiffLlama) and import them back, exactly.

    baseline  ↔  LlamaForCausalLM       same tensors, same names (RoPE is rotate-half in both)
    diff      ↔  DiffLlamaForCausalLM   same function; q/k/v rows permuted, subln folded into o_proj
    diff2     →  refused: transformers has no Differential Transformer V2 class

Neither direction needs transformers: config.json, model.safetensors and the tokenizer files are
written and read directly (transformers is only needed to *use* the exported folder).

## Why `diff` needs a permutation (H = n_heads, Hk = n_kv_heads, d = head_dim, r = H/Hk)

difftrain (docs/models.md) forms differential head i ∈ [0, H/2) from query heads 2i (map A1) and
2i+1 (map A2), key heads 2g and 2g+1 with g = ⌊i/r⌋, and the value [v_2g ; v_2g+1] — the
contiguous 2d slice g of V read as Hk/2 heads of width 2d.

transformers' `DiffLlamaAttention` runs two ordinary GQA attentions over all H query heads with
V split in halves, `torch.chunk(V, 2, dim=heads)`, each half repeated twice along the heads; the
outputs are concatenated on features and then chunked on heads into a first and a second half
that are subtracted. Following the indices: query head h reads key head ⌊h/r⌋ and values
[v_(⌊h/r⌋ mod Hk/2) ; v_(Hk/2 + ⌊h/r⌋ mod Hk/2)], and differential head i is the pair (i, i + H/2).
Because H/2 = r·Hk/2, ⌊(i + H/2)/r⌋ = g + Hk/2 with g = ⌊i/r⌋ < Hk/2, so differential head i uses
query heads i, i + H/2, key heads g, g + Hk/2 and the value [v_g ; v_(g + Hk/2)].

So the two layouts agree once head j of HF's q_proj is head P_H(j) of ours, and head j of HF's
k_proj and v_proj is head P_Hk(j) of ours, where

    P_n(j) = 2·(j mod n/2) + ⌊j / (n/2)⌋      (n/2 first members of the pairs, then the seconds)

i.e. rows viewed as (n/2, 2, d, D) are transposed to (2, n/2, d, D) — a "de-interleave". HF's
differential head i then sees exactly our q/k heads and our 2d value slice g, in the same feature
order, and its outputs (B, T, H/2, 2d) → H·d are in our order, so o_proj's columns need no
permutation. RoPE acts within each head and commutes with permuting heads. Both use scale 1/√d,
λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit with λinit = 0.8 − 0.6·exp(−0.3·l) for 0-based layer l,
and the same parameter names for the four λ vectors, which are copied unchanged.

## subln and its ε

Ours: out_i = (1 − λinit)·w ⊙ y_i / √(mean(y_i²) + 1e-5) with a learnable w ∈ R^{2d} shared by
the heads (`subln`). HF's `groupnorm` has no weight and uses ε = rms_norm_eps. Two exact fixes:

- w is folded into o_proj: o_proj(concat_i (w ⊙ n_i)) = (W_o · diag(w repeated H/2 times))·n, so
  HF's o_proj = ours with column 2d·i + f multiplied by w_f.
- if norm_eps ≠ 1e-5 (HF's config has one ε for every norm), V is scaled by c = √(norm_eps/1e-5):
  the attention output is linear in V, so y → c·y and c·y / √(c²·mean(y²) + norm_eps) =
  y / √(mean(y²) + 1e-5). With the default norm_eps = 1e-5, c = 1 and V is not touched.

Import undoes both: rows are re-interleaved, V is divided by c, and subln = ones (a DiffLlama
checkpoint has no subln weights; one that carries `self_attn.subln.weight` or
`self_attn.groupnorm.weight`, e.g. converted from Microsoft's code, keeps them).

## Bit-identical round trips

Folding w into o_proj (and scaling V) rounds, so the transformers tensors alone do not give back
the run's tensors bit for bit. `export` therefore also writes `difftrain.safetensors` (ignored by
transformers): the run's ModelConfig and the original value of every tensor whose conversion
does not invert exactly. `import` uses it only when re-exporting the restored tensors reproduces
model.safetensors bit for bit (i.e. the weights were not changed since the export); otherwise it
imports the transformers weights as they are — the same function either way.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from difftrain.adapters import ADAPTER_CONFIG
from difftrain.errors import DifftrainError, InteropError
from difftrain.interop.paths import EXPORT_DTYPES, check_export_paths, check_import_paths
from difftrain.io import (
    atomic_save_safetensors,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    json_error_reason,
)
from difftrain.model.config import ModelConfig
from difftrain.rundir import CHECKPOINTS, CONFIG, METRICS, RECIPE, TOKENIZER, WEIGHTS

LLAMA = "LlamaForCausalLM"
DIFFLLAMA = "DiffLlamaForCausalLM"
SUPPORTED_ARCHITECTURES: dict[str, str] = {LLAMA: "baseline", DIFFLLAMA: "diff"}
"""transformers class → difftrain arch (both directions)."""
MODEL_TYPES = {LLAMA: "llama", DIFFLLAMA: "diffllama"}
HF_CLASS_OF_ARCH = {arch: cls for cls, arch in SUPPORTED_ARCHITECTURES.items()}

SUBLN_EPS = 1e-5
"""ε of difftrain's per-head RMSNorm (`DiffAttention.subln`), fixed by the model."""
SIDECAR = "difftrain.safetensors"
"""Exact difftrain tensors and config kept next to an export (transformers ignores the file)."""
HF_INDEX = "model.safetensors.index.json"
DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPES}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


# --------------------------------------------------------------------------------------------
# results


@dataclass
class ExportResult:
    """What `export_hf` wrote."""

    out_dir: Path
    hf_class: str
    arch: str
    dtype: str
    files: list[str]
    num_params: int
    notes: list[str] = field(default_factory=list)


@dataclass
class ImportResult:
    """What `import_hf` wrote."""

    run_dir: Path
    hf_class: str
    config: ModelConfig
    files: list[str]
    num_params: int
    exact_sidecar: bool
    """True when difftrain.safetensors restored the original difftrain tensors bit for bit."""
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# the head permutation


def deinterleave_heads(w: Tensor, n_heads: int) -> Tensor:
    """Rows of `n_heads` heads in difftrain's pair order → transformers' DiffLlama order.

    Head j of the result is head P(j) = 2·(j mod n/2) + ⌊j/(n/2)⌋ of `w`: rows viewed as
    (n/2, 2, d, cols) are transposed to (2, n/2, d, cols).
    """
    rows, cols = w.shape
    return w.reshape(n_heads // 2, 2, rows // n_heads, cols).transpose(0, 1).reshape(rows, cols)


def interleave_heads(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of `deinterleave_heads`: (2, n/2, d, cols) → (n/2, 2, d, cols)."""
    rows, cols = w.shape
    return w.reshape(2, n_heads // 2, rows // n_heads, cols).transpose(0, 1).reshape(rows, cols)


def value_scale(config: ModelConfig) -> float:
    """c = √(norm_eps / 1e-5): the factor on V that turns HF's groupnorm ε into subln's 1e-5."""
    return math.sqrt(config.norm_eps / SUBLN_EPS)


# --------------------------------------------------------------------------------------------
# state dicts


def hf_class_for(config: ModelConfig) -> str:
    """The transformers class a difftrain arch exports to, or an InteropError (diff2)."""
    cls = HF_CLASS_OF_ARCH.get(config.arch)
    if cls is None:
        raise InteropError(
            f"arch={config.arch} has no transformers class (transformers implements the Differential "
            "Transformer V1 as DiffLlama, but not V2), so it cannot be exported; export supports "
            + ", ".join(f"{a} → {c}" for a, c in HF_CLASS_OF_ARCH.items())
        )
    return cls


def to_hf_state_dict(
    sd: dict[str, Tensor], config: ModelConfig, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """difftrain tensors → the tensors of the matching transformers class (see the module doc).

    The conversion is computed in fp32 and cast to `dtype`. A tied lm_head is dropped (HF ties it
    to the embedding through `tie_word_embeddings`).
    """
    hf_class_for(config)
    out = {k: t for k, t in sd.items() if not (k == "lm_head.weight" and config.tie_embeddings)}
    if config.arch == "diff":
        H, Hk = config.n_heads, config.n_kv_heads
        assert Hk is not None
        c = value_scale(config)
        for i in range(config.n_layers):
            p = f"model.layers.{i}.self_attn."
            w = out.pop(p + "subln.weight").float()
            v = out[p + "v_proj.weight"].float()
            out[p + "q_proj.weight"] = deinterleave_heads(out[p + "q_proj.weight"], H)
            out[p + "k_proj.weight"] = deinterleave_heads(out[p + "k_proj.weight"], Hk)
            out[p + "v_proj.weight"] = deinterleave_heads(v * c if c != 1.0 else v, Hk)
            out[p + "o_proj.weight"] = out[p + "o_proj.weight"].float() * w.repeat(H // 2)[None, :]
    return {k: t.detach().to(dtype).contiguous() for k, t in out.items()}


def from_hf_state_dict(hf: dict[str, Tensor], config: ModelConfig, where: str = CONFIG) -> dict[str, Tensor]:
    """Tensors of a (checked) Llama / DiffLlama checkpoint → difftrain's state dict, in fp32.

    Keys must already match `expected_hf_shapes` (see `check_hf_tensors`). DiffLlama: q/k/v rows
    re-interleaved, V divided by `value_scale`, subln = ones unless the checkpoint carries one.
    `where`: the config.json its messages name.
    """
    sd = {k: t.float() for k, t in hf.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_embeddings:
        head = sd.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, sd["model.embed_tokens.weight"]):
            raise InteropError(
                f"{where} has tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings to false there to import both"
            )
    if config.arch == "diff":
        H, Hk, d = config.n_heads, config.n_kv_heads, config.head_dim
        assert Hk is not None and d is not None
        c = value_scale(config)
        for i in range(config.n_layers):
            p = f"model.layers.{i}.self_attn."
            sd[p + "q_proj.weight"] = interleave_heads(sd[p + "q_proj.weight"], H)
            sd[p + "k_proj.weight"] = interleave_heads(sd[p + "k_proj.weight"], Hk)
            v = interleave_heads(sd[p + "v_proj.weight"], Hk)
            sd[p + "v_proj.weight"] = v / c if c != 1.0 else v
            w = sd.pop(p + "groupnorm.weight", None)
            w = sd.pop(p + "subln.weight", w)
            sd[p + "subln.weight"] = torch.ones(2 * d) if w is None else w
    return sd


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the transformers checkpoint of `config`: name → (shape, formula in HF's names)."""
    V, D, F, L = config.vocab_size, config.d_model, config.ffn_hidden, config.n_layers
    H, Hk, d = config.n_heads, config.n_kv_heads, config.head_dim
    assert isinstance(V, int) and F is not None and Hk is not None and d is not None
    vd = "vocab_size × hidden_size"
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((V, D), vd)}
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((D,), "hidden_size")
        out[p + "post_attention_layernorm.weight"] = ((D,), "hidden_size")
        out[p + "self_attn.q_proj.weight"] = ((H * d, D), "num_attention_heads·head_dim × hidden_size")
        out[p + "self_attn.k_proj.weight"] = ((Hk * d, D), "num_key_value_heads·head_dim × hidden_size")
        out[p + "self_attn.v_proj.weight"] = ((Hk * d, D), "num_key_value_heads·head_dim × hidden_size")
        out[p + "self_attn.o_proj.weight"] = ((D, H * d), "hidden_size × num_attention_heads·head_dim")
        out[p + "mlp.gate_proj.weight"] = ((F, D), "intermediate_size × hidden_size")
        out[p + "mlp.up_proj.weight"] = ((F, D), "intermediate_size × hidden_size")
        out[p + "mlp.down_proj.weight"] = ((D, F), "hidden_size × intermediate_size")
        if config.arch == "diff":
            for n in ("q1", "k1", "q2", "k2"):
                out[p + f"self_attn.lambda_{n}"] = ((d,), "head_dim")
    out["model.norm.weight"] = ((D,), "hidden_size")
    if not config.tie_embeddings:
        out["lm_head.weight"] = ((V, D), vd)
    return out


def check_hf_tensors(hf: dict[str, Tensor], config: ModelConfig, hf_dir: Path) -> None:
    """InteropError unless `hf` holds exactly the tensors config.json implies, with its shapes."""
    expected = expected_hf_shapes(config)
    optional: dict[str, tuple[int, ...]] = {}
    if config.tie_embeddings:
        optional["lm_head.weight"] = expected["model.embed_tokens.weight"][0]
    if config.arch == "diff":
        assert config.head_dim is not None
        for i in range(config.n_layers):
            for n in ("subln", "groupnorm"):
                optional[f"model.layers.{i}.self_attn.{n}.weight"] = (2 * config.head_dim,)
    cfg = hf_dir / CONFIG
    missing = [k for k in expected if k not in hf]
    unexpected = [
        k for k in hf if k not in expected and k not in optional and not k.endswith(_IGNORED_SUFFIXES)
    ]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InteropError(
            f"{hf_dir}: tensor {missing[0]}{more} is missing from the weights but {cfg} implies it; "
            "the config and the weights come from different models, or the download is incomplete"
        )
    extra_layers = sorted(
        {int(m.group(1)) for k in unexpected if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    )
    if extra_layers and extra_layers[0] >= config.n_layers:
        raise InteropError(
            f"{hf_dir}: the weights hold layers up to model.layers.{extra_layers[-1]} but {cfg} says "
            f"num_hidden_layers={config.n_layers}; set num_hidden_layers={extra_layers[-1] + 1} there (the config "
            "and the weights disagree)"
        )
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise InteropError(
            f"{hf_dir}: unexpected tensor {unexpected[0]}{more} for a {HF_CLASS_OF_ARCH[config.arch]} "
            f"with this {cfg}; difftrain imports only the plain Llama/DiffLlama layout (no biases, no extra modules)"
        )
    for k, t in hf.items():
        want = expected[k][0] if k in expected else optional.get(k)
        if want is not None and tuple(t.shape) != want:
            formula = f" ({expected[k][1]})" if k in expected else ""
            raise InteropError(
                f"{hf_dir}: tensor {k} has shape {tuple(t.shape)} but {cfg} implies {want}{formula}; "
                "fix the sizes in config.json to match the weights"
            )
        if not t.is_floating_point():
            raise InteropError(f"{hf_dir}: tensor {k} has dtype {t.dtype}; expected floating-point weights")


# --------------------------------------------------------------------------------------------
# configs


def hf_config_dict(
    config: ModelConfig, *, bos_id: int, eos_id: int, pad_id: int, dtype: str = "float32"
) -> dict[str, Any]:
    """config.json of the transformers class for `config` (readable by transformers 4.48+ and 5.x)."""
    cls = hf_class_for(config)
    out: dict[str, Any] = {
        "architectures": [cls],
        "model_type": MODEL_TYPES[cls],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,  # transformers 4.x; 5.x reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
        "dtype": dtype,
    }
    if cls == LLAMA:
        out["mlp_bias"] = False
        out["pretraining_tp"] = 1
    else:
        out["lambda_std_dev"] = config.lambda_std
    return out


def _num(
    hf: dict[str, Any],
    key: str,
    where: Path,
    *,
    default: Any = None,
    integer: bool = True,
    positive: bool = True,
) -> Any:
    v = hf.get(key, default)
    if v is None:
        raise InteropError(f"{where}: missing `{key}`; a Llama/DiffLlama config.json needs it")
    ok = (
        isinstance(v, int) and not isinstance(v, bool)
        if integer
        else isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    if not ok or (positive and v <= 0):
        kind = "a positive integer" if integer else "a positive number"
        raise InteropError(f"{where}: `{key}`={v!r} must be {kind}")
    return v


def hf_class_of(hf: dict[str, Any], where: Path) -> str:
    """The supported transformers class a config.json describes, or an InteropError naming it."""
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    by_type = {t: c for c, t in MODEL_TYPES.items()}
    if not archs and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    name = ", ".join(map(str, archs)) or f"model_type={hf.get('model_type')!r}"
    raise InteropError(
        f"{where}: architecture {name} is not supported; difftrain imports "
        + " and ".join(f"{c} (model_type {MODEL_TYPES[c]})" for c in SUPPORTED_ARCHITECTURES)
    )


def config_from_hf(hf: dict[str, Any], where: Path) -> tuple[ModelConfig, str]:
    """A transformers config.json (as a dict) → (ModelConfig, transformers class).

    Refuses (InteropError naming the key) what difftrain's model cannot compute exactly: biases,
    activations other than SiLU, RoPE scaling, odd head counts for DiffLlama.
    """
    cls = hf_class_of(hf, where)
    D = _num(hf, "hidden_size", where)
    L = _num(hf, "num_hidden_layers", where)
    H = _num(hf, "num_attention_heads", where)
    V = _num(hf, "vocab_size", where)
    F = _num(hf, "intermediate_size", where)
    Hk = _num(hf, "num_key_value_heads", where, default=H)
    d = hf.get("head_dim")
    if d is None:
        if D % H:
            raise InteropError(
                f"{where}: hidden_size={D} is not divisible by num_attention_heads={H}; set `head_dim` explicitly"
            )
        d = D // H
    d = _num({"head_dim": d}, "head_dim", where)
    if H % Hk:
        raise InteropError(
            f"{where}: num_attention_heads={H} is not a multiple of num_key_value_heads={Hk}; fix one of them"
        )
    if d % 2:
        raise InteropError(f"{where}: head_dim={d} must be even (RoPE rotates pairs of features)")
    if cls == DIFFLLAMA and (H % 2 or Hk % 2):
        raise InteropError(
            f"{where}: DiffLlama needs even num_attention_heads and num_key_value_heads "
            f"(got {H} and {Hk}): differential heads pair them"
        )
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise InteropError(f"{where}: hidden_act={act!r} is not supported; difftrain's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise InteropError(
                f"{where}: {key}=true is not supported; difftrain's projections have no biases"
            )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise InteropError(f"{where}: rope_parameters must be a mapping, got {rope!r}")
    if (
        "rope_type" not in rope
        and "type" not in rope
        and rope
        and all(isinstance(v, dict) for v in rope.values())
    ):
        raise InteropError(f"{where}: per-layer-type rope_parameters are not supported")
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type != "default":
        raise InteropError(
            f"{where}: RoPE scaling rope_type={rope_type!r} is not supported; difftrain implements plain RoPE "
            "(rope_type 'default')"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("partial_rotary_factor", 1.0) != 1.0 or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise InteropError(
            f"{where}: partial_rotary_factor is not supported; difftrain rotates the whole head"
        )
    init_std = hf.get("initializer_range") or 0.02
    lam_std = hf.get("lambda_std_dev")
    fields: dict[str, Any] = {
        "arch": SUPPORTED_ARCHITECTURES[cls],
        "vocab_size": V,
        "d_model": D,
        "n_layers": L,
        "n_heads": H,
        "n_kv_heads": Hk,
        "head_dim": d,
        "ffn_hidden": F,
        "max_seq_len": _num(hf, "max_position_embeddings", where, default=2048),
        "rope_theta": _num({"rope_theta": theta}, "rope_theta", where, integer=False),
        "norm_eps": _num(hf, "rms_norm_eps", where, default=1e-6 if cls == LLAMA else 1e-5, integer=False),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": init_std if init_std > 0 else 0.02,
    }
    if cls == DIFFLLAMA and lam_std is not None:
        fields["lambda_std"] = lam_std
    try:
        return ModelConfig.from_dict(fields, where=str(where)), cls
    except DifftrainError as e:
        raise InteropError(f"{e} (converted from the transformers config)") from e


# --------------------------------------------------------------------------------------------
# tokenizer files


def jinja_chat_template(chat: Any) -> str:
    """A chat template (finetune.chat_template) as the Jinja template transformers'
    `apply_chat_template` renders: each message as roles[role] with its content, in order, then the
    assistant's header with add_generation_prompt — the text `difftrain chat` gives the model. The
    formats' text goes in as string literals, which neither Jinja's delimiters nor the
    trim_blocks transformers sets can change."""

    def literal(text: str) -> str:
        return "{{ " + json.dumps(text, ensure_ascii=False) + " }}" if text else ""

    branches = []
    for i, (role, fmt) in enumerate(chat.roles.items()):
        head, tail = fmt.split("{content}")
        branches.append(
            f"{{% {'if' if i == 0 else 'elif'} message['role'] == {json.dumps(role)} %}}"
            f"{literal(head)}{{{{ message['content'] }}}}{literal(tail)}"
        )
    unknown = "{% else %}{{ raise_exception('the chat template has no role ' + message['role']) }}{% endif %}"
    reply_head = chat.roles["assistant"].split("{content}")[0]
    return (
        "{% for message in messages %}"
        + "".join(branches)
        + unknown
        + "{% endfor %}{% if add_generation_prompt %}"
        + literal(reply_head)
        + "{% endif %}"
    )


def chat_end_token_id(chat: Any, tok: Any) -> int | None:
    """The token that ends an assistant turn of a chat template (the stripped text after its
    {content}, as `difftrain chat` stops at it), where that is one token; else None."""
    tail = str(chat.roles.get("assistant", "")).split("{content}")[-1].strip()
    return tok.token_to_id(tail) if tail else None


def run_chat_template(run_path: Path, settings: Any) -> Any:
    """The chat template (a ChatTemplateConfig) of a run fine-tuned on `messages` records, as its
    summary.json and its prompt `settings` (`rundir.prompt_settings`) record them; None for any
    other run."""
    from difftrain.recipe import ChatTemplateConfig
    from difftrain.rundir import record_kinds

    if not settings.instruction or "messages" not in (record_kinds(run_path) or []):
        return None
    return settings.chat if settings.chat is not None else ChatTemplateConfig()


def hf_tokenizer_files(tokenizer: Any, model_max_length: int, chat: Any = None) -> dict[str, str]:
    """tokenizer_config.json and special_tokens_map.json for `PreTrainedTokenizerFast` (the
    tokenizer.json itself is copied verbatim). No post-processor: like difftrain's own `encode`,
    `tokenizer(text)` adds no special tokens (pretraining separates documents with eos only).
    `chat`: a chat fine-tune's template, written as `chat_template` (`jinja_chat_template`)."""
    special = {
        "bos_token": tokenizer.id_to_token(tokenizer.bos_id),
        "eos_token": tokenizer.id_to_token(tokenizer.eos_id),
        "pad_token": tokenizer.id_to_token(tokenizer.pad_id),
    }
    extra = sorted(
        (t for t in tokenizer.special_tokens if t not in special.values()), key=tokenizer.special_tokens.get
    )
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": extra,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if chat is not None:
        cfg["chat_template"] = jinja_chat_template(chat)
    return {
        "tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(
            {**special, "additional_special_tokens": extra}, indent=2, ensure_ascii=False
        )
        + "\n",
    }


# --------------------------------------------------------------------------------------------
# reading checkpoints


def _load_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise InteropError(f"{path} is damaged or not a safetensors file ({e}); download it again") from e


def read_hf_weights(hf_dir: Path) -> tuple[dict[str, Tensor], list[Path]]:
    """All tensors of a transformers checkpoint folder: model.safetensors, or the shards listed in
    model.safetensors.index.json — in that order, as transformers' from_pretrained looks for them.
    Pickle files (pytorch_model.bin) are refused."""
    index, single = hf_dir / HF_INDEX, hf_dir / WEIGHTS
    if single.is_file():
        return _load_safetensors(single)[0], [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InteropError(f"{index} is not a valid safetensors index ({e}); download it again") from e
        tensors: dict[str, Tensor] = {}
        files = []
        for name in dict.fromkeys(weight_map.values()):
            shard = hf_dir / str(name)
            if Path(str(name)).is_absolute() or ".." in Path(str(name)).parts:
                raise InteropError(f"{index} lists shard {name!r} outside {hf_dir}")
            if not shard.is_file():
                raise InteropError(
                    f"{index} lists shard {name} but {shard} does not exist; the download is incomplete"
                )
            part, _ = _load_safetensors(shard)
            tensors.update(part)
            files.append(shard)
        absent = [k for k in weight_map if k not in tensors]
        if absent:
            raise InteropError(
                f"{index} maps {absent[0]} to {weight_map[absent[0]]} but that shard does not hold it"
            )
        return tensors, files
    pickles = [
        p.name for p in (hf_dir / "pytorch_model.bin", hf_dir / "pytorch_model.bin.index.json") if p.exists()
    ]
    if pickles:
        raise InteropError(
            f"{hf_dir} has only {pickles[0]} (a pickle); difftrain reads safetensors only. Convert it with "
            '`python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{hf_dir}').save_pretrained('{hf_dir}')\"`"
        )
    raise InteropError(
        f"{hf_dir} has no {WEIGHTS} and no {HF_INDEX}; is it a transformers checkpoint folder?"
    )


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InteropError(
            f"{path.parent} has no {path.name}; it is not a transformers {what} folder"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InteropError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise InteropError(f"{path}, line {e.lineno}: invalid JSON: {json_error_reason(e)}") from e
    if not isinstance(data, dict):
        raise InteropError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _prepare_out_dir(path: Path, overwrite: bool, flag: str, what: str, *, keep_runs: str) -> None:
    """`keep_runs`: "any" refuses --overwrite into any difftrain run directory (an export would
    replace its config.json and weights), "trained" only into one that training wrote (checkpoints,
    metrics, an adapter); an earlier import may be imported over."""
    if path.exists() and not path.is_dir():
        raise InteropError(f"{path} is a file; choose a folder for the {what}")
    if path.is_dir() and any(path.iterdir()):
        # a run is refused first, with or without the flag: suggesting it there would only lead
        # to this refusal
        trained = [n for n in (CHECKPOINTS, METRICS, ADAPTER_CONFIG) if (path / n).exists()]
        if trained or (keep_runs == "any" and (path / RECIPE).is_file()):
            raise InteropError(
                f"{path} holds a difftrain run ({(trained or [RECIPE])[0]}); {flag} writes into a folder but never "
                "over a run: choose a new folder, or remove that run first"
            )
        if not overwrite:
            raise InteropError(
                f"{path} exists and is not empty; choose a new folder or pass {flag} to write into it"
            )
    path.mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------------------------
# export


def export_hf(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    overwrite: bool = False,
) -> ExportResult:
    """Write a run directory as a transformers checkpoint folder that
    `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
    load offline: config.json, model.safetensors, generation_config.json, tokenizer.json,
    tokenizer_config.json, special_tokens_map.json, README.md, and difftrain.safetensors (exact
    round trips, see the module doc). `dtype`: float32 (exact), bfloat16 or float16."""
    from difftrain.rundir import load_run, weights_state_dict

    run_path, out = Path(run_dir), Path(out_dir)
    check_export_paths(run_path, out, dtype)
    run = load_run(run_path)  # checks the folder and its weights; a LoRA run: base + adapter, merged
    config: ModelConfig = run.config  # type: ignore[assignment]
    tok = run.tokenizer
    ours = {k: t.detach().float().clone() for k, t in weights_state_dict(run.model).items()}
    hf_sd = to_hf_state_dict(ours, config, DTYPES[dtype])  # raises for diff2 before anything is written
    cls = HF_CLASS_OF_ARCH[config.arch]
    _prepare_out_dir(out, overwrite, "--overwrite", "export", keep_runs="any")

    # Tensors whose conversion does not invert bit for bit are kept in the sidecar (fp32 only:
    # a bf16/fp16 export is rounded anyway).
    exact: dict[str, Tensor] = {}
    notes: list[str] = []
    if (run_path / ADAPTER_CONFIG).is_file():
        notes.append(
            "a LoRA run: exported as its base with the adapter merged in (as `difftrain merge` makes it)"
        )
    if dtype == "float32":
        back = from_hf_state_dict(hf_sd, config)
        exact = {k: t for k, t in ours.items() if k in back and not torch.equal(back[k], t)}
    if config.arch == "diff":
        notes.append("q/k/v rows permuted to DiffLlama's head order; subln weight folded into o_proj columns")
        if value_scale(config) != 1.0:
            notes.append(
                f"V scaled by √(norm_eps/1e-5) = {value_scale(config):.6g} (DiffLlama's groupnorm uses rms_norm_eps)"
            )
    if exact:
        notes.append(f"{len(exact)} exact difftrain tensors kept in {SIDECAR} for bit-identical re-import")

    stale = _stale_shards(out)
    if stale:
        notes.append(
            f"removed {len(stale)} files of the folder's earlier sharded weights ({HF_INDEX} and its shards), "
            "which would shadow this export's for a reader that looks for shards first"
        )
    stale_tokenizer = [out / n for n in STALE_TOKENIZER_FILES if (out / n).is_file()]
    stale_tokenizer += [
        out / n for n in STALE_TOKENIZER_FOLDERS if (out / n).is_dir() and not (out / n).is_symlink()
    ]
    if stale_tokenizer:
        notes.append(
            f"removed the folder's earlier {', '.join(p.name for p in stale_tokenizer)}, which transformers "
            "would read instead of (or on top of) this export's tokenizer"
        )
        stale += stale_tokenizer
    bos, eos, pad = tok.bos_id, tok.eos_id, tok.pad_id
    # everything the export writes is made before the first write (a failure leaves the folder as it was)
    from difftrain.rundir import prompt_settings

    style = prompt_settings(run_path)
    chat = run_chat_template(run_path, style)
    tokenizer_files = hf_tokenizer_files(tok, config.max_seq_len, chat)
    if chat is not None:
        notes.append(
            "a chat fine-tune: its chat template is written as tokenizer_config.json's chat_template"
        )
    own_start = tok.document_start_id != tok.eos_id  # an imported tokenizer that puts its bos first
    card = _model_card(
        config,
        cls,
        run_path,
        out,
        own_start=own_start,
        chat=chat is not None,
        prompt_format=style.prompt_format if style.instruction else None,
        start_token="tok.bos_token_id" if tok.document_start_id == bos else str(tok.document_start_id),
    )
    atomic_save_safetensors(out / WEIGHTS, hf_sd, metadata={"format": "pt"})
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    atomic_save_safetensors(
        out / SIDECAR,
        exact,
        metadata={
            "format": "pt",
            "producer": "difftrain",
            "difftrain_config": json.dumps(config.model_dump(mode="json")),
            "about": "difftrain's exact tensors for `difftrain import` (transformers ignores this file)",
        },
    )
    atomic_write_bytes(
        out / TOKENIZER, tok.to_str().encode("utf-8") if tok.path is None else Path(tok.path).read_bytes()
    )
    for name, text in tokenizer_files.items():
        atomic_write_text(out / name, text)
    # a chat fine-tune's reply ends at its template's end of turn (<|end|>), where `difftrain chat`
    # stops: transformers' generate stops there too when it is one of the eos ids
    end_id = chat_end_token_id(chat, tok) if chat is not None else None
    stop_ids: int | list[int] = eos if end_id is None or end_id == eos else [eos, end_id]
    atomic_write_json(
        out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": stop_ids, "pad_token_id": pad}
    )
    atomic_write_text(out / "README.md", card)
    atomic_write_json(out / CONFIG, hf_config_dict(config, bos_id=bos, eos_id=eos, pad_id=pad, dtype=dtype))
    # what this export wrote (an --overwrite keeps other files of the folder; they are not listed)
    files = sorted(
        {WEIGHTS, SIDECAR, TOKENIZER, *tokenizer_files, "generation_config.json", "README.md", CONFIG}
    )
    n = sum(t.numel() for t in ours.values())  # the model's count, as pretrain and import print it
    return ExportResult(out, cls, config.arch, dtype, files, n, notes)


STALE_TOKENIZER_FILES = (
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""Tokenizer files an export does not write that transformers reads when a folder has them: a
chat template file wins over tokenizer_config.json's chat_template (an export of a plain run over
a chat model's folder would still chat), added_tokens.json adds tokens, and the slow tokenizers'
files (tokenizer.model, vocab.json + merges.txt) are what a slow or sentencepiece tokenizer
loads. An --overwrite export removes them, as it removes earlier shards."""

STALE_TOKENIZER_FOLDERS = ("additional_chat_templates",)
"""Folders of the same kind: transformers reads the named chat templates in
additional_chat_templates/ (and, with no default among them, refuses to render a chat)."""

SHARD_NAME = re.compile(r"model-\d+-of-\d+\.safetensors")
"""How transformers names the shards of a sharded checkpoint (model-00001-of-00003.safetensors)."""


def _stale_shards(out: Path) -> list[Path]:
    """In a folder an --overwrite export writes into: an earlier sharded checkpoint's index and the
    shards it lists (inside the folder), which this export's model.safetensors replaces. Where the
    index cannot be read, its shards are the files named as transformers names shards."""
    index = out / HF_INDEX
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = {str(n) for n in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a damaged index
        names = {p.name for p in out.iterdir() if SHARD_NAME.fullmatch(p.name)}
    shards = [out / n for n in sorted(names) if Path(n).name == n and n != WEIGHTS and (out / n).is_file()]
    return [index, *shards]


def _model_card(
    config: ModelConfig,
    cls: str,
    run_path: Path,
    out: Path,
    *,
    own_start: bool = False,
    chat: bool = False,
    prompt_format: str | None = None,
    start_token: str = "tok.bos_token_id",
) -> str:
    """The exported README.md, whose snippets give the model the tokens `difftrain generate` and
    `difftrain chat` give it (the same greedy tokens). `own_start`: the tokenizer's post-processor
    puts the start token (`start_token`, as the snippet writes it) before a text itself (an
    imported Llama's <s>), which a document and a fine-tuning example both start with; else a
    document starts after eos and a fine-tuning example with its own text. `prompt_format`: an
    instruction fine-tune's finetune.prompt_format, which the plain snippet's prompt is written
    in. `chat`: a chat fine-tune, whose template the tokenizer carries (and `apply_chat_template`
    adds no start token to)."""
    import collections

    first = ", 1:"  # the snippet prints the text after the start token (eos, or the tokenizer's own)
    if prompt_format is None:
        text = "def fibonacci(n):"
        start = (
            ""
            if own_start
            else "ids = torch.cat([torch.tensor([[tok.eos_token_id]]), ids], dim=1)  # a document starts after eos\n"
        )
        about = (
            "The tokenizer puts its start token before a text, as the model was trained; `difftrain generate` "
            "samples with the same prompt tokens (the same greedy tokens). "
            if own_start
            else "The tokenizer adds no special tokens; documents were separated by the eos token in training, "
            "so a prompt starts after one, as `difftrain generate` samples it (the same greedy tokens). "
        )
    else:  # an instruction fine-tune: its examples start with the prompt in its format
        try:  # a record's other fields shown as ...; a format that needs more ({meta[lang]}, {id:03d}) as it is
            text = prompt_format.format_map(
                collections.defaultdict(lambda: "...", prompt="def fibonacci(n):")
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            text = prompt_format
        start = ""
        first = ", 1:" if own_start else ""  # no start token before its prompt: all of it is text
        about = (
            "Fine-tuned on instruction records: the prompt is written in the run's finetune.prompt_format "
            f"({prompt_format!r}) and starts as its examples did, as `difftrain generate` samples it (the same "
            "greedy tokens). "
        )
    kind = {
        "baseline": "A Llama-style Transformer",
        "diff": "A Differential Transformer (Ye et al., ICLR 2025)",
    }[config.arch]
    return (
        f"---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [difftrain, {MODEL_TYPES[cls]}]\n---\n\n"
        f"# {run_path.name}\n\n{kind} trained with difftrain and exported as `{cls}`: "
        f"d_model {config.d_model}, {config.n_layers} layer{'s' * (config.n_layers != 1)}, {config.n_heads} heads "
        f"({config.n_kv_heads} key/value heads), head_dim {config.head_dim}, vocabulary {config.vocab_size}, "
        f"context {config.max_seq_len}.\n\n"
        "```python\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f'tok = AutoTokenizer.from_pretrained("{out}")\n'
        f'model = AutoModelForCausalLM.from_pretrained("{out}")\n'
        f'ids = tok({text!r}, return_tensors="pt").input_ids\n'
        + start
        + f"print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0{first}]))\n```\n\n"
        + about
        + f"`{SIDECAR}` holds difftrain's exact tensors for `difftrain import` and is ignored by transformers.\n"
        + (
            "\nFine-tuned on chat records: the template is in tokenizer_config.json, and "
            "generation_config.json ends a reply at the template's end of turn, as `difftrain chat` does:\n\n"
            "```python\n"
            'messages = [{"role": "user", "content": "Hello!"}]\n'
            "ids = tok.apply_chat_template(\n"
            '    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True\n'
            ").input_ids\n"
            + (
                f"ids = torch.cat([torch.tensor([[{start_token}]]), ids], dim=1)  # as the examples started\n"
                if own_start
                else ""
            )
            + f"out = model.generate(ids, max_new_tokens={min(128, config.max_seq_len // 2)}, do_sample=False)\n"
            "print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))\n```\n"
            if chat
            else ""
        )
    )


# --------------------------------------------------------------------------------------------
# import


def _restore_sidecar(
    hf_dir: Path, hf: dict[str, Tensor], sd: dict[str, Tensor], config: ModelConfig
) -> tuple[ModelConfig, dict[str, Tensor], bool, list[str]]:
    """Use difftrain.safetensors when it belongs to these exact weights (see the module doc)."""
    path = hf_dir / SIDECAR
    if not path.is_file():
        return config, sd, False, []
    tensors, meta = _load_safetensors(path)
    try:
        saved = ModelConfig.from_dict(json.loads(meta["difftrain_config"]))
    except (KeyError, ValueError, DifftrainError):
        return config, sd, False, [f"{SIDECAR} ignored: it has no valid difftrain config"]
    # fields config.json does not carry may differ; everything else must agree
    free = {"attn_impl"} | ({"lambda_std"} if config.arch == "baseline" else set())
    if {k: v for k, v in saved.model_dump().items() if k not in free} != {
        k: v for k, v in config.model_dump().items() if k not in free
    }:
        return config, sd, False, [f"{SIDECAR} ignored: config.json was changed after the export"]
    if not tensors:  # the conversion was exact (or the export was rounded to bf16/fp16)
        return saved, sd, False, [f"restored difftrain's config from {SIDECAR}"]
    cand = dict(sd)
    for k, t in tensors.items():
        if k not in cand or cand[k].shape != t.shape:
            return config, sd, False, [f"{SIDECAR} ignored: it does not match the weights"]
        cand[k] = t.float()
    again = to_hf_state_dict(cand, saved)
    if any(not torch.equal(again[k].to(hf[k].dtype), hf[k]) for k in again):
        return config, sd, False, [f"{SIDECAR} ignored: model.safetensors was changed after the export"]
    return saved, cand, True, [f"restored difftrain's exact config and {len(tensors)} tensors from {SIDECAR}"]


def _json_or_empty(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _tokenizer_notes(src: Path, tok: Any) -> list[str]:
    """What of the checkpoint's tokenizer settings the run does not keep: its chat template
    (difftrain's chat and fine-tunes use finetune.chat_template) and an end-of-text token it
    declares that is not the one difftrain finds by name (documents and replies end at that)."""
    notes = []
    cfg = _json_or_empty(src / "tokenizer_config.json")
    if cfg.get("chat_template") or any(
        (src / n).is_file() for n in ("chat_template.jinja", "chat_template.json")
    ):
        notes.append(
            "the checkpoint's chat template is not imported: `difftrain chat` and fine-tunes render chats with "
            "finetune.chat_template (a fine-tune on chat records writes it into the run)"
        )
    declared: dict[int, str] = {}  # id → where it is declared as eos (or as a stop token)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = cfg if name == "tokenizer_config.json" else _json_or_empty(src / name)
        token = data.get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        i = tok.token_to_id(token) if isinstance(token, str) and token else None
        if i is not None:
            declared.setdefault(i, name)
    for name in ("generation_config.json", CONFIG):
        ids = _json_or_empty(src / name).get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.vocab_size:
                declared.setdefault(i, name)
    others = {i: where for i, where in declared.items() if i != tok.eos_id}
    if others:
        listed = ", ".join(f"{tok.id_to_token(i)} (id {i}, {where})" for i, where in sorted(others.items()))
        notes.append(
            f"the checkpoint declares {listed} as an end of text; difftrain ends documents and generations at "
            f"{tok.id_to_token(tok.eos_id)} (id {tok.eos_id}), the end-of-text token it finds by name, and an "
            "export declares that one"
        )
    return notes


def import_hf(
    hf_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> ImportResult:
    """Turn a transformers Llama / DiffLlama checkpoint folder (config.json, safetensors, sharded
    or not, tokenizer.json) into a run directory: config.json, model.safetensors (fp32),
    tokenizer.json and a recipe.yaml to fine-tune or continue pretraining from."""
    from difftrain.data.tokenizer import load_tokenizer
    from difftrain.recipe import recipe_from_dict

    src, dst = Path(hf_dir), Path(run_dir)
    check_import_paths(src, dst)
    hf_cfg = _read_json(src / CONFIG, "checkpoint")
    config, cls = config_from_hf(hf_cfg, src / CONFIG)
    tok_path = src / TOKENIZER
    if not tok_path.is_file():
        raise InteropError(
            f'{src} has no {TOKENIZER}; write one with `python -c "from transformers import AutoTokenizer; '
            f"AutoTokenizer.from_pretrained('{src}').save_pretrained('{src}')\"` and import again"
        )
    try:
        tok = load_tokenizer(
            tok_path,
            fix='write it again with `python -c "from transformers import AutoTokenizer; '
            f"AutoTokenizer.from_pretrained('{src}').save_pretrained('{src}')\"`, or download it again",
        )
    except DifftrainError as e:
        raise InteropError(f"cannot import the tokenizer of {src}: {e}") from e
    assert isinstance(config.vocab_size, int)
    if tok.vocab_size > config.vocab_size:
        raise InteropError(
            f"{tok_path} has {tok.vocab_size} tokens but {src / CONFIG} says vocab_size={config.vocab_size}; "
            "the tokenizer belongs to another model"
        )
    hf, _ = read_hf_weights(src)
    if not hf:
        raise InteropError(f"{src}: the weights file holds no tensors")
    check_hf_tensors(hf, config, src)
    hf = {k: t for k, t in hf.items() if not k.endswith(_IGNORED_SUFFIXES)}
    sd = from_hf_state_dict(hf, config, str(src / CONFIG))
    notes: list[str] = _tokenizer_notes(src, tok)
    src_dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in hf.values()})
    if src_dtypes != ["float32"]:
        notes.append(f"converted {', '.join(src_dtypes)} weights to float32")
    config, sd, exact, more = _restore_sidecar(src, hf, sd, config)
    notes += more
    if (
        config.arch == "diff"
        and not exact
        and not any(k.endswith((".subln.weight", ".groupnorm.weight")) for k in hf)
    ):
        notes.append("the checkpoint has no subln weights (DiffLlama's groupnorm has none): set to ones")

    _prepare_out_dir(dst, overwrite, "--overwrite", "run directory", keep_runs="trained")
    origin = src.resolve()  # recorded absolute: it names the checkpoint from any folder
    meta = {"format": "pt", "producer": "difftrain", "imported_from": str(origin), "hf_class": cls}
    atomic_save_safetensors(dst / WEIGHTS, sd, metadata=meta)
    atomic_write_bytes(dst / TOKENIZER, tok_path.read_bytes())
    config.to_json(dst / CONFIG)
    recipe = recipe_from_dict(
        {
            "name": dst.resolve().name,
            "description": f"{cls} imported from {origin} with `difftrain import`",
            "out_dir": str(dst.resolve().parent),
            "model": config.model_dump(mode="json"),
            "tokenizer": {"path": TOKENIZER},
            "data": {},
            "train": {"max_steps": 1000},
        }
    )
    header = (
        f"# Recipe of a model imported from {origin} ({cls}) by `difftrain import`.\n"
        f"# The weights are in this folder; fine-tune from it with `finetune.base: {dst.resolve()}`.\n"
    )
    atomic_write_text(dst / RECIPE, header + recipe.to_yaml())
    files = sorted((WEIGHTS, TOKENIZER, CONFIG, RECIPE))  # what this import wrote
    n = sum(t.numel() for t in sd.values())
    return ImportResult(dst, cls, config, files, n, exact, notes)
