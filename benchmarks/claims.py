"""The claims study (`make claims`): diff vs baseline over seeds, on the probes a CPU can run.

    .venv/bin/python benchmarks/claims.py                       # the study (about an hour on 2 cores)
    .venv/bin/python benchmarks/claims.py --quickstart-steps 0  # the recall runs only
    .venv/bin/python benchmarks/claims.py --report-only         # tables and plots from the runs there are

It trains `recall-diff` and `recall-baseline` with each seed, and `quickstart` and
`quickstart-baseline` with each seed for --quickstart-steps steps (the recipe's 800 by default;
fewer to fit the time, said in the report); then `difftrain eval --suite recall` on the recall
runs and `--suite ppl,outliers,attention` on the quickstart runs. Runs go to --runs-dir (one
folder per recipe and seed); a run that finished already is reused, so an interrupted study
continues where it stopped. --jobs runs that many trainings at once, one thread each (on a CPU
shared with other jobs, intra-op threads that wait for each other cost more than they give).

It writes benchmarks/results/claims.json (every run's figures, and their mean and standard
deviation over seeds) and claims.md: one table per claim, diff against baseline, and a one-line
reading of each row that says whether the gap exceeds the seed-to-seed spread (|Δ| larger than
the two standard deviations added), with PNG plots beside them. Every file says the date, the
machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIFFTRAIN = [sys.executable, "-m", "difftrain"]
PAIRS = {"recall": ("recall-diff", "recall-baseline"), "quickstart": ("quickstart", "quickstart-baseline")}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


# ---------------------------------------------------------------------------------------------
# running


def run_dir(runs: Path, recipe: str, seed: int) -> Path:
    return runs / f"{recipe}-s{seed}"


def finished(path: Path, steps: int | None) -> bool:
    try:
        s = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(s.get("finished")) and (steps is None or s.get("steps") == steps)


def recipe_steps(recipe: str) -> int | None:
    """The shipped recipe's train.max_steps (a run of other steps is not reused)."""
    from difftrain.recipe import load_recipe

    return load_recipe(recipe).train.max_steps


def sh(cmd: list[str], log: Path, threads: int | None) -> None:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {shlex.join(cmd)}; see {log}")


def train_and_eval(job: tuple[str, int, int | None, str], args: argparse.Namespace) -> Path:
    recipe, seed, steps, suites = job
    out = run_dir(args.runs_dir, recipe, seed)
    log = args.runs_dir / f"{out.name}.log"
    threads = 1 if args.jobs > 1 else None
    if finished(out, steps if steps is not None else recipe_steps(recipe)):
        args.reused.append(out.name)
    else:
        cmd = [*DIFFTRAIN, "pretrain", recipe, f"seed={seed}", f"name={out.name}", f"out_dir={args.runs_dir}"]
        cmd += [f"train.max_steps={steps}"] if steps is not None else []
        sh([*cmd, "--overwrite", "--no-progress"], log, threads)
    sh([*DIFFTRAIN, "eval", str(out), "--suite", suites, "--json"], log, threads)
    print(f"[{time.strftime('%H:%M:%S')}] {out.name} done (load {load()})", flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# figures of one run


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_figures(path: Path) -> dict[str, Any]:
    """What the study reads from one run directory."""
    summary = _read(path / "summary.json") or {}
    out: dict[str, Any] = {
        "run": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "steps": summary.get("steps"),
        "tokens": summary.get("tokens"),
        "train_time_s": summary.get("train_time_s") or summary.get("wall_time_s"),
        "final_val_loss": summary.get("final_val_loss"),
    }
    recall = _read(path / "eval" / "recall.json")
    if recall:
        st = recall["settings"]
        out["recall"] = {
            "task_n_pairs": st["task_n_pairs"],
            "task_distractor_rate": st["task_distractor_rate"],
            "cells": {
                f"{c['n_pairs']}@{c['distractor_rate']:g}": c["accuracy"] for c in recall["results"]["cells"]
            },
        }
    from difftrain.train.metrics import read_metrics

    rows = read_metrics(path / "metrics.csv")
    out["val_by_step"] = [[r["step"], r["val/loss"]] for r in rows if "val/loss" in r]
    out["val_curve"] = [
        [r["train/tokens"], r["val/loss"]] for r in rows if "val/loss" in r and "train/tokens" in r
    ]
    ppl = _read(path / "eval" / "ppl.json")
    if ppl:
        out["ppl"] = {"loss": ppl["results"]["loss"], "bits_per_byte": ppl["results"].get("bits_per_byte")}
    outl = _read(path / "eval" / "outliers.json")
    if outl:
        r = outl["results"]
        out["outliers"] = {
            f"{name} {stat}": r[key].get(stat.replace("top-1", "top1"))
            for name, key in (("attention logits", "attention_logits"), ("hidden states", "hidden_states"))
            for stat in ("top-1", "kurtosis")
        }
    att = _read(path / "eval" / "attention.json")
    if att:
        r = att["results"]
        out["attention"] = {"answer share": r.get("answer_share"), "noise share": r.get("noise_share")}
    return out


# ---------------------------------------------------------------------------------------------
# statistics and tables


def stats(xs: list[float | None]) -> dict[str, Any]:
    vals = [float(x) for x in xs if x is not None]
    return {
        "n": len(vals),
        "mean": statistics.fmean(vals) if vals else None,
        "std": statistics.stdev(vals) if len(vals) > 1 else None,
        "values": vals,
    }


def compare(d: dict[str, Any], b: dict[str, Any], higher_better: bool | None) -> dict[str, Any]:
    """Diff minus baseline, and the reading: does |Δ| exceed the two seed-to-seed stds added?"""
    if d["mean"] is None or b["mean"] is None:
        return {"delta": None, "exceeds_spread": None, "reading": "missing"}
    delta = d["mean"] - b["mean"]
    if d["std"] is None or b["std"] is None:
        return {"delta": delta, "exceeds_spread": None, "reading": "one seed: no spread to compare with"}
    spread = d["std"] + b["std"]
    exceeds = abs(delta) > spread
    if not exceeds:
        reading = f"no clear difference: gap {abs(delta):.3g} ≤ seed spread {spread:.3g}"
    else:
        who = "diff" if (delta > 0) == bool(higher_better) else "baseline"
        side = "higher" if delta > 0 else "lower"
        verdict = f"{who} better" if higher_better is not None else f"diff {side}"
        reading = f"{verdict}: gap {abs(delta):.3g} > seed spread {spread:.3g}"
    return {"delta": delta, "exceeds_spread": exceeds, "reading": reading}


def fmt(s: dict[str, Any], spec: str) -> str:
    if s["mean"] is None:
        return "—"
    std = f" ± {s['std']:{spec}}" if s["std"] is not None else ""
    return f"{s['mean']:{spec}}{std}"


def claim_rows(
    runs: dict[str, list[dict[str, Any]]],
    pair: tuple[str, str],
    getter: Any,
    names: list[str],
    better: bool | None,
) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        d = stats([getter(r, name) for r in runs.get(pair[0], [])])
        b = stats([getter(r, name) for r in runs.get(pair[1], [])])
        rows.append({"name": name, "diff": d, "baseline": b, **compare(d, b, better)})
    return rows


def _dig(r: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(r, dict) or k not in r:
            return None
        r = r[k]
    return r


def build_claims(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    claims: dict[str, Any] = {}
    rec = [r for r in runs.get("recall-diff", []) + runs.get("recall-baseline", []) if "recall" in r]
    if rec:
        cells = sorted(
            {c for r in rec for c in r["recall"]["cells"]},
            key=lambda c: (float(c.split("@")[1]), int(c.split("@")[0])),
        )
        claims["retrieval accuracy by N"] = {
            "unit": "exact-match accuracy per query (N pairs @ distractor rate)",
            "format": ".3f",
            "rows": claim_rows(
                runs, PAIRS["recall"], lambda r, c: _dig(r, "recall", "cells", c), cells, True
            ),
        }
        steps = sorted({int(t) for r in rec for t, _ in r.get("val_by_step", [])})

        def at_step(r: dict[str, Any], t: str) -> float | None:
            return next((v for st, v in r.get("val_by_step", []) if int(st) == int(t.split()[-1])), None)

        claims["answer loss against steps (recall)"] = {
            "unit": "validation loss on the answers (nats/token) at each validation step: how fast the task is "
            "learned (chance: ln 64 = 4.16)",
            "format": ".3f",
            "rows": claim_rows(runs, PAIRS["recall"], at_step, [f"step {t}" for t in steps], False),
        }
    qs = [r for r in runs.get("quickstart", []) + runs.get("quickstart-baseline", []) if r.get("val_curve")]
    if qs:
        tokens = sorted({int(t) for r in qs for t, _ in r["val_curve"]})

        def at(r: dict[str, Any], t: str) -> float | None:
            return next((v for tok, v in r["val_curve"] if int(tok) == int(t)), None)

        rows = claim_rows(runs, PAIRS["quickstart"], at, [str(t) for t in tokens], False)
        rows += claim_rows(
            runs, PAIRS["quickstart"], lambda r, _: _dig(r, "ppl", "loss"), ["eval ppl loss"], False
        )
        claims["validation loss against tokens"] = {
            "unit": "nats/token at tokens seen",
            "format": ".4f",
            "rows": rows,
        }
    out_names = [
        "attention logits top-1",
        "attention logits kurtosis",
        "hidden states top-1",
        "hidden states kurtosis",
    ]
    if any("outliers" in r for r in qs or runs.get("quickstart", [])):
        claims["activation outliers"] = {
            "unit": "largest |activation| and kurtosis (lower: fewer outliers)",
            "format": ".2f",
            "rows": claim_rows(
                runs, PAIRS["quickstart"], lambda r, n: _dig(r, "outliers", n), out_names, False
            ),
        }
    if any("attention" in r for r in runs.get("quickstart", [])):
        claims["attention share on the answer"] = {
            "unit": "share of attention on the answer span vs the rest during retrieval (the diff map is "
            "signed, its rows sum to 1 − λ: its shares can fall outside [0, 1])",
            "format": ".3f",
            "rows": claim_rows(
                runs, PAIRS["quickstart"], lambda r, n: _dig(r, "attention", n), ["answer share"], True
            )
            + claim_rows(
                runs, PAIRS["quickstart"], lambda r, n: _dig(r, "attention", n), ["noise share"], False
            ),
        }
    return claims


def label(name: str) -> str:
    """A row's name as the table shows it (recall cells are stored as "N@rate")."""
    if "@" in name:
        n, rate = name.split("@")
        return f"N={n}, distractors {rate}"
    return f"{int(name):,} tokens" if name.isdigit() else name


def commit() -> str:
    try:
        r = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return r.stdout.strip() or "unknown"


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Claims study: diff vs baseline over seeds",
        "",
        f"{doc['date']} · {doc['machine']} · load average at start {doc['load_start']}, at end {doc['load_end']}",
        "",
        f"Command: `{doc['command']}` at commit {doc['commit']} ({doc['seconds'] / 60:.0f} minutes). {doc['setup']}",
        "",
        "Each cell is the mean ± standard deviation over seeds; Δ = diff − baseline. A reading says the gap "
        "exceeds the seed-to-seed spread when the gap (the absolute Δ) is larger than the two standard "
        "deviations added.",
    ]
    for title, claim in doc["claims"].items():
        spec = claim["format"]
        lines += ["", f"## {title}", "", f"{claim['unit']}.", ""]
        lines += ["| | diff | baseline | Δ | reading |", "| --- | --- | --- | --- | --- |"]
        for r in claim["rows"]:
            delta = "—" if r["delta"] is None else f"{r['delta']:+{spec}}"
            lines.append(
                f"| {label(r['name'])} | {fmt(r['diff'], spec)} | {fmt(r['baseline'], spec)} | {delta} | {r['reading']} |"
            )
        judged = [r for r in claim["rows"] if r["exceeds_spread"] is not None]
        beyond = [r for r in judged if r["exceeds_spread"]]
        if judged:
            lines += [
                "",
                f"Gap beyond the seed spread in {len(beyond)} of {len(judged)} rows"
                + (f" ({', '.join(label(r['name']) for r in beyond)})." if beyond else "."),
            ]
    if doc.get("plots"):
        lines += ["", "Figures: " + ", ".join(f"[{p}]({p})" for p in doc["plots"])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# figures


def plots(doc: dict[str, Any], runs: dict[str, list[dict[str, Any]]], out_dir: Path) -> list[str]:
    from difftrain.evals import plots as P

    if not P.available():
        return []
    import numpy as np

    footer = f"{doc['date']} · {doc['machine']}\n{doc['command']} (commit {doc['commit']})"
    written = []
    claim = doc["claims"].get("retrieval accuracy by N")
    if claim:
        fig = P._figure(7.0, 4.8)
        ax = fig.subplots(1, 1)
        rates = sorted({float(r["name"].split("@")[1]) for r in claim["rows"]})
        for i, arch in enumerate(("diff", "baseline")):
            for j, rate in enumerate(rates):
                rows = [
                    r
                    for r in claim["rows"]
                    if float(r["name"].split("@")[1]) == rate and r[arch]["mean"] is not None
                ]
                n = np.array([int(r["name"].split("@")[0]) for r in rows])
                m = np.array([r[arch]["mean"] for r in rows])
                s = np.array([r[arch]["std"] or 0.0 for r in rows])
                ax.plot(
                    n,
                    m,
                    color=f"C{i}",
                    ls=["-", "--", ":"][j % 3],
                    marker="o",
                    label=f"{arch}, distractors {rate:g}",
                )
                ax.fill_between(n, m - s, m + s, color=f"C{i}", alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter("{x:g}")
        ax.set_xlabel("N (key→value pairs)")
        ax.set_ylabel("exact-match accuracy (mean ± std over seeds)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        P._suptitle(fig, "Associative recall: recall-diff vs recall-baseline\n" + footer, 8)
        written.append(str(P._save(fig, out_dir / "claims-recall.png").name))
    qs = {k: runs.get(k, []) for k in PAIRS["quickstart"]}
    if any(r.get("val_curve") for rs in qs.values() for r in rs):
        fig = P._figure(7.0, 4.8)
        ax = fig.subplots(1, 1)
        for i, (name, rs) in enumerate(qs.items()):
            curves = [dict((int(t), v) for t, v in r["val_curve"]) for r in rs if r.get("val_curve")]
            toks = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if toks:
                vals = np.array([[c[t] for t in toks] for c in curves])
                m, s = vals.mean(0), vals.std(0, ddof=1) if len(curves) > 1 else np.zeros(len(toks))
                ax.plot(toks, m, color=f"C{i}", marker="o", label=f"{name} ({len(curves)} seeds)")
                ax.fill_between(toks, m - s, m + s, color=f"C{i}", alpha=0.2)
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("validation loss (nats/token, mean ± std)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        P._suptitle(fig, "Validation loss against tokens: quickstart vs quickstart-baseline\n" + footer, 8)
        written.append(str(P._save(fig, out_dir / "claims-loss.png").name))
    return written


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--quickstart-steps", type=int, default=None, help="0 skips the quickstart runs")
    ap.add_argument("--recall-steps", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--jobs", type=int, default=2, help="trainings at once (one thread each when > 1)")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "claims")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--report-only", action="store_true", help="no training: report the runs there are")
    args = ap.parse_args(argv)
    args.runs_dir = args.runs_dir.resolve()
    args.reused = []  # runs an earlier invocation finished (trained then, evaluated again now)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    argv_s = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/claims.py {argv_s}".strip()
    started, load_start, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load(), time.perf_counter()

    # the recall runs first (the study's main claim), each seed's pair side by side
    jobs: list[tuple[str, int, int | None, str]] = [
        (r, seed, args.recall_steps, "recall") for seed in args.seeds for r in PAIRS["recall"]
    ]
    if args.quickstart_steps != 0:
        jobs += [
            (r, seed, args.quickstart_steps, "ppl,outliers,attention")
            for seed in args.seeds
            for r in PAIRS["quickstart"]
        ]
    if not args.report_only:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(lambda j: train_and_eval(j, args), jobs))

    runs: dict[str, list[dict[str, Any]]] = {}
    for recipe, seed, _, _ in jobs:
        path = run_dir(args.runs_dir, recipe, seed)
        if path.is_dir():
            runs.setdefault(recipe, []).append({"seed": seed, **run_figures(path)})
    qs_steps = args.quickstart_steps if args.quickstart_steps is not None else "the recipe's 800"
    doc: dict[str, Any] = {
        "date": started,
        "machine": machine(),
        "load_start": load_start,
        "load_end": load(),
        "command": command,
        "commit": commit(),
        "seconds": time.perf_counter() - t0,
        "setup": (
            f"Seeds {', '.join(map(str, args.seeds))}; recall-diff / recall-baseline at their recipe's steps"
            + (f" ({args.recall_steps})" if args.recall_steps else "")
            + (
                f"; quickstart / quickstart-baseline for {qs_steps} steps"
                if args.quickstart_steps != 0
                else "; no quickstart runs"
            )
            + f"; {args.jobs} trainings at a time"
            + (", one thread each." if args.jobs > 1 else ".")
            + (
                f" Trained (same recipe and steps) by an earlier invocation and reused: {', '.join(sorted(args.reused))}."
                if args.reused
                else ""
            )
            + " Training time per run (s): "
            + "; ".join(
                f"{name} {fmt(stats([r.get('train_time_s') for r in rs]), '.0f')}"
                for name, rs in runs.items()
            )
            + "."
        ),
        "claims": build_claims(runs),
        "runs": runs,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    doc["plots"] = plots(doc, runs, args.out_dir)
    from difftrain.io import atomic_write_json, atomic_write_text

    atomic_write_json(args.out_dir / "claims.json", doc)
    atomic_write_text(args.out_dir / "claims.md", markdown(doc))
    print(markdown(doc))
    print(f"wrote {args.out_dir / 'claims.md'} and claims.json in {doc['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
