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
    """A rich progress display for data preparation; yields the callback `prepare_data` calls.

    The callback receives `difftrain.data.shards.PrepareProgress` reports (stage, source,
    documents, bytes, tokens, total_bytes) and shows one bar per stage.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )
    tasks: dict[str, Any] = {}
    labels = {"tokenizer": "training tokenizer", "shards": "tokenizing"}

    def update(p: Any) -> None:
        info = f"{p.source} · {fmt_count(p.documents)} docs" + (
            f" · {fmt_count(p.tokens)} tokens" if p.tokens else ""
        )
        if p.stage not in tasks:
            tasks[p.stage] = bars.add_task(labels.get(p.stage, p.stage), total=p.total_bytes, info=info)
        bars.update(tasks[p.stage], completed=p.bytes, total=p.total_bytes, info=info)

    with bars:
        yield update
