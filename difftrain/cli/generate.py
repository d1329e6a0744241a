"""`difftrain generate RUN_DIR`: sample from a trained run (streaming, batched, JSON, interactive).

The command parses and checks its arguments, loads the run (config.json + model.safetensors +
tokenizer.json, never a pickle), and renders what `difftrain.infer.generate` yields. Completion
text goes to stdout (the prompt is echoed dimmed before it); headers, footers and notes go to
stderr, so `difftrain generate RUN --prompt x > out.txt` keeps only the text.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from difftrain.cli.common import console, err_console, fmt_count
from difftrain.errors import ConfigError, DataError

HELP = (
    "Sample text from a trained run.\n\n"
    "Streams each completion as it is produced and ends with a footer (tokens, time, tokens/s). Several "
    "prompts (--prompt repeated, or --prompt-file) and --num-samples run as batches of left-padded "
    "sequences with --no-stream or --json; with --stream they are shown one after another.\n\n"
    "Each prompt is preceded by <|eos|>, the document separator the model saw in training, so the prompt "
    "reads as the start of a document; without --prompt a document is sampled from scratch. In --prompt and "
    "in interactive input, \\n and \\t are a newline and a tab.\n\n"
    "A sequence stops at <|eos|>, at any --stop string (cut from the text), after --max-new-tokens, or when "
    "the context is full: the model reads at most max_seq_len tokens, and generation then stops with a "
    "note. It never slides the window (the model would read a context it was not trained on).\n\n"
    "Sampling applies the repetition penalty, then temperature, top-k, top-p and min-p; --greedy (or "
    "--temperature 0) takes the most probable token. A seed makes samples reproducible: sample i uses "
    "seed + i, whatever the batch. Without --seed a random one is drawn and printed."
)

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    r"""Turn the two-character sequences \n, \t, \\ into newline, tab and backslash."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


@dataclass
class Prompt:
    text: str
    where: str  # "--prompt", "prompts.jsonl, line 3", "input"


def read_prompt_file(path: Path) -> list[Prompt]:
    """One prompt per non-blank line, or for .jsonl one JSON object with a "prompt" field per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"--prompt-file {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise DataError(f"--prompt-file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"--prompt-file {path}: cannot read it ({e.strerror})") from None
    prompts = []
    jsonl = path.suffix.lower() == ".jsonl"
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        if not jsonl:
            prompts.append(Prompt(line, where))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f'{where}: invalid JSON ({e.msg}); each line must be an object like {{"prompt": "..."}}'
            ) from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise DataError(
                f'{where}: no "prompt" field; each line must be an object like {{"prompt": "..."}}'
            )
        if not isinstance(record["prompt"], str):
            raise DataError(f'{where}: "prompt" must be a string, got {type(record["prompt"]).__name__}')
        if record["prompt"] == "":
            raise DataError(f'{where}: "prompt" is empty; remove the line or give some text')
        prompts.append(Prompt(record["prompt"], where))
    if not prompts:
        raise DataError(f"--prompt-file {path} holds no prompts (it is empty or blank)")
    return prompts


class Session:
    """A loaded run plus the generation settings; turns prompts into rendered completions."""

    def __init__(self, run: Any, gen: Any, *, num_samples: int, seed: int, batch_size: int) -> None:
        self.run, self.gen = run, gen
        self.num_samples, self.seed, self.batch_size = num_samples, seed, batch_size
        self.rows_done = 0  # seeds keep advancing across interactive turns

    # -- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        from difftrain.infer.generate import prompt_ids

        ids = prompt_ids(self.run.tokenizer, prompt.text)
        limit = self.run.config.max_seq_len
        if len(ids) > limit:
            raise DataError(
                f"{prompt.where}: the prompt is {len(ids)} tokens (with the leading <|eos|>) but {self.run.path} "
                f"has max_seq_len={limit}; shorten it by at least {len(ids) - limit} tokens"
            )
        return ids

    def rows(self, prompts: list[Prompt]) -> list[tuple[int, int, Prompt, list[int]]]:
        """(row seed, sample index, prompt, ids) for every prompt × sample, in order."""
        encoded = [self.encode(p) for p in prompts]
        out = []
        for p, ids in zip(prompts, encoded, strict=True):
            for s in range(self.num_samples):
                out.append((self.seed + self.rows_done + len(out), s, p, ids))
        return out

    # -- running -----------------------------------------------------------------------------
    def stream(self, prompts: list[Prompt]) -> list[dict[str, Any]]:
        """Generate row by row, printing text as it comes (Ctrl-C propagates to the caller)."""
        from difftrain.infer.generate import Finished, Token, generate

        rows = self.rows(prompts)
        results = []
        for seed, s, p, ids in rows:
            if len(rows) > 1:
                console.rule(f"[dim]{p.where} · sample {s + 1}/{self.num_samples}", align="left")
            console.print(p.text, style="dim", end="", markup=False, highlight=False, soft_wrap=True)
            out = console.file
            for ev in generate(self.run.model, [ids], self.gen, tokenizer=self.run.tokenizer, seeds=[seed]):
                if isinstance(ev, Token) and ev.text:
                    out.write(ev.text)
                    out.flush()
                elif isinstance(ev, Finished):
                    out.write("\n")
                    out.flush()
                    result = _result(ev.completion, p, s, seed)
                    results.append(result)
                    self._footer([result], ev.completion.time_s)
            self.rows_done += 1
        return results

    def batch(self, prompts: list[Prompt], *, show: bool) -> list[dict[str, Any]]:
        """Generate in batches of `batch_size` rows; print the completions when `show`."""
        from difftrain.infer.generate import generate_all

        rows = self.rows(prompts)
        results: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            completions = generate_all(
                self.run.model,
                [r[3] for r in chunk],
                self.gen,
                tokenizer=self.run.tokenizer,
                seeds=[r[0] for r in chunk],
            )
            for (seed, s, p, _), c in zip(chunk, completions, strict=True):
                results.append(_result(c, p, s, seed))
                if show:
                    if len(rows) > 1:
                        console.rule(f"[dim]{p.where} · sample {s + 1}/{self.num_samples}", align="left")
                    console.print(p.text, style="dim", end="", markup=False, highlight=False, soft_wrap=True)
                    console.print(c.text, markup=False, highlight=False, soft_wrap=True)
        self.rows_done += len(rows)
        if show:
            self._footer(results, time.perf_counter() - t0)
        return results

    def _footer(self, results: list[dict[str, Any]], seconds: float) -> None:
        tokens = sum(r["completion_tokens"] for r in results)
        parts = [
            f"{tokens} tokens",
            f"{seconds:.2f} s",
            f"{tokens / seconds if seconds > 0 else 0:.1f} tokens/s",
        ]
        if len(results) == 1:
            parts.append(f"first token {results[0]['first_token_s'] * 1000:.0f} ms")
            parts.append(f"stopped: {_REASONS[results[0]['finish_reason']]}")
        else:
            parts.insert(0, f"{len(results)} completions")
        err_console.print("[dim]" + " · ".join(parts), soft_wrap=True)
        if any(r["finish_reason"] == "context" for r in results):
            err_console.print(
                f"[yellow]note:[/] the context is full (the model reads at most max_seq_len="
                f"{self.run.config.max_seq_len} tokens); generation stops there instead of sliding the window",
                soft_wrap=True,
            )


_REASONS = {
    "eos": "end of document",
    "stop": "stop string",
    "length": "--max-new-tokens",
    "context": "context full",
}


def _result(c: Any, p: Prompt, sample: int, seed: int) -> dict[str, Any]:
    return {
        "prompt": p.text,
        "source": p.where,
        "sample": sample,
        "seed": seed,
        "completion": c.text,
        "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.token_ids),
        "finish_reason": c.finish_reason,
        "first_token_s": round(c.first_token_s, 6),
        "time_s": round(c.time_s, 6),
        "tokens_per_s": round(c.tokens_per_s, 3),
        "token_ids": c.token_ids,
    }


# ----- interactive -----------------------------------------------------------------------------
_SETTABLE = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "greedy": lambda v: v.lower() in ("1", "true", "on", "yes"),
}

REPL_HELP = """Type a prompt and press Enter; its continuation streams below it.
  a line ending in \\ continues on the next line; \\n and \\t are a newline and a tab
  Ctrl-C stops a generation (and clears the line at the prompt); Ctrl-D or /quit exits
  /set KEY VALUE changes a setting: max_new_tokens, temperature, top_k, top_p, min_p,
      repetition_penalty, greedy      /show prints the settings      /help prints this"""


def _read_prompt() -> str:
    lines = [input("» ")]
    while lines[-1].endswith("\\") and not lines[-1].endswith("\\\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input("… "))
    return "\n".join(lines)


def repl(session: Session) -> None:
    """Read prompts until EOF; Ctrl-C interrupts a generation without quitting."""
    try:  # line editing and history (arrow keys) where the platform has readline
        import readline  # noqa: F401
    except ImportError:
        pass
    err_console.print(f"[dim]{REPL_HELP}", soft_wrap=True)
    while True:
        try:
            line = _read_prompt()
        except EOFError:
            err_console.print()
            return
        except KeyboardInterrupt:
            err_console.print("\n[dim](Ctrl-D or /quit exits)", soft_wrap=True)
            continue
        cmd = line.strip()
        if cmd in ("/quit", "/exit"):
            return
        if cmd == "/help":
            err_console.print(f"[dim]{REPL_HELP}", soft_wrap=True)
            continue
        if cmd == "/show":
            g = session.gen
            err_console.print(
                f"[dim]max_new_tokens={g.max_new_tokens} {g.sampling} seed={session.seed}", soft_wrap=True
            )
            continue
        if cmd.startswith("/set"):
            _set(session, cmd.split()[1:])
            continue
        if cmd == "":
            continue
        try:
            session.stream([Prompt(unescape(line), "input")])
        except KeyboardInterrupt:
            console.file.write("\n")
            err_console.print("[yellow]interrupted[/]", soft_wrap=True)
            session.rows_done += 1
        except (ConfigError, DataError) as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)


def _set(session: Session, args: list[str]) -> None:
    if len(args) != 2:
        err_console.print(
            "[bold red]error:[/] usage: /set KEY VALUE, e.g. /set temperature 0.5", soft_wrap=True
        )
        return
    key, value = args
    try:
        if key == "max_new_tokens":
            session.gen = replace(session.gen, max_new_tokens=int(value))
        elif key in _SETTABLE:
            session.gen = replace(
                session.gen, sampling=replace(session.gen.sampling, **{key: _SETTABLE[key](value)})
            )
        else:
            raise ConfigError(f"unknown setting {key!r}; one of max_new_tokens, {', '.join(_SETTABLE)}")
    except ValueError:
        err_console.print(f"[bold red]error:[/] {key}: {value!r} is not a number", soft_wrap=True)
    except ConfigError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)


# ----- the command -----------------------------------------------------------------------------
def generate_command(
    run_dir: Path = typer.Argument(
        ..., help="Run directory (holds config.json, model.safetensors, tokenizer.json)."
    ),
    prompt: list[str] = typer.Option(
        None, "--prompt", "-p", help="Prompt text (repeat for several). \\n is a newline."
    ),
    prompt_file: Path = typer.Option(
        None, "--prompt-file", help='One prompt per line, or a .jsonl with a "prompt" field per line.'
    ),
    max_new_tokens: int = typer.Option(
        256, "--max-new-tokens", "-n", help="Most tokens to generate per completion."
    ),
    temperature: float = typer.Option(0.8, "--temperature", "-t", help="Softmax temperature (0 = greedy)."),
    top_k: int = typer.Option(50, "--top-k", help="Sample among the k most probable tokens (0 = off)."),
    top_p: float = typer.Option(
        0.95,
        "--top-p",
        help="Nucleus: smallest set of tokens with this much probability, in (0, 1] (1 = off).",
    ),
    min_p: float = typer.Option(
        0.0, "--min-p", help="Drop tokens below min_p × the top probability (0 = off)."
    ),
    repetition_penalty: float = typer.Option(
        1.0, "--repetition-penalty", help="Penalise tokens already present (1 = off, e.g. 1.2)."
    ),
    stop: list[str] = typer.Option(
        None, "--stop", help="Stop when the completion contains this string (repeatable)."
    ),
    num_samples: int = typer.Option(1, "--num-samples", help="Completions per prompt."),
    seed: int = typer.Option(None, "--seed", help="Seed for sampling (default: a random seed, printed)."),
    greedy: bool = typer.Option(False, "--greedy", help="Always take the most probable token."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N | mps."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16."
    ),
    stream: bool = typer.Option(
        True, "--stream/--no-stream", help="Print tokens as they come (else batch and print at the end)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print machine-readable results (JSON on stdout) instead of text."
    ),
    interactive: bool = typer.Option(
        False, "--interactive", "-i", help="Read prompts from the keyboard (a REPL with history)."
    ),
    batch_size: int = typer.Option(
        16, "--batch-size", help="Sequences generated together with --no-stream / --json."
    ),
    cache: bool = typer.Option(
        True,
        "--cache/--no-cache",
        help="Use the KV cache (--no-cache recomputes the prefix each step: the slow reference).",
    ),
) -> None:
    from difftrain.infer.generate import GenerationConfig
    from difftrain.infer.sampling import SamplingConfig

    # Arguments first: a typo fails in milliseconds, before the model loads.
    sampling = SamplingConfig(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        greedy=greedy,
    )
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop or ()), use_cache=cache
    )
    if num_samples < 1:
        raise ConfigError(f"--num-samples {num_samples} must be ≥ 1")
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be ≥ 1")
    if prompt and prompt_file is not None:
        raise ConfigError("give either --prompt or --prompt-file, not both")
    if interactive and (prompt or prompt_file is not None or as_json):
        raise ConfigError(
            "--interactive reads prompts from the keyboard; leave out --prompt, --prompt-file and --json"
        )
    if prompt_file is not None:
        prompts = read_prompt_file(prompt_file)
    elif prompt:
        for i, text in enumerate(prompt, start=1):
            if text == "":
                where = "--prompt" if len(prompt) == 1 else f"--prompt number {i}"
                raise DataError(
                    f"{where} is empty; give some text, or leave out --prompt to sample a document from scratch"
                )
        prompts = [
            Prompt(unescape(t), "--prompt" if len(prompt) == 1 else f"--prompt {i}")
            for i, t in enumerate(prompt, 1)
        ]
    else:
        prompts = [Prompt("", "start of a document")]
    if seed is None:
        seed = secrets.randbelow(2**31)

    from difftrain.infer.device import resolve_device, resolve_dtype
    from difftrain.rundir import load_run

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    run = load_run(run_dir, device=dev, dtype=dt)
    load_s = time.perf_counter() - t0
    session = Session(run, gen, num_samples=num_samples, seed=seed, batch_size=batch_size)
    if not interactive:
        for p in prompts:  # every prompt fits, checked before anything is printed
            session.encode(p)

    if not as_json:
        n_params = sum(p.numel() for p in run.model.parameters())
        err_console.print(
            f"[dim]{run.path} · {run.config.arch} · {fmt_count(n_params)} parameters · max_seq_len {run.config.max_seq_len}"
            f" · {dev} {str(dt).removeprefix('torch.')} · loaded in {load_s:.1f} s · seed {seed}",
            soft_wrap=True,
        )
        if sampling.is_greedy and num_samples > 1:
            err_console.print(
                f"[yellow]warning:[/] greedy decoding gives the same completion {num_samples} times",
                soft_wrap=True,
            )
    if interactive:
        repl(session)
        return
    if as_json:
        t1 = time.perf_counter()
        results = session.batch(prompts, show=False)
        seconds = time.perf_counter() - t1
        tokens = sum(r["completion_tokens"] for r in results)
        doc = {
            "run": str(run.path),
            "arch": run.config.arch,
            "device": str(dev),
            "dtype": str(dt).removeprefix("torch."),
            "settings": {
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_k": top_k,
                "top_p": top_p,
                "min_p": min_p,
                "repetition_penalty": repetition_penalty,
                "greedy": sampling.is_greedy,
                "stop": list(gen.stop),
                "num_samples": num_samples,
                "seed": seed,
                "cache": cache,
            },
            "results": results,
            "total": {
                "completions": len(results),
                "completion_tokens": tokens,
                "time_s": round(seconds, 6),
                "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
            },
        }
        sys.stdout.write(json.dumps(doc, ensure_ascii=False, indent=2) + "\n")
        sys.stdout.flush()
    elif stream:
        session.stream(prompts)
    else:
        session.batch(prompts, show=True)


def register(app: typer.Typer) -> None:
    app.command("generate", help=HELP)(generate_command)
