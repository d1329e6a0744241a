"""`finetune`: continue training an existing run — in full, with LoRA, or with QLoRA — into a new run.

    base run ──► model (config.json + weights) and tokenizer ──► [grow vocab for new template tokens]
             ──► full: every weight trains          → model.safetensors
                 lora: base frozen, B·A trains      → adapter.safetensors + adapter.json
                 qlora: base frozen in 4-bit NF4    → adapter.safetensors + adapter.json
    data ──► instruction records (prompt/response, or messages through the chat template; loss on
             the responses) or plain text (continued pretraining: the pretraining windows)

The loop itself — optimizer, precision, checkpoints, exact resume, progress, summary — is
`difftrain.train.run.fit`, the same one pretraining uses. What differs is what is built before it
(the model from the base run, the data module) and what each save writes (`export`).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from difftrain.data.sft import SFTTemplate, add_special_tokens, render_messages
from difftrain.errors import DataError, DeviceError, RecipeError, RunDirError
from difftrain.model.config import vocab_rows
from difftrain.recipe import Recipe, require_finetuning, resolve_data_format
from difftrain.rundir import RECIPE, TOKENIZER, base_run_dir, load_config, resolve_model
from difftrain.spec import RunSpec, resolve
from difftrain.train.distributed import DistContext, compute_dtype
from difftrain.train.preflight import dry_run_warnings, memory_warnings, preflight, training_into
from difftrain.train.run import FitOptions, Hooks, TrainResult, _quiet_lightning, fit, start_processes
from difftrain.train.runcheck import check_run_dir


def _check_method(method: str, spec: RunSpec) -> None:
    if method != "qlora":
        return
    from difftrain.model.lora import import_bitsandbytes

    if spec.accelerator == "mps":
        raise DeviceError(
            "finetune.method=qlora needs bitsandbytes' 4-bit kernels, which do not run on Apple MPS; "
            "use finetune.method=lora"
        )
    import_bitsandbytes()
    if spec.world_size > 1:
        raise DeviceError(
            f"finetune.method=qlora trains on one device (the run has {spec.world_size}); use "
            "finetune.method=lora to fine-tune on several"
        )
    if spec.recipe.train.precision == "bf16-true":
        raise DeviceError(
            "finetune.method=qlora keeps 4-bit weights that a whole-model cast to bf16 (train.precision="
            "bf16-true) would break; use train.precision=bf16-mixed"
        )


def plan_finetune(recipe: Recipe) -> tuple[RunSpec, Path]:
    """Check the recipe against its base run and this machine: (spec, base run directory). The
    spec's recipe has the base's model (with the recipe's changeable `model:` keys) and tokenizer.
    Reads the base's config.json; loads no weights, writes nothing."""
    from difftrain.data.config import TokenizerConfig

    ft = require_finetuning(recipe)
    base = base_run_dir(ft)
    base_tok_path = (base / TOKENIZER).resolve()
    if (
        recipe.tokenizer.path is not None
        and Path(recipe.tokenizer.path).expanduser().resolve() != base_tok_path
    ):
        run = recipe._own_run_dir
        if run is not None:  # a fine-tune's own recipe.yaml holds its base's tokenizer: the base changed
            old_base = Path(recipe.tokenizer.path).expanduser().parent
            raise RunDirError(
                f"{run} was fine-tuned from {old_base}, not finetune.base={ft.base}: a different base makes a "
                "different run; resume it from its base, or fine-tune the new base into another `name`"
            )
        raise RecipeError(
            f"tokenizer.path={recipe.tokenizer.path}: a fine-tune uses its base run's tokenizer ({base_tok_path}); "
            "remove tokenizer.path from the recipe"
        )
    model_cfg = resolve_model(recipe, base)  # (after the base check: a run's recipe names its model)
    # (model_copy keeps the recipe's folder, source and own model keys)
    spec = resolve(
        recipe.model_copy(update={"model": model_cfg, "tokenizer": TokenizerConfig(path=str(base_tok_path))})
    )
    if spec.run_dir.resolve() == base.resolve():
        raise RecipeError(
            f"finetune.base is {base}, the folder this fine-tune writes to; give the fine-tune its own `name`"
        )
    _check_method(ft.method, spec)
    return spec, base


def instruction_data(spec: RunSpec, tokenizer: Any) -> tuple[Any, list[int], Any, dict[str, Any]]:
    """Read and tokenize the recipe's instruction records (nothing is written): (tokenizer grown by
    the chat template's special tokens where `messages` records need them, the new token ids, the
    set-up SFTDataModule, record counts for the start table)."""
    from difftrain.data.modules import SFTDataModule, load_sft_records

    r, ft, t = spec.recipe, spec.recipe.finetune, spec.recipe.train
    assert ft is not None
    try:
        train_records, val_records, stats = load_sft_records(
            r.data,
            seed=r.seed,
            base_dir=r.recipe_dir,
            check_messages=lambda messages: render_messages(messages, ft.chat_template),
        )
    except DataError as e:
        if "has no field" in str(e) or "plain documents" in str(e):
            raise DataError(f"{e} (for plain text, set finetune.data_format: text)") from e
        raise
    kinds = {
        "messages" if "messages" in x and "prompt" not in x else "prompt/response"
        for x in (*train_records, *val_records)
    }
    new_ids: list[int] = []
    if "messages" in kinds:  # rendered through the chat template: its tokens must exist
        tokenizer, new_ids = add_special_tokens(tokenizer, ft.chat_template.special_tokens)
    dm = SFTDataModule(
        train_records,
        val_records,
        tokenizer=tokenizer,
        max_seq_len=spec.seq_len,
        micro_batch_size=t.micro_batch_size,
        seed=r.seed,
        template=SFTTemplate.from_config(ft),
        train_on_prompt=ft.train_on_prompt,
        pad_to_max_seq_len=bool(t.compile),
        num_workers=r.data.num_workers,
        pin_memory=r.data.pin_memory,
    )
    dm.setup()  # tokenizes every record now: bad records fail before anything is written
    if 0 < len(dm.val_examples) < spec.world_size:
        raise DataError(
            f"{len(dm.val_examples)} validation records for {spec.world_size} processes, and every "
            "process validates at least one; raise data.val_fraction or train on fewer devices"
        )
    records = {
        "record_kinds": sorted(kinds),
        "train_records": len(dm.train_examples),
        "val_records": len(dm.val_examples),
        "truncated": dm.truncated,
        "empty_responses": dm.empty_responses,
        "sources": stats,
        "bad_records": sum(st.bad_records for st in stats),
        "bad_examples": [x for st in stats for x in st.bad_examples],
    }
    return tokenizer, new_ids, dm, records


DATA_STATE_KEY = "DataFingerprint"


def data_fingerprint_callback(key: str) -> Any:
    """A callback that saves `key`, the fine-tune's data fingerprint (`_data_key`), in every
    checkpoint, for `_check_resumed_data`."""
    import lightning as L

    class DataFingerprint(L.Callback):
        @property
        def state_key(self) -> str:
            return DATA_STATE_KEY

        def state_dict(self) -> dict[str, Any]:
            return {"data": key}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            """Nothing to restore: `_check_resumed_data` compared the key before the start."""

    return DataFingerprint()


def _data_key(dm: Any, prepared: Any) -> str:
    """What a fine-tune trains on, as one hash: the token ids and loss targets of every
    instruction example, or a plain-text fine-tune's shards' sources fingerprint."""
    import hashlib

    import numpy as np

    if prepared is not None:  # its shards' sources fingerprint (the dry run reads it alike)
        return str(prepared.index.get("fingerprint", ""))
    h = hashlib.sha256()
    for examples in (dm.train_examples, dm.val_examples):
        for ids, targets in examples:
            h.update(np.asarray(ids, dtype=np.int64).tobytes())
            h.update(np.asarray(targets, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def _check_resumed_data(checkpoint: Path, key: str, run_dir: Path) -> None:
    """Refuse a resume whose data changed since the checkpoint was saved (a checkpoint of an
    older version, without the fingerprint, is not judged)."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
        saved = state.get("callbacks", {}).get(DATA_STATE_KEY, {}).get("data")
    except Exception:  # an unreadable checkpoint is named by the resume itself
        return
    if saved is not None and saved != key:
        raise RunDirError(
            f"the data of {run_dir} changed since its checkpoint (other records, or other text): resuming "
            "would train on other data; restore it as it was, or start again with --overwrite"
        )


@dataclass
class FinetuneSetup:
    """What a fine-tune decides before its model is built (`setup_finetune`, for the run and its
    dry run alike): the spec (the base's model, grown by the chat template's tokens), the base run,
    the data (`prepared` text shards: None in a dry run), the instruction records' counts, the run
    folder's decision and the data's fingerprint; `lora_targets`, `trained_in_full` and `warnings`
    once the adapter is planned."""

    spec: RunSpec
    base: Path
    data_format: str
    tokenizer: Any
    new_ids: list[int]
    base_vocab_size: int
    base_vocab_rows: int
    dm: Any
    prepared: Any
    records: dict[str, Any]
    resuming: bool
    point: Any
    data_key: str | None
    dist: DistContext | None = None  # the run's processes (None in a dry run)
    lora_targets: list[str] | None = None
    trained_in_full: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def new_tokens(self) -> dict[str, int]:
        return {self.tokenizer.id_to_token(i): i for i in self.new_ids}


def setup_finetune(
    recipe: Recipe,
    *,
    resume: bool | str | None,
    overwrite: bool,
    start: Callable[[RunSpec], DistContext] | None = None,
    data_progress: Any = None,
) -> FinetuneSetup:
    """Every check a fine-tune makes before its first write, in order: the base run, the recipe
    against this machine, the run folder's refusals, the data, the vocabulary, the run folder's
    decision, the resume's data and adapter base. `start` starts the run's processes
    (`start_processes`); then rank 0 prepares the text and decides the folder. Without it, the
    dry run: nothing is written (the base weights checked instead of loaded, local text sources
    read instead of tokenized)."""
    from difftrain.adapters import ADAPTER_CONFIG, read_adapter_spec, resolve_base
    from difftrain.data.modules import PretrainDataModule
    from difftrain.data.shards import cached_index
    from difftrain.data.sources import SourceStats, check_local_sources, require_documents, resolve_sources
    from difftrain.io import check_run_dir_creatable
    from difftrain.rundir import ADAPTER_WEIGHTS, WEIGHTS, check_safetensors, load_run_tokenizer
    from difftrain.train.run import prepare_text

    dry = start is None
    spec, base = plan_finetune(recipe)
    r = spec.recipe
    flag: bool | str = r.train.resume if resume is None else resume
    # the run folder's refusals before the data is read (tokenizing records takes tens of seconds);
    # model.vocab_size may still grow by the chat template's tokens: `preflight` compares it after
    check_run_dir(
        r, resume=flag, overwrite=overwrite, batch=spec.batch, ignore=frozenset({"model.vocab_size"})
    )
    dist = None if start is None else start(spec)  # every rank runs what follows; writes on rank 0
    data_format = resolve_data_format(r)
    tokenizer = load_run_tokenizer(base)  # (restore advice for a run folder's tokenizer)
    base_vocab_rows = tokenizer.vocab_size
    for weights in (base / WEIGHTS, base / ADAPTER_WEIGHTS) if dry else ():
        if weights.is_file():  # an empty or cut file, as the run refuses it
            check_safetensors(weights)
    records: dict[str, Any] = {}
    new_ids: list[int] = []
    dm = prepared = None
    if data_format == "instruction":
        tokenizer, new_ids, dm, records = instruction_data(spec, tokenizer)
    elif dry:  # the first document of each source, read as the run reads it
        check_local_sources(r.data, r.recipe_dir)
        for source in resolve_sources(r.data, r.recipe_dir):
            stats = SourceStats(source.spec.source)
            if next(iter(source.documents(stats, r.data.on_bad_record)), None) is None:
                require_documents(source, stats)  # no document at all: refused as the run refuses it
    else:
        assert dist is not None
        prepared = prepare_text(spec, dist, data_progress)
        dm = PretrainDataModule.from_config(
            prepared, r.data, seq_len=spec.seq_len, micro_batch_size=r.train.micro_batch_size, seed=r.seed
        )
    if tokenizer.vocab_size > int(spec.model.vocab_size):  # (rows kept while they hold every id)
        spec = spec.with_model(spec.model.replace(vocab_size=vocab_rows(tokenizer.vocab_size)))
    base_vocab_size = int(load_config(base).vocab_size)  # (the spec's model has the grown vocabulary)

    resuming, point = (dist or DistContext()).on_rank_zero(  # (a dry run: one process)
        lambda: preflight(spec, resume=flag, overwrite=overwrite, dry_run=dry)
    )
    if dm is not None:
        data_key: str | None = _data_key(dm, prepared)
    else:  # a dry run's text: the shards the resume would read, where they are prepared already
        index = cached_index(r.data, r.tokenizer, seed=r.seed, base_dir=r.recipe_dir)
        data_key = str(index.get("fingerprint", "")) if index is not None else None
    if resuming and data_key is not None:
        _check_resumed_data(point.path, data_key, spec.run_dir)
    if resuming and r.finetune.method != "full" and (spec.run_dir / ADAPTER_CONFIG).is_file():
        resolve_base(spec.run_dir, read_adapter_spec(spec.run_dir))  # the base it trained on (SHA-256)
    if dry:
        check_run_dir_creatable(spec.run_dir)
    return FinetuneSetup(
        spec, base, data_format, tokenizer, new_ids, base_vocab_size, base_vocab_rows, dm, prepared, records,
        resuming, point, data_key, dist,
    )  # fmt: skip


def dry_run_finetune(recipe: Recipe, *, resume: bool | None = None, overwrite: bool = False) -> FinetuneSetup:
    """`finetune --dry-run`: `setup_finetune` with nothing written, the adapter planned on a model
    of shapes only (meta: no memory), and the warnings the run would give at its start."""
    from difftrain.adapters import plan_finetune_adapter, rank_warning
    from difftrain.model import Transformer

    setup = setup_finetune(recipe, resume=resume, overwrite=overwrite)
    ft = setup.spec.recipe.finetune
    assert ft is not None
    setup.warnings = dry_run_warnings(setup.spec, setup.point)
    if ft.method != "full":
        with torch.device("meta"):
            skeleton = Transformer(setup.spec.model)
        adapter = plan_finetune_adapter(skeleton, ft, train_embeddings=bool(setup.new_ids))
        setup.lora_targets, setup.trained_in_full = adapter.targets, adapter.trained
        setup.warnings += [w for w in (rank_warning(skeleton, adapter),) if w]
    return setup


def finetune(
    recipe: Recipe,
    *,
    resume: bool | str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    console: Any = None,
    on_start: Any = None,
    extra_callbacks: Sequence[Any] = (),
    fault_hook: Any = None,
    data_progress: Any = None,
) -> TrainResult:
    """Fine-tune `recipe.finetune.base` into a new run directory; keyword arguments and result as
    `pretrain` (`StartInfo.details`: the run's `FinetuneSetup`)."""
    import lightning as L

    from difftrain.adapters import (
        adapt_model,
        base_reference,
        plan_finetune_adapter,
        rank_warning,
        save_adapter,
    )
    from difftrain.model.lora import grow_vocab
    from difftrain.rundir import load_run

    _quiet_lightning()
    setup = setup_finetune(
        recipe, resume=resume, overwrite=overwrite, start=start_processes, data_progress=data_progress
    )
    spec, base, new_ids = setup.spec, setup.base, setup.new_ids
    r, ft, t, run_dir = spec.recipe, spec.recipe.finetune, spec.recipe.train, spec.run_dir
    assert ft is not None
    model_cfg, instruction = spec.model, setup.data_format == "instruction"
    vocab_size = model_cfg.vocab_size

    # the model: base weights, grown vocabulary, then LoRA (and 4-bit) or all weights trainable
    L.seed_everything(r.seed, workers=True, verbose=False)
    model = load_run(base).model
    if new_ids or vocab_size != model.config.vocab_size:
        grow_vocab(model, new_ids, vocab_size, used_rows=setup.base_vocab_rows)
    model.config, model.attn_impl = model_cfg, model_cfg.attn_impl
    counts = model.num_params()
    model.train()
    export = rank_note = None
    if ft.method == "full":
        model.requires_grad_(True)
    else:
        adapter = plan_finetune_adapter(model, ft, train_embeddings=bool(new_ids))
        rank_note = rank_warning(model, adapter)
        device = torch.device("cuda", torch.cuda.current_device()) if spec.accelerator == "cuda" else "cpu"
        adapt_model(
            model,
            adapter,
            quantize_on=device if ft.method == "qlora" else None,
            compute_dtype=compute_dtype(t.precision),
        )
        if ft.method == "qlora" and not adapter.quantized:
            raise RecipeError(
                "finetune.method=qlora but the model has no decoder linear layers to store in 4 bits"
            )
        adapter.base = base_reference(base, run_dir)
        adapter.vocab = {
            "base_vocab_size": setup.base_vocab_size,
            "vocab_size": vocab_size,
            "new_ids": new_ids,
            "used_rows": setup.base_vocab_rows,
        }
        setup.lora_targets, setup.trained_in_full = adapter.targets, adapter.trained
        export = partial(save_adapter, spec=adapter)  # (run_dir, model, step)
    model.set_activation_checkpointing(t.activation_checkpointing)
    opts = FitOptions(
        counts=counts,
        has_val=setup.records["val_records"] > 0 if instruction else r.data.val_windows > 0,
        resume_command=f"difftrain finetune {shlex.quote(str(run_dir / RECIPE))} --resume",
        details=setup,
        # `difftrain plan` covers fine-tunes too
        warnings=memory_warnings(r, spec.accelerator) + ([rank_note] if rank_note else []),
        export=export,
        save_frozen=ft.method == "full",
        step_seed=r.seed,
        validate_first=True,
        tokens_per_micro_batch=0 if instruction else t.micro_batch_size * spec.seq_len,
        token_mean=instruction,  # responses of different lengths
        summary_extra={
            "method": ft.method,
            "base": str(base),
            "data_format": setup.data_format,
            **({"record_kinds": setup.records["record_kinds"]} if instruction else {}),
            **({"lora_rank": ft.lora.rank, "lora_alpha": ft.lora.alpha} if ft.method != "full" else {}),
        },
    )
    hooks = Hooks(
        progress, console, on_start, [*extra_callbacks, data_fingerprint_callback(setup.data_key)], fault_hook
    )
    with training_into(setup, replace=overwrite):
        return fit(spec, model, setup.dm, setup.point, opts, hooks)
