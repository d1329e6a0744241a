"""Run the whole benchmark (`make bench`) and write benchmarks/results/bench-<device>-<mode>.{json,md}.

    .venv/bin/python benchmarks/run_all.py              # default: a few minutes on a 2-core CPU
    .venv/bin/python benchmarks/run_all.py --quick      # tiny shapes: a smoke test (about a minute)
    .venv/bin/python benchmarks/run_all.py --full       # + torch.compile, flex attention, longer grid
    .venv/bin/python benchmarks/run_all.py --threads 1  # on a machine other jobs share (see below)

Everything is measured by `difftrain bench` (difftrain/bench.py) in this one process, so the
ratios in the result are comparable; the .md file holds the README's tables, regenerated from the
JSON (`difftrain bench --markdown FILE.json` prints the same). On a CPU that other jobs share,
`--threads 1` avoids the intra-op threads waiting for each other, which otherwise dominates both
wall and CPU time; the result records the thread count and the load average.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    mode.add_argument("--full", action="store_true", help="add torch.compile, flex and a longer grid")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--only", nargs="+", default=None, help="sections to run (default: all)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    from rich.table import Table

    from difftrain.bench import run_bench
    from difftrain.bench_report import SECTIONS, BenchOptions, bench_markdown, describe, tables
    from difftrain.cli.common import WideWhenPiped
    from difftrain.errors import DifftrainError
    from difftrain.io import atomic_write_json, atomic_write_text

    mode_name = "quick" if args.quick else "full" if args.full else "default"
    argv_s = " ".join(sys.argv[1:] if argv is None else argv)
    opts = BenchOptions(
        mode=mode_name,
        sections=tuple(args.only or SECTIONS),
        device=args.device,
        threads=args.threads,
        command=f"python benchmarks/run_all.py {argv_s}".strip(),
    )
    console = WideWhenPiped()  # piped or to a file: no cell cropped
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        console.print(f"[dim]{time.perf_counter() - t0:6.0f} s[/] {msg}")

    try:
        result = run_bench(opts, progress=progress)
    except DifftrainError as e:  # a bad option or setting (no GPU for --device cuda, ...): one line
        console.print(f"[bold red]error:[/] {e}", soft_wrap=True)
        return e.exit_code
    console.print(f"[bold]difftrain bench[/] — {describe(result)}")
    for title, header, rows in tables(result):
        table = Table(title=title, title_justify="left")
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*[str(c) for c in row])
        console.print(table)
    # the name `difftrain bench` gives: a run of some sections (--only) never replaces a whole run's
    import torch

    stem = args.out_dir / Path(opts.default_out(torch.device(result["device"]["type"]))).stem
    atomic_write_json(stem.with_suffix(".json"), result)
    atomic_write_text(stem.with_suffix(".md"), bench_markdown(result))
    console.print(f"wrote {stem}.json and {stem}.md in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
