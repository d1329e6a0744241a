"""`difftrain plan RECIPE [--gpu-mem 8GB] [key=value ...]`: will this run fit, and if not, what fixes it."""

from __future__ import annotations

import json
from typing import Any

import typer

from difftrain.cli.common import OVERRIDES, RECIPE, console, fmt_count, kv_table, spec_rows


def plan_command(
    recipe: str = RECIPE,
    overrides: list[str] = OVERRIDES,
    gpu_mem: str = typer.Option(
        None,
        "--gpu-mem",
        help="Plan for a CUDA GPU with this much memory (8GB, 11.5GiB, 24000MB; GB = GiB). "
        "Default: this machine's GPU, else its RAM.",
    ),
    device: str = typer.Option("auto", "--device", help="auto | cpu: plan for this machine's GPU or RAM."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON instead of tables."),
) -> None:
    """Estimate a training run's memory before it starts: does it fit, and what would make it fit.

    Parameters; weights, gradients and optimizer state; activations per micro-batch (each arch,
    with and without activation checkpointing, each precision); the KV cache for generation; the
    peak. Says whether it fits and lists the cheapest changes that make it fit. Exit code 0 when it
    fits, 1 when it does not."""
    from difftrain.errors import ConfigError
    from difftrain.plan import plan_recipe, plan_target, tokenizer_size
    from difftrain.recipe import load_recipe
    from difftrain.train.preflight import check_vocab_early

    if device not in ("auto", "cpu"):
        raise ConfigError(f"--device {device!r}: choose auto or cpu (use --gpu-mem to plan for a GPU)")
    if device == "cpu" and gpu_mem is not None:
        raise ConfigError("--device cpu plans for this machine's RAM, --gpu-mem for a GPU; give one of them")
    r = load_recipe(recipe, overrides or [])
    target = plan_target(r, gpu_mem, device)  # where train.accelerator lets it train
    pretraining = r.finetune is None and r.model is not None  # checked as `pretrain --dry-run` does
    vocab_note = check_vocab_early(r, tokenizer_size(r)) if pretraining else None
    rp = plan_recipe(r, target)
    rp.plan.notes += [vocab_note] if vocab_note else []
    if as_json:
        print(json.dumps({"recipe": r.source or r.name, **rp.to_dict()}, indent=2))
    else:
        _render(r, rp)
    if not rp.plan.fits:
        raise typer.Exit(1)


def _render(r: Any, rp: Any) -> None:
    from rich.table import Table

    from difftrain.plan import fmt_bytes

    p = rp.plan
    s, c, t = p.settings, p.config, p.target
    head = [
        ("recipe", str(r.source or r.name)),
        (
            "parameters",
            f"{fmt_count(p.params)} ({fmt_count(p.trained_params)} trained) · vocab {c.vocab_size}"
            + (f" · {p.method}" if p.method != "full" else ""),
        ),
        *spec_rows(rp.spec),
        *([("fsdp", f"{s.fsdp.strategy} over {s.fsdp.shards}")] if s.fsdp else []),
        ("target", f"{t.name}: {fmt_bytes(t.memory)}"),
    ]
    console.print(kv_table("difftrain plan", head))

    phase = "backward pass" if p.peak_backward >= p.peak_step else "optimizer step"
    table = Table(
        title="memory at the peak of a training step",
        title_justify="left",
        caption=(
            f"The rows are not a sum: the peak is the larger of the backward pass ({fmt_bytes(p.peak_backward)}: "
            f"activations and gradients) and the optimizer step ({fmt_bytes(p.peak_step)}: gradients and "
            f"optimizer temporaries), which never hold their parts at once; here the {phase}."
        ),
        caption_justify="left",
    )
    table.add_column("what")
    table.add_column("bytes", justify="right")
    for k, v in p.breakdown().items():
        if v:
            table.add_row(k, fmt_bytes(v))
    table.add_row("[bold]peak of the step[/]", f"[bold]{fmt_bytes(p.peak)}[/]")
    host = "CUDA context" if t.kind == "cuda" else "the Python process"
    table.add_row(f"+ {host} and allocator slack", fmt_bytes(p.process_need - p.peak))
    if p.processes > 1:  # train.devices processes on this machine's CPU, each with the whole step
        table.add_row(f"× {p.processes} processes (train.devices)", fmt_bytes(p.device_need))
    verdict = "[bold green]fits[/]" if p.fits else "[bold red]does not fit[/]"
    table.add_row(
        f"[bold]needs[/] ({verdict})", f"[bold]{fmt_bytes(p.device_need)}[/] of {fmt_bytes(t.memory)}"
    )
    console.print(table)

    if rp.activation_table:
        act = Table(
            title=f"activations of one micro-batch ({s.micro_batch_size} × {s.seq_len})", title_justify="left"
        )
        act.add_column("arch")
        for label in ("fp32", "bf16 mixed", "bf16 true"):
            act.add_column(label, justify="right")
            act.add_column("+ckpt", justify="right")
        by = {(x["arch"], x["precision"], x["checkpointing"]): x["bytes"] for x in rp.activation_table}
        for arch in ("baseline", "diff", "diff2"):
            precisions = ("32-true", "bf16-mixed", "bf16-true")
            cells = [fmt_bytes(by[(arch, prec, ck)]) for prec in precisions for ck in (False, True)]
            act.add_row(arch + (" ◂" if arch == c.arch else ""), *cells)
        console.print(act)
    console.print(
        f"generation (batch 1, {c.max_seq_len} tokens, {rp.generation_dtype}, as `generate` runs it there): "
        f"weights {fmt_bytes(rp.generation_bytes - rp.kv_cache - rp.generation_logits)} + KV cache "
        f"{fmt_bytes(rp.kv_cache)} + logits {fmt_bytes(rp.generation_logits)} = {fmt_bytes(rp.generation_bytes)}"
    )
    for note in p.notes:
        console.print(f"[dim]note: {note}[/]")
    if not p.fits:
        if rp.suggestions:
            console.print("[bold]cheapest changes that make it fit[/] (as overrides):")
            for sug in rp.suggestions:
                console.print(
                    f"  [cyan]{sug.overrides}[/]  → needs {fmt_bytes(sug.plan.device_need)} ({'; '.join(sug.why)})"
                )
        elif t.memory <= t.overhead:
            console.print(
                f"[yellow]the {'CUDA context' if t.kind == 'cuda' else 'process'} alone takes about "
                f"{fmt_bytes(t.overhead)}, at least as much as the {fmt_bytes(t.memory)} given: no model trains "
                "there; give --gpu-mem the GPU's whole memory, e.g. 8GB[/]"
            )
        else:
            console.print(
                "[yellow]no combination of 8-bit optimizer, checkpointing, micro-batch, bf16-true and "
                "sequence length fits; use a smaller model or a bigger device[/]"
            )


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
