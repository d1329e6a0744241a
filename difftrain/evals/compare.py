"""`difftrain compare`: runs side by side — training figures, every shared eval suite, curves.

Reads only what runs already hold: summary.json, metrics.csv (curves) and eval/<suite>.json (the
`headline` of each suite; a result on `--data` shows as its own section `suite@label`). Nothing is
recomputed; `difftrain eval` fills in missing suites.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from difftrain.errors import ConfigError, DifftrainError, RunDirError
from difftrain.evals import SUITES, check_suite
from difftrain.evals.common import (
    DATA_SUITES,
    check_label,
    describe_data,
    eval_options,
    load_result,
    missing_result,
    rerun_command,
    result_key,
    result_keys,
    same_data,
    split_key,
    stale,
)
from difftrain.io import RunLock, sha256_file
from difftrain.rundir import (
    CONFIG,
    METRICS,
    TOKENIZER,
    imported_from,
    is_adapter_run,
    read_summary,
    require_run_dir,
    require_weights,
    training_command,
)


@dataclass
class RunRecord:
    path: Path
    label: str
    summary: dict[str, Any]
    config: dict[str, Any]
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Row:
    """One line of the comparison: a value per run; `better` = "lower" | "higher" | None."""

    name: str
    values: list[Any]
    better: str | None = None
    format: str = ""

    def best(self) -> int | None:
        """Index of the best run (None without a direction, with fewer than 2 values, or a tie).
        Values are compared as `format` prints them: 4e-7 and -1e-6 (both +0.0000) tie."""
        vals = [(self._shown(v), i) for i, v in enumerate(self.values) if isinstance(v, (int, float))]
        if self.better is None or len(vals) < 2:
            return None
        pick = min(vals) if self.better == "lower" else max(vals)
        return None if sum(v == pick[0] for v, _ in vals) > 1 else pick[1]

    def _shown(self, v: float) -> float:
        """`v` rounded as its format prints it (a fixed-point format: its decimals)."""
        m = re.fullmatch(r"[+ ]?,?\.(\d+)[f%]", self.format or "")
        if m is None:
            return float(v)
        digits = int(m.group(1)) + (2 if self.format.endswith("%") else 0)
        return round(float(v), digits) + 0.0  # (+0.0: -0.0 and 0.0 are one figure)


@dataclass
class Comparison:
    runs: list[RunRecord]
    training: list[Row]
    suites: dict[str, list[Row]]
    partial: dict[str, list[str]]
    """Results present in some runs only: suite (or suite@label) → labels of the runs that lack it."""
    notes: list[str]
    commands: dict[str, str] = field(default_factory=dict)
    """For each result in `partial`: the `difftrain eval RUN ...` command that makes it."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "runs": [
                {"path": str(r.path), "label": r.label, "arch": r.config.get("arch")} for r in self.runs
            ],
            "training": [asdict(r) for r in self.training],
            "suites": {s: [asdict(r) for r in rows] for s, rows in self.suites.items()},
            "partial": self.partial,
            "commands": self.commands,
            "notes": self.notes,
        }


def _labels(paths: Sequence[Path]) -> list[str]:
    """Each run's folder name (`.` and `..` resolved), or its path where two share a name."""
    names = [p.name if p.name not in ("", ".", "..") else p.resolve().name for p in paths]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths, strict=True)]


def _config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _params(rec: RunRecord) -> int | None:
    if rec.summary.get("params") is not None:
        return int(rec.summary["params"])
    from difftrain.model import ModelConfig
    from difftrain.model.config import num_params

    with contextlib.suppress(Exception):  # a config another version wrote: the count is informative only
        return num_params(ModelConfig.from_dict(rec.config))["total"] if rec.config else None
    return None


MODEL_SETTINGS = {"seq_len"}
"""Settings of a result that the model fixes (its max_seq_len), not an option."""
DATA_SETTINGS = {"data", "sources", "split"}
"""Settings that say what text a suite read: compared by `_data_note`, not as options."""


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [x for k in sorted(set(a) | set(b)) for x in _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _versus(a: dict[str, Any], b: dict[str, Any], keys: Sequence[str]) -> str:
    """`keys` (dotted settings keys) as "key a-value vs b-value, ...", values shortened for a note."""

    def setting(doc: dict[str, Any], key: str) -> str:
        value: Any = doc.get("settings")
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        text = "—" if value is None else str(value)
        return text if len(text) <= 40 else text[:37] + "..."

    return ", ".join(f"{k} {setting(a, k)} vs {setting(b, k)}" for k in keys)


def _data_note(
    key: str, first: RunRecord, a: dict[str, Any], other: RunRecord, b: dict[str, Any]
) -> str | None:
    """The note where two results of a suite that reads text used different (or unknown) data."""
    suite, label = split_key(key)
    same = same_data(a, b)
    if same:
        return None
    if same is None:
        unknown = [
            rec.label
            for rec, doc in ((first, a), (other, b))
            if "sources" not in (doc.get("settings") or {}) and not (doc.get("results") or {}).get("source")
        ]
        who = " and ".join(unknown) or other.label
        return (
            f"{key}: the result of {who} does not record what its validation split was drawn from (an "
            f"older difftrain wrote it), so {first.label} and {other.label} may have been measured on "
            f"different data; rerun `difftrain eval RUN --suite {suite}` on it to record that"
        )
    split = (a.get("settings") or {}).get("sources") == (b.get("settings") or {}).get("sources")
    differs = f"{describe_data(a, split)} vs {describe_data(b, split)}"
    if label is None:
        fix = (
            f"to rank them on the same text, evaluate both on one source neither trained on, "
            f"`difftrain eval RUN --suite {suite} --data PATH`, and compare the `{suite}@<label>` results"
        )
    else:
        fix = (
            f"evaluate {other.label} on the source of {first.label}: "
            f"`{rerun_command(other.path, key, a, dtype=False)}`"
        )
    return f"{key}: {first.label} and {other.label} were measured on different data ({differs}); {fix}"


def _dtype_note(
    key: str, first: RunRecord, a: dict[str, Any], other: RunRecord, b: dict[str, Any]
) -> str | None:
    """The note where two results used different precisions: rerun one (in float32 where one is)."""
    da, db = a.get("dtype"), b.get("dtype")
    if not da or not db or da == db:
        return None
    target = "float32" if "float32" in (da, db) else da
    rec, doc = (other, b) if db != target else (first, a)
    return (
        f"{key}: {first.label} was evaluated in {da} and {other.label} in {db}; rerun "
        f"`{rerun_command(rec.path, key, doc, dtype=False)} --dtype {target}` to compare them at one precision"
    )


def check_result(name: str) -> str:
    """A result name given to `compare --suite`: a suite, or `suite@label` (a result on --data)."""
    suite, label = split_key(name.strip())
    if label is not None:
        check_label(label, f"--suite {name.strip()}: the label {label!r}")
    return result_key(check_suite(suite), label)


def _run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """The run directories `paths` name: two or more, distinct, each a difftrain run."""
    if len(paths) < 2:
        raise ConfigError("compare needs two or more run directories, e.g. `difftrain compare runs/a runs/b`")
    dirs = [require_run_dir(Path(p)) for p in paths]
    seen: dict[Path, Path] = {}
    for d in dirs:
        if not ((d / CONFIG).is_file() or (d / "summary.json").is_file() or (d / METRICS).is_file()):
            raise RunDirError(
                f"{d} is not a difftrain run directory (no config.json, summary.json or metrics.csv)"
            )
        if (other := seen.setdefault(d.resolve(), d)) is not d:
            raise ConfigError(
                f"{d} and {other} are the same run; compare different runs "
                "(`difftrain eval` shows one run's results)"
            )
    return dirs


def _training_note(r: RunRecord) -> str | None:
    """Why a run's training figures are missing (no summary.json) or not final (unfinished)."""
    if not r.summary:
        if source := imported_from(r.path):
            return f"{r.path} was imported from {source} (`difftrain import`): it has no training figures"
        try:  # without weights it has nothing to evaluate either: say what to do about that
            if not is_adapter_run(r.path):
                require_weights(r.path)
            why = "training unfinished?"
        except RunDirError as e:
            why = str(e)
        return f"{r.path} has no summary.json ({why}): its training figures are missing"
    if r.summary.get("finished") is not False:
        return None
    step = r.summary.get("steps")
    try:
        training = RunLock(r.path).holder() is not None
    except DifftrainError as e:  # a .lock this user cannot open: say so, compare the rest
        return (
            f"{r.label} stopped at step {step} or is still training (its lock file cannot be read: "
            f"{e}): its final figures are those of step {step}"
        )
    if training:
        return f"{r.label} is still training: its final figures are those of step {step}"
    cmd = f"difftrain {training_command(r.path)} {shlex.quote(str(r.path))} --resume"
    return (
        f"{r.label} stopped at step {step}, before the end of its training: its final figures are "
        f"those of that step; `{cmd}` finishes it"
    )


def _suite_rows(docs: Sequence[dict[str, Any]]) -> list[Row]:
    """One row per headline figure any of the results has, in order of first appearance."""
    meta: dict[str, dict[str, Any]] = {}
    for d in docs:
        for h in d["headline"]:
            meta.setdefault(h["name"], h)
    return [
        Row(
            n,
            [next((h["value"] for h in d["headline"] if h["name"] == n), None) for d in docs],
            h.get("better"),
            h.get("format", ".4f"),
        )
        for n, h in meta.items()
    ]


def _settings_notes(s: str, runs: Sequence[RunRecord], docs: Sequence[dict[str, Any]]) -> list[str]:
    """The notes where a result `s` of a run was computed otherwise than the first run's."""
    notes: list[str | None] = []
    first, a = runs[0], docs[0]
    for r, d in zip(runs[1:], docs[1:], strict=True):
        keys = _diff_keys(a.get("settings"), d.get("settings"))
        model_keys = [k for k in keys if k in MODEL_SETTINGS]
        keys = [k for k in keys if k not in MODEL_SETTINGS]
        if split_key(s)[0] in DATA_SUITES:
            keys = [k for k in keys if k.split(".")[0] not in DATA_SETTINGS]
            notes.append(_data_note(s, first, a, r, d))
        notes.append(_dtype_note(s, first, a, r, d))
        if model_keys:
            notes.append(
                f"{s}: {first.label} and {r.label} were evaluated at different context lengths "
                f"({_versus(a, d, model_keys)}: each model's max_seq_len), which no eval option changes; compare them "
                "with that in mind"
            )
        if keys:  # every key the command below sets is named, up to five
            shown = _versus(a, d, keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
            options = eval_options(a.get("settings") or {}, keys)
            fix = (
                f"`difftrain eval {shlex.quote(str(r.path))} --suite {split_key(s)[0]} {options}` evaluates "
                f"{r.label} as {first.label} was"
                if options
                else "rerun `difftrain eval` with the same options"
            )
            notes.append(
                f"{s}: {first.label} and {r.label} were evaluated with different settings "
                f"({shown}); {fix}, to compare them fairly"
            )
    for r, d in zip(runs, docs, strict=True):
        if stale(r.path, d):
            notes.append(
                f"{s}: the result of {r.label} predates its current weights; rerun `{rerun_command(r.path, s, d)}`"
            )
    return [n for n in notes if n]


def compare_runs(paths: Sequence[str | Path], suites: Sequence[str] | None = None) -> Comparison:
    """Gather the comparison of `paths` (two or more run directories). `suites`: the results to
    show, by suite or `suite@label` (a RunDirError names a run that lacks one); default: every
    result present in all runs."""
    dirs = _run_dirs(paths)
    wanted = list(dict.fromkeys(check_result(s) for s in suites)) if suites else None
    runs = [
        RunRecord(d, lab, read_summary(d), _config(d)) for d, lab in zip(dirs, _labels(dirs), strict=True)
    ]
    notes = [n for r in runs if (n := _training_note(r))]
    for r in runs:
        for key in (k for s in SUITES for k in result_keys(r.path, s)):
            if (doc := load_result(r.path, key)) is not None:
                r.evals[key] = doc
    # every result some run holds, in the order of SUITES, each suite's own before its labels
    held = sorted(
        {k for r in runs for k in r.evals},
        key=lambda k: (SUITES.index(split_key(k)[0]), split_key(k)[1] or ""),
    )

    def example(key: str) -> dict[str, Any] | None:
        return next((r.evals[key] for r in runs if key in r.evals), None)

    for s in wanted or []:
        for r in runs:
            if s not in r.evals:
                raise missing_result(r.path, s, example(s))
    shown = wanted or [s for s in held if all(s in r.evals for r in runs)]
    partial = (
        {} if wanted else {s: [r.label for r in runs if s not in r.evals] for s in held if s not in shown}
    )

    def get(key: str) -> list[Any]:
        return [r.summary.get(key) for r in runs]

    # all sessions of a resumed run (wall_time_s: the last session's, or an older summary's)
    train_time = [r.summary.get("train_time_s") or r.summary.get("wall_time_s") for r in runs]
    training = [
        Row("arch", [r.config.get("arch") or r.summary.get("arch") for r in runs]),
        Row("params", [_params(r) for r in runs], None, "count"),
        Row("steps", get("steps"), None, "d"),
        Row("tokens", get("tokens"), None, "count"),
        Row("training time (s)", train_time, "lower", ".1f"),
        Row("tokens/s", get("tokens_per_s"), "higher", ",.0f"),
        Row("final train loss", get("final_train_loss"), "lower", ".4f"),
        Row("final val loss", get("final_val_loss"), "lower", ".4f"),
        Row("best val loss", get("best_val_loss"), "lower", ".4f"),
    ]
    table: dict[str, list[Row]] = {}
    for s in shown:
        docs = [r.evals[s] for r in runs]
        table[s] = _suite_rows(docs)
        notes += _settings_notes(s, runs, docs)
    if note := _tokenizer_note(runs):  # per-token figures are shown, not ranked
        notes.append(note)
        ppl_rows = [r for s, rows in table.items() if split_key(s)[0] == "ppl" for r in rows]
        for row in training + ppl_rows:
            if row.name in ("final train loss", "final val loss", "best val loss", "loss", "ppl"):
                row.better = None
    return Comparison(
        runs=runs,
        training=training,
        suites=table,
        partial=partial,
        notes=notes,
        commands={s: rerun_command("RUN", s, example(s)) for s in partial},
    )


def _tokenizer_note(runs: Sequence[RunRecord]) -> str | None:
    """A note where the runs' tokenizer.json files differ: only figures per byte rank them."""
    held: dict[str, tuple[str, Any]] = {}
    for r in runs:
        f = r.path / TOKENIZER
        try:
            held[r.label] = (sha256_file(f), r.config.get("vocab_size"))
        except OSError:
            continue
    if len({digest for digest, _ in held.values()}) < 2:
        return None
    sizes = ", ".join(
        f"{label} {size:,}" if isinstance(size, int) else label for label, (_, size) in held.items()
    )
    return (
        f"the runs use different tokenizers (vocabularies: {sizes}): loss and ppl are per token, and a "
        "token is another unit in each, so they are shown but not ranked; bits/byte compares the runs"
    )


def plot_curves(comparison: Comparison, path: str | Path) -> Path:
    """The loss curves of the compared runs, and recall accuracy against N for the runs that
    have a recall result, as a figure."""
    import difftrain.evals.plots as plots
    from difftrain.train.metrics import read_metrics

    curves = [(r.label, read_metrics(r.path / METRICS)) for r in comparison.runs]
    if not any(rows for _, rows in curves):
        raise RunDirError(
            "none of the runs has a metrics.csv with logged steps, so there are no curves to plot"
        )
    recall = [(r.label, r.evals["recall"]["results"]) for r in comparison.runs if "recall" in r.evals]
    return plots.loss_curves(curves, path, recall)
