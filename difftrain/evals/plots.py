"""Figures of the evaluations and of `difftrain compare` (PNG; compare: SVG or PDF too, by suffix).

matplotlib is optional (`pip install 'difftrain[plot]'`): imported lazily, a DifftrainError
says how to install it. Figures use matplotlib's object API (no pyplot state, no GUI backend)
and are written atomically.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from difftrain.errors import DifftrainError
from difftrain.evals.common import bits_label
from difftrain.io import atomic_path

MISSING = (
    "matplotlib is not installed, so no figure was drawn; install it with `pip install 'difftrain[plot]'`"
)


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require() -> None:
    """Raise a DifftrainError with the install command when matplotlib is missing."""
    if not available():
        raise DifftrainError(
            "plotting needs matplotlib, which is not installed; install it with `pip install 'difftrain[plot]'`"
        )


def draw(out: Any, plot: bool | None, run: Any, suite: str, make: Callable[[Path, str], object]) -> None:
    """A suite's figure: `make(path, title)` to RUN_DIR/eval/<suite>.png, listed in `out.plots`,
    unless `plot` is False. Without matplotlib: a DifftrainError where `plot` is True (asked
    for), else a note in `out.notes`."""
    path = run.path / "eval" / f"{suite}.png"
    if plot is not False and available():
        make(path, f"{run.path.name} ({run.config.arch})")
        out.plots.append(str(path))
    elif plot:
        require()
    elif plot is None:
        out.notes.append(MISSING)


def _figure(w: float, h: float) -> Any:
    require()
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=110, layout="constrained")


def _suptitle(fig: Any, text: str, fontsize: float = 12.0) -> None:
    """`fig.suptitle(text)`, each line wrapped to the figure's width."""
    import textwrap

    per_line = max(20, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))  # ~0.6 em per character
    wrapped = "\n".join(
        textwrap.fill(line, per_line, break_on_hyphens=False, break_long_words=True)
        for line in text.split("\n")
    )
    fig.suptitle(wrapped, fontsize=fontsize)


FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def figure_format(path: Path | str) -> str:
    """The format of a figure at `path`, from its suffix (case ignored)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        what = f"ends in {suffix!r}" if suffix else "has no suffix"
        raise DifftrainError(
            f"the figure path {str(path)!r} {what}; name it with one of {', '.join(FORMATS)} "
            f"(e.g. compare.png)"
        )
    return FORMATS[suffix]


def check_target(path: Path | str) -> None:
    """Check a figure path the user gave (compare --plot) before anything is computed."""
    from difftrain.io import unwritable_file_reason

    figure_format(path)
    path = Path(path)
    if path.is_dir():
        raise DifftrainError(
            f"the figure path {str(path)!r} is a folder; name a file in it, e.g. {path / 'compare.png'}"
        )
    if (why := unwritable_file_reason(path)) is not None:
        raise DifftrainError(f"cannot write the figure {str(path)!r}: {why}; choose another path")


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


def _save(fig: Any, path: Path | str) -> Path:
    path = Path(path)
    fmt = figure_format(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt)
    return path


def needle_heatmap(
    results: dict[str, Any], settings: dict[str, Any], path: Path | str, title: str = ""
) -> Path:
    """Accuracy per context length (rows) × needle depth (columns), one panel per (N, R)."""
    lengths, depths = settings["lengths"], settings["depths"]
    needles = [tuple(x) for x in settings["needles"]]
    cols = min(len(needles), 3)
    rows = -(-len(needles) // cols)
    fig = _figure(1.0 + 4.2 * cols, 0.9 + (0.45 * len(lengths) + 1.4) * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    cells = {
        (c["context_tokens"], c["depth"], c["n_needles"], c["n_queries"]): c["accuracy"]
        for c in results["cells"]
    }
    image = None
    for ax, (n, r) in zip(axes, needles, strict=False):
        grid = np.array([[cells.get((L, d, n, r)) or 0.0 for d in depths] for L in lengths])
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        for (i, j), v in np.ndenumerate(grid):
            color = "black" if 0.25 < v < 0.8 else "white"
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color=color)
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set(xlabel="depth of the queried needle", ylabel="context length (tokens)")
        acc = next(
            (b["accuracy"] for b in results["by_needles"] if (b["n_needles"], b["n_queries"]) == (n, r)), None
        )
        ax.set_title(
            f"N={n} needles, R={r} queried" + (f" — mean {acc:.2f}" if acc is not None else ""), fontsize=10
        )
    for ax in axes[len(needles) :]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=list(axes[: len(needles)]), label="retrieval accuracy", shrink=0.9)
    _suptitle(
        fig,
        f"Multi-needle retrieval{' — ' + title if title else ''} ({settings['samples']} samples per cell)",
    )
    return _save(fig, path)


def attention_maps(
    maps: Sequence[np.ndarray],
    path: Path | str,
    *,
    arch: str,
    answer_span: tuple[int, int] | None = None,
    query_rows: Sequence[int] = (),
    title: str = "",
) -> Path:
    """A grid of layers (rows) × heads (columns) of one prompt's effective attention maps
    (maps[l]: (heads, T, S)), on one colour scale with a √ stretch (most mass sits on a few
    keys): sequential for softmax maps, diverging around 0 for the signed differential maps.
    The answer span's key columns are outlined in blue, the probed query rows ticked."""
    from matplotlib.colors import FuncNorm

    n_layers, n_heads = len(maps), maps[0].shape[0]
    panel = max(1.2, min(2.0, 16.0 / max(n_heads, n_layers)))
    fig = _figure(max(7.5, 1.4 + panel * n_heads), 1.2 + panel * n_layers)
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    signed = arch != "baseline"
    # The first query rows attend to a handful of keys and always reach ±1; scaling to them would
    # wash out every other row, so the scale comes from the rows after them (beyond it: clipped).
    skip = min(8, maps[0].shape[1] // 4)
    lim = max(float(np.abs(m[:, skip:]).max()) for m in maps) or 1.0
    sqrt_stretch = (lambda x: np.sign(x) * np.sqrt(np.abs(x)), lambda y: np.sign(y) * y * y)
    norm = FuncNorm(sqrt_stretch, vmin=-lim if signed else 0.0, vmax=lim)
    cmap = "RdBu_r" if signed else "magma"
    image = None
    for li, m in enumerate(maps):
        for h in range(n_heads):
            ax = axes[li, h]
            image = ax.imshow(m[h], cmap=cmap, norm=norm, interpolation="nearest")
            if answer_span is not None:
                ax.axvspan(
                    answer_span[0] - 0.5, answer_span[1] - 0.5, fill=False, edgecolor="tab:blue", lw=0.9
                )
            for q in query_rows:
                ax.plot([-0.5], [q], marker="_", color="black", markersize=5, clip_on=False)
            ax.set(xticks=[], yticks=[])
            if li == 0:
                ax.set_title(f"head {h}", fontsize=9)
            if h == 0:
                ax.set_ylabel(f"layer {li}\nquery position", fontsize=8)
            if li == n_layers - 1:
                ax.set_xlabel("key position", fontsize=8)
    kind, label = {
        "baseline": ("softmax maps", "attention probability"),
        "diff": ("differential maps A1 − λA2", "A1 − λ·A2"),
    }.get(arch, ("combined maps A2i − σ(λ)A2i+1", "A2i − σ(λ)·A2i+1"))
    if image is not None:
        fig.colorbar(
            image,
            ax=axes.ravel().tolist(),
            label=f"{label} (√ scale)",
            shrink=0.7,
            extend="both" if signed else "max",
        )
    _suptitle(
        fig,
        f"Attention {kind}{' — ' + title if title else ''}\n"
        "blue box: answer span (keys) · black ticks: query rows predicting the value",
        fontsize=10,
    )
    return _save(fig, path)


def quant_curve(rows: Sequence[dict[str, Any]], path: Path | str, title: str = "") -> Path:
    """Loss (and needle accuracy, when measured) against the bits of the attention logits."""
    has_needle = any(r.get("needle_accuracy") is not None for r in rows)
    fig = _figure(5.0 + (4.5 if has_needle else 0.0), 3.6)
    axes = fig.subplots(1, 2 if has_needle else 1, squeeze=False)[0]
    bits = [r["bits"] for r in rows]
    x = list(range(len(bits)))
    ax = axes[0]
    losses = [r["loss"] for r in rows]
    ax.plot(x, losses, marker="o", color="tab:red")
    # at least ±0.01 nats of room, so that rounding noise does not look like a cliff
    pad = max(0.01, 0.1 * (max(losses) - min(losses)))
    ax.set_ylim(min(losses) - pad, max(losses) + pad)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xticks(x, [bits_label(b) for b in bits])
    _label(ax, "bits of the attention logits", "loss (nats/token)", "loss")
    if has_needle:
        ax = axes[1]
        ax.plot(x, [r.get("needle_accuracy") for r in rows], marker="o", color="tab:green")
        ax.set_xticks(x, [str(b) for b in bits])
        ax.set_ylim(-0.02, 1.02)
        _label(ax, "bits of the attention logits", "needle retrieval accuracy", "retrieval")
    _suptitle(fig, f"Attention-logit quantization (dynamic absmax){' — ' + title if title else ''}")
    return _save(fig, path)


def _recall_panel(ax: Any, runs: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Accuracy against N on `ax`: one colour per run, one line style per distractor rate."""
    styles = ["-", "--", ":", "-."]
    rates = sorted({c["distractor_rate"] for _, res in runs for c in res["cells"]})
    for i, (label, res) in enumerate(runs):
        for j, rate in enumerate(rates):
            cells = sorted(
                (c for c in res["cells"] if c["distractor_rate"] == rate and c["accuracy"] is not None),
                key=lambda c: c["n_pairs"],
            )
            if cells:
                ax.plot(
                    [c["n_pairs"] for c in cells],
                    [c["accuracy"] for c in cells],
                    color=f"C{i % 10}",
                    ls=styles[j % len(styles)],
                    marker="o",
                    markersize=3.5,
                    label=f"{label}, distractors {rate:g}",
                )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter("{x:g}")
    ax.set_ylim(-0.03, 1.03)
    _label(
        ax, "N (key→value pairs in the context)", "exact-match accuracy", "associative recall: accuracy vs N"
    )
    ax.legend(fontsize=7)


def recall_curves(runs: Sequence[tuple[str, dict[str, Any]]], path: Path | str, title: str = "") -> Path:
    """Recall accuracy against N for each run (label, the `results` of recall.json)."""
    fig = _figure(6.4, 4.4)
    _recall_panel(fig.subplots(1, 1), runs)
    if title:
        _suptitle(fig, title)
    return _save(fig, path)


def loss_curves(
    runs: Sequence[tuple[str, list[dict[str, Any]]]],
    path: Path | str,
    recall: Sequence[tuple[str, dict[str, Any]]] = (),
) -> Path:
    """Train and validation loss of each run against tokens seen and against training time;
    with `recall` (label, recall results), a third panel of recall accuracy vs N."""
    fig = _figure(18.0 if recall else 12.0, 4.4)
    axes = fig.subplots(1, 3 if recall else 2)
    if recall:
        _recall_panel(axes[2], recall)
    styles = {"train": {"lw": 1.0, "alpha": 0.55}, "val": {"lw": 1.8, "marker": "o", "markersize": 3.5}}
    panels = (
        ("train/tokens", "tokens seen", "tokens"),
        ("train/time_s", "training time (s)", "training time"),
    )
    for ax, (key, xlabel, what) in zip(axes[:2], panels, strict=True):
        for i, (label, rows) in enumerate(runs):
            for split, style in styles.items():
                if pts := [r for r in rows if f"{split}/loss" in r and key in r]:
                    xs, ys = [r[key] for r in pts], [r[f"{split}/loss"] for r in pts]
                    ax.plot(xs, ys, color=f"C{i % 10}", label=f"{label} {split}", **style)
        _label(ax, xlabel, "loss (nats/token)", f"loss vs {what}")
        ax.legend(fontsize=7)
    _suptitle(fig, "Training curves (thin: train loss, dots: validation loss)")
    return _save(fig, path)
