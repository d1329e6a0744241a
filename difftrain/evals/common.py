"""What every evaluation suite shares: options, the result file, seeds, option checks.

A suite is a function `run(run, opts, progress) -> SuiteOutput` (see `difftrain.evals.SUITES`).
Its result is one JSON document, written atomically to `RUN_DIR/eval/<suite>.json`:

    {
      "suite": "ppl", "format": 1, "run": "runs/quickstart", "arch": "diff", "params": 4194304,
      "label": null,         set (e.g. "wiki") when the suite ran on `--data`: see below
      "weights": {"size": ..., "mtime_ns": ..., "sample": ..., "step": ...},   the weights evaluated
      "created": "2025-01-01T12:00:00+0000", "seconds": 12.3, "device": "cpu", "dtype": "float32",
      "settings": {...},     everything that decides the numbers (grid, seed, data, windows);
                             a suite that reads text records `data` ("validation" or --data as
                             written) and `sources`, what it was drawn from, paths made absolute
      "results": {...},      the suite's figures
      "headline": [{"name": "loss", "value": 3.2, "better": "lower", "format": ".4f"}, ...],
      "plots": ["eval/needle.png"],   relative to the run directory
      "notes": [...]
    }

A suite that reads text (ppl, outliers, quant) run with `--data SOURCE` writes
`RUN_DIR/eval/<suite>@<label>.json` (label: the source's name, e.g. `wiki` for data/wiki.txt, or
`--data-label`); `result_key` is the file's stem. `headline` lets `difftrain compare` show any
suite; `settings` lets it warn when two runs were evaluated differently.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftrain.errors import ConfigError, RunDirError
from difftrain.io import RunLock, atomic_write_json
from difftrain.rundir import WEIGHTS, Run

FORMAT = 1
EVAL_DIR = "eval"

Progress = Callable[[int, int], None]
"""progress(done, total): called by a suite as its work advances (the CLI draws a bar)."""


def _no_progress(done: int, total: int) -> None:
    pass


@dataclass
class EvalOptions:
    """Settings of one `difftrain eval` invocation. Unset (None) grid options take the suite's
    default; `full` switches to the paper-sized grids."""

    seed: int = 0
    full: bool = False
    batch_size: int = 8
    data: str | None = None
    windows: int | None = None
    lengths: list[int] | None = None
    depths: list[float] | None = None
    needles: list[tuple[int, int]] | None = None
    pairs: list[int] | None = None
    distractors: list[float] | None = None
    samples: int | None = None
    tokens: int | None = None
    bits: list[int] | None = None
    with_needle: bool = False
    demos: int | None = None
    permutations: int | None = None
    items: int | None = None
    plot: bool | None = None
    """None: the suite's default (needle, quant and recall draw their figure, attention does not)."""
    data_label: str | None = None
    text_field: str | None = None
    """With `data`: the field of its records read as plain text."""


@dataclass
class SuiteOutput:
    """What a suite function returns; `finish` wraps it into the result document."""

    settings: dict[str, Any]
    results: dict[str, Any]
    headline: list[dict[str, Any]]
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    label: str | None = None


def headline(name: str, value: float | None, better: str | None = None, fmt: str = ".4f") -> dict[str, Any]:
    """One figure of a suite's summary: `better` is "lower", "higher" or None (no direction)."""
    return {"name": name, "value": value, "better": better, "format": fmt}


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts: `data.builtin.stable_seed` less its lowest bit."""
    from difftrain.data.builtin import stable_seed as seed64

    return seed64(*parts) >> 1


DATA_SUITES = ("ppl", "outliers", "quant")
"""The suites that read text, and so take `--data`."""


def check_label(label: str, given: str | None = None) -> str:
    """A `--data-label` (part of a file name); `given`: how the user wrote it, for the message."""
    if not re.fullmatch(r"[^\W_][\w.-]{0,63}", label) or label.endswith(".json"):
        raise ConfigError(
            f"{given or f'--data-label {label!r}'} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it names the result file eval/<suite>@<label>.json), e.g. --data-label wiki"
        )
    return label


def data_label(source: str) -> str:
    """The default label of results on `--data SOURCE`: the source's name without its folder,
    scheme and suffix (`builtin:tiny-stories` → tiny-stories, `data/wiki.txt` → wiki,
    `data/*.txt` → data, `hf:org/set:config@test` → set-config-test)."""

    def last(text: str) -> str:
        literal = os.path.exists(text)  # a file named with [ ] is that file, not a pattern
        parts = [p for p in re.split(r"[\\/]", text) if p and (literal or not any(c in p for c in "*?["))]
        return parts[-1] if parts else ""

    text = source.strip()
    if text.startswith("builtin:"):
        name = text.removeprefix("builtin:")
    elif text.startswith("hf:"):
        rest, _, split = text.removeprefix("hf:").partition("@")
        dataset, _, config = rest.partition(":")
        name = "-".join(p for p in (last(dataset), config, split) if p)
    else:
        name = last(text)
        if "." in name.strip("."):
            name = name.strip(".").rsplit(".", 1)[0]
    name = re.sub(r"[^\w.-]+", "-", name).strip("-._")[:64].rstrip("-._")
    return name or "data"


def result_key(suite: str, label: str | None = None) -> str:
    """The name of a result: the suite, or `suite@label` for a result on `--data`."""
    return f"{suite}@{label}" if label else suite


def split_key(key: str) -> tuple[str, str | None]:
    suite, _, label = key.partition("@")
    return suite, label or None


def result_path(run_dir: Path | str, key: str) -> Path:
    return Path(run_dir) / EVAL_DIR / f"{key}.json"


def result_keys(run_dir: Path | str, suite: str) -> list[str]:
    """The results of `suite` a run holds: its own (if any), then those on `--data` by label."""
    folder = Path(run_dir) / EVAL_DIR
    keys = [suite] if (folder / f"{suite}.json").is_file() else []
    return keys + sorted(p.stem for p in folder.glob(f"{glob.escape(suite)}@*.json") if p.is_file())


def finish(run: Run, suite: str, out: SuiteOutput, seconds: float) -> dict[str, Any]:
    """The result document of a suite run (see the module docstring)."""
    p = next(run.model.parameters())
    w = trained_file(run.path)
    st = w.stat() if w.is_file() else None
    step = weights_step(w) if st else None
    if (pid := RunLock(run.path).holder()) is not None:
        at = f" at step {step}" if step is not None else ""
        out.notes.append(
            f"{run.path} is still training (process {pid or '?'}): these are the results of its weights{at}, "
            "the last it saved; evaluate again when it ends"
        )
    return {
        "suite": suite,
        "label": out.label,
        "format": FORMAT,
        "run": str(run.path),
        "arch": run.config.arch,  # type: ignore[attr-defined]
        "params": sum(p.numel() for p in run.model.parameters()),
        "weights": {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample": weights_sample(w), "step": step}
        if st
        else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(seconds, 3),
        "device": str(p.device),
        "dtype": str(p.dtype).removeprefix("torch."),
        "settings": out.settings,
        "results": out.results,
        "headline": out.headline,
        "plots": [stored_plot_path(run.path, p) for p in out.plots],
        "notes": out.notes,
    }


def stored_plot_path(run_dir: Path, plot: str) -> str:
    """A figure as a result names it: relative to the run directory where it lies in it, else absolute."""
    p = Path(plot).resolve()
    try:
        return p.relative_to(Path(run_dir).resolve()).as_posix()
    except ValueError:
        return str(p)


def plot_path(run_dir: Path | str, plot: str) -> Path:
    """A result's figure as a path from here (`stored_plot_path` in reverse; a path relative to
    the current folder that exists there is kept as it is)."""
    p = Path(plot)
    if p.is_absolute() or (p.exists() and not (Path(run_dir) / p).exists()):
        return p
    return Path(run_dir) / p


def save_result(run_dir: Path | str, doc: dict[str, Any]) -> Path:
    """Write the result atomically to its `result_path`; returns that path."""
    key = result_key(doc["suite"], doc.get("label"))
    path = result_path(run_dir, key)
    old: dict[str, Any] = {}
    with contextlib.suppress(RunDirError):  # a damaged result is replaced, not read
        old = load_result(run_dir, key) or {}
    atomic_write_json(path, doc)
    # a figure of the replaced result that this one did not redraw (--no-plot) would show stale
    # figures next to the new JSON: removed (only files in eval/)
    kept = {plot_path(run_dir, p).resolve() for p in doc.get("plots", [])}
    folder = path.parent.resolve()
    for p in old.get("plots", []):
        fig = plot_path(run_dir, str(p)).resolve()
        if fig not in kept and fig.parent == folder and fig.is_file():
            with contextlib.suppress(OSError):
                fig.unlink()
    return path


def load_result(run_dir: Path | str, key: str) -> dict[str, Any] | None:
    """The stored result `key` (a suite, or `suite@label`) of a run, or None when it was never run."""
    path = result_path(run_dir, key)
    if not path.is_file():
        return None
    suite, label = split_key(key)
    again = rerun_command(run_dir, key)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path} is not valid JSON ({e}); delete it and run `{again}` again") from e
    if (
        not isinstance(doc, dict)
        or doc.get("suite") != suite
        or (doc.get("label") or None) != label
        or not isinstance(doc.get("headline"), list)
    ):
        raise RunDirError(f"{path} is not a difftrain eval result; delete it and run `{again}`")
    return doc


def missing_result(run_dir: Path | str, key: str, example: dict[str, Any] | None = None) -> RunDirError:
    """The error for result `key` a run lacks, with the command that makes it (`example`: another
    run's result, whose --data source and options the command takes)."""
    from difftrain.rundir import imported_from

    suite, label = split_key(key)
    if label is None and suite in DATA_SUITES and imported_from(Path(run_dir)) is not None:
        return RunDirError(
            f"{run_dir} has no `{key}` result: it was imported, so it has no validation split to measure; "
            f"measure the runs on one source with `difftrain eval RUN --suite {suite} --data SOURCE` and "
            f"compare that result, `--suite {suite}@LABEL`"
        )
    return RunDirError(
        f"{run_dir} has no `{key}` result ({result_path(run_dir, key)}); "
        f"run `{rerun_command(run_dir, key, example)}` first"
    )


def bits_label(bits: int) -> str:
    """A quant width as the table and plot show it (16: the unquantized reference)."""
    return "16 = none (ref)" if bits >= 16 else str(bits)


EVAL_OPTIONS = (
    *("windows", "lengths", "depths", "needles", "pairs", "distractors", "samples", "tokens"),
    *("bits", "demos", "permutations", "items", "seed"),
)
"""A result's settings that an `eval` option (`--<setting>`) sets."""


def eval_options(settings: dict[str, Any], keys: list[str]) -> str:
    """The eval options that give a result `settings` for the differing `keys` ('' where a key
    is set by no option)."""
    parts = []
    for k in keys:
        if k not in EVAL_OPTIONS or settings.get(k) is None:
            return ""
        v = settings[k]
        if isinstance(v, list):
            v = ",".join(
                "x".join(map(str, x)) if isinstance(x, list) else f"{x:g}" if isinstance(x, float) else str(x)
                for x in v
            )
        parts.append(f"--{k} {v}")
    return " ".join(parts)


def rerun_command(
    run_dir: Path | str, key: str, doc: dict[str, Any] | None = None, *, dtype: bool = True
) -> str:
    """The `difftrain eval` command that (re)makes result `key` of a run; given the stored result
    `doc`, with the options, --data source and (`dtype`) precision that reproduce it."""
    suite, label = split_key(key)
    cmd = f"difftrain eval {shlex.quote(str(run_dir))} --suite {suite}"
    doc = doc or {}
    settings = doc.get("settings") or {}
    if label:
        source = settings.get("data")
        sources = settings.get("sources")
        if isinstance(sources, list) and len(sources) == 1 and isinstance(sources[0], str):
            source = sources[0]  # as recorded: absolute, so the command works from any folder
        cmd += f" --data {shlex.quote(str(source)) if source else 'SOURCE'}"
        if source is None or data_label(str(source)) != label:
            cmd += f" --data-label {label}"
        if settings.get("text_field"):
            cmd += f" --text-field {shlex.quote(str(settings['text_field']))}"
    keys = [k for k in EVAL_OPTIONS if settings.get(k) is not None]
    parts = [eval_options(settings, keys)]
    needle = settings.get("needle")
    if isinstance(needle, dict):
        parts += [
            "--with-needle",
            eval_options(needle, [k for k in EVAL_OPTIONS if needle.get(k) is not None and k not in keys]),
        ]
    if dtype and doc.get("dtype"):
        parts.append(f"--dtype {doc['dtype']}")
    return " ".join(p for p in (cmd, *parts) if p)


def evaluated_source(data: str) -> str:
    """A `--data` source as a result records it: a local path made absolute against the current
    folder; builtin: and hub sources as written."""
    from difftrain.data.config import absolute_source

    return absolute_source(data.strip(), Path.cwd())


def same_data(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two results of a suite that reads text were measured on the same data: the same
    split ("validation" or --data) of the same `sources`. Without `sources`, judged by
    `results.source`; None where that is missing too and both read a validation split."""
    sa, sb = a.get("settings") or {}, b.get("settings") or {}
    split_a, split_b = (s.get("data") or "validation" for s in (sa, sb))
    if isinstance(sa.get("sources"), list) and isinstance(sb.get("sources"), list):
        if "split" in sa and "split" in sb and sa["split"] != sb["split"]:
            return False  # another seed or val_fraction draws other documents
        return (split_a == "validation") == (split_b == "validation") and sa["sources"] == sb["sources"]
    ta, tb = ((d.get("results") or {}).get("source") for d in (a, b))
    if ta and tb:
        return bool(ta == tb)
    if split_a != split_b:
        return False
    return None if split_a == "validation" else True


def describe_data(doc: dict[str, Any], with_split: bool = False) -> str:
    """What a result of a suite that reads text was measured on, for a message; `with_split`:
    with the seed and val_fraction that drew a validation split."""
    st = doc.get("settings") or {}
    sources = st.get("sources")
    if isinstance(sources, list) and sources:
        text = ", ".join(map(str, sources))
        drawn = st.get("split")
        if with_split and isinstance(drawn, dict) and {"seed", "val_fraction"} <= set(drawn):
            text += f" (seed {drawn['seed']}, val_fraction {drawn['val_fraction']:g})"
        return f"the validation split of {text}" if st.get("data") in (None, "validation") else text
    source = (doc.get("results") or {}).get("source") or st.get("data")
    return str(source) if source else "unknown data"


def check_data_label(
    run_dir: Path | str, suites: Sequence[str], data: str, label: str | None
) -> list[tuple[Path, str]]:
    """Before `eval --data DATA [--data-label LABEL]` writes eval/<suite>@<label>.json: where such
    a result holds another source, a ConfigError asking for --data-label when the label is the
    default; a label the user gave replaces it, and the (path, old source) pairs say which."""
    chosen = label or data_label(data)
    new = evaluated_source(data)
    clashes: list[tuple[Path, str]] = []
    for s in suites:
        try:
            doc = load_result(run_dir, result_key(s, chosen))
        except RunDirError:
            continue
        if doc is None:
            continue
        st = doc.get("settings") or {}
        sources = st.get("sources")
        if isinstance(sources, list):
            same, old = sources == [new], ", ".join(map(str, sources))
        else:
            same, old = str(st.get("data")) == data.strip(), str(st.get("data") or "unknown data")
        if not same:
            clashes.append((result_path(run_dir, result_key(s, chosen)), old))
    if clashes and label is None:
        path, old = clashes[0]
        taken = {p.stem.partition("@")[2] for p in (Path(run_dir) / EVAL_DIR).glob("*@*.json")}
        free = next(f"{chosen[:60]}-{i}" for i in range(2, 10_000) if f"{chosen[:60]}-{i}" not in taken)
        raise ConfigError(
            f"{path} holds the result on {old}, not {data}; keep both with --data-label NAME "
            f"(e.g. --data-label {free}), or replace that result with --data-label {chosen}"
        )
    return clashes


SAMPLE_BYTES = 1 << 16


def trained_file(run_dir: Path) -> Path:
    """The file training rewrites: model.safetensors, or a LoRA run's adapter.safetensors."""
    from difftrain.adapters import ADAPTER_WEIGHTS

    w, adapter = run_dir / WEIGHTS, run_dir / ADAPTER_WEIGHTS
    return adapter if not w.is_file() and adapter.is_file() else w


def weights_step(path: Path) -> int | None:
    """The training step in a weights file's metadata, or None (imported, merged, unreadable)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {}).get("step", ""))
    except Exception:  # the loader names a damaged file
        return None


def weights_sample(path: Path) -> str:
    """A digest of three 64 KiB stretches of a weights file: its start, middle and end."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def stale(run_dir: Path | str, doc: dict[str, Any]) -> bool:
    """Whether the weights changed since the result was computed: the same size and mtime mean
    the same file; a new mtime (a copied run folder) is checked by the content sample."""
    w = trained_file(Path(run_dir))
    seen = doc.get("weights")
    if not w.is_file() or not seen:
        return False
    st = w.stat()
    if st.st_size != seen["size"]:
        return True
    if st.st_mtime_ns == seen["mtime_ns"]:
        return False
    return seen.get("sample") is None or seen["sample"] != weights_sample(w)


def check_positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{name} {value} must be ≥ {minimum}")


BITS = [8, 6, 4]
REFERENCE_BITS = 16


def check_bits(bits: list[int] | None) -> list[int]:
    """The quant suite's widths, the unquantized reference first."""
    bits = list(BITS if bits is None else bits)
    if not bits:
        raise ConfigError("--bits is empty; give bit widths such as 8,6,4")
    if bad := [b for b in bits if not 2 <= b <= 16]:
        raise ConfigError(f"--bits {bad[0]} is out of range; widths go from 2 to 16 (16 = no quantization)")
    return [REFERENCE_BITS] + sorted({b for b in bits if b < REFERENCE_BITS}, reverse=True)


def check_depths(depths: Sequence[float] | None) -> None:
    if depths is not None and not depths:
        raise ConfigError("--depths is empty; give fractions in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    for d in depths or []:
        if not 0.0 <= d <= 1.0:
            raise ConfigError(f"--depths {d:g} is outside [0, 1] (0 = start, 1 = end of the context)")


def batches(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None
