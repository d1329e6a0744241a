"""The run directory (file names: `difftrain.layout`): reading and writing a run's inference
files, and loading a run, a LoRA fine-tune's adapter over its base run included (train/, infer/,
evals/ and interop/ all load runs from here). Weights are checked against the config on load:
missing, unexpected or mis-shaped tensors are a CheckpointError that says which.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftrain.errors import CheckpointError, ConfigError, RecipeError, RunDirError
from difftrain.io import RunLock, atomic_save_safetensors, sha256_file
from difftrain.layout import (  # noqa: F401 - re-exported: `from difftrain.rundir import CHECKPOINTS`
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECKPOINTS,
    CONFIG,
    METRICS,
    RECIPE,
    RUN_FILES,
    SUMMARY,
    TOKENIZER,
    WEIGHTS,
    holds_run,
    is_adapter_run,
)

if TYPE_CHECKING:  # torch loads where weights are touched: recipe checks must not wait for it
    import torch
    from torch import nn

    from difftrain.data.tokenizer import Tokenizer
    from difftrain.model import ModelConfig
    from difftrain.recipe import FinetuneConfig, Recipe

CHANGEABLE_MODEL_KEYS = {"attn_impl", "max_seq_len", "init_std", "lambda_std"}
"""The `model:` keys a fine-tune may set differently from its base run."""


def weights_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as saved: a tied lm_head is dropped (it is the embedding)."""
    sd = model.state_dict()
    head = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and emb is not None and head.weight is emb.weight:
        sd.pop("lm_head.weight", None)
    return sd


def save_weights(
    path: Path, model: torch.nn.Module | dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write model.safetensors atomically, from a model or from its saved-form state dict (e.g. the
    full weights gathered from FSDP shards)."""
    import torch

    meta = {"format": "pt", "producer": "difftrain", **(metadata or {})}
    sd = weights_state_dict(model) if isinstance(model, torch.nn.Module) else model
    atomic_save_safetensors(path, sd, metadata=meta)


@contextlib.contextmanager
def _safetensors_errors(path: Path) -> Iterator[None]:
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{path} is damaged or not a safetensors file ({e}); restore it, or rewrite it from the last "
            f"checkpoint with {resume_command(path.parent)}"
        ) from e


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with _safetensors_errors(path):
        return load_file(str(path))


def check_safetensors(path: Path) -> None:
    """The CheckpointError `read_safetensors` would raise for `path`, from its header alone."""
    from safetensors import safe_open

    with _safetensors_errors(path), safe_open(str(path), framework="pt") as f:
        f.keys()


def check_state_dict(
    sd: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: Path, against: str
) -> None:
    """Raise a CheckpointError unless `sd` has exactly the `expected` tensors with their shapes
    (`against`: the file that implies them)."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected and k != "lm_head.weight"]  # (a tied head, saved)
    if missing or unexpected:
        parts = [f"missing {len(missing)} tensors (e.g. {missing[0]})"] if missing else []
        parts += [f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})"] if unexpected else []
        raise CheckpointError(
            f"{source} does not match its {against}: {', '.join(parts)}; the two files come from different runs"
        )
    for k, t in expected.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise CheckpointError(
                f"{source}: tensor {k} has shape {tuple(sd[k].shape)} but {against} implies {tuple(t.shape)}; "
                "the two files come from different runs"
            )


@dataclass
class Run:
    """A loaded run: the model in eval mode, its config and tokenizer."""

    path: Path
    model: torch.nn.Module
    config: object
    tokenizer: object


def require_run_dir(path: Path) -> Path:
    path = Path(path)
    if not path.exists():
        guess = Path("runs") / path  # `generate quickstart` for runs/quickstart, the usual slip
        if not path.is_absolute() and guess.is_dir():
            raise RunDirError(f"no run directory {path}; did you mean {guess}? (runs live under runs/)")
        raise RunDirError(
            f"no run directory {path}; train one with `difftrain pretrain RECIPE` (or check the path)"
        )
    if not path.is_dir():
        raise RunDirError(f"{path} is a file, not a run directory")
    return path


def resolve_model(recipe: Recipe, base: Path) -> ModelConfig:
    return apply_model_keys(recipe, load_config(base), f"the base run {base}")


def apply_model_keys(recipe: Recipe, base_cfg: ModelConfig, base: str) -> ModelConfig:
    """`base_cfg` (the model of `base`, as the messages name it) with the recipe's own `model:`
    keys applied; a key that would change the architecture is a RecipeError."""
    if recipe.model is None or not recipe.model_keys:
        return base_cfg
    updates = {k: getattr(recipe.model, k) for k in recipe.model_keys}
    if updates.get("vocab_size") == "auto":
        updates.pop("vocab_size")
    for k, v in updates.items():
        if k == "vocab_size" and v > base_cfg.vocab_size and recipe._own_run_dir is not None:
            continue  # a run's own recipe.yaml: one that grew its vocabulary records the grown size
        if k not in CHANGEABLE_MODEL_KEYS and v != getattr(base_cfg, k):
            raise RecipeError(
                f"model.{k}={v} but {base} has {k}={getattr(base_cfg, k)}: a fine-tune keeps the "
                f"base's architecture (only {', '.join(sorted(CHANGEABLE_MODEL_KEYS))} may change); remove "
                f"model.{k} from the recipe"
            )
    return base_cfg.replace(**updates)


def base_run_dir(ft: FinetuneConfig) -> Path:
    """The run directory `finetune.base` names, checked to hold a config.json (before torch loads)."""
    base = Path(ft.base).expanduser()
    if not base.exists():
        from difftrain.recipe import shipped_recipes

        example = (
            f"`difftrain pretrain {base.name}` writes runs/{base.name}"
            if base.name in shipped_recipes()
            else "e.g. `difftrain pretrain quickstart` writes runs/quickstart"
        )
        raise RunDirError(
            f"finetune.base: no run directory {base}; train it first ({example}) or fix the path "
            "(relative to the current folder)"
        )
    require_run_dir(base)
    if not (base / CONFIG).is_file():
        raise RunDirError(f"finetune.base: {base} has no {CONFIG}; it is not a difftrain run directory")
    return base


def training_command(path: Path) -> str:
    """`finetune` for a run whose recipe.yaml has a finetune: section, else `pretrain`."""
    return "finetune" if _run_recipe(path).get("finetune") else "pretrain"


def _run_recipe(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load((Path(path) / RECIPE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def resume_command(path: Path) -> str:
    """The command that resumes the run in `path` from its own recipe.yaml, in backquotes."""
    return f"`difftrain {training_command(path)} {shlex.quote(str(path / RECIPE))} --resume`"


def require_model_files(path: Path) -> Path:
    """`require_run_dir`, and the weights `load_run` reads there (without torch)."""
    path = require_run_dir(path)
    if not is_adapter_run(path):
        require_weights(path)
    return path


def require_weights(path: Path) -> Path:
    """model.safetensors of a run, or a RunDirError that says where training stands and what to do."""
    weights = path / WEIGHTS
    if weights.is_file():
        return weights
    holder = RunLock(path).holder()
    if holder is not None:
        by = f" (pid {holder})" if holder else ""
        raise RunDirError(
            f"{path} is still training{by} and has not saved {WEIGHTS} yet; wait for its first save "
            "(every train.save_every steps) or for the run to end"
        )
    resume = resume_command(path)
    ckpts = sorted((path / CHECKPOINTS).glob("*.ckpt")) if (path / CHECKPOINTS).is_dir() else []
    if (path / ADAPTER_WEIGHTS).is_file():  # a LoRA fine-tune (never has WEIGHTS) lost its adapter config
        raise RunDirError(
            f"{path} has {ADAPTER_WEIGHTS} but no {ADAPTER_CONFIG} (a LoRA fine-tune's description of it); "
            f"restore it, or write both again from the last checkpoint with {resume}"
        )
    if ckpts:
        raise RunDirError(
            f"{path} has no {WEIGHTS} but has checkpoints ({ckpts[-1].name}); rewrite the weights from the "
            f"last checkpoint by resuming: {resume}"
        )
    if (path / RECIPE).is_file():  # nothing to resume; --overwrite: a plain start refuses its logs
        start = f"`difftrain {training_command(path)} {shlex.quote(str(path / RECIPE))} --overwrite`"
        raise RunDirError(
            f"{path} has no {WEIGHTS} and no checkpoint (it stopped before its first save, every "
            f"train.save_every steps); start it again with {start}"
        )
    raise RunDirError(f"{path} is not a difftrain run directory (no {WEIGHTS}, no {RECIPE})")


def load_config(path: Path):
    from difftrain.model import ModelConfig

    cfg_path = path / CONFIG
    if not cfg_path.is_file():
        raise RunDirError(f"{path} has no {CONFIG}; it is not a complete run directory{_rewrite_hint(path)}")
    try:
        return ModelConfig.from_json(cfg_path)
    except ConfigError as e:
        if "transformers config" in str(e):  # its own advice: import the folder
            raise
        raise RunDirError(f"{e}{_rewrite_hint(path)}") from None


def _rewrite_hint(path: Path) -> str:
    """How to write a run's config.json again."""
    if (path / RECIPE).is_file() and (path / CHECKPOINTS).is_dir():
        return f"; write it again from the run's recipe by resuming: {resume_command(path)}"
    return "; restore it from a copy of the run"


def load_run(path: Path | str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Run:
    """Load config.json + model.safetensors + tokenizer.json from a run directory (never a pickle);
    a LoRA fine-tune not merged is its base run with the adapter applied (`load_adapter_run`)."""
    from difftrain.model import Transformer

    path = require_model_files(Path(path))
    if is_adapter_run(path):
        return load_adapter_run(path, device=device, dtype=dtype)
    weights = path / WEIGHTS
    config = load_config(path)
    tokenizer = load_run_tokenizer(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise RunDirError(
            f"{path / TOKENIZER} has {tokenizer.vocab_size} tokens but config.json says "
            f"vocab_size={config.vocab_size}; the tokenizer belongs to another run"
        )
    model = Transformer(config)
    sd = read_safetensors(weights)
    check_state_dict(sd, weights_state_dict(model), weights, CONFIG)
    model.load_state_dict(sd, strict=False)
    return _ready(path, model, config, tokenizer, device, dtype)


def _ready(path: Path, model: nn.Module, config: Any, tokenizer: Any, device: Any, dtype: Any) -> Run:
    model.to(device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return Run(path=path, model=model.eval(), config=config, tokenizer=tokenizer)


def load_run_tokenizer(path: Path) -> Tokenizer:
    """A run folder's tokenizer.json; missing or damaged, an error that says how to restore it."""
    from difftrain.data.tokenizer import load_tokenizer

    restore = "copy the tokenizer the run was trained with into it"
    if (path / RECIPE).is_file() and (path / CHECKPOINTS).is_dir():
        restore += f", or rewrite it from the data cache by resuming: {resume_command(path)}"
    if not (path / TOKENIZER).is_file():
        raise RunDirError(f"{path} has no {TOKENIZER}; {restore}")
    return load_tokenizer(path / TOKENIZER, fix=restore)


FORMAT = "difftrain-lora"
VERSION = 1


@dataclass
class AdapterSpec:
    """What adapter.json records: enough to rebuild the trained model from its base run."""

    method: str  # lora | qlora
    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]  # the patterns as written in the recipe
    targets: list[str]  # the linear layers they matched
    trained: list[str] = field(default_factory=list)  # parameters trained in full
    quantized: list[str] = field(default_factory=list)  # layers held in 4-bit NF4 (qlora)
    base: dict[str, Any] = field(default_factory=dict)  # path, abs_path, weights_file, weights_sha256
    vocab: dict[str, Any] = field(default_factory=dict)  # base_vocab_size, vocab_size, new_ids, used_rows
    step: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any, where: Path) -> AdapterSpec:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RunDirError(f"{where} is not a difftrain adapter file (format {FORMAT!r} expected)")
        if data.get("version", 0) > VERSION:
            raise RunDirError(
                f"{where} was written by a newer difftrain (adapter format {data['version']}); upgrade difftrain"
            )
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        try:
            return cls(**fields)
        except TypeError as e:
            raise RunDirError(f"{where} is incomplete ({e}); fine-tune again or restore the file") from e


def read_adapter_spec(run_dir: Path) -> AdapterSpec:
    f = Path(run_dir) / ADAPTER_CONFIG
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{run_dir} has no {ADAPTER_CONFIG}; it is not a LoRA fine-tune") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{f} is not valid JSON ({e}); restore it or fine-tune again") from e
    return AdapterSpec.from_json(data, f)


def weights_file(run_dir: Path) -> Path:
    """The file that holds a run's own weights: model.safetensors, or its adapter."""
    d = Path(run_dir)
    return d / ADAPTER_WEIGHTS if is_adapter_run(d) else d / WEIGHTS


def resolve_base(run_dir: Path, spec: AdapterSpec) -> Path:
    """The base run of an adapter run, verified to hold the weights the adapter was trained on."""
    run_dir = Path(run_dir)
    ref = spec.base
    candidates = [(run_dir / ref["path"]).resolve()] if ref.get("path") else []
    candidates += [Path(ref["abs_path"])] if ref.get("abs_path") else []
    base = next((c for c in candidates if c.is_dir()), None)
    if base is None:
        shown = ", ".join(dict.fromkeys(str(c) for c in candidates)) or "(none recorded)"
        raise RunDirError(
            f"{run_dir} is a LoRA adapter whose base run is gone (looked in {shown}); put the base run back "
            f'there, or, if you moved it, set "path" under "base" in {run_dir / ADAPTER_CONFIG} to its new '
            "folder (its weights' SHA-256 is checked)"
        )
    expected = ref.get("weights_sha256")
    if expected:
        f = weights_file(base)
        if not f.is_file():
            raise RunDirError(
                f"the base run {base} of adapter {run_dir} has no {f.name}; restore the base run's weights"
            )
        actual = sha256_file(f)
        if actual != expected:
            raise CheckpointError(
                f"the base run {base} has changed since {run_dir} was fine-tuned from it ({f.name} sha256 "
                f"{actual[:12]}…, adapter expects {expected[:12]}…); restore the base weights it was trained "
                "on, or fine-tune again from the current base"
            )
    return base


def adapt_model(
    model: nn.Module,
    spec: AdapterSpec,
    *,
    quantize_on: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Freeze `model`, put LoRA on `spec.targets`, and make `spec.trained` trainable (in place).

    quantize_on: a device to hold `spec.quantized` in 4-bit NF4 (training QLoRA); None rounds them
    through NF4 and keeps them dense (loading a QLoRA adapter without 4-bit kernels)."""
    import torch

    from difftrain.model.lora import apply_lora, nf4_round_trip_, quantize_4bit

    model.requires_grad_(False)
    if spec.quantized:
        if quantize_on is not None:
            quantize_4bit(
                model, spec.quantized, device=quantize_on, compute_dtype=compute_dtype or torch.float32
            )
        else:
            nf4_round_trip_(model, spec.quantized)
    apply_lora(model, spec.targets, spec.rank, spec.alpha, spec.dropout)
    params = dict(model.named_parameters())
    for name in spec.trained:
        if name not in params:
            raise CheckpointError(f"the adapter trains `{name}`, which this model does not have")
        params[name].requires_grad_(True)


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What adapter.safetensors holds: every trainable parameter (LoRA matrices and ones trained in full)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_adapter_run(
    path: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    merge: bool = True,
) -> Run:
    """Rebuild a LoRA fine-tune from its base run + adapter files; `merge` folds the adapter into
    the weights (in fp32, before any cast to `dtype`), else the LoRA layers stay."""
    import torch

    from difftrain.model.lora import grow_vocab, merge_lora

    path = require_run_dir(Path(path))
    spec = read_adapter_spec(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise RunDirError(
            f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; restore it, or resume the fine-tune with "
            f"`difftrain finetune {path / RECIPE} --resume`"
        )
    base_dir = resolve_base(path, spec)
    base = load_run(base_dir)  # fp32 on CPU; an adapter base is merged
    model = base.model
    config = load_config(path)
    base_cfg = base.config
    for key in "arch d_model n_layers n_heads n_kv_heads head_dim ffn_hidden tie_embeddings".split():
        if getattr(config, key) != getattr(base_cfg, key):
            raise RunDirError(
                f"{path / CONFIG} has {key}={getattr(config, key)} but its base run {base_dir} has "
                f"{getattr(base_cfg, key)}; the adapter belongs to another base"
            )
    if config.vocab_size != base_cfg.vocab_size or spec.vocab.get("new_ids"):
        grow_vocab(
            model,
            spec.vocab.get("new_ids", []),
            config.vocab_size,
            int(spec.vocab.get("used_rows", base_cfg.vocab_size)),
        )
    model.config = config  # attn_impl / max_seq_len as the fine-tune set them
    model.attn_impl = config.attn_impl
    adapt_model(model, spec)
    sd = read_safetensors(weights)
    expected = adapter_tensors(model)
    check_state_dict(sd, expected, weights, ADAPTER_CONFIG)
    with torch.no_grad():
        for k, p in expected.items():
            p.copy_(sd[k].to(p.dtype))
    model.requires_grad_(False)
    if merge:
        merge_lora(model)
    return _ready(path, model, config, load_run_tokenizer(path), device, dtype)


def weights_metadata(path: Path) -> dict[str, str]:
    """The metadata of a run's model.safetensors ({} where it has none or cannot be read), from
    its JSON header without torch."""
    try:
        with open(Path(path) / WEIGHTS, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= 100 << 20:
                return {}
            meta = json.loads(f.read(size)).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError):  # missing or unreadable weights: not this
        return {}  # function's error to report
    return {k: v for k, v in meta.items() if isinstance(v, str)} if isinstance(meta, dict) else {}


def imported_from(path: Path) -> str | None:
    """Where `difftrain import` took the run's weights from, or None for a trained run."""
    return weights_metadata(path).get("imported_from")


def read_summary(path: Path) -> dict:
    f = Path(path) / SUMMARY
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunDirError(
            f"{f} is not valid JSON ({e}); delete it, it is rewritten at the end of training"
        ) from e


@dataclass(frozen=True)
class PromptSettings:
    """How a run reads a prompt: as an instruction (else a document), its `prompt_format`, and
    its chat template (a `ChatTemplateConfig`; None: the default one)."""

    instruction: bool = False
    prompt_format: str = "{prompt}"
    chat: object = None


def prompt_settings(run_path: Path | str) -> PromptSettings:
    """From its recipe.yaml: an instruction fine-tune's formats; documents for anything else."""
    data = _run_recipe(Path(run_path))
    ft = data.get("finetune")
    if not isinstance(ft, dict):
        return PromptSettings()
    chat = None
    with contextlib.suppress(Exception):  # an unreadable template: the default one
        from difftrain.recipe import ChatTemplateConfig

        chat = None if ft.get("chat_template") is None else ChatTemplateConfig(**ft["chat_template"])
    fmt = ft.get("data_format", "auto")
    if fmt == "auto":
        try:
            from difftrain.recipe import recipe_from_dict, resolve_data_format

            fmt = resolve_data_format(recipe_from_dict(data, Path(run_path)))
        except Exception:  # the recipe no longer validates here: assume instruction tuning
            fmt = "instruction"
    prompt_format = ft.get("prompt_format") if isinstance(ft.get("prompt_format"), str) else "{prompt}"
    return PromptSettings(instruction=fmt == "instruction", prompt_format=prompt_format, chat=chat)


def record_kinds(run_path: Path | str) -> list[str] | None:
    """The kinds of instruction records a fine-tune trained on ("messages", "prompt/response"), as
    its summary.json records them; None where it does not say."""
    try:
        summary = read_summary(Path(run_path))
    except RunDirError:
        return None
    kinds = summary.get("record_kinds") if isinstance(summary, dict) else None
    return kinds if isinstance(kinds, list) else None
