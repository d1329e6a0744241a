"""`difftrain export RUN_DIR --format hf OUT_DIR` and `difftrain import HF_DIR RUN_DIR`."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from difftrain.cli.common import console, fmt_count, kv_table, plural

FORMATS = ("hf",)


def export_command(
    run_dir: Path = typer.Argument(..., help="Run directory to export."),
    out_dir: Path = typer.Argument(..., help="Folder to write the exported model to."),
    format: str = typer.Option("hf", "--format", help="hf: Hugging Face transformers (Llama / DiffLlama)."),
    dtype: str = typer.Option(
        "float32", "--dtype", help="Weight dtype: float32 (exact), bfloat16 or float16 (half the size)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into OUT_DIR even if it is not empty."),
) -> None:
    """Export a run for transformers: baseline → LlamaForCausalLM, diff → DiffLlamaForCausalLM."""
    from difftrain.errors import InteropError
    from difftrain.interop.paths import check_export_paths
    from difftrain.rundir import require_model_files

    if format not in FORMATS:
        raise InteropError(f"--format {format!r} is not supported; choose one of: {', '.join(FORMATS)}")
    check_export_paths(run_dir, out_dir, dtype)  # mistakes in the options and paths fail before torch loads
    require_model_files(run_dir)
    from difftrain.interop.hf import export_hf

    r = export_hf(run_dir, out_dir, dtype=dtype, overwrite=overwrite)
    rows = [
        ("run", str(run_dir)),
        ("model", f"{r.arch} → {r.hf_class} · {fmt_count(r.num_params)} parameters · {r.dtype}"),
        ("wrote", f"{r.out_dir}: {', '.join(r.files)}"),
        *(("note", n) for n in r.notes),
        ("load", f"AutoModelForCausalLM.from_pretrained({str(r.out_dir)!r})"),
    ]
    console.print(kv_table("difftrain export", rows))


def import_command(
    hf_dir: Path = typer.Argument(
        ..., help="transformers checkpoint folder (config.json, *.safetensors, tokenizer.json)."
    ),
    run_dir: Path = typer.Argument(..., help="Run directory to create."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into RUN_DIR even if it is not empty."),
) -> None:
    """Import a Llama / DiffLlama checkpoint into a run directory (generate, eval and finetune accept it)."""
    from difftrain.interop.paths import check_import_paths

    check_import_paths(hf_dir, run_dir)  # a mistyped path fails before torch loads
    from difftrain.interop.hf import import_hf

    r = import_hf(hf_dir, run_dir, overwrite=overwrite)
    c = r.config
    rows = [
        ("from", f"{hf_dir} ({r.hf_class})"),
        (
            "model",
            f"{c.arch} · d_model {c.d_model} · {plural(c.n_layers, 'layer')} · {plural(c.n_heads, 'head')} ({c.n_kv_heads} kv) "
            f"· {fmt_count(r.num_params)} parameters",
        ),
        ("wrote", f"{r.run_dir}: {', '.join(r.files)}"),
        *(("note", n) for n in r.notes),
        ("next", f"difftrain generate {shlex.quote(str(r.run_dir))}"),
    ]
    console.print(kv_table("difftrain import", rows))


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
    app.command("import")(import_command)
