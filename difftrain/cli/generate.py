"""`difftrain generate RUN_DIR` and `difftrain chat RUN_DIR`: render what a `Session` and the REPLs
of `difftrain.infer.chat` yield: completions on stdout, headers, footers and notes on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from difftrain.cli.common import DEVICE, DTYPE, console, err_console, run_banner, warn
from difftrain.errors import ConfigError, DataError
from difftrain.infer.prompts import Prompt, parse_prompts, require_utf8, unescape, utf8_problem

COMPILE_HELP = (
    "Run the decode step under torch.compile: each new prompt length (or batch shape) first waits for a "
    "compilation (seconds to tens of seconds; its footer says so), then tokens come faster. Needs a C++ "
    "compiler on CPU, Triton on CUDA."
)

# the options generate and chat share
_RUN_DIR = typer.Argument(..., help="Run directory (holds config.json, model.safetensors, tokenizer.json).")
_TEMPERATURE = typer.Option(0.8, "--temperature", "-t", help="Softmax temperature (0 = greedy).")
_TOP_K = typer.Option(50, "--top-k", help="Sample among the k most probable tokens (0 = off).")
_TOP_P = typer.Option(
    0.95, "--top-p", help="Nucleus: smallest set of tokens with this much probability, in (0, 1] (1 = off)."
)
_MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below min_p × the top probability (0 = off).")
_REPETITION_PENALTY = typer.Option(1.0, "--repetition-penalty", help="Penalise repeated tokens (1 = off).")
_SEED = typer.Option(None, "--seed", help="Seed for sampling (default: a random seed, printed).")
_GREEDY = typer.Option(False, "--greedy", help="Always take the most probable token.")
_COMPILE = typer.Option(False, "--compile", help=COMPILE_HELP)


def read_prompt_file(path: Path) -> list[Prompt]:
    """The prompts of --prompt-file (`parse_prompts`); `-` reads plain lines from standard input."""
    stdin = str(path) == "-"
    try:
        text = sys.stdin.read() if stdin else path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"--prompt-file {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise DataError(f"--prompt-file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"--prompt-file {path}: cannot read it ({e.strerror})") from None
    jsonl = not stdin and path.suffix.lower() == ".jsonl"
    prompts = parse_prompts(text, "stdin" if stdin else str(path), jsonl=jsonl)
    if not prompts:
        what = "- (standard input)" if stdin else str(path)
        raise DataError(f"--prompt-file {what} holds no prompts (it is empty or blank)")
    return prompts


def _read_prompt(marker: str = "» ") -> str:
    """A message typed at the REPL (lines ending in \\ continue it); no `marker` on piped input;
    EOFError at the end of input or output."""
    if console.quiet:  # (`on_broken_pipe`)
        raise EOFError
    with contextlib.suppress(ImportError):  # line editing and history (arrow keys) where there is readline
        import readline  # noqa: F401
    piped = not sys.stdin.isatty()
    marker = "" if piped else marker
    while True:
        try:
            lines = [input(marker)]
            while lines[-1].endswith("\\") and not lines[-1].endswith("\\\\"):
                lines[-1] = lines[-1][:-1]
                try:
                    lines.append(input("… " if marker else ""))
                except EOFError:  # the end of input ends the message (the next read ends the session)
                    break
        except BrokenPipeError:
            raise EOFError from None
        text = "\n".join(lines).removeprefix("\ufeff")  # (a byte-order mark is no part of a message)
        if (problem := utf8_problem(text)) is None:
            return text
        if piped:  # nobody to type it again: as --prompt-file - refuses it
            require_utf8(text, "standard input")
        warn(f"{problem}; type it again (is the terminal's encoding UTF-8?)", "error", "bold red")


_REASONS = dict(eos="end of document", stop="stop string", length="--max-new-tokens", context="context full")


@dataclass
class _Render:
    """Shows what a session and its REPL yield: text on stdout, the rest on stderr. Each row's
    completion follows a rule (with `rules`) and its prompt, dimmed, or `reply_label`."""

    session: Any
    rules: bool
    reply_label: str | None = None
    stop_reason: str = _REASONS["stop"]

    def __call__(self, ev: Any) -> None:
        from difftrain.infer.chat import Note
        from difftrain.infer.session import Result, Row

        if isinstance(ev, Row):
            self.header(ev)
        elif isinstance(ev, Result):
            self.text("\n")
            self.footer([ev], ev.completion.time_s)
        elif isinstance(ev, Note):
            self.note(ev)
        else:  # a Token
            self.text(ev.text)

    def header(self, row: Any) -> None:
        if self.rules:
            from rich.rule import Rule

            title = f"[dim]{escape(row.prompt.where)} · sample {row.sample + 1}/{self.session.num_samples}"
            console.print(Rule(title, align="left"), width=console.width if console.is_terminal else 80)
        if self.reply_label is not None:
            console.print(self.reply_label, end="")
        else:
            console.print(row.text, style="dim", end="", markup=False, highlight=False, soft_wrap=True)

    def text(self, text: str) -> None:
        if text:
            console.file.write(text)
            console.file.flush()

    def note(self, ev: Any) -> None:
        if ev.kind == "error":
            warn(ev.text, "error", "bold red")
        elif ev.kind == "interrupted":
            console.file.write("\n")
            err_console.print(f"[yellow]interrupted[/]{escape(ev.text)}", soft_wrap=True)
        else:
            err_console.print(f"[dim]{escape(ev.text)}", soft_wrap=True)

    def footer(self, results: list[Any], seconds: float) -> None:
        tokens = sum(len(r.completion.token_ids) for r in results)
        compiling = " (incl. compiling the decode step)" if self.session.compiled_anew() else ""
        parts = [
            f"{tokens} tokens",
            f"{seconds:.2f} s{compiling}",
            f"{tokens / seconds if seconds > 0 else 0:.1f} tokens/s",
        ]
        if len(results) == 1:
            c = results[0].completion
            reason = {**_REASONS, "stop": self.stop_reason}[c.finish_reason]
            parts += [f"first token {c.first_token_s * 1000:.0f} ms", f"stopped: {reason}"]
        else:
            parts.insert(0, f"{len(results)} completions")
        err_console.print("[dim]" + " · ".join(parts), soft_wrap=True)
        if any(r.completion.finish_reason == "context" for r in results):
            warn(
                f"the context is full (the model reads at most max_seq_len={self.session.run.config.max_seq_len} "
                "tokens); generation stops there instead of sliding the window",
                "note",
            )


def _banner(run: Any, load_s: float, seed: int, style: Any, greedy: bool = False) -> None:
    """The run's one-line description (a seed unless `greedy`)."""
    kind = "instruction-tuned" if style.instruction else "pretrained"
    run_banner(run, f"loaded in {load_s:.1f} s", "greedy" if greedy else f"seed {seed}", kind=kind)


MAX_SEED = 2**62  # torch's generators take 64-bit seeds; each sample draws with seed + its number


def _seed(seed: int | None) -> int:
    """--seed, checked, or a random one."""
    if seed is None:
        return secrets.randbelow(2**31)
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed {seed} is out of range; use a whole number from 0 to 2^62 ({MAX_SEED})")
    return seed


def _stdin_has_data() -> bool:
    """Whether text was piped into standard input (which generate does not read), without waiting."""
    import select

    try:
        if sys.stdin is None or sys.stdin.isatty():
            return False
        fd = sys.stdin.fileno()
        return bool(select.select([fd], [], [], 0)[0]) and os.read(fd, 1) != b""
    except (OSError, ValueError, AttributeError):
        return False


def _load(run_dir: Path, device: str, dtype: str, compile: bool) -> tuple[Any, float, Any]:
    """(run, seconds it took to load, its `PromptStyle`); a missing compiler fails first."""
    from difftrain.infer.device import require_compiler, resolve_device, resolve_dtype
    from difftrain.infer.session import prompt_style
    from difftrain.rundir import load_run

    dev = resolve_device(device)
    if compile:
        require_compiler(dev)
    dt = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    run = load_run(run_dir, device=dev, dtype=dt)
    return run, time.perf_counter() - t0, prompt_style(run.path)


def generate_command(
    run_dir: Path = _RUN_DIR,
    prompt: list[str] = typer.Option(None, "--prompt", "-p", help="Prompt (repeatable); \\n is a newline."),
    prompt_file: Path = typer.Option(
        None, "--prompt-file", help='Prompts, one per line (or .jsonl with a "prompt" field); - is stdin.'
    ),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most new tokens per completion."),
    temperature: float = _TEMPERATURE,
    top_k: int = _TOP_K,
    top_p: float = _TOP_P,
    min_p: float = _MIN_P,
    repetition_penalty: float = _REPETITION_PENALTY,
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable); \\n is a newline."),
    num_samples: int = typer.Option(1, "--num-samples", help="Completions per prompt."),
    seed: int = _SEED,
    greedy: bool = _GREEDY,
    device: str = DEVICE,
    dtype: str = DTYPE,
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Print tokens as they come, or batch."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
    interactive: bool = typer.Option(False, "--interactive", "-i", help="Type prompts in a REPL."),
    batch_size: int = typer.Option(16, "--batch-size", help="Sequences per batch (--no-stream, --json)."),
    cache: bool = typer.Option(
        True, "--cache/--no-cache", help="Use the KV cache (--no-cache: recompute the prefix, slowly)."
    ),
    compile: bool = _COMPILE,
) -> None:
    r"""Sample text from a trained run.

    Streams each completion, then a footer (tokens, time, tokens/s). With --no-stream or --json,
    several prompts (--prompt repeated, --prompt-file) and --num-samples run as batches of
    left-padded sequences.

    A pretrained run reads a prompt as the start of a document (after the token it saw before every
    document: <|eos|>, or an imported tokenizer's start token such as Llama's <s>); without --prompt
    it samples a document from scratch. An instruction-tuned run reads the prompt in its
    finetune.prompt_format (a .jsonl --prompt-file may fill more fields than `prompt`). In --prompt
    and interactive input, \n and \t are a newline and a tab.

    A sequence stops at <|eos|>, at a --stop string (cut from the text), after --max-new-tokens, or,
    with a note, when the context (max_seq_len) is full: the window never slides.

    Sampling applies the repetition penalty, then temperature, top-k, top-p and min-p; --greedy (or
    --temperature 0) takes the most probable token. The i-th completion (prompts × --num-samples, in
    order) uses seed + i, whatever the batch; without --seed a random seed is drawn and printed."""
    from difftrain.rundir import record_kinds, require_model_files

    require_model_files(run_dir)  # a mistyped path or option fails before torch loads
    from difftrain.infer.settings import GenerationConfig, SamplingConfig

    sampling = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty, greedy)
    if compile and not cache:
        raise ConfigError("--compile runs the cached decode step; leave out --no-cache (or --compile)")
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=tuple(unescape(x) for x in stop or ()),
        use_cache=cache,
        compile=compile,
    )
    for name, value in (("--num-samples", num_samples), ("--batch-size", batch_size)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be ≥ 1")
    if prompt and prompt_file is not None:
        raise ConfigError("give either --prompt or --prompt-file, not both")
    if interactive and (prompt or prompt_file is not None or as_json):
        raise ConfigError(
            "--interactive reads prompts from the keyboard; drop --prompt, --prompt-file, --json"
        )
    if prompt_file is not None:
        prompts = read_prompt_file(prompt_file)
    elif prompt:
        prompts = [
            Prompt(unescape(t), "--prompt" if len(prompt) == 1 else f"--prompt {i}")
            for i, t in enumerate(prompt, 1)
        ]
        empty = next((p.where for p in prompts if not p.text), None)
        if empty is not None:
            raise DataError(
                f"{empty.replace(' ', ' number ')} is empty; give some text, or leave out --prompt to sample a "
                "document from scratch"
            )
    else:
        prompts = [Prompt("", "start of a document")]
        if not interactive and _stdin_has_data():
            warn(
                "standard input is not read without --prompt-file - (or --interactive); generating "
                "from the start of a document"
            )
    for p in prompts:  # before the model loads
        require_utf8(p.text, p.where)
    seed = _seed(seed)

    from difftrain.infer.session import Session

    run, load_s, style = _load(run_dir, device, dtype, compile)
    session = Session(run, gen, style, seed, num_samples=num_samples, batch_size=batch_size)
    rows = [] if interactive else session.rows(prompts)  # every prompt fits, before anything is printed

    if not as_json:
        _banner(run, load_s, seed, style, greedy=sampling.is_greedy and not interactive)
        if record_kinds(run.path) == ["messages"] and (prompt or prompt_file is not None or interactive):
            warn(
                f"{run.path} was fine-tuned on `messages` records only: `difftrain chat {shlex.quote(str(run.path))}` "
                "talks to it in its chat template; here a prompt is rendered as prompt/response records are "
                "(finetune.prompt_format), which it never saw",
                "note",
            )
        if sampling.is_greedy and num_samples > 1:
            warn(f"greedy decoding gives the same completion {num_samples} times")
    render = _Render(session, rules=len(rows) > 1 or num_samples > 1)
    if interactive:
        from difftrain.infer.chat import Repl

        Repl(session, _read_prompt, render).run()
    elif as_json:
        t1 = time.perf_counter()
        results = [r.to_json() for r in session.batch(rows)]
        seconds = time.perf_counter() - t1
        tokens = sum(r["completion_tokens"] for r in results)
        w, g = run.model.lm_head.weight, sampling.is_greedy
        # greedy decoding draws nothing: the sampling settings and seeds it does not use are null
        drawn = {k: None if g else getattr(sampling, k) for k in ("temperature", "top_k", "top_p", "min_p")}
        doc = {
            "run": str(run.path),
            "arch": run.config.arch,
            "prompt_style": "instruction" if style.instruction else "document",
            "device": str(w.device),
            "dtype": str(w.dtype).removeprefix("torch."),
            "settings": {
                "max_new_tokens": max_new_tokens,
                **drawn,
                "repetition_penalty": repetition_penalty,
                "greedy": g,
                "stop": list(gen.stop),
                "num_samples": num_samples,
                "seed": None if g else seed,
                "cache": cache,
            },
            "results": [{**r, "seed": None} for r in results] if g else results,
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
        for event in session.stream(rows):
            render(event)
    else:
        t0 = time.perf_counter()
        results = []
        for r in session.batch(rows):
            results.append(r)
            render.header(r.row)
            console.print(r.completion.text, markup=False, highlight=False, soft_wrap=True)
        render.footer(results, time.perf_counter() - t0)


def chat_command(
    run_dir: Path = _RUN_DIR,
    system: str = typer.Option(None, "--system", help="A system message that opens the conversation."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens per reply."),
    temperature: float = _TEMPERATURE,
    top_k: int = _TOP_K,
    top_p: float = _TOP_P,
    min_p: float = _MIN_P,
    repetition_penalty: float = _REPETITION_PENALTY,
    seed: int = _SEED,
    greedy: bool = _GREEDY,
    device: str = DEVICE,
    dtype: str = DTYPE,
    compile: bool = _COMPILE,
) -> None:
    """Talk to a chat fine-tuned run (a REPL with history).

    Each turn renders the conversation with the run's finetune.chat_template (the default template
    for runs not fine-tuned on messages) and streams the reply until the template's end marker
    (<|end|>) or <|eos|>. When the conversation outgrows max_seq_len, the oldest exchanges are
    dropped, with a note (the system message is kept). Ctrl-C stops a reply; /reset starts over;
    /help lists the commands (/set and /show change and print the sampling settings); Ctrl-D or
    /quit exits."""
    from difftrain.rundir import record_kinds, require_model_files

    require_model_files(run_dir)  # a mistyped path or option fails before torch loads
    from difftrain.infer.settings import GenerationConfig, SamplingConfig

    sampling = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty, greedy)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, compile=compile)
    require_utf8(system or "", "--system")
    seed = _seed(seed)
    from difftrain.infer.chat import Chat, ChatRepl
    from difftrain.infer.session import Session
    from difftrain.recipe import ChatTemplateConfig

    run, load_s, style = _load(run_dir, device, dtype, compile)
    chat = Chat(style.chat or ChatTemplateConfig(), system)
    if system:  # every message would be refused as too long: say whose text is
        n = len(run.tokenizer.encode(chat.render()))
        if n > run.config.max_seq_len - 8:
            raise ConfigError(
                f"--system is {n} tokens with the template; the context is {run.config.max_seq_len} "
                "(max_seq_len) and needs room for your messages and the replies: shorten it"
            )
    if chat.end:
        gen = replace(gen, stop=(chat.end,))
    _banner(run, load_s, seed, style)
    if not style.instruction:
        warn(
            f"{run.path} is not instruction-tuned; it reads the chat template as plain text (fine-tune it on "
            "`messages` records with `difftrain finetune` for a model that follows it)",
            "note",
        )
    elif record_kinds(run.path) == ["prompt/response"]:
        warn(
            f"{run.path} was fine-tuned on prompt/response records, not `messages`: it never saw the chat "
            f"template; `difftrain generate {shlex.quote(str(run.path))} -p TEXT` gives it prompts in the format "
            "it learned",
            "note",
        )
    session = Session(run, gen, style, seed)
    render = _Render(session, False, "[bold cyan]assistant »[/] ", f"end of reply ({chat.end})")
    ChatRepl(session, _read_prompt, render, chat).run()


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_command)
    app.command("chat")(chat_command)
