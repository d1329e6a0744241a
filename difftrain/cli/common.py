"""Shared rendering helpers of the CLI: consoles, tables, number formatting, progress."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def fmt_count(n: float) -> str:
    """12_345_678 → '12.3M'."""
    n = float(n)
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    return table


@contextlib.contextmanager
def data_progress() -> Iterator[Any]:
    """A rich progress display for data preparation; yields the callback the data library calls.

    The callback is `progress(stage, done, total=None, **info)`: stage is a label ("reading",
    "tokenizer", "tokenizing", ...), done/total count documents or bytes.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int = 0, total: int | None = None, **info: Any) -> None:
        text = " · ".join(f"{k} {fmt_count(v) if isinstance(v, (int, float)) else v}" for k, v in info.items())
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total, info=text)
        bars.update(tasks[stage], completed=done, total=total, info=text)

    with bars:
        yield update
