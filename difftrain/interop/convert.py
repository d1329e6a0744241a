"""The tensor, config and tokenizer-file layouts of difftrain's models and transformers' Llama /
DiffLlama.

    baseline  ↔  LlamaForCausalLM       same tensors, same names (RoPE is rotate-half in both)
    diff      ↔  DiffLlamaForCausalLM   same function; q/k/v rows permuted, subln folded into o_proj
    diff2     →  refused: transformers has no Differential Transformer V2 class

`diff` (H = n_heads, Hk = n_kv_heads, d = head_dim): difftrain pairs query heads 2i, 2i+1 and key
heads 2g, 2g+1 (g = ⌊i/(H/Hk)⌋) into differential head i, with the 2d value slice g; DiffLlama
pairs heads i and i + H/2, key heads g and g + Hk/2, and the value [v_g ; v_(g + Hk/2)]. So head
j of HF's q_proj is head P_H(j) of ours and head j of its k_proj/v_proj is head P_Hk(j), with

    P_n(j) = 2·(j mod n/2) + ⌊j / (n/2)⌋      (rows (n/2, 2, d, D) transposed to (2, n/2, d, D))

o_proj's columns, the λ vectors, λinit and the scale 1/√d agree unchanged. subln's learnable
weight w ∈ R^{2d} is folded into o_proj (column 2d·i + f times w_f), since HF's groupnorm has none;
where norm_eps ≠ 1e-5 (HF uses one ε for every norm), V is scaled by c = √(norm_eps/1e-5), which
makes groupnorm(c·y) with ε = norm_eps equal subln's normalisation of y with ε = 1e-5. Import
undoes both (subln = ones, unless the checkpoint carries subln or groupnorm weights).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from difftrain.errors import DifftrainError, InteropError
from difftrain.model.config import ModelConfig
from difftrain.rundir import CONFIG

LLAMA = "LlamaForCausalLM"
DIFFLLAMA = "DiffLlamaForCausalLM"
SUPPORTED_ARCHITECTURES: dict[str, str] = {LLAMA: "baseline", DIFFLLAMA: "diff"}
"""transformers class → difftrain arch (both directions)."""
MODEL_TYPES = {LLAMA: "llama", DIFFLLAMA: "diffllama"}
HF_CLASS_OF_ARCH = {arch: cls for cls, arch in SUPPORTED_ARCHITECTURES.items()}

SUBLN_EPS = 1e-5
"""ε of difftrain's per-head RMSNorm (`DiffAttention.subln`), fixed by the model."""
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


def deinterleave_heads(w: Tensor, n_heads: int) -> Tensor:
    """Rows of `n_heads` heads in difftrain's pair order → DiffLlama's: head j of the result is
    head P(j) of `w` (the module doc)."""
    rows, cols = w.shape
    return w.reshape(n_heads // 2, 2, rows // n_heads, cols).transpose(0, 1).reshape(rows, cols)


def interleave_heads(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of `deinterleave_heads`: (2, n/2, d, cols) → (n/2, 2, d, cols)."""
    rows, cols = w.shape
    return w.reshape(2, n_heads // 2, rows // n_heads, cols).transpose(0, 1).reshape(rows, cols)


def value_scale(config: ModelConfig) -> float:
    """c = √(norm_eps / 1e-5): the factor on V that turns HF's groupnorm ε into subln's 1e-5."""
    return math.sqrt(config.norm_eps / SUBLN_EPS)


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
    """difftrain tensors → the matching transformers class's (the module doc), computed in fp32 and
    cast to `dtype`. A tied lm_head is dropped (HF ties it through `tie_word_embeddings`)."""
    hf_class_for(config)
    out = {k: t for k, t in sd.items() if not (k == "lm_head.weight" and config.tie_embeddings)}
    if config.arch == "diff":
        H, Hk = config.n_heads, config.n_kv_heads
        assert Hk is not None
        c = value_scale(config)
        for i in range(config.n_layers):
            p = f"model.layers.{i}.self_attn."
            w = out.pop(p + "subln.weight").float()
            out[p + "q_proj.weight"] = deinterleave_heads(out[p + "q_proj.weight"], H)
            out[p + "k_proj.weight"] = deinterleave_heads(out[p + "k_proj.weight"], Hk)
            out[p + "v_proj.weight"] = deinterleave_heads(out[p + "v_proj.weight"].float() * c, Hk)
            out[p + "o_proj.weight"] = out[p + "o_proj.weight"].float() * w.repeat(H // 2)[None, :]
    return {k: t.detach().to(dtype).contiguous() for k, t in out.items()}


def from_hf_state_dict(hf: dict[str, Tensor], config: ModelConfig, where: str = CONFIG) -> dict[str, Tensor]:
    """Tensors of a Llama / DiffLlama checkpoint (checked by `check_hf_tensors`) → difftrain's, in
    fp32 (the inverse of `to_hf_state_dict`). `where`: the config.json its messages name."""
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
            sd[p + "v_proj.weight"] = interleave_heads(sd[p + "v_proj.weight"], Hk) / c
            w = sd.pop(p + "groupnorm.weight", None)
            w = sd.pop(p + "subln.weight", w)
            sd[p + "subln.weight"] = torch.ones(2 * d) if w is None else w
    return sd


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the transformers checkpoint of `config`: name → (shape, formula in HF's names)."""
    V, D, F, L = config.vocab_size, config.d_model, config.ffn_hidden, config.n_layers
    H, Hk, d = config.n_heads, config.n_kv_heads, config.head_dim
    assert isinstance(V, int) and F is not None and Hk is not None and d is not None
    vd, qd, kd = "vocab_size × hidden_size", "num_attention_heads·head_dim", "num_key_value_heads·head_dim"
    layer = {
        "input_layernorm.weight": ((D,), "hidden_size"),
        "post_attention_layernorm.weight": ((D,), "hidden_size"),
        "self_attn.q_proj.weight": ((H * d, D), f"{qd} × hidden_size"),
        "self_attn.k_proj.weight": ((Hk * d, D), f"{kd} × hidden_size"),
        "self_attn.v_proj.weight": ((Hk * d, D), f"{kd} × hidden_size"),
        "self_attn.o_proj.weight": ((D, H * d), f"hidden_size × {qd}"),
        "mlp.gate_proj.weight": ((F, D), "intermediate_size × hidden_size"),
        "mlp.up_proj.weight": ((F, D), "intermediate_size × hidden_size"),
        "mlp.down_proj.weight": ((D, F), "hidden_size × intermediate_size"),
    }
    if config.arch == "diff":
        layer |= {f"self_attn.lambda_{n}": ((d,), "head_dim") for n in ("q1", "k1", "q2", "k2")}
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((V, D), vd)}
    out |= {f"model.layers.{i}.{k}": v for i in range(L) for k, v in layer.items()}
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

    def first(names: list[str]) -> str:
        return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")

    if missing:
        raise InteropError(
            f"{hf_dir}: tensor {first(missing)} is missing from the weights but {cfg} implies it; "
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
        raise InteropError(
            f"{hf_dir}: unexpected tensor {first(unexpected)} for a {HF_CLASS_OF_ARCH[config.arch]} "
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


def hf_config_dict(
    config: ModelConfig, *, bos_id: int, eos_id: int, pad_id: int, dtype: str = "float32"
) -> dict[str, Any]:
    """config.json of the transformers class for `config` (readable by transformers 4.48+ and 5.x)."""
    cls = hf_class_for(config)
    return {
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
    } | ({"mlp_bias": False, "pretraining_tp": 1} if cls == LLAMA else {"lambda_std_dev": config.lambda_std})


def _num(hf: dict[str, Any], key: str, where: Path, *, default: Any = None, integer: bool = True) -> Any:
    v = hf.get(key, default)
    if v is None:
        raise InteropError(f"{where}: missing `{key}`; a Llama/DiffLlama config.json needs it")
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or v <= 0:
        raise InteropError(f"{where}: `{key}`={v!r} must be a positive {'integer' if integer else 'number'}")
    return v


def hf_class_of(hf: dict[str, Any], where: Path) -> str:
    """The supported transformers class a config.json describes, or an InteropError naming it."""
    archs = hf.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    if supported := [a for a in archs if a in SUPPORTED_ARCHITECTURES]:
        return supported[0]
    by_type = {t: c for c, t in MODEL_TYPES.items()}
    if not archs and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    name = ", ".join(map(str, archs)) or f"model_type={hf.get('model_type')!r}"
    raise InteropError(
        f"{where}: architecture {name} is not supported; difftrain imports "
        + " and ".join(f"{c} (model_type {MODEL_TYPES[c]})" for c in SUPPORTED_ARCHITECTURES)
    )


def config_from_hf(hf: dict[str, Any], where: Path) -> tuple[ModelConfig, str]:
    """A transformers config.json (as a dict) → (ModelConfig, transformers class); an InteropError
    naming the key for what difftrain's model cannot compute exactly."""
    cls = hf_class_of(hf, where)
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
    D, L, H, V, F = (_num(hf, key, where) for key in sizes)
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
    if rope and not {"rope_type", "type"} & rope.keys() and all(isinstance(v, dict) for v in rope.values()):
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
    if cls == DIFFLLAMA and hf.get("lambda_std_dev") is not None:
        fields["lambda_std"] = hf["lambda_std_dev"]
    try:
        return ModelConfig.from_dict(fields, where=str(where)), cls
    except DifftrainError as e:
        raise InteropError(f"{e} (converted from the transformers config)") from e


def jinja_chat_template(chat: Any) -> str:
    """A finetune.chat_template as the Jinja template of transformers' `apply_chat_template`,
    rendering the text `difftrain chat` gives the model. The formats' text goes in as string
    literals, which neither Jinja's delimiters nor transformers' trim_blocks can change."""

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
    """The token that ends an assistant turn (the stripped text after {content}, where `difftrain
    chat` stops), where that is one token; else None."""
    tail = str(chat.roles.get("assistant", "")).split("{content}")[-1].strip()
    return tok.token_to_id(tail) if tail else None


def run_chat_template(run_path: Path, settings: Any) -> Any:
    """The ChatTemplateConfig of a run fine-tuned on `messages` records (`settings`:
    `rundir.prompt_settings`); None for any other run."""
    from difftrain.recipe import ChatTemplateConfig
    from difftrain.rundir import record_kinds

    if not settings.instruction or "messages" not in (record_kinds(run_path) or []):
        return None
    return settings.chat if settings.chat is not None else ChatTemplateConfig()


def hf_tokenizer_files(tokenizer: Any, model_max_length: int, chat: Any = None) -> dict[str, str]:
    """tokenizer_config.json and special_tokens_map.json for `PreTrainedTokenizerFast`. Like
    difftrain's `encode`, `tokenizer(text)` adds no special tokens. `chat`: a chat fine-tune's
    template, written as `chat_template`."""
    special = {
        f"{n}_token": tokenizer.id_to_token(getattr(tokenizer, f"{n}_id")) for n in ("bos", "eos", "pad")
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
        **({"chat_template": jinja_chat_template(chat)} if chat is not None else {}),
    }
    return {
        "tokenizer_config.json": json_text(cfg),
        "special_tokens_map.json": json_text({**special, "additional_special_tokens": extra}),
    }


def json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
