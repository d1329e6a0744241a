"""`difftrain bench RECIPE [key=value ...]`: the recipe's training speed and memory on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from difftrain.cli.common import OVERRIDES, RECIPE, console, fmt_count, kv_table


def bench_command(
    recipe: str = RECIPE,
    overrides: list[str] = OVERRIDES,
    steps: int = typer.Option(3, "--steps", min=1, help="Timed training steps per arch and repetition."),
    reps: int = typer.Option(3, "--reps", min=1, help="Repetitions (archs take turns); the median counts."),
    warmup: int = typer.Option(
        2, "--warmup", min=1, help="Untimed steps per arch first (compilation, peak memory)."
    ),
    json_out: Path = typer.Option(None, "--json", help="Also write the result as JSON to this file."),
) -> None:
    """Time the recipe's training step on this machine: tokens/s, MFU and peak memory.

    Builds the recipe's model with random weights (no data needed) and the same shape in the
    other arch (baseline for diff and diff2, diff for baseline), and times training steps of
    both in turn, in the recipe's precision, compile setting and optimizer."""
    from difftrain.errors import ConfigError
    from difftrain.recipe import load_recipe

    r = load_recipe(recipe, overrides or [])
    if json_out is not None:  # refused before the measuring, not after it
        from difftrain.io import unwritable_file_reason

        why = unwritable_file_reason(json_out)
        if why is not None:
            raise ConfigError(f"--json {json_out}: cannot write the result there ({why}); choose a file path")
    from difftrain.bench import bench_recipe

    with console.status("benchmarking…") as status:
        result = bench_recipe(
            r, steps=steps, reps=reps, warmup=warmup, progress=lambda m: status.update(f"benchmarking: {m}")
        )
    render(result)
    if json_out is not None:
        from difftrain.io import atomic_write_json

        atomic_write_json(json_out, result)
        console.print(f"wrote {json_out}")


def render(result: dict[str, Any]) -> None:
    from difftrain.plan import fmt_bytes

    s, dev = result["setup"], result["device"]
    head = [
        ("recipe", result["recipe"]),
        ("device", f"{dev['name']} ({dev['type']}, {dev['threads']} threads, torch {dev['torch']})"),
        (
            "step",
            f"micro-batch {s['micro_batch_size']} × {s['seq_len']} tokens · vocab {s['vocab_size']} · "
            f"{s['precision']} · {s['optimizer']}"
            + (" · compiled" if s["compile"] else "")
            + (" · activation checkpointing" if s["activation_checkpointing"] else ""),
        ),
        ("timing", f"median of {s['reps']} × {s['steps']} steps per arch, after {s['warmup']} warm-up steps"),
    ]
    for arch in filter(None, (result["arch"], result["other"])):
        a = result["archs"][arch]
        mfu = f"MFU {a['mfu']:.1%}" if a["mfu"] is not None else "MFU — (no known peak FLOP/s here)"
        mem = fmt_bytes(a["peak_memory"])
        speed = (
            f"{a['tokens_per_s']:,.0f} tokens/s · {mfu} · peak memory {mem} · {fmt_count(a['params'])} params"
        )
        head.append((arch + (" (recipe)" if arch == result["arch"] else ""), speed))
    if result["ratio"] is not None:
        head.append((f"{result['arch']} / {result['other']}", f"{result['ratio']:.2f}× the tokens/s"))
    console.print(kv_table("difftrain bench", head))
    what = (
        "torch.cuda.max_memory_allocated over building the model and its warm-up steps"
        if dev["type"] == "cuda"
        else "weights, optimizer state and batch plus the tensors' peak in a step (the profiler's)"
    )
    console.print(f"[dim]peak memory: {what}[/]", soft_wrap=True)
    for note in result["notes"]:
        console.print(f"[dim]note: {note}[/]")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
