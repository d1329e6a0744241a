"""`difftrain prepare RECIPE [key=value ...]`: build (or find) the tokenizer and token shards."""

from __future__ import annotations

import shlex
from typing import Any

import typer

from difftrain.cli.common import (
    OVERRIDES,
    RECIPE,
    DataBars,
    console,
    fmt_count,
    kv_table,
    prepared_rows,
    vocab_shortfall,
    warn,
)
from difftrain.errors import RecipeError


def _bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def prepare_table(prepared: Any, tokenizer_cfg: Any) -> Any:
    """The summary table of a `PreparedData` made with the recipe's `tokenizer_cfg`."""
    s = prepared.stats
    cached = "reused from cache" if prepared.from_cache else "built now"
    tok_note = "cached" if prepared.tokenizer_from_cache else f"trained in {s.tokenizer_seconds:.1f} s"
    if tokenizer_cfg.path is not None:
        tok_note = f"loaded from {tokenizer_cfg.path}"
    # sources weighted other than 1 write training documents as often as their weight says
    weighted = s.train_tokens + s.val_tokens != s.tokens
    copies = " · train counts each weighted copy (data.sources[].weight)" if weighted else ""
    rows = [
        ("documents", f"{s.documents:,} ({s.train_documents:,} train · {s.val_documents:,} val){copies}"),
        ("bytes", _bytes(s.bytes)),
        ("tokens", f"{s.tokens:,}" + (f" ({fmt_count(s.tokens)})" if s.tokens >= 1000 else "")),
        ("tokens/byte", f"{s.tokens_per_byte:.3f}"),
        ("train tokens", f"{s.train_tokens:,}" + ("  (weighted copies included)" if weighted else "")),
        (
            "val tokens",
            f"{s.val_tokens:,}"
            + ("  (held out from the end: too few documents to split)" if s.split == "tail" else ""),
        ),
        (
            "vocabulary",
            f"{s.vocab_size:,} tokens ({tok_note}) · shards {prepared.index['dtype']}"
            + vocab_shortfall(s.vocab_size, tokenizer_cfg, s.bytes),
        ),
        ("time", f"{s.seconds:.1f} s ({cached})"),
        ("cache", f"{prepared.cache_dir}  ({_bytes(s.cache_bytes)})"),
        ("tokenizer", str(prepared.tokenizer_path)),
    ]
    rows[1:1] = prepared_rows(prepared, first=False)  # (prepare_command lists the skipped records)
    return kv_table("difftrain prepare", rows)


def prepare_command(
    recipe: str = RECIPE,
    overrides: list[str] = OVERRIDES,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
) -> None:
    """Train (or load) the tokenizer and tokenize RECIPE's data into cached shards; print a summary.

    Later commands (`pretrain`) reuse the cache, so running this first is optional; it is the way
    to check the data (counts, bad records, tokens per byte) before training.
    """
    from difftrain.data.shards import prepare_data
    from difftrain.recipe import check_record_fields, load_recipe

    r = load_recipe(recipe, overrides or [])
    if r.finetune is not None:  # its data needs the base run's tokenizer
        raise RecipeError(
            f"{recipe} is a fine-tuning recipe (finetune.base: {r.finetune.base}): its data is tokenized "
            f"with the base run's tokenizer when the fine-tune starts; check it with `difftrain finetune "
            f"{shlex.quote(recipe)} --dry-run` (records, bad records, truncation)"
        )
    check_record_fields(r)
    with DataBars() as bars:
        prepared = prepare_data(
            r.data, r.tokenizer, seed=r.seed, base_dir=r.recipe_dir, progress=bars if progress else None
        )
    console.print(prepare_table(prepared, r.tokenizer))
    for src in prepared.stats.sources:
        examples = src.get("bad_examples", [])
        for example in examples:
            warn(example, "skipped")
        more = src.get("bad_records", 0) - len(examples)
        if more > 0:
            warn(
                f"… and {more:,} more in {src['source']} (the first {len(examples)} are listed; with "
                "data.on_bad_record=error the first stops the run)",
                "skipped",
            )
    vocab = r.model.vocab_size
    if vocab != "auto":
        from difftrain.data.tokenizer import check_vocab_fits, load_tokenizer

        check_vocab_fits(load_tokenizer(prepared.tokenizer_path), vocab)


def register(app: typer.Typer) -> None:
    app.command("prepare")(prepare_command)
