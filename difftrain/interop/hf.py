"""Export runs to Hugging Face transformers (Llama, DiffLlama) and import them back, exactly.

Neither direction needs transformers (`difftrain.interop.convert` holds the layout conversion).
Folding subln into o_proj (and scaling V) rounds, so an export also writes `difftrain.safetensors`
(ignored by transformers): the run's ModelConfig and the original value of every tensor whose
conversion does not invert exactly. Import uses it only when re-exporting the restored tensors
reproduces model.safetensors bit for bit; otherwise it imports the transformers weights as they are.
"""

from __future__ import annotations

import collections
import json
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
from difftrain.interop.convert import (
    _IGNORED_SUFFIXES,
    HF_CLASS_OF_ARCH,
    MODEL_TYPES,
    chat_end_token_id,
    check_hf_tensors,
    config_from_hf,
    from_hf_state_dict,
    hf_config_dict,
    hf_tokenizer_files,
    json_text,
    run_chat_template,
    to_hf_state_dict,
    value_scale,
)
from difftrain.interop.paths import EXPORT_DTYPES, check_export_paths, check_import_paths
from difftrain.io import atomic_save_safetensors, atomic_write_bytes, atomic_write_text, json_error_reason
from difftrain.model.config import ModelConfig
from difftrain.rundir import CHECKPOINTS, CONFIG, METRICS, RECIPE, TOKENIZER, WEIGHTS

SIDECAR = "difftrain.safetensors"
"""Exact difftrain tensors and config kept next to an export (transformers ignores the file)."""
HF_INDEX = "model.safetensors.index.json"
DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPES}


@dataclass
class ExportResult:
    out_dir: Path
    hf_class: str
    arch: str
    dtype: str
    files: list[str]
    num_params: int
    notes: list[str] = field(default_factory=list)


@dataclass
class ImportResult:
    run_dir: Path
    hf_class: str
    config: ModelConfig
    files: list[str]
    num_params: int
    exact_sidecar: bool
    """True when difftrain.safetensors restored the original difftrain tensors bit for bit."""
    notes: list[str] = field(default_factory=list)


def _load_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise InteropError(f"{path} is damaged or not a safetensors file ({e}); download it again") from e


def _weight_map(index: Path) -> dict[str, str]:
    """tensor name → shard file, from a model.safetensors.index.json."""
    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    if not isinstance(weight_map, dict):
        raise TypeError("weight_map is not a mapping")
    return weight_map


def read_hf_weights(hf_dir: Path) -> dict[str, Tensor]:
    """All tensors of a transformers checkpoint folder: model.safetensors, or the shards listed in
    model.safetensors.index.json (as from_pretrained looks for them). Pickles are refused."""
    index, single = hf_dir / HF_INDEX, hf_dir / WEIGHTS
    if single.is_file():
        return _load_safetensors(single)[0]
    if index.is_file():
        try:
            weight_map = _weight_map(index)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InteropError(f"{index} is not a valid safetensors index ({e}); download it again") from e
        tensors: dict[str, Tensor] = {}
        for name in dict.fromkeys(map(str, weight_map.values())):
            shard = hf_dir / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise InteropError(f"{index} lists shard {name!r} outside {hf_dir}")
            if not shard.is_file():
                raise InteropError(
                    f"{index} lists shard {name} but {shard} does not exist; the download is incomplete"
                )
            tensors.update(_load_safetensors(shard)[0])
        if absent := [k for k in weight_map if k not in tensors]:
            raise InteropError(
                f"{index} maps {absent[0]} to {weight_map[absent[0]]} but that shard does not hold it"
            )
        return tensors
    if pickles := [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (hf_dir / n).exists()]:
        raise InteropError(
            f"{hf_dir} has only {pickles[0]} (a pickle); difftrain reads safetensors only. Convert it with "
            '`python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{hf_dir}').save_pretrained('{hf_dir}')\"`"
        )
    raise InteropError(
        f"{hf_dir} has no {WEIGHTS} and no {HF_INDEX}; is it a transformers checkpoint folder?"
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InteropError(
            f"{path.parent} has no {path.name}; it is not a transformers checkpoint folder"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InteropError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise InteropError(f"{path}, line {e.lineno}: invalid JSON: {json_error_reason(e)}") from e
    if not isinstance(data, dict):
        raise InteropError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _prepare_out_dir(path: Path, overwrite: bool, what: str, *, any_run: bool) -> None:
    """Create the folder to write. Never over a run that training wrote (checkpoints, metrics, an
    adapter), nor with `any_run` over any run directory (an earlier import may be imported over)."""
    if path.exists() and not path.is_dir():
        raise InteropError(f"{path} is a file; choose a folder for the {what}")
    if path.is_dir() and any(path.iterdir()):
        # a run is refused with or without --overwrite: suggesting the flag would only lead here
        trained = [n for n in (CHECKPOINTS, METRICS, ADAPTER_CONFIG) if (path / n).exists()]
        if trained or (any_run and (path / RECIPE).is_file()):
            raise InteropError(
                f"{path} holds a difftrain run ({(trained or [RECIPE])[0]}); --overwrite writes into a folder but "
                "never over a run: choose a new folder, or remove that run first"
            )
        if not overwrite:
            raise InteropError(
                f"{path} exists and is not empty; choose a new folder or pass --overwrite to write into it"
            )
    path.mkdir(parents=True, exist_ok=True)


def export_hf(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    overwrite: bool = False,
) -> ExportResult:
    """Write a run directory as a transformers checkpoint folder that `AutoModelForCausalLM` and
    `AutoTokenizer.from_pretrained(out_dir)` load offline: config.json, model.safetensors,
    generation_config.json, the tokenizer files, README.md and difftrain.safetensors (the module
    doc). `dtype`: float32 (exact), bfloat16 or float16."""
    from difftrain.rundir import load_run, prompt_settings, weights_state_dict

    run_path, out = Path(run_dir), Path(out_dir)
    check_export_paths(run_path, out, dtype)
    run = load_run(run_path)  # checks the folder and its weights; a LoRA run: base + adapter, merged
    config: ModelConfig = run.config  # type: ignore[assignment]
    tok = run.tokenizer
    ours = {k: t.detach().float().clone() for k, t in weights_state_dict(run.model).items()}
    hf_sd = to_hf_state_dict(ours, config, DTYPES[dtype])  # raises for diff2 before anything is written
    cls = HF_CLASS_OF_ARCH[config.arch]
    _prepare_out_dir(out, overwrite, "export", any_run=True)

    notes: list[str] = []
    if (run_path / ADAPTER_CONFIG).is_file():
        notes.append("a LoRA run: exported as its base with the adapter merged in (as `difftrain merge`)")
    if config.arch == "diff":
        notes.append("q/k/v rows permuted to DiffLlama's head order; subln weight folded into o_proj columns")
        if value_scale(config) != 1.0:
            notes.append(
                f"V scaled by √(norm_eps/1e-5) = {value_scale(config):.6g} (DiffLlama's groupnorm uses rms_norm_eps)"
            )
    # the tensors whose conversion does not invert bit for bit (fp32 only: bf16/fp16 rounds anyway)
    exact: dict[str, Tensor] = {}
    if dtype == "float32":
        back = from_hf_state_dict(hf_sd, config)
        exact = {k: t for k, t in ours.items() if k in back and not torch.equal(back[k], t)}
    if exact:
        notes.append(f"{len(exact)} exact difftrain tensors kept in {SIDECAR} for bit-identical re-import")
    if stale := _stale_shards(out):
        notes.append(
            f"removed {len(stale)} files of the folder's earlier sharded weights ({HF_INDEX} and its shards), "
            "which would shadow this export's for a reader that looks for shards first"
        )
    stale_tokenizer = [p for n in STALE_TOKENIZER_FILES if (p := out / n).is_file()]
    stale_tokenizer += [p for n in STALE_TOKENIZER_FOLDERS if (p := out / n).is_dir() and not p.is_symlink()]
    if stale_tokenizer:
        notes.append(
            f"removed the folder's earlier {', '.join(p.name for p in stale_tokenizer)}, which transformers "
            "would read instead of (or on top of) this export's tokenizer"
        )
    # everything the export writes is made before the first write (a failure leaves the folder as it was)
    style = prompt_settings(run_path)
    chat = run_chat_template(run_path, style)
    tokenizer_files = hf_tokenizer_files(tok, config.max_seq_len, chat)
    if chat is not None:
        notes.append("a chat fine-tune: its chat template is written into tokenizer_config.json")
    card = _model_card(
        config, cls, run_path, out, tok, style.prompt_format if style.instruction else None, chat is not None
    )
    bos, eos, pad = tok.bos_id, tok.eos_id, tok.pad_id
    # a chat reply ends at its template's end of turn, where `difftrain chat` stops: so does
    # transformers' generate when that token is one of the eos ids
    end_id = chat_end_token_id(chat, tok) if chat is not None else None
    stop_ids: int | list[int] = eos if end_id is None or end_id == eos else [eos, end_id]

    atomic_save_safetensors(out / WEIGHTS, hf_sd, metadata={"format": "pt"})
    for path in stale + stale_tokenizer:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    sidecar_meta = {
        "format": "pt",
        "producer": "difftrain",
        "difftrain_config": json.dumps(config.model_dump(mode="json")),
        "about": "difftrain's exact tensors for `difftrain import` (transformers ignores this file)",
    }
    atomic_save_safetensors(out / SIDECAR, exact, metadata=sidecar_meta)
    atomic_write_bytes(
        out / TOKENIZER, tok.to_str().encode("utf-8") if tok.path is None else Path(tok.path).read_bytes()
    )
    texts = {
        **tokenizer_files,
        "README.md": card,
        "generation_config.json": json_text(
            {"bos_token_id": bos, "eos_token_id": stop_ids, "pad_token_id": pad}
        ),
        CONFIG: json_text(hf_config_dict(config, bos_id=bos, eos_id=eos, pad_id=pad, dtype=dtype)),
    }
    for name, text in texts.items():
        atomic_write_text(out / name, text)
    files = sorted({WEIGHTS, SIDECAR, TOKENIZER, *texts})  # (an --overwrite keeps other files: not listed)
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
"""Tokenizer files an export does not write that transformers reads when a folder has them (a
chat template, added tokens, a slow tokenizer's files): an --overwrite export removes them."""
STALE_TOKENIZER_FOLDERS = ("additional_chat_templates",)  # (named chat templates)
SHARD_NAME = re.compile(r"model-\d+-of-\d+\.safetensors")  # transformers' shard names


def _stale_shards(out: Path) -> list[Path]:
    """An earlier sharded checkpoint's index and the shards it lists in `out` (or, where the index
    cannot be read, the files named as transformers names shards): model.safetensors replaces them."""
    index = out / HF_INDEX
    if not index.is_file():
        return []
    try:
        names = {str(n) for n in _weight_map(index).values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a damaged index
        names = {p.name for p in out.iterdir() if SHARD_NAME.fullmatch(p.name)}
    shards = [out / n for n in sorted(names) if Path(n).name == n and n != WEIGHTS and (out / n).is_file()]
    return [index, *shards]


def _model_card(
    config: ModelConfig, cls: str, run_path: Path, out: Path, tok: Any, prompt_format: str | None, chat: bool
) -> str:
    """The exported README.md, whose snippets give the model the tokens `difftrain generate` and
    `difftrain chat` give it. `prompt_format`: an instruction fine-tune's finetune.prompt_format;
    `chat`: a chat fine-tune, whose template the tokenizer carries."""
    own_start = tok.document_start_id != tok.eos_id  # the tokenizer puts its start token (bos) first
    text = "def fibonacci(n):"
    if prompt_format is not None:  # an instruction fine-tune: its examples start in its format
        try:  # a record's other fields shown as ...; a format that needs more ({meta[lang]}, {id:03d}) as it is
            text = prompt_format.format_map(collections.defaultdict(lambda: "...", prompt=text))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            text = prompt_format
        about = (
            "Fine-tuned on instruction records: the prompt is written in the run's finetune.prompt_format "
            f"({prompt_format!r}) and starts as its examples did, as `difftrain generate` samples it (the same "
            "greedy tokens). "
        )
    elif own_start:
        about = (
            "The tokenizer puts its start token before a text, as the model was trained; `difftrain generate` "
            "samples with the same prompt tokens (the same greedy tokens). "
        )
    else:
        about = (
            "The tokenizer adds no special tokens; documents were separated by the eos token in training, "
            "so a prompt starts after one, as `difftrain generate` samples it (the same greedy tokens). "
        )
    after_eos = (
        "ids = torch.cat([torch.tensor([[tok.eos_token_id]]), ids], dim=1)  # a document starts after eos\n"
        if prompt_format is None and not own_start
        else ""
    )
    first = ", 1:" if own_start or prompt_format is None else ""  # the text after a start token
    kind = (
        "A Differential Transformer (Ye et al., ICLR 2025)"
        if config.arch == "diff"
        else "A Llama-style Transformer"
    )
    start_token = "tok.bos_token_id" if tok.document_start_id == tok.bos_id else str(tok.document_start_id)
    chat_snippet = (
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
    )
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
        + after_eos
        + f"print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0{first}]))\n```\n\n"
        + about
        + f"`{SIDECAR}` holds difftrain's exact tensors for `difftrain import` and is ignored by transformers.\n"
        + (chat_snippet if chat else "")
    )


def _restore_sidecar(
    hf_dir: Path, hf: dict[str, Tensor], sd: dict[str, Tensor], config: ModelConfig
) -> tuple[ModelConfig, dict[str, Tensor], bool, list[str]]:
    """Use difftrain.safetensors when it belongs to these exact weights (the module doc)."""
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
    if saved.model_dump(exclude=free) != config.model_dump(exclude=free):
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
    """What of the checkpoint's tokenizer settings the run does not keep: its chat template and an
    end-of-text token it declares that is not the one difftrain finds by name."""
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
        token = _json_or_empty(src / name).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token and (i := tok.token_to_id(token)) is not None:
            declared.setdefault(i, name)
    for name in ("generation_config.json", CONFIG):
        ids = _json_or_empty(src / name).get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.vocab_size:
                declared.setdefault(i, name)
    if others := {i: where for i, where in declared.items() if i != tok.eos_id}:
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
    or not, tokenizer.json) into a run directory (weights in fp32, a recipe.yaml to start from)."""
    from difftrain.data.tokenizer import load_tokenizer
    from difftrain.recipe import recipe_from_dict

    src, dst = Path(hf_dir), Path(run_dir)
    check_import_paths(src, dst)
    config, cls = config_from_hf(_read_config(src / CONFIG), src / CONFIG)
    tok_path = src / TOKENIZER
    resave = (
        '`python -c "from transformers import AutoTokenizer; '
        f"AutoTokenizer.from_pretrained('{src}').save_pretrained('{src}')\"`"
    )
    if not tok_path.is_file():
        raise InteropError(f"{src} has no {TOKENIZER}; write one with {resave} and import again")
    try:
        tok = load_tokenizer(tok_path, fix=f"write it again with {resave}, or download it again")
    except DifftrainError as e:
        raise InteropError(f"cannot import the tokenizer of {src}: {e}") from e
    assert isinstance(config.vocab_size, int)
    if tok.vocab_size > config.vocab_size:
        raise InteropError(
            f"{tok_path} has {tok.vocab_size} tokens but {src / CONFIG} says vocab_size={config.vocab_size}; "
            "the tokenizer belongs to another model"
        )
    hf = read_hf_weights(src)
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

    _prepare_out_dir(dst, overwrite, "run directory", any_run=False)
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
    return ImportResult(dst, cls, config, files, sum(t.numel() for t in sd.values()), exact, notes)
