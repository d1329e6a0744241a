"""`difftrain finetune RECIPE [key=value ...]` and `difftrain merge RUN_DIR [OUT_DIR]`."""

from __future__ import annotations

import shlex
from pathlib import Path
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
    plural,
    prepared_rows,
    print_table,
    run_row,
    run_training,
    skipped_records_row,
    spec_rows,
    started_row,
)


def _setup_rows(setup: Any) -> list[tuple[str, str]]:
    """The rows the start table and the dry run share, from the fine-tune's `FinetuneSetup`."""
    spec = setup.spec
    m, ft, rec = spec.model, spec.recipe.finetune, setup.records
    method = ft.method
    if method != "full":
        from difftrain.model.lora import short_names

        targets = setup.lora_targets or []
        method += f" · rank {ft.lora.rank} · alpha {ft.lora.alpha:g} · dropout {ft.lora.dropout:g}"
        method += f" · {plural(len(targets), 'linear layer')} ({', '.join(short_names(targets))})"
        if method.startswith("qlora"):
            method += " · base in 4-bit NF4"
    instruction = setup.data_format == "instruction"
    if instruction:
        data = f"instruction records: {rec['train_records']:,} train · {rec['val_records']:,} val"
        if rec["truncated"]:
            data += f" · {rec['truncated']:,} truncated to {spec.seq_len} tokens"
        if rec["empty_responses"]:
            data += (
                f" · {rec['empty_responses']:,} with an empty response (only where a reply ends is trained)"
            )
        val_fraction = spec.recipe.data.val_fraction
        if not rec["val_records"] and val_fraction:  # (with val_fraction 0 the user asked for none)
            data += (
                f" · no validation loss: data.val_fraction={val_fraction:g} drew no record (raise it, e.g. "
                "data.val_fraction=0.2, or add records)"
            )
        if not ft.train_on_prompt:
            data += " · loss on responses only"
        skipped = skipped_records_row(rec["bad_records"], rec["bad_examples"])
    elif setup.prepared is not None:
        data = f"plain text (continued pretraining) · {fmt_count(setup.prepared.index['train']['tokens'])} train tokens"
        skipped = prepared_rows(setup.prepared)
    else:
        data = "plain text (continued pretraining; tokenized when the run starts)"
        skipped = []
    rows = [
        (
            "base",
            f"{setup.base} · {m.arch} · d_model {m.d_model} · {plural(m.n_layers, 'layer')} · vocab {setup.base_vocab_size}",
        ),
        ("method", method),
        ("data", data),
        *skipped,
    ]
    if setup.new_ids:
        new = ", ".join(setup.new_tokens)  # (ids: the rows after the base's vocabulary)
        rows.append(("new tokens", f"{new} (vocab {setup.base_vocab_size} → {m.vocab_size})"))
    return rows + spec_rows(spec, padded=instruction)


def _show_start(info: Any) -> None:
    setup, total, trainable = info.details, info.total_params, info.trainable_params
    rows = [
        started_row(setup.spec, info.resumed_from),
        (
            "trainable",
            f"{trainable:,} of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
            + (f" · trained in full: {len(setup.trained_in_full)} tensors" if setup.trained_in_full else ""),
        ),
        *_setup_rows(setup),
    ]
    print_table("difftrain finetune", rows, info.warnings)


def next_command(summary: dict[str, Any], run_dir: Path) -> str:
    """What to run next on a fine-tuned run: `chat` for one tuned on `messages` records only (its
    chat template is how it reads a conversation), else `generate`."""
    command = "chat" if summary.get("record_kinds") == ["messages"] else "generate"
    return f"difftrain {command} {shlex.quote(str(run_dir))}"


def _show_end(summary: dict[str, Any], run_dir: Path) -> None:
    f = fmt_figure
    loss = (
        f"before {f(summary.get('initial_val_loss'))} → after {f(summary['final_val_loss'])}"
        f" · train {f(summary['final_train_loss'])}"
    )
    rows = end_rows(summary, ("val loss", loss))
    if summary.get("method") in ("lora", "qlora"):
        rows.append(("saved", f"{run_dir / 'adapter.safetensors'} (adapter; base: {summary['base']})"))
        rows.append(("merge", f"difftrain merge {shlex.quote(str(run_dir))}"))
    rows.append(("next", next_command(summary, run_dir)))
    print_table("done", rows)


def finetune_command(
    recipe: str = RECIPE,
    overrides: list[str] = OVERRIDES,
    resume: bool = RESUME,
    overwrite: bool = OVERWRITE,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Check the recipe, base run and data, show the plan; write nothing."
    ),
    progress: bool = PROGRESS,
) -> None:
    """Fine-tune the run named by finetune.base (full, LoRA or QLoRA) into runs/<name>/."""
    from difftrain.recipe import load_recipe, require_finetuning

    r = load_recipe(recipe, overrides or [])  # before torch loads: a typo fails at once
    require_finetuning(r)
    check_files(r)  # and so does a missing base run, data file or unwritable folder
    from difftrain.train.runcheck import early_check

    early_check(r, resume=resume, overwrite=overwrite)  # and the run folder's refusals
    from difftrain.train.finetune import dry_run_finetune, finetune

    if dry_run:
        setup = dry_run_finetune(r, resume=resume, overwrite=overwrite)
        rows = [("recipe", r.source), run_row(setup.spec, setup.resuming, setup.point, overwrite)]
        print_table("dry run: the fine-tune is ready", rows + _setup_rows(setup), setup.warnings)
        return
    run_training(
        "finetune", finetune, r, _show_start, _show_end, resume=resume, overwrite=overwrite, progress=progress
    )


def merge_command(
    run_dir: Path = typer.Argument(..., help="A LoRA/QLoRA fine-tune's run directory."),
    out_dir: Path = typer.Argument(None, help="Where to write the merged run (default: RUN_DIR-merged)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a merge/import at OUT_DIR (never a trained run or other files)."
    ),
) -> None:
    """Fold a LoRA adapter into its base run's weights and write a plain run directory."""
    from difftrain.rundir import read_summary, require_run_dir

    require_run_dir(run_dir)  # before torch loads
    from difftrain.adapters import merge_run, read_adapter_spec

    out = merge_run(run_dir, out_dir, overwrite=overwrite)
    spec = read_adapter_spec(run_dir)
    size = (out / "model.safetensors").stat().st_size
    rows = [
        (
            "adapter",
            f"{run_dir} ({spec.method}, rank {spec.rank}, {len(spec.targets)} adapted linear layers, step {spec.step})",
        ),
        ("base", str(spec.base.get("abs_path"))),
        ("merged", f"{out} (model.safetensors, {size / 2**20:.1f} MB)"),
    ]
    if spec.method == "qlora":
        rows.append(
            ("note", "the 4-bit base was dequantized: the merged weights are the model QLoRA trained")
        )
    rows.append(("next", next_command(read_summary(out), out)))
    print_table("merged", rows)


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune_command)
    app.command("merge")(merge_command)
