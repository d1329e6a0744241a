"""Shared parts of the CLI: option declarations, consoles, tables, number formatting, progress."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

from difftrain.cli.complete import override_items, recipe_refs

PIPE_WIDTH = 1000  # columns of output to a file or a pipe (COLUMNS unset): no cell is cropped

# options that several commands share
RECIPE = typer.Argument(
    ..., autocompletion=recipe_refs, help="Recipe file or shipped recipe name (see `difftrain recipes list`)."
)
OVERRIDES = typer.Argument(
    None, autocompletion=override_items, help="Overrides as key.sub=value, e.g. train.max_steps=100."
)
RESUME = typer.Option(
    None, "--resume/--no-resume", help="Continue from the last good checkpoint (default: train.resume)."
)
OVERWRITE = typer.Option(False, "--overwrite", help="Replace a run directory that holds another run.")
PROGRESS = typer.Option(None, "--progress/--no-progress", help="Progress bar (default: logging.progress).")
DEVICE = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N | mps.")
DTYPE = typer.Option("auto", "--dtype", help="auto (GPU bf16, CPU fp32) | float32 | bfloat16 | float16.")


class WideWhenPiped(Console):
    """A rich Console that lays out for PIPE_WIDTH columns when its output is not a terminal."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal and "COLUMNS" not in os.environ:
            return ConsoleDimensions(PIPE_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    def on_broken_pipe(self) -> None:
        """The reader of stdout went away (`| head`): warn once and write on into /dev/null."""
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit succeeds
        os.close(devnull)
        warn("standard output was closed (its reader ended); going on without printing to it")


console = WideWhenPiped(highlight=False)
err_console = WideWhenPiped(stderr=True, highlight=False)


def warn(text: str, label: str = "warning", style: str = "yellow") -> None:
    """A `label:` line on stderr; the text is printed as it is (no rich markup in it)."""
    err_console.print(f"[{style}]{label}:[/] {escape(text)}", soft_wrap=True)


def run_banner(run: Any, *parts: str, kind: str | None = None) -> None:
    """A loaded run's dim line on stderr: path, arch, `kind`, size, context, device, dtype, `parts`."""
    w, n = run.model.lm_head.weight, sum(p.numel() for p in run.model.parameters())
    about = [str(run.path), run.config.arch, *([kind] if kind else []), f"{fmt_count(n)} parameters"]
    about += [f"max_seq_len {run.config.max_seq_len}", f"{w.device} {str(w.dtype).removeprefix('torch.')}"]
    err_console.print(f"[dim]{escape(' · '.join(about + list(parts)))}", soft_wrap=True)


def fmt_count(n: float) -> str:
    """12_345_678 → '12.3M'; an int too large for a float → its order of magnitude."""
    try:
        n = float(n)
    except OverflowError:
        return f"≈1e{len(str(abs(int(n)))) - 1}"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def print_table(title: str, rows: list[tuple[str, str]], warnings: Any = ()) -> None:
    """Print a `kv_table`, then each of `warnings`."""
    console.print(kv_table(title, rows))
    for w in warnings:
        warn(w)


def kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """A two-column table of labels and values; the values are plain text, never rich markup."""
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for k, v in rows:
        table.add_row(k, Text(v) if isinstance(v, str) else v)
    return table


class DataBars(contextlib.AbstractContextManager):
    """The `progress` callback of `prepare_data`: one transient bar per stage on stderr (only on a
    terminal); a context manager whose exit (or `stop`) ends it."""

    LABELS = {"tokenizer": "training tokenizer", "shards": "tokenizing"}

    def __init__(self) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        desc, info = TextColumn("[bold]{task.description}"), TextColumn("{task.fields[info]}")
        columns = (desc, BarColumn(), DownloadColumn(), info, TimeElapsedColumn())
        self.bars = Progress(*columns, console=err_console, transient=True)
        self.tasks: dict[str, Any] = {}

    def __call__(self, p: Any) -> None:
        if not err_console.is_terminal:
            return
        if not self.bars.live.is_started:
            self.bars.start()
        info = f"{p.source} · {fmt_count(p.documents)} docs" + (
            f" · {fmt_count(p.tokens)} tokens" if p.tokens else ""
        )
        if p.stage not in self.tasks:
            self.tasks[p.stage] = self.bars.add_task(self.LABELS.get(p.stage, p.stage), info=info)
        self.bars.update(self.tasks[p.stage], completed=p.bytes, total=p.total_bytes, info=info)

    def stop(self) -> None:
        if self.bars.live.is_started:
            self.bars.stop()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def oom_advice(recipe: Any, *, finetune: bool = False, device: str = "GPU") -> str:
    """The message for `device` running out of memory: the changes `plan` would weigh, with this
    recipe's numbers, those a resume takes first."""
    from difftrain.errors import DifftrainError
    from difftrain.spec import resolve
    from difftrain.train.runcheck import resumable_change

    t = recipe.train
    micro = t.micro_batch_size
    try:
        spec = resolve(recipe)
        global_bs, accumulate, seq_len = spec.global_batch_size, spec.accumulate, spec.seq_len
        optimizer = spec.recipe.optim.name
    except DifftrainError:  # a fine-tune's model (and so its seq_len) comes from its base run
        global_bs = t.global_batch_size or micro
        accumulate, seq_len, optimizer = global_bs // micro, t.seq_len, recipe.optim.name
    tries: list[str] = []  # overrides, each with what it costs
    if micro > 1:
        smaller = max(d for d in range(1, micro) if micro % d == 0)
        tries.append(
            f"train.micro_batch_size={smaller} train.global_batch_size={global_bs} "
            f"(accumulation {accumulate} → {accumulate * micro // smaller}, same global batch)"
        )
    if not t.activation_checkpointing:
        tries.append("train.activation_checkpointing=true (~30% more compute)")
    if finetune and recipe.finetune is not None and recipe.finetune.method != "qlora":
        tries.append("finetune.method=qlora (4-bit frozen weights)")
    elif not finetune and optimizer in ("adamw", "auto") and t.strategy != "fsdp":  # fsdp refuses 8-bit
        tries.append("optim.name=adamw8bit (8-bit optimizer states)")
    if seq_len and seq_len >= 128:
        tries.append(f"train.seq_len={seq_len // 2}")
    keep = [x for x in tries if all(map(resumable_change, re.findall(r"([\w.]+)=", x)))]
    new = [x for x in tries if x not in keep]
    parts = ["; ".join(keep) + " — then run again (add --resume if a checkpoint was saved)"] if keep else []
    if new:
        parts.append(
            "; ".join(new) + " — these make a different run, which --resume refuses: start it with "
            "another name=... or --overwrite"
        )
    return (
        f"out of {device} memory (micro_batch_size {micro}{f' × seq_len {seq_len}' if seq_len else ''}); "
        "try, one at a time: " + "; or ".join(parts) + f"; `difftrain plan {recipe.command_args}` estimates "
        "the memory of each"
    )


def spec_rows(spec: Any, padded: bool = False) -> list[tuple[str, str]]:
    """A `RunSpec`'s resolved settings as `plan`, `--dry-run` and the start table show them.
    `padded`: sequences are padded to the longest of a batch, so a step holds at most its tokens."""
    m, t, o = spec.model, spec.recipe.train, spec.recipe.optim
    at_most = "≤" if padded else ""
    rows = [
        (
            "model",
            f"{m.arch} · d_model {m.d_model} · {plural(m.n_layers, 'layer')} · {plural(m.n_heads, 'head')}"
            + (f" ({m.n_kv_heads} kv)" if m.n_kv_heads != m.n_heads else "")
            + f" · head_dim {m.head_dim}",
        ),
        (
            "batch",
            f"{spec.global_batch_size} seq × {at_most}{spec.seq_len} tok = {at_most}{fmt_count(spec.tokens_per_step)} "
            f"tok/step (micro {t.micro_batch_size} × accum {spec.accumulate} × devices {spec.world_size})",
        ),
        ("steps", f"{spec.max_steps} ({at_most}{fmt_count(spec.max_steps * spec.tokens_per_step)} tokens)"),
        (
            "optimizer",
            f"{o.name} · lr {o.lr:g} · wd {o.weight_decay:g} · "
            + (f"clip {t.grad_clip:g}" if t.grad_clip is not None else "no clip")
            + f" · {o.schedule} · warmup {o.warmup_steps}",
        ),
        (
            "precision",
            f"{t.precision} · compile {'on' if t.compile else 'off'} · attention {spec.attention}"
            + (" · activation checkpointing" if t.activation_checkpointing else ""),
        ),
        ("device", spec.device),
    ]
    if spec.reasons:
        rows.append(("auto", " · ".join(f"{k} {value} ({why})" for k, value, why in spec.auto_choices())))
    return rows


def run_row(spec: Any, resuming: bool, point: Any, overwrite: bool) -> tuple[str, str]:
    """A dry run's `run` row: the folder and what the run would do with it."""
    if resuming:
        return ("run", f"{spec.run_dir} (resumes from step {point.step})")
    action = "replaces the run there (--overwrite)" if overwrite and spec.run_dir.exists() else "a new run"
    return ("run", f"{spec.run_dir} ({action})")


def started_row(spec: Any, resumed_from: int | None) -> tuple[str, str]:
    """A start table's `run` row."""
    return ("run", str(spec.run_dir) + (f"  (resuming from step {resumed_from})" if resumed_from else ""))


def skipped_records_row(count: int, examples: list[str]) -> list[tuple[str, str]]:
    """The row for records `data.on_bad_record: skip` dropped (none when none were)."""
    if not count:
        return []
    first = f"; the first: {examples[0]}" if examples else ""
    return [("skipped records", f"{count:,} malformed (data.on_bad_record: skip){first}")]


def prepared_rows(prepared: Any, first: bool = True) -> list[tuple[str, str]]:
    """The rows of a `prepare_data` result's skipped records (`first`: with the first one) and
    `.json` files read as text."""
    s = prepared.stats
    examples = [x for src in s.sources for x in src.get("bad_examples", [])] if first else []
    n = sum(src.get("json_documents", 0) for src in s.sources)
    json_row = ("json as text", f"{n:,} .json files in folders hold no records (configs): read as text")
    return skipped_records_row(s.bad_records, examples) + ([json_row] if n else [])


def check_files(r: Any) -> None:
    """Check, without torch and writing nothing, the files and folders a training run reads and
    writes: base run, local data, tokenizer, data cache (where still to fill), run directory."""
    from difftrain.data.shards import cached_index
    from difftrain.data.sources import check_local_sources
    from difftrain.data.tokenizer import tokenizer_file
    from difftrain.errors import DataError
    from difftrain.io import check_run_dir_creatable
    from difftrain.recipe import check_record_fields, resolve_data_format
    from difftrain.rundir import base_run_dir

    if r.finetune is not None:
        base_run_dir(r.finetune)
    check_record_fields(r)
    check_local_sources(r.data, r.recipe_dir)
    if r.finetune is None and (tok := r.tokenizer.file(r.recipe_dir)) is not None:  # a fine-tune: its base's
        tokenizer_file(tok)
    if r.finetune is None or resolve_data_format(r) == "text":
        try:  # the data cache must be writable unless it holds the prepared data already
            r.data.check_cache_dir()
        except DataError:
            if (
                r.finetune is not None
                or cached_index(r.data, r.tokenizer, seed=r.seed, base_dir=r.recipe_dir) is None
            ):
                raise
    check_run_dir_creatable(r.run_dir)


def plural(n: int, word: str) -> str:
    """1 → '1 layer', 4 → '4 layers'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def vocab_shortfall(tokenizer_size: int, tokenizer_cfg: Any, corpus_bytes: int | None = None) -> str:
    """A note when the trained tokenizer came out smaller than tokenizer.train.vocab_size, else ""."""
    if tokenizer_cfg.path is not None or tokenizer_size >= tokenizer_cfg.train.vocab_size:
        return ""
    asked = f" — {tokenizer_size:,} of the {tokenizer_cfg.train.vocab_size:,} asked for (tokenizer.train.vocab_size): "
    max_bytes = tokenizer_cfg.train.max_bytes
    if corpus_bytes is not None and corpus_bytes > max_bytes:
        return (
            asked + f"its sample of {max_bytes:,} bytes (tokenizer.train.max_bytes, of {corpus_bytes:,}) has "
            "no more pairs to merge; raise max_bytes for more"
        )
    return asked + "the data has no more pairs to merge"


def end_rows(summary: dict[str, Any], loss: Any, throughput_note: str = "") -> list[tuple[str, str]]:
    """The rows a training run's end table opens with; a resumed run's wall time adds the training
    time of the whole run, a compiled run's throughput the tokens/s once compiled."""
    wall, train = summary["wall_time_s"], summary.get("train_time_s") or 0.0
    steady = summary.get("steady_tokens_per_s")
    return [
        ("steps", f"{summary['steps']} ({fmt_count(summary['tokens'])} tokens)"),
        (
            "wall time",
            f"{wall:.1f} s" + (f" this session · {train:.1f} s of training in all" if train > wall else ""),
        ),
        (
            "throughput",
            f"{summary['tokens_per_s']:,.0f} tokens/s"
            + (f" ({steady:,.0f} once compiled; the run's includes the compilation)" if steady else "")
            + throughput_note,
        ),
        loss,
        ("peak memory", peak_memory(summary)),
    ]


def peak_memory(summary: dict[str, Any]) -> str:
    """The peak-memory cell ("—" where not measured; rank 0's of several processes)."""
    rss, gpu = summary.get("peak_rss_mb"), summary.get("peak_gpu_mem_mb")
    text = ("RSS —" if rss is None else f"RSS {rss:.0f} MiB") + (f" · GPU {gpu:.0f} MiB" if gpu else "")
    n = summary.get("devices") or 1
    return f"{text} (rank 0 of {n} processes)" if isinstance(n, int) and n > 1 and (rss or gpu) else text


def fmt_figure(value: float | None, fmt: str = ".4f") -> str:
    """`format(value, fmt)` without the minus sign of a value that rounds to zero; "—" for None."""
    if value is None:
        return "—"
    text = format(value, fmt)
    return format(0.0, fmt) if text.startswith("-") and not text.strip("-0.,%") else text


_PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


def first_line(e: BaseException, limit: int = 160) -> str:
    """The first sentence of an exception's message (less gloo's "[file.cc:123] " prefix and advice)."""
    line = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [type(e).__name__])[0])
    line = line.split(". ", 1)[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def report_finished(result: Any, command: str) -> None:
    """What a resume of a finished run says: nothing was trained, what it repaired, how to train on."""
    for note in result.notes:
        warn(note, "repaired")
    console.print(
        f"{escape(str(result.run_dir))} had finished at step {result.resumed_from}: nothing to train "
        f"(to train on, resume with a larger train.max_steps, e.g. `difftrain {command} "
        f"{escape(str(result.run_dir / 'recipe.yaml'))} --resume train.max_steps={2 * int(result.resumed_from or 1)}`)",
        soft_wrap=True,
    )


def run_training(command: str, train: Any, recipe: Any, on_start: Any, on_end: Any, **kwargs: Any) -> None:
    """Run `train(recipe, ...)` (pretrain or finetune) with data progress bars, then
    `on_end(summary, run_dir)` on rank 0. A graceful stop prints the resume command and exits 130
    (SIGINT) or 143 (SIGTERM); running out of memory becomes a DeviceError with `oom_advice`."""
    import shlex
    import signal

    import torch

    from difftrain.errors import DeviceError, StopRequested, TrainingError

    resume_cmd = f"difftrain {command} {shlex.quote(str(recipe.run_dir / 'recipe.yaml'))} --resume"
    t = recipe.train
    several = t.devices != 1 or t.num_nodes > 1  # (auto: every GPU there is)
    try:
        with DataBars() as dp:

            def started(info: Any) -> None:
                dp.stop()
                on_start(info)

            result = train(recipe, console=console, on_start=started, data_progress=dp, **kwargs)
    except StopRequested as stop:
        if stop.is_global_zero:  # one unbroken line, to be copied and pasted
            err_console.print(
                f"[yellow]stopped at step {stop.step}; checkpoint saved.[/] Resume with: [bold]{escape(resume_cmd)}[/]",
                soft_wrap=True,
            )
        raise typer.Exit(130 if stop.signum == signal.SIGINT else 143) from None
    except torch.OutOfMemoryError as e:
        raise DeviceError(oom_advice(recipe, finetune=command == "finetune")) from e
    except RuntimeError as e:  # the CPU allocator's failure is a plain RuntimeError
        # a collective failed because another process of the run went away
        if several and (type(e).__name__ == "DistBackendError" or any(s in str(e) for s in _PEER_LOST)):
            raise TrainingError(
                f"another process of this run ended while this one waited for it ({first_line(e)}): killed, "
                f"or out of memory (see its output or the system log); the checkpoints saved so far are kept: "
                f"resume with `{resume_cmd}`"
            ) from e
        if "can't allocate memory" not in str(e) and "DefaultCPUAllocator: not enough memory" not in str(e):
            raise
        raise DeviceError(oom_advice(recipe, finetune=command == "finetune", device="CPU")) from e
    if result.is_global_zero:  # one table, not one per process
        if result.finished_before:
            report_finished(result, command)
        on_end(result.summary, result.run_dir)
