"""metrics.csv: one row per logged step, rewritten atomically, continued across resumes.

Unlike Lightning's CSVLogger, a resumed run keeps the rows up to the checkpoint it resumes from
(it logs the later steps again), so the file holds one continuous curve.
"""

from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

from difftrain.io import atomic_write_text


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.csv as dicts of floats (empty cells omitted). A damaged file (binary
    bytes, a row without a whole step) yields the rows that can be read: the curves of `compare
    --plot` and the rows a resume keeps, not a traceback."""
    rows = []
    # (a missing file: no rows; unreadable from some row on: the rows read so far)
    with (
        contextlib.suppress(OSError, csv.Error),
        open(path, newline="", encoding="utf-8", errors="replace") as f,
    ):
        for r in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in r.items():
                if isinstance(k, str) and k and isinstance(v, str) and v:
                    try:
                        row[k] = int(float(v)) if k == "step" else float(v)
                    except (ValueError, OverflowError):
                        row[k] = v
            if isinstance(row.get("step"), int):
                rows.append(row)
    return rows


class MetricsCSV(Logger):
    def __init__(self, path: Path, resume_step: int | None = None, flush_every: int = 20) -> None:
        super().__init__()
        self.path = Path(path)
        self.flush_every = flush_every
        self.rows: list[dict[str, Any]] = []
        if resume_step is not None:
            self.rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        self._pending = 0

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> str:
        return ""

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The resolved recipe.yaml in the run directory holds every setting."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({"step": step, **{k: float(v) for k, v in metrics.items() if k != "epoch"}})
        self._pending += 1
        if self._pending >= self.flush_every:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        if not self.rows:
            return
        keys = ["step"] + sorted({k for r in self.rows for k in r} - {"step"})
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=keys)
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.path, buf.getvalue())
        self._pending = 0
