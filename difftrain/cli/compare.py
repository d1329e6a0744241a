"""`difftrain compare RUN_DIR RUN_DIR ... [--plot compare.png]`: runs side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from difftrain.cli.common import console, fmt_count, fmt_figure, warn

HELP = """Compare two or more runs side by side.

One table: parameters, tokens, training time, tokens/s, final and best validation loss (from each
run's summary.json), then the headline figures of every eval suite present in all the runs
(RUN_DIR/eval/<suite>.json, made by `difftrain eval`; a suite evaluated on another source with
`eval --data` shows as `suite@label`); the best value of each row is bold. --suite insists on
given suites (an error names the runs that lack them). Notes flag results measured differently:
other options, other data (a validation split drawn from other sources, another --data source)
or another precision (eval --dtype), each with the command that evens them out. --plot draws the
loss curves (train and validation, against tokens and against training time) as a PNG, SVG
or PDF, by the suffix of the file name.
"""


def _cell(value: Any, fmt: str) -> str:
    if fmt == "count" and value is not None:
        return fmt_count(value)
    if value is None or (isinstance(value, (int, float)) and fmt):
        return fmt_figure(value, fmt)  # "—" for None; -1e-6 → +0.0000
    return str(value)


def render(cmp: Any) -> None:
    t = Table(title="difftrain compare", title_justify="left")
    t.add_column("", style="bold", no_wrap=True)
    for r in cmp.runs:
        t.add_column(r.label, justify="right")

    def add(rows: list[Any]) -> None:
        for row in rows:
            best = row.best()
            cells = [_cell(v, row.format) for v in row.values]
            if best is not None:
                cells[best] = f"[bold green]{cells[best]}[/]"
            t.add_row(row.name + {"lower": "  ↓", "higher": "  ↑"}.get(row.better, ""), *cells)

    add(cmp.training)
    for suite, rows in cmp.suites.items():
        t.add_section()
        t.add_row(f"[cyan]{suite}[/]", *[""] * len(cmp.runs))
        add(rows)
    console.print(t)
    for suite, missing in cmp.partial.items():
        command = cmp.commands.get(suite, f"difftrain eval RUN --suite {suite}")
        warn(
            f"`{suite}` is not in every run (missing in {', '.join(missing)}); run `{command}` on them to include it",
            "note",
        )
    for note in cmp.notes:
        warn(note, "note")


def compare_command(
    run_dirs: list[str] = typer.Argument(..., help="Two or more run directories."),
    plot: str = typer.Option(None, "--plot", help="Write the loss curves to this .png, .svg or .pdf file."),
    suite: list[str] = typer.Option(
        None, "--suite", "-s", help="Eval suites to show (each run must have them), e.g. ppl,ppl@wiki."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON on stdout."),
) -> None:
    from difftrain.rundir import require_run_dir

    for d in run_dirs:  # a mistyped path fails before torch loads
        require_run_dir(Path(d))
    from difftrain.evals.compare import compare_runs, plot_curves

    suites = [p.strip() for s in suite or [] for p in s.split(",") if p.strip()]
    if plot is not None:
        from difftrain.evals import plots

        plots.check_target(plot)
        plots.require()
    cmp = compare_runs(run_dirs, suites or None)
    written = plot_curves(cmp, plot) if plot is not None else None
    if as_json:
        doc = {**cmp.as_dict(), "plot": str(written) if written else None}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    render(cmp)
    if written is not None:
        console.print(f"[dim]figure:[/] {written}")


def register(app: typer.Typer) -> None:
    app.command("compare", help=HELP)(compare_command)
