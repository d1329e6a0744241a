"""`difftrain pretrain RECIPE [key=value ...]`: train a model from scratch into a run directory."""

from __future__ import annotations

import shlex
from typing import Any

import typer

from difftrain.cli.common import (
    check_files,
    console,
    fmt_count,
    fmt_figure,
    json_as_text_row,
    kv_table,
    peak_memory,
    prepared_bad_examples,
    report_finished,
    run_row,
    skipped_records_row,
    spec_rows,
    throughput,
    vocab_shortfall,
    wall_time,
    warn,
)
from difftrain.cli.complete import override_items, recipe_refs


def _start_table(info: Any) -> None:
    """The start table of the run's `StartInfo`."""
    spec, data = info.spec, info.details.prepared
    rows = [
        (
            "run",
            str(spec.run_dir) + (f"  (resuming from step {info.resumed_from})" if info.resumed_from else ""),
        ),
        ("parameters", " · ".join(f"{k} {fmt_count(v)}" for k, v in info.counts.items() if v)),
        *skipped_records_row(data.stats.bad_records, prepared_bad_examples(data)),
        *json_as_text_row(data.stats),
        (
            "vocabulary",
            f"{spec.model.vocab_size} (tokenizer {data.tokenizer_path.name})"
            + vocab_shortfall(data.stats.vocab_size, spec.recipe.tokenizer, data.stats.bytes),
        ),
        *spec_rows(spec),
    ]
    console.print(kv_table("difftrain pretrain", rows))
    for w in info.warnings:
        warn(w)


def _end_table(summary: dict[str, Any], run_dir: Any) -> None:
    rows = [
        ("steps", f"{summary['steps']} ({fmt_count(summary['tokens'])} tokens)"),
        ("wall time", wall_time(summary)),
        ("throughput", throughput(summary) + (f" · MFU {summary['mfu']:.1%}" if summary.get("mfu") else "")),
        (
            "loss",
            f"train {fmt_figure(summary['final_train_loss'])} · val {fmt_figure(summary['final_val_loss'])} · best val {fmt_figure(summary['best_val_loss'])}",
        ),
        ("peak memory", peak_memory(summary)),
    ]
    if summary.get("skipped_steps"):
        rows.append(("skipped steps", str(summary["skipped_steps"])))
    rows.append(("next", f"difftrain generate {shlex.quote(str(run_dir))}"))
    console.print(kv_table("done", rows))


def pretrain_command(
    recipe: str = typer.Argument(
        ...,
        autocompletion=recipe_refs,
        help="Recipe file or shipped recipe name (see `difftrain recipes list`).",
    ),
    overrides: list[str] = typer.Argument(
        None, autocompletion=override_items, help="Overrides as key.sub=value, e.g. train.max_steps=100."
    ),
    resume: bool = typer.Option(
        None, "--resume/--no-resume", help="Continue from the last good checkpoint (default: train.resume)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a run directory that holds another run."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate the recipe and show the plan; train nothing, write nothing."
    ),
    progress: bool = typer.Option(
        None, "--progress/--no-progress", help="Show the progress bar (default: logging.progress)."
    ),
) -> None:
    """Train a model from scratch as RECIPE says; writes runs/<name>/ (docs/run-directory.md)."""
    from difftrain.recipe import load_recipe

    r = load_recipe(recipe, overrides or [])
    if r.finetune is None:  # (a fine-tuning recipe is sent to `finetune` below)
        from difftrain.train.runcheck import early_check

        check_files(r)  # a missing file or unwritable folder fails before torch loads
        early_check(r, resume=resume, overwrite=overwrite)
    if dry_run:
        from difftrain.train.run import setup_pretrain

        setup = setup_pretrain(r, resume=resume, overwrite=overwrite)  # (no processes: writes nothing)
        rows = [
            ("recipe", r.source),
            run_row(setup.spec, setup.resuming, setup.point, overwrite),
            ("data", _data_row(setup)),
            *spec_rows(setup.spec),
        ]
        console.print(kv_table("dry run: the recipe is valid", rows))
        for w in setup.warnings:
            warn(w)
        return
    _train(r, resume=resume, overwrite=overwrite, progress=progress)


def _data_row(setup: Any) -> str:
    """The dry run's data row: what the cache holds of the recipe's data."""
    r, index = setup.spec.recipe, setup.index
    if index is None:
        return (
            f"not prepared yet: the run tokenizes it first (`difftrain prepare {r.command_args}` does it now "
            "and checks the splits)"
        )
    specs = r.data.recall_specs
    if specs is not None:  # one example per sequence, validated on examples of their own seeds
        held = sum(s.val_documents for s in specs) if r.data.val_windows > 0 else 0
        return f"prepared: {sum(s.num_documents for s in specs):,} training · {held:,} validation recall examples"
    return f"prepared: {index['train']['tokens']:,} training · {index['val']['tokens']:,} validation tokens"


def _train(r: Any, *, resume: bool | None, overwrite: bool, progress: bool | None) -> None:
    from difftrain.cli.common import run_training
    from difftrain.train.run import pretrain

    result = run_training(
        "pretrain", pretrain, r, on_start=_start_table, resume=resume, overwrite=overwrite, progress=progress
    )
    if result.is_global_zero:
        if result.finished_before:
            report_finished(result, "pretrain")
        _end_table(result.summary, result.run_dir)


def register(app: typer.Typer) -> None:
    app.command("pretrain")(pretrain_command)
