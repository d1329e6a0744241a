"""`difftrain bench [--quick | --full] [--only SECTION ...]`: performance figures of this machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from difftrain.cli.common import console, err_console


def bench_command(
    quick: bool = typer.Option(False, "--quick", help="Tiny shapes: a smoke test in seconds."),
    full: bool = typer.Option(False, "--full", help="Also torch.compile, flex attention and a longer grid."),
    only: list[str] = typer.Option(
        None,
        "--only",
        help="Run only these sections (repeatable): attention, train_step, lightning, hf, optimizer, decode, memory.",
    ),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    threads: int = typer.Option(None, "--threads", help="torch.set_num_threads (default: torch's choice)."),
    reps: int = typer.Option(None, "--reps", help="Timed repetitions per figure (default: the mode's)."),
    compile: bool = typer.Option(
        None,
        "--compile/--no-compile",
        help="Time torch.compile variants (default: none with --quick; on CUDA all; on CPU the decode step, and the training step too with --full).",
    ),
    precision: str = typer.Option(
        None,
        "--precision",
        help="32-true | bf16-mixed | bf16-true | 16-mixed (default: 32-true on CPU, bf16-mixed on CUDA).",
    ),
    out: Path = typer.Option(
        None,
        "--out",
        help="Write the JSON result here (default: bench-<device>-<mode>.json; with --only, the sections are appended to the name).",
    ),
    markdown: Path = typer.Option(
        None,
        "--markdown",
        help="Print the tables of an existing JSON result as markdown and exit (measures nothing).",
    ),
) -> None:
    """Measure speed and memory in one process, as ratios (benchmarks/README.md).

    Attention cores, training steps, the Lightning overhead, transformers on the same weights,
    optimizers, decoding and the memory planner."""
    from difftrain.bench_report import SECTIONS, BenchOptions, bench_markdown, validate_result
    from difftrain.errors import ConfigError

    if markdown is not None:
        try:
            result = json.loads(markdown.read_text(encoding="utf-8"))
            validate_result(result)
        except FileNotFoundError:
            raise ConfigError(
                f"--markdown {markdown}: no such file; run `difftrain bench --out {markdown}` first"
            ) from None
        except (json.JSONDecodeError, ValueError) as e:
            raise ConfigError(f"--markdown {markdown}: not a difftrain bench result ({e})") from None
        sys.stdout.write(bench_markdown(result))
        return
    if quick and full:
        raise ConfigError("--quick and --full contradict each other; pick one")
    mode = "quick" if quick else "full" if full else "default"
    sections = tuple(only) if only else SECTIONS
    opts = BenchOptions(
        mode=mode,
        sections=sections,
        device=device,
        threads=threads,
        reps=reps,
        compile=compile,
        precision=precision,
        command="difftrain bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
    )
    opts.check()  # before torch loads: a mistyped option is answered at once
    if out is not None:  # a result that cannot be written is refused before minutes of measuring
        from difftrain.io import unwritable_file_reason

        why = unwritable_file_reason(out)
        if why is not None:
            raise ConfigError(f"--out {out}: cannot write the result there ({why}); choose a file path")
    dev = opts.resolved_device()
    if dev.type != "cuda" and precision == "16-mixed":  # as pretrain refuses it
        from difftrain.errors import DeviceError

        raise DeviceError("--precision 16-mixed needs a CUDA GPU; on CPU use 32-true (or bf16-mixed)")
    import os

    import torch

    from difftrain.bench import run_bench

    if threads:
        torch.set_num_threads(threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if dev.type == "cpu" and load > (os.cpu_count() or 1):
        err_console.print(
            f"[yellow]warning:[/] load average {load:.1f} on {os.cpu_count()} cores: other jobs share the CPU, "
            "absolute figures will be noisy (ratios are paired)"
            + ("" if torch.get_num_threads() == 1 else "; --threads 1 avoids threads waiting on each other")
        )
    with console.status("benchmarking…") as status:
        result = run_bench(opts, progress=lambda msg: status.update(f"benchmarking: {msg}"))
    _render(result)
    path = out or Path(opts.default_out(dev))
    from difftrain.io import atomic_write_json

    replaced = " (replacing the earlier result there)" if path.exists() else ""
    atomic_write_json(path, result)
    console.print(
        f"wrote {path}{replaced} ({result['seconds']:.0f} s); tables: difftrain bench --markdown {path}"
    )


def _render(result: dict[str, Any]) -> None:
    from rich.table import Table

    from difftrain.bench_report import describe, tables

    console.print(f"[bold]difftrain bench[/] — {describe(result)}")
    for title, header, rows in tables(result):
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*[str(c) for c in row])
        console.print(table)
    console.print(
        "[dim]Ratios are medians of per-repetition ratios (the variants timed in turn, each repetition "
        "against its neighbour), so with few repetitions they can differ from the ratio of two median columns.",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
