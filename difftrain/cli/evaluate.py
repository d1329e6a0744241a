"""`difftrain eval RUN_DIR --suite SUITE`: check the options (before the model loads), run each
suite through `difftrain.evals.evaluate`, save RUN_DIR/eval/<suite>.json and render it."""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from difftrain.cli.common import DEVICE, DTYPE, console, err_console, fmt_count, fmt_figure, kv_table, warn
from difftrain.cli.complete import suite_names
from difftrain.errors import ConfigError, RunDirError

HELP = """Evaluate a run: perplexity, needle retrieval, associative recall, attention and outlier
probes, quantization.

Suites (--suite, repeatable or comma-separated; `all` runs every one):

  ppl        loss, perplexity, bits/byte on the validation windows or --data
  needle     multi-needle retrieval: accuracy over context length × depth ×
             (N needles, R queried), greedy decoding; heat map eval/needle.png
  recall     associative recall: accuracy over N key→value pairs × distractors
  attention  attention mass on the answer span vs the rest of the context
             during retrieval, per layer and depth; --plot: eval/attention.png
  outliers   top-1/2/3/10/100, median and kurtosis of attention logits and
             hidden states
  quant      the ppl figures with attention logits fake-quantized to --bits
             (default 8,6,4), needle accuracy too with --with-needle; plot
             eval/quant.png
  icl-order  in-context classification accuracy over demonstration orders

Results go to RUN_DIR/eval/<suite>.json (with --data: eval/<suite>@<label>.json, see --data-label);
a rerun replaces the result, whatever its --dtype. `--show` prints a run's stored results again;
`difftrain compare` puts runs side by side. Defaults take about a minute per suite on a 2-core CPU
for the quickstart model; --full runs the paper-sized grids.
"""


def _split(text: str | None, what: str, cast: Any) -> list[Any] | None:
    if text is None:
        return None
    out = []
    for part in filter(None, map(str.strip, text.split(","))):
        try:
            out.append(cast(part))
        except ValueError:
            raise ConfigError(f"{what} {part!r} is not a number; give comma-separated numbers") from None
    if not out:
        raise ConfigError(f"{what} is empty; give a comma-separated list")
    return out


def parse_suites(values: list[str] | None) -> list[str]:
    from difftrain.evals import SUITES, check_suite

    parts = _suite_parts(values)
    if part := next((p for p in parts if "@" in p), None):
        raise ConfigError(
            f"--suite {part} names a stored result on another source: run it with --suite "
            f"{part.split('@')[0]} --data SOURCE, or print it with --show --suite {part}"
        )
    names = [s for p in parts for s in (SUITES if p.lower() == "all" else [check_suite(p)])]
    if not names:
        raise ConfigError("--suite is empty; choose from " + ", ".join(SUITES))
    return list(dict.fromkeys(names))


def _suite_parts(values: list[str] | None) -> list[str]:
    """The names --suite was given (repeated, comma-separated; default ppl)."""
    return [p.strip() for v in values or ["ppl"] for p in v.split(",") if p.strip()]


def _acc_cell(v: float | None) -> str:
    if v is None:
        return "—"
    color = "green" if v >= 0.8 else "yellow" if v >= 0.4 else "red"
    return f"[{color}]{v:.2f}[/]"


def _table(heading: str | None, *columns: str, bold: tuple[int, ...] = ()) -> Table:
    """A table of right-aligned `columns` (at the indices `bold`: in bold) after a heading."""
    if heading is not None:
        console.print(f"[bold]{heading}[/]", soft_wrap=True)
    t = Table()
    for i, c in enumerate(columns):
        t.add_column(c, justify="right", style="bold" if i in bold or i - len(columns) in bold else None)
    return t


def render(doc: dict[str, Any], run_dir: Path) -> None:
    """Print one suite's result; `run_dir`: the run as named now (where its plots lie)."""
    from difftrain.evals.common import bits_label, plot_path

    suite, res, st = doc["suite"], doc["results"], doc["settings"]
    title = f"{suite}{'@' + doc['label'] if doc.get('label') else ''} · {run_dir} ({doc['arch']})"
    if suite == "ppl":
        err = f" ± {res['loss_stderr']:.4f}" if res.get("loss_stderr") else ""
        rows = [
            ("data", res["source"]),
            (
                "windows",
                f"{res['windows']} × {st['seq_len']} tokens ({fmt_count(res['tokens'])} tokens, {fmt_count(res['bytes'])} bytes)",
            ),
            ("loss", f"{res['loss']:.4f}{err} nats/token"),
            ("perplexity", f"{res['ppl']:.3f}"),
            ("bits/token", f"{res['bits_per_token']:.4f}"),
            ("bits/byte", fmt_figure(res["bits_per_byte"])),
            *([("note", res["note"])] if res.get("note") else []),
        ]
        console.print(kv_table(title, rows))
    elif suite == "needle":
        for n, r in st["needles"]:
            heading = f"{title} · N={n} needles, R={r} queried · {st['samples']} samples per cell"
            t = _table(heading, "context", *[f"{d:.0%}" for d in st["depths"]], "mean", bold=(0, -1))
            for L in st["lengths"]:
                by_d = {
                    c["depth"]: c["accuracy"]
                    for c in res["cells"]
                    if (c["context_tokens"], c["n_needles"], c["n_queries"]) == (L, n, r)
                }
                vals = [v for v in by_d.values() if v is not None]
                mean = sum(vals) / len(vals) if vals else None
                t.add_row(str(L), *[_acc_cell(by_d.get(d)) for d in st["depths"]], _acc_cell(mean))
            console.print(t)
        console.print(
            f"[bold]accuracy[/] {res['accuracy']:.3f} · exact match (all queries) {res['exact_match']:.3f}"
        )
    elif suite == "recall":
        head = (
            f"{title} · {st['samples']} examples per cell, {st['n_queries']} queries each, "
            f"keys {st['key_vocab']}, values {st['value_vocab']} (exact match per query)"
        )
        t = _table(head, "N pairs", *[f"distractors {r:g}" for r in st["distractors"]], "mean", bold=(0, -1))
        for row in res["by_pairs"]:
            by_r = {
                c["distractor_rate"]: c["accuracy"] for c in res["cells"] if c["n_pairs"] == row["n_pairs"]
            }
            cells = [_acc_cell(by_r.get(r)) for r in st["distractors"]]
            t.add_row(str(row["n_pairs"]), *cells, _acc_cell(row["accuracy"]))
        console.print(t)
        at = res.get("at_recipe")
        tail = f" · at the recipe's N={at['n_pairs']}: {at['accuracy']:.3f}" if at else ""
        console.print(f"[bold]accuracy[/] {res['accuracy']:.3f}{tail}")
    elif suite == "attention":
        signed = doc["arch"] != "baseline"
        columns = ["answer", "noise", *(["|noise|"] if signed else []), "answer share", "noise share"]
        t = _table(f"{title} · map {res['map']} · {res['prompts']} prompts", "needle depth", *columns)
        keys = ["answer", "noise", *(["noise_abs"] if signed else []), "answer_share", "noise_share"]
        for row in res["by_depth"] + [{"depth": None, **{k: res.get(k) for k in keys}}]:
            depth = "mean" if row["depth"] is None else f"{row['depth']:.0%}"
            cells = [fmt_figure(row.get(k), ".3f") for k in keys]
            t.add_row(depth, *cells, style="bold" if row["depth"] is None else None)
        console.print(t)
        lt = _table("per layer (mean over depths)", "layer", "answer", "noise", "answer share")
        for row in res["per_layer"]:
            lt.add_row(
                str(row["layer"]), *[fmt_figure(row.get(k), ".3f") for k in keys[:2] + ["answer_share"]]
            )
        console.print(lt)
        if signed:
            why = (
                "The combined map's rows sum to 1 − σ(λ) (not 1; λ per token and head), and with no subln "
                "that scale reaches the output"
                if doc["arch"] == "diff2"
                else "The differential map's rows sum to its 1 − λ (not 1) and its scale does not reach the "
                "output (subln normalises each head)"
            )
            console.print(f"[dim]{why}: compare the shares across archs, not the masses.", soft_wrap=True)
    elif suite == "outliers":
        head = f"{title} · {fmt_count(res['tokens'])} tokens of the {res['source']}"
        t = _table(head, "", *(f"top-{k}" for k in (1, 2, 3, 10, 100)), "median", "kurtosis", bold=(0,))
        t.columns[0].justify = "left"
        for name, key in (("attention logits", "attention_logits"), ("hidden states", "hidden_states")):
            s = res[key]
            tops = [fmt_figure(s[f"top{k}"], ".2f") for k in (1, 2, 3, 10, 100)]
            t.add_row(name, *tops, fmt_figure(s["median"], ".3f"), fmt_figure(s.get("kurtosis"), ".1f"))
        console.print(t)
        lt = _table("per layer", "layer", "logit top-1", "logit kurtosis", "hidden top-1", "hidden kurtosis")
        for a, h in zip(res["attention_logits"]["per_layer"], res["hidden_states"]["per_layer"], strict=True):
            cells = [
                c
                for x in (a, h)
                for c in (fmt_figure(x["top1"], ".2f"), fmt_figure(x.get("kurtosis"), ".1f"))
            ]
            lt.add_row(str(a["layer"]), *cells)
        console.print(lt)
    elif suite == "quant":
        needle = "needle" in st
        columns = ["bits", "loss", "ppl", "Δloss", "ppl ratio", *(["needle acc", "Δacc"] if needle else [])]
        t = _table(f"{title} · attention logits, dynamic absmax {st['granularity']}", *columns)
        for r in res["rows"]:
            cells = [
                bits_label(r["bits"]),
                f"{r['loss']:.4f}",
                f"{r['ppl']:.3f}",
                fmt_figure(r["delta_loss"], "+.4f"),
                f"{r['ppl_ratio']:.3f}",
            ]
            if needle:
                cells += [f"{r['needle_accuracy']:.3f}", fmt_figure(r["delta_accuracy"], "+.3f")]
            t.add_row(*cells)
        console.print(t)
    elif suite == "icl-order":
        task = f"{st['demos']} demonstrations, {st['items']} test items, labels {' / '.join(st['labels'])}"
        accuracy = (
            f"mean {res['mean']:.3f} · std {res['std']:.3f} · best {res['best']:.3f} · "
            f"worst {res['worst']:.3f} (chance {res['chance']:.2f})"
        )
        rows = [
            ("task", task),
            ("orders", str(st["permutations"])),
            ("accuracy", accuracy),
            ("order margin", f"{res['margin']:.3f} (best − worst)"),
            ("predicts 'high'", f"{res['predicted_high']:.0%} of the time"),
        ]
        console.print(kv_table(title, rows))
    for note in doc.get("notes", []):
        warn(note, "note")
    for p in doc.get("plots", []):
        console.print(f"[dim]figure:[/] {plot_path(run_dir, p)}")


def show_results(run_dir: str, values: list[str] | None, as_json: bool) -> None:
    """`eval --show`: print a run's stored results (every one, or --suite's) and run nothing."""
    from difftrain.evals import SUITES, load_result
    from difftrain.evals.common import missing_result, rerun_command, result_keys, result_path, stale
    from difftrain.evals.compare import check_result
    from difftrain.rundir import is_adapter_run, require_run_dir, require_weights

    run = require_run_dir(Path(run_dir))
    parts = _suite_parts(values or ["all"])
    if any(p.lower() == "all" for p in parts):
        keys = [k for s in SUITES for k in result_keys(run, s)]
        if not keys:
            if not is_adapter_run(run):  # no weights: nothing to evaluate yet, and it says what to do
                require_weights(run)
            raise ConfigError(
                f"{run} holds no eval results yet; make one with `difftrain eval {run} --suite ppl`"
            )
    else:
        keys = list(dict.fromkeys(check_result(p) for p in parts))
    docs: dict[str, Any] = {}
    for key in keys:
        docs[key] = load_result(run, key)
        if docs[key] is None:
            raise missing_result(run, key)
    stale_keys = {key for key, doc in docs.items() if stale(run, doc)}
    if as_json:  # each result as stored, and whether it is stale (the note goes to stderr)
        shown = {key: {**doc, "stale": key in stale_keys} for key, doc in docs.items()}
        sys.stdout.write(json.dumps(shown, indent=2) + "\n")
    for key, doc in docs.items():
        if not as_json:
            render(doc, run)
            step = (doc.get("weights") or {}).get("step")
            on = f" on {doc['device']}" if doc.get("device") else ""
            on += f" in {doc['dtype']}" if doc.get("dtype") else ""
            on += f" · weights of step {step}" if step is not None else ""
            console.print(
                f"[dim]{result_path(run, key)} · computed {doc.get('created', '?')}{on}[/]", soft_wrap=True
            )
        if key in stale_keys:
            warn(f"{key} predates the run's current weights; rerun `{rerun_command(run, key, doc)}`", "note")


_SHOW_PARAMS = {"run_dir", "suite", "as_json", "show"}  # every other option changes what a run computes


def eval_command(
    run_dir: str = typer.Argument(..., help="Run directory (e.g. runs/quickstart)."),
    suite: list[str] = typer.Option(
        None,
        "--suite",
        "-s",
        autocompletion=suite_names,
        help="Suite(s) to run: ppl, needle, recall, attention, outliers, quant, icl-order, all (default ppl).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout (no tables)."),
    show: bool = typer.Option(False, "--show", help="Print stored results (all or --suite's); run nothing."),
    data: str = typer.Option(
        None,
        "--data",
        help="ppl/outliers/quant: evaluate on this source (path, glob, builtin:NAME, hf:NAME) instead of the "
        "validation split; saved as eval/<suite>@<label>.json.",
    ),
    data_label: str = typer.Option(
        None,
        "--data-label",
        help="With --data: the label of its results (default: the source's name, e.g. wiki for data/wiki.txt); "
        "a label given here replaces a result of that label on another source.",
    ),
    text_field: str = typer.Option(
        None,
        "--text-field",
        help="With --data: the field of its records (.jsonl, .json, .parquet, hf:) to read as plain text "
        "(default text; an instruction fine-tune renders records with messages, or prompt and response, "
        "through its template).",
    ),
    full: bool = typer.Option(False, "--full", help="Paper-sized grids (much slower); explicit options win."),
    seed: int = typer.Option(0, "--seed", help="Seed of generated prompts (needle, attention, icl-order)."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward pass."),
    windows: int = typer.Option(
        None,
        "--windows",
        help="ppl/quant: number of windows (default: the run's data.val_windows, or 32 where that is 0); "
        "at most the non-overlapping windows the text holds, with a note.",
    ),
    lengths: str = typer.Option(None, "--lengths", help="needle/attention: context lengths, e.g. 64,128."),
    depths: str = typer.Option(
        None, "--depths", help="needle/attention: needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)."
    ),
    needles: str = typer.Option(
        None, "--needles", help="needle/attention: N×R (N needles, R queried), e.g. 4x2."
    ),
    pairs: str = typer.Option(None, "--pairs", help="recall: key→value pair counts (default 4,8,16,32,64)."),
    distractors: str = typer.Option(
        None, "--distractors", help="recall: distractor rates, e.g. 0,1 (default: 0 and the recipe's)."
    ),
    samples: int = typer.Option(
        None,
        "--samples",
        help="needle/attention: samples per grid cell (default 4; --full 20); recall: examples per cell (64; 256).",
    ),
    tokens: int = typer.Option(None, "--tokens", help="outliers: tokens (default 8192; --full 131072)."),
    bits: str = typer.Option(None, "--bits", help="quant: bit widths (default 8,6,4; 16 is the reference)."),
    with_needle: bool = typer.Option(False, "--with-needle", help="quant: also measure needle accuracy."),
    demos: int = typer.Option(None, "--demos", help="icl-order: demos per prompt (default 8; --full 16)."),
    permutations: int = typer.Option(
        None, "--permutations", help="icl-order: orders of the demonstrations (default 8; --full 24)."
    ),
    items: int = typer.Option(None, "--items", help="icl-order: test items (default 32; --full 100)."),
    plot: bool = typer.Option(
        None, "--plot/--no-plot", help="Draw figures (default: needle and quant; attention maps with --plot)."
    ),
) -> None:
    if show:
        given, params = locals(), inspect.signature(eval_command).parameters
        used = [
            params[name].default.param_decls[0]
            for name in params
            if name not in _SHOW_PARAMS and given[name] != params[name].default.default
        ]
        if used:
            raise ConfigError(
                f"--show prints the stored results and runs nothing, so {', '.join(used)} would do nothing; "
                "drop it (or drop --show to run the suites with it)"
            )
        show_results(run_dir, suite, as_json)
        return
    from difftrain.rundir import require_model_files

    require_model_files(Path(run_dir))  # a mistyped name fails before torch loads
    from difftrain.evals import EvalOptions, load_result, preflight, save_result
    from difftrain.evals import common as ec
    from difftrain.evals.needle import parse_needles
    from difftrain.evals.windows import data_source

    suites = parse_suites(suite)
    opts = EvalOptions(
        seed=seed,
        full=full,
        batch_size=batch_size,
        data=data,
        windows=windows,
        lengths=_split(lengths, "--lengths", int),
        depths=_split(depths, "--depths", float),
        needles=parse_needles(needles) if needles is not None else None,
        pairs=_split(pairs, "--pairs", int),
        distractors=_split(distractors, "--distractors", float),
        samples=samples,
        tokens=tokens,
        bits=_split(bits, "--bits", int),
        with_needle=with_needle,
        demos=demos,
        permutations=permutations,
        items=items,
        plot=plot,
        data_label=ec.check_label(data_label) if data_label is not None else None,
        text_field=text_field,
    )
    if text_field is not None and not text_field.strip():
        raise ConfigError("--text-field is empty; name the field of --data's records to read")
    for name, given, what in (
        ("--data-label", data_label, "the results of --data"),
        ("--text-field", text_field, "the field of --data's records to read"),
    ):
        if given is not None and data is None:
            raise ConfigError(f"{name} names {what}; give --data SOURCE with it (or drop it)")
    data_suites = [s for s in suites if s in ec.DATA_SUITES]
    if data is not None and not data_suites:
        raise ConfigError(
            f"--data applies to the suites that read text ({', '.join(ec.DATA_SUITES)}), not {', '.join(suites)}: "
            "drop --data, or add e.g. --suite ppl"
        )
    replacing: list[tuple[Path, str]] = []
    if data is not None:
        data_source(data, text_field)  # a missing file fails before the model loads
        # a result on another source under the same label: refused, or replaced with a note
        replacing = ec.check_data_label(run_dir, data_suites, data, opts.data_label)
    positive = {"--batch-size": batch_size, "--windows": windows, "--samples": samples, "--tokens": tokens}
    for name, v in positive.items():
        ec.check_positive(name, v)
    for name, v in {"--demos": demos, "--permutations": permutations, "--items": items}.items():
        ec.check_positive(name, v, 2)  # icl-order compares orders of at least two demonstrations
    ec.check_depths(opts.depths)
    ec.check_bits(opts.bits)
    if plot:
        from difftrain.evals import plots

        plots.require()
    from difftrain.cli.common import run_banner
    from difftrain.infer.device import resolve_device, resolve_dtype
    from difftrain.io import uncreatable_reason
    from difftrain.rundir import load_run

    if (why := uncreatable_reason(Path(run_dir) / "eval")) is not None:  # results are saved there
        raise RunDirError(
            f"cannot save results in {Path(run_dir) / 'eval'}: {why}; make the run folder writable, or "
            "copy the run to a folder you can write and evaluate the copy"
        )
    dev = resolve_device(device)
    run = load_run(run_dir, device=dev, dtype=resolve_dtype(dtype, dev))
    named = set(map(str.lower, _suite_parts(suite)))  # must run; what `all` adds may be skipped
    skipped: dict[str, str] = {}
    for s in suites:
        try:
            preflight(run, s, opts)
        except ConfigError as e:
            if s in named:
                raise
            skipped[s] = str(e).removeprefix(f"{s}: ")  # (said once: "skipped attention: ...")
    suites = [s for s in suites if s not in skipped]
    if not as_json:
        run_banner(run)
    for s, why in skipped.items():
        err_console.print(f"[yellow]skipped {s}: {escape(why)}[/]", soft_wrap=True)
    for path, old in replacing:
        if ec.split_key(path.stem)[0] in suites:
            warn(f"--data-label {opts.data_label} replaces {path}, the result on {old}", "note")
    docs = {}
    for s in suites:
        doc = _run_with_progress(run, s, opts, show=not as_json and err_console.is_terminal)
        before = None  # the precision of the stored result this one replaces
        with contextlib.suppress(RunDirError):
            before = (load_result(run.path, ec.result_key(s, doc.get("label"))) or {}).get("dtype")
        try:
            path = save_result(run.path, doc)
        except OSError as e:  # (disk full, a folder made read-only meanwhile): show what was measured
            if not as_json:
                render(doc, run.path)
            raise RunDirError(
                f"cannot save the {s} result in {run.path / 'eval'}: {e.strerror or e}; the result is shown "
                "above, not saved: free space or make the folder writable, and run it again"
            ) from e
        docs[s] = doc
        if not as_json:
            render(doc, run.path)
            # the precision is no part of a result's name: say when it replaced another one's
            was = f"; replaced the {before} result" if before not in (None, doc["dtype"]) else ""
            console.print(f"[dim]saved {path} ({doc['dtype']}, {doc['seconds']:.1f} s{was})[/]")
    if as_json:
        sys.stdout.write(json.dumps(docs, indent=2) + "\n")
        sys.stdout.flush()


def _run_with_progress(run: Any, suite: str, opts: Any, show: bool) -> dict[str, Any]:
    from difftrain.evals import evaluate

    if not show:
        return evaluate(run, suite, opts)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(f"[bold]{suite}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bars:
        task = bars.add_task(suite, total=None)
        return evaluate(
            run, suite, opts, progress=lambda done, total: bars.update(task, completed=done, total=total)
        )


def register(app: typer.Typer) -> None:
    app.command("eval", help=HELP)(eval_command)
