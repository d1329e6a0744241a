"""`difftrain pretrain RECIPE [key=value ...]`: train a model from scratch into a run directory."""

from __future__ import annotations

import shlex
from typing import Any

import typer

from difftrain.cli.common import (
    OVERRIDES,
    OVERWRITE,
    PROGRESS,
    RECIPE,
    RESUME,
    check_files,
    end_rows,
    fmt_count,
    fmt_figure,
    prepared_rows,
    print_table,
    run_row,
    run_training,
    spec_rows,
    started_row,
    vocab_shortfall,
)


def _show_start(info: Any) -> None:
    spec, data = info.spec, info.details.prepared
    rows = [
        started_row(spec, info.resumed_from),
        ("parameters", " · ".join(f"{k} {fmt_count(v)}" for k, v in info.counts.items() if v)),
        *prepared_rows(data),
        (
            "vocabulary",
            f"{spec.model.vocab_size} (tokenizer {data.tokenizer_path.name})"
            + vocab_shortfall(data.stats.vocab_size, spec.recipe.tokenizer, data.stats.bytes),
        ),
        *spec_rows(spec),
    ]
    print_table("difftrain pretrain", rows, info.warnings)


def _show_end(summary: dict[str, Any], run_dir: Any) -> None:
    f = fmt_figure
    loss = f"train {f(summary['final_train_loss'])} · val {f(summary['final_val_loss'])} · best val {f(summary['best_val_loss'])}"
    mfu = f" · MFU {summary['mfu']:.1%}" if summary.get("mfu") else ""
    rows = end_rows(summary, ("loss", loss), mfu)
    if summary.get("skipped_steps"):
        rows.append(("skipped steps", str(summary["skipped_steps"])))
    rows.append(("next", f"difftrain generate {shlex.quote(str(run_dir))}"))
    print_table("done", rows)


def pretrain_command(
    recipe: str = RECIPE,
    overrides: list[str] = OVERRIDES,
    resume: bool = RESUME,
    overwrite: bool = OVERWRITE,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate the recipe and show the plan; train nothing, write nothing."
    ),
    progress: bool = PROGRESS,
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
        print_table("dry run: the recipe is valid", rows, setup.warnings)
        return
    from difftrain.train.run import pretrain

    run_training(
        "pretrain", pretrain, r, _show_start, _show_end, resume=resume, overwrite=overwrite, progress=progress
    )


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


def register(app: typer.Typer) -> None:
    app.command("pretrain")(pretrain_command)
