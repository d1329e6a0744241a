"""The token windows the suites that read text (ppl, outliers, quant) score: the run's validation
split rebuilt through the shard cache, or a `--data` source, tokenized with the run's tokenizer.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from difftrain.errors import ConfigError, DataError, RecipeError, RunDirError
from difftrain.evals.common import check_positive, evaluated_source
from difftrain.rundir import RECIPE, TOKENIZER, Run

if TYPE_CHECKING:
    import torch

DEFAULT_WINDOWS = 32


@dataclass
class TokenWindows:
    """Fixed windows of seq_len + 1 tokens: input = w[:-1], targets = w[1:]. `source`: where they
    come from, for people; `sources`: paths absolute; `target_bytes`: the UTF-8 bytes of each
    window's targets; `split_drawn`: for a validation split, its {seed, val_fraction}."""

    windows: torch.Tensor
    source: str
    split: str
    split_tokens: int
    target_bytes: np.ndarray
    records_as_text: bool = False
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    split_drawn: dict[str, Any] | None = None


def data_settings(opts: Any, tw: TokenWindows) -> dict[str, Any]:
    """The settings that say what text a result measured (`same_data` compares them), and seq_len."""
    out = {"data": opts.data or "validation", "sources": tw.sources, "split": tw.split_drawn}
    out |= {"text_field": opts.text_field, "seq_len": tw.windows.shape[1] - 1}
    return {k: v for k, v in out.items() if v is not None}


def _run_recipe(run_dir: Path):
    from difftrain.recipe import load_recipe

    path = run_dir / RECIPE
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} has no {RECIPE}, so its validation data is unknown; evaluate on a data source with --data SOURCE"
        )
    try:
        return load_recipe(path)
    except RecipeError as e:
        raise RunDirError(
            f"{path} cannot be read as a recipe ({e}); evaluate on a data source with --data SOURCE"
        ) from e


def _sources_base(data_cfg: Any, run_dir: Path) -> Path:
    """The folder the run's relative source paths resolve against: the first of the current
    folder, the folder above `out_dir` and the run's own where they all exist; else the current."""
    rel = [
        s.source
        for s in data_cfg.sources
        if s.kind == "path" and not Path(s.source).expanduser().is_absolute()
    ]
    for base in (Path.cwd(), run_dir.resolve().parent.parent, run_dir.resolve()):
        if all(any(base.glob(p)) if any(c in p for c in "*?[") else (base / p).exists() for p in rel):
            return base
    return Path.cwd()


def window_target_bytes(tokenizer: Any, windows: np.ndarray) -> np.ndarray:
    """UTF-8 bytes of the text each window's targets (w[1:]) stand for: (n,) int64. Tokenizers
    that are not byte-level decode pieces differently alone: the window's decoded text less that
    of its first token."""
    if getattr(tokenizer, "is_byte_level", False):
        table = token_byte_lengths(tokenizer)
        return table[np.clip(windows[:, 1:], 0, len(table) - 1)].sum(axis=1)

    def size(ids: list[int]) -> int:
        return len(tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8"))

    return np.array([max(0, size(w) - size(w[:1])) for w in windows.tolist()], dtype=np.int64)


def token_byte_lengths(tokenizer: Any) -> np.ndarray:
    """UTF-8 bytes of the text each token id stands for (special tokens: 0)."""
    n = tokenizer.vocab_size
    if getattr(tokenizer, "is_byte_level", False):
        table = [len(b) for b in tokenizer._id_bytes]
    else:
        table = [len(tokenizer.decode([i]).encode("utf-8")) for i in range(n)]
    out = np.asarray(table, dtype=np.int64)
    out[[i for i in set(tokenizer.special_tokens.values()) if i < n]] = 0
    return out


def data_source(data: str, text_field: str | None = None, **fields: Any) -> Any:
    """The `--data` source (a `Source`) resolved against the current folder, named as the option
    in messages; a missing file fails here. `fields`: more SourceSpec fields."""
    from difftrain.data.config import SourceSpec
    from difftrain.data.sources import Source

    try:
        spec = SourceSpec(
            source=data, **fields, **({"text_field": text_field} if text_field is not None else {})
        )
    except ValueError as e:
        errors = e.errors() if hasattr(e, "errors") else []  # pydantic's ValidationError
        msg = errors[0]["msg"].removeprefix("Value error, ") if errors else str(e) or "invalid source"
        raise DataError(f"--data {data!r}: {msg}") from None
    source = Source(spec, 0, Path.cwd().resolve(), name=f"--data {data!r}")
    source.check_local_files()
    return source


def holds_records(source: Any) -> bool:
    """Whether a `--data` source holds instruction records (`messages`, or a prompt field) for
    an instruction fine-tune's template to render, judged by its first record or its columns."""
    from difftrain.data.files import RECORD_SUFFIXES, suffix

    spec = source.spec
    if spec.kind == "builtin":
        return spec.source == "builtin:python-docstrings"
    if spec.kind != "hf" and (
        not source.files or any(suffix(f) not in RECORD_SUFFIXES for f in source.files)
    ):
        return False
    names = source.record_fields()
    if names is None:  # unknown before reading: the record reader names any problem
        return True
    return spec.prompt_field in names or ("messages" in names and spec.text_field not in names)


def _data_advice(e: DataError, label: str) -> DataError:
    """A DataError from reading the `--data` source `label`, its advice put in eval's options."""
    from difftrain.data.hub import CHAT_RECORD_AS_TEXT

    field_hint = "; name the field to read with --text-field FIELD"
    record_hint = (
        "; an instruction fine-tune reads records with `messages`, or a prompt and a response, through "
        "its template: fix the record, or read one field as plain text with --text-field FIELD"
    )
    text = str(e)
    for old, new in (
        (
            CHAT_RECORD_AS_TEXT,
            "a chat record (`messages`), and this run has no chat template: evaluate its chat fine-tune "
            "(`difftrain finetune` on this file), or read one field as plain text with --text-field FIELD",
        ),
        (f"; set text_field: <field> on {label}", field_hint),
        *((f"; set {name}: <field> on {label}", record_hint) for name in ("prompt_field", "response_field")),
        (f"; set text_field (or prompt_field/response_field) on {label}", field_hint),
        ("; set text_field (or prompt_field/response_field) on this source", field_hint),
        (", or set data.on_bad_record: skip to drop such records", ""),
        (
            "not a string; fix the record",
            "not a string; fix the record, or name a text field with --text-field FIELD",
        ),
        ("or remove the source from data.sources", "or give another --data source"),
        ("or remove it from data.sources", "or give another --data source"),
    ):
        text = text.replace(old, new)
    return e if text == str(e) else DataError(text)


def require_own_split(run_dir: Path, suite: str | None = None) -> None:
    """ConfigError for an imported run: its recipe.yaml holds default data it never trained on."""
    from difftrain.rundir import imported_from

    if (origin := imported_from(run_dir)) is not None:
        reader = f"`{suite}`" if suite else "eval"
        raise ConfigError(
            f"{run_dir} was imported (from {origin}), so it has no validation split of its own for {reader} to "
            "read (its recipe.yaml holds default data it never trained on); give the text to measure with "
            "--data SOURCE, e.g. --data builtin:python-stdlib or --data 'docs/*.md'"
        )


def records_as_text(recipe: Any) -> Any:
    """For an instruction fine-tune's recipe: its records as text through its template, prompts
    included (a `RecordText`); None for other runs."""
    if recipe.finetune is None:
        return None
    from difftrain.data.sft import SFTTemplate
    from difftrain.data.sources import RecordText
    from difftrain.recipe import resolve_data_format

    if resolve_data_format(recipe) != "instruction":
        return None
    ft = recipe.finetune
    template = SFTTemplate.from_config(ft)
    key = json.dumps(
        [ft.prompt_format, ft.response_format, ft.chat_template.model_dump(mode="json")], sort_keys=True
    )
    return RecordText(key, lambda record: "".join(text for text, _ in template(record)))


def option_windows(run: Any, opts: Any) -> TokenWindows:
    """The windows ppl and quant score, as eval's options say."""
    check_positive("--windows", opts.windows)
    return eval_windows(
        run,
        data=opts.data,
        count=opts.windows,
        full=opts.full,
        text_field=opts.text_field,
        asked=f"--windows {opts.windows:,}" if opts.windows is not None else None,
    )


def eval_windows(
    run: Run,
    *,
    data: str | None,
    count: int | None,
    full: bool,
    text_field: str | None = None,
    asked: str | None = None,
    error_bar: bool = True,
) -> TokenWindows:
    """The windows a perplexity-like suite evaluates, tokenized with the run's own tokenizer.

    Without `data`: the run's validation split, rebuilt through the shard cache (with count =
    data.val_windows, the windows of training's validation loss). With `data`: all of that source;
    an instruction fine-tune renders instruction records through its template (`holds_records`)
    unless `text_field` names a field to read as text. Windows are evenly spaced; `full` takes
    every non-overlapping one, and at most those are taken, with a note naming `asked` (the
    option the count came from; `error_bar`: the note says why). A split shorter than one window
    is scored as one window of all its tokens, with a note.
    """
    from difftrain.data.config import DataConfig, TokenizerConfig, absolute_source
    from difftrain.data.shards import prepare_data, val_window_offsets  # (data.modules loads Lightning)

    window = int(run.config.max_seq_len) + 1  # type: ignore[attr-defined]
    sources = as_text = source_label = None
    if data is None:
        require_own_split(run.path)
        recipe = _run_recipe(run.path)
        data_cfg, seed = recipe.data, recipe.seed
        base = _sources_base(data_cfg, run.path)
        as_text = records_as_text(recipe)
        if as_text is not None:  # an instruction fine-tune: its records, as training rendered them
            from difftrain.data.sources import resolve_sources

            sources = resolve_sources(data_cfg, base, as_text)
        if count is None and not full:
            count = data_cfg.val_windows or DEFAULT_WINDOWS
            asked = asked or (
                f"data.val_windows={data_cfg.val_windows:,} (the windows of training's validation loss)"
                if data_cfg.val_windows
                else f"the default {DEFAULT_WINDOWS} windows"
            )
        named = where = f"validation split of {', '.join(s.source for s in data_cfg.sources)}"
        drawn_from = [absolute_source(s.source, base) for s in data_cfg.sources]
        hint = (
            "raise data.val_fraction when fine-tuning, or evaluate on more records with "
            "--data FILE.jsonl (rendered through the run's template)"
            if as_text is not None
            else "raise data.val_fraction when training, or evaluate on another source with --data SOURCE"
        )
    else:
        own = None
        with contextlib.suppress(RunDirError):
            own = _run_recipe(run.path)
        template = records_as_text(own) if own is not None and text_field is None else None
        fields: dict[str, Any] = {}
        if template is not None and own.data.sources and not data.startswith("builtin:"):
            first = own.data.sources[0]  # the record fields the run was fine-tuned with
            fields = {"prompt_field": first.prompt_field, "response_field": first.response_field}
        source = data_source(data, text_field, **fields)
        source_label = source.label
        if template is not None:
            try:
                if holds_records(source):
                    as_text = source.records_as_text = template
            except DataError as e:
                raise _data_advice(e, source.label) from e
        sources = [source]
        cache_dir = own.data.cache_dir if own else None
        data_cfg = DataConfig(sources=[source.spec], val_fraction=0.0, val_windows=0, cache_dir=cache_dir)
        seed, base = 0, Path.cwd()
        where = source.spec.source
        named = f"--data source {where}"
        drawn_from = [evaluated_source(data)]
        hint = "give a larger --data source"
    tok_cfg = TokenizerConfig(path=str((run.path / TOKENIZER).resolve()))
    try:
        prepared = prepare_data(data_cfg, tok_cfg, seed=seed, base_dir=base, sources=sources)
    except DataError as e:
        if source_label is None:
            raise
        raise _data_advice(e, source_label) from e
    split = "val" if data is None else "train"
    path = prepared.val_path if data is None else prepared.train_path
    n_tokens = int(prepared.index[split]["tokens"])
    notes: list[str] = []
    if n_tokens < 2:
        raise DataError(
            f"the {named} holds {n_tokens} token{'s' * (n_tokens != 1)}: nothing to score; {hint}"
        )
    if n_tokens < window:
        notes.append(
            f"the {named} holds {n_tokens:,} tokens, fewer than one window of max_seq_len + 1 = {window}: "
            f"scored as one window of all {n_tokens:,} (no error bar); for full windows, {hint}"
        )
        window = n_tokens
    fit = n_tokens // window  # non-overlapping windows
    if count is None:  # --full without an explicit --windows: every non-overlapping window
        count = fit if full else DEFAULT_WINDOWS
    count = max(1, count)
    if count > fit and not notes:  # (a split shorter than one window is noted already)
        notes.append(
            f"{f'{asked} asks for' if asked else 'asked for'} {count:,} windows of {window} tokens, more than the "
            f"{fit:,} non-overlapping ones the {named} holds ({n_tokens:,} tokens): evaluated on those {fit:,}, "
            "so that no token counts twice"
            + (" and the ± (which treats windows as independent) stays honest" if error_bar else "")
        )
    count = min(count, fit)
    offsets = val_window_offsets(n_tokens, window, count)
    mm = np.memmap(path, dtype=prepared.dtype, mode="r", shape=(n_tokens,))
    arr = np.stack([np.asarray(mm[o : o + window], dtype=np.int64) for o in offsets])
    import torch

    return TokenWindows(
        windows=torch.from_numpy(arr),
        source=where,
        split=split,
        split_tokens=n_tokens,
        target_bytes=window_target_bytes(run.tokenizer, arr),
        records_as_text=as_text is not None,
        sources=drawn_from,
        notes=notes,
        split_drawn={"seed": seed, "val_fraction": data_cfg.val_fraction} if data is None else None,
    )
