"""`difftrain generate RUN_DIR` and `difftrain chat RUN_DIR`: sample from a trained run.

The commands parse and check their arguments, load the run (config.json + model.safetensors +
tokenizer.json, never a pickle), and render what `difftrain.infer.generate` yields. Completion
text goes to stdout (the prompt is echoed dimmed before it); headers, footers and notes go to
stderr, so `difftrain generate RUN --prompt x > out.txt` keeps only the text.

How a prompt is written for the model depends on how the run was trained (`PromptStyle`): a
pretrained run reads documents, so the prompt follows <|eos|> (the separator before every
document of its training stream); an instruction-tuned run reads its SFT format, so the prompt
is `finetune.prompt_format` filled in, with no token before it (as in fine-tuning).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from difftrain.cli.common import console, err_console, fmt_count, warn
from difftrain.errors import ConfigError, DataError
from difftrain.rundir import PromptSettings

HELP = (
    "Sample text from a trained run.\n\n"
    "Streams each completion as it is produced and ends with a footer (tokens, time, tokens/s). Several "
    "prompts (--prompt repeated, or --prompt-file) and --num-samples run as batches of left-padded "
    "sequences with --no-stream or --json; with --stream they are shown one after another.\n\n"
    "A pretrained run reads each prompt as the start of a document: it is preceded by the token the model "
    "saw before every document (<|eos|>, the separator, or an imported tokenizer's own start token such as "
    "Llama's <s>); without --prompt a document is sampled from scratch. "
    "An instruction-tuned run (difftrain finetune) reads the prompt in its finetune.prompt_format, filled "
    "from the record's fields (a .jsonl --prompt-file may carry more fields than `prompt`). In --prompt "
    "and in interactive input, \\n and \\t are a newline and a tab.\n\n"
    "A sequence stops at <|eos|>, at any --stop string (cut from the text), after --max-new-tokens, or when "
    "the context is full: the model reads at most max_seq_len tokens, and generation then stops with a "
    "note. It never slides the window (the model would read a context it was not trained on).\n\n"
    "Sampling applies the repetition penalty, then temperature, top-k, top-p and min-p; --greedy (or "
    "--temperature 0) takes the most probable token. A seed makes samples reproducible: the i-th "
    "completion of the command (prompts × --num-samples, in order) uses seed + i, whatever the batch "
    "(--json shows each one's seed). Without --seed a random one is drawn and printed."
)

CHAT_HELP = (
    "Talk to a chat fine-tuned run (a REPL with history).\n\n"
    "Each turn renders the conversation with the run's finetune.chat_template (the default template for "
    "runs not fine-tuned on messages), adds the assistant header, and streams the reply until the "
    "template's end marker (<|end|>) or <|eos|>. When the conversation outgrows max_seq_len, the oldest "
    "exchanges are dropped, with a note (the system message is kept); a reply stops when it fills the "
    "context. Ctrl-C stops a reply; /reset starts over; /help lists the commands (/set and /show change "
    "and print the sampling settings); Ctrl-D or /quit exits."
)

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    r"""Turn the two-character sequences \n, \t, \\ into newline, tab and backslash."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


@dataclass
class Prompt:
    text: str
    where: str  # "--prompt", "prompts.jsonl, line 3", "input"
    record: dict[str, Any] = field(default_factory=dict)  # fields for finetune.prompt_format

    @property
    def fields(self) -> dict[str, Any]:
        return {**self.record, "prompt": self.text}


def utf8_problem(text: str) -> str | None:
    """Why `text` is no UTF-8 text (None when it is): bytes that are not UTF-8 reach Python as
    lone surrogates (a command-line argument, standard input), and so does a JSON escape of half
    an emoji ("\\ud83d"); no tokenizer can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"a lone surrogate U+{ch:04X}"
        return f"{what} at character {e.start + 1} is not UTF-8 text"
    return None


def require_utf8(text: str, where: str) -> None:
    """A DataError naming `where` the text came from when it is no UTF-8 text (`utf8_problem`)."""
    problem = utf8_problem(text)
    if problem is not None:
        raise DataError(f"{where}: {problem}; give UTF-8 text")


def read_prompt_file(path: Path) -> list[Prompt]:
    """One prompt per non-blank line, or for .jsonl one JSON object with a "prompt" field per line;
    `-` reads plain lines from standard input."""
    from difftrain.io import json_error_reason

    stdin = str(path) == "-"
    try:
        # (a byte-order mark, which editors on Windows write first, is no part of the first prompt)
        lines = (
            (sys.stdin.read() if stdin else path.read_text(encoding="utf-8"))
            .removeprefix("\ufeff")
            .splitlines()
        )
    except FileNotFoundError:
        raise DataError(f"--prompt-file {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise DataError(f"--prompt-file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"--prompt-file {path}: cannot read it ({e.strerror})") from None
    prompts = []
    jsonl = not stdin and path.suffix.lower() == ".jsonl"
    name = "stdin" if stdin else str(path)
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}, line {n}"
        if not jsonl:
            prompts.append(Prompt(line, where))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f'{where}: invalid JSON ({json_error_reason(e)}); each line must be an object like {{"prompt": "..."}}'
            ) from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise DataError(
                f'{where}: no "prompt" field; each line must be an object like {{"prompt": "..."}}'
            )
        if not isinstance(record["prompt"], str):
            raise DataError(f'{where}: "prompt" must be a string, got {type(record["prompt"]).__name__}')
        if record["prompt"] == "":
            raise DataError(f'{where}: "prompt" is empty; remove the line or give some text')
        prompts.append(Prompt(record["prompt"], where, record))
    if not prompts:
        what = "- (standard input)" if stdin else str(path)
        raise DataError(f"--prompt-file {what} holds no prompts (it is empty or blank)")
    return prompts


# ----- how a run reads prompts -----------------------------------------------------------------
@dataclass(frozen=True)
class PromptStyle(PromptSettings):
    """How a run expects its input (see the module docstring): `rundir.PromptSettings` (whether
    it was fine-tuned on instruction records, their prompt_format, its chat template), rendered."""

    def render(self, prompt: Prompt) -> str:
        if not self.instruction:
            return prompt.text
        try:
            return self.prompt_format.format_map(prompt.fields)
        except KeyError as e:
            raise DataError(
                f"{prompt.where}: this run was fine-tuned with finetune.prompt_format={self.prompt_format!r}, "
                f"which needs the field {e}; give a .jsonl --prompt-file whose records have it"
            ) from None
        except (ValueError, IndexError) as e:
            raise DataError(
                f"finetune.prompt_format={self.prompt_format!r} of this run is not a format: {e}"
            ) from None

    def ids(self, tokenizer: Any, text: str) -> list[int]:
        """Token ids of rendered text: a document's after the token documents start after
        (<|eos|>, or an imported tokenizer's <s>); an instruction's as fine-tuning examples
        start (`prompt_ids` without document_start); an empty prompt starts from the document start."""
        from difftrain.infer.generate import prompt_ids

        return prompt_ids(tokenizer, text, document_start=not (self.instruction and text))


def prompt_style(run_path: Path) -> PromptStyle:
    """The run's `PromptStyle`, from its recipe.yaml (`rundir.prompt_settings`)."""
    from difftrain.rundir import prompt_settings

    return PromptStyle(**vars(prompt_settings(run_path)))


# ----- running and rendering -------------------------------------------------------------------
@dataclass
class Row:
    """One completion to produce: `text` is what the model reads (rendered prompt), `ids` its tokens."""

    seed: int
    sample: int
    prompt: Prompt
    text: str
    ids: list[int]


class Session:
    """A loaded run plus the generation settings; turns prompts into rendered completions."""

    def __init__(
        self, run: Any, gen: Any, *, num_samples: int, seed: int, batch_size: int, style: PromptStyle
    ) -> None:
        self.run, self.gen, self.style = run, gen, style
        self.num_samples, self.seed, self.batch_size = num_samples, seed, batch_size
        self.rows_done = 0  # seeds keep advancing across interactive turns
        # torch.compile's graphs so far in this process: figures that include a (re)compile say so
        self.graphs_seen = _compiled_graphs() if gen.compile else 0
        self.stop_reason = _REASONS["stop"]  # what the footer calls a stop (chat: the reply's end marker)

    def encode(self, prompt: Prompt) -> tuple[str, list[int]]:
        """(rendered text, ids), or a DataError if it does not fit the context."""
        text = self.style.render(prompt)
        ids = self.style.ids(self.run.tokenizer, text)
        limit = self.run.config.max_seq_len
        if len(ids) > limit:
            raise DataError(
                f"{prompt.where}: the prompt is {len(ids)} tokens but {self.run.path} has max_seq_len={limit}; "
                f"shorten it by at least {len(ids) - limit} tokens"
            )
        return text, ids

    def rows(self, prompts: list[Prompt]) -> list[Row]:
        """Every prompt × sample, in order; row k gets seed + k (counting earlier turns)."""
        encoded = [self.encode(p) for p in prompts]
        out: list[Row] = []
        for p, (text, ids) in zip(prompts, encoded, strict=True):
            for s in range(self.num_samples):
                out.append(Row(self.seed + self.rows_done + len(out), s, p, text, ids))
        return out

    def _header(self, row: Row, n_rows: int, echo: bool) -> None:
        if n_rows > 1:
            from rich.rule import Rule

            title = f"[dim]{escape(row.prompt.where)} · sample {row.sample + 1}/{self.num_samples}"
            # the terminal's width; piped, where the console lays out for very long lines, 80 columns
            console.print(Rule(title, align="left"), width=console.width if console.is_terminal else 80)
        if echo:
            console.print(row.text, style="dim", end="", markup=False, highlight=False, soft_wrap=True)

    def stream(self, rows: list[Row], *, echo: bool = True) -> list[dict[str, Any]]:
        """Generate row by row, printing text as it comes (Ctrl-C propagates to the caller)."""
        from difftrain.infer.generate import Finished, Token, generate

        results = []
        for row in rows:
            self._header(row, len(rows), echo)
            out = console.file
            events = generate(
                self.run.model, [row.ids], self.gen, tokenizer=self.run.tokenizer, seeds=[row.seed]
            )
            for ev in events:
                if isinstance(ev, Token) and ev.text:
                    out.write(ev.text)
                    out.flush()
                elif isinstance(ev, Finished):
                    out.write("\n")
                    out.flush()
                    results.append(_result(ev.completion, row))
                    self._footer(results[-1:], ev.completion.time_s)
            self.rows_done += 1
        return results

    def batch(self, rows: list[Row], *, show: bool) -> list[dict[str, Any]]:
        """Generate in batches of `batch_size` rows; print the completions when `show`."""
        from difftrain.infer.generate import generate_all

        results: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            completions = generate_all(
                self.run.model,
                [r.ids for r in chunk],
                self.gen,
                tokenizer=self.run.tokenizer,
                seeds=[r.seed for r in chunk],
            )
            for row, c in zip(chunk, completions, strict=True):
                results.append(_result(c, row))
                if show:
                    self._header(row, len(rows), echo=True)
                    console.print(c.text, markup=False, highlight=False, soft_wrap=True)
        self.rows_done += len(rows)
        if show:
            self._footer(results, time.perf_counter() - t0)
        return results

    def _footer(self, results: list[dict[str, Any]], seconds: float) -> None:
        tokens = sum(r["completion_tokens"] for r in results)
        compiling = ""
        if self.gen.compile:  # a new prompt length or batch shape compiles the decode step again
            graphs = _compiled_graphs()
            if graphs > self.graphs_seen:
                compiling, self.graphs_seen = " (incl. compiling the decode step)", graphs
        parts = [
            f"{tokens} tokens",
            f"{seconds:.2f} s{compiling}",
            f"{tokens / seconds if seconds > 0 else 0:.1f} tokens/s",
        ]
        if len(results) == 1:
            parts.append(f"first token {results[0]['first_token_s'] * 1000:.0f} ms")
            reason = results[0]["finish_reason"]
            parts.append(f"stopped: {self.stop_reason if reason == 'stop' else _REASONS[reason]}")
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


def _compiled_graphs() -> int:
    """How many graphs torch.compile has made in this process (0 where it made none)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


def _result(c: Any, row: Row) -> dict[str, Any]:
    return {
        "prompt": row.prompt.text,
        "source": row.prompt.where,
        "sample": row.sample,
        "seed": row.seed,
        "completion": c.text,
        "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.token_ids),
        "finish_reason": c.finish_reason,
        "first_token_s": round(c.first_token_s, 6),
        "time_s": round(c.time_s, 6),
        "tokens_per_s": round(c.tokens_per_s, 3),
        "token_ids": c.token_ids,
        # a .jsonl prompt's other fields (an id, a reference answer): results keep their inputs
        **(
            {"record": extra}
            if (extra := {k: v for k, v in row.prompt.record.items() if k != "prompt"})
            else {}
        ),
    }


# ----- interactive -----------------------------------------------------------------------------


def _switch(value: str) -> bool:
    v = value.lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ConfigError(f"greedy: {value!r} is not on or off; use /set greedy on (or off)")


_SETTABLE = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "greedy": _switch,
}

_INPUT_HELP = "  a line ending in \\ continues on the next line; \\n and \\t are a newline and a tab\n"
# the commands of both REPLs (`_command` and the loops), one line each
_COMMANDS_HELP = f"""  /set KEY VALUE   changes a setting: {", ".join(["max_new_tokens", *_SETTABLE])}
  /show            prints the settings
  /help            prints this
  /quit            exits (so do /exit and Ctrl-D)"""

REPL_HELP = (
    "Type a prompt and press Enter; its continuation streams below it.\n"
    + _INPUT_HELP
    + "  Ctrl-C stops a generation (and clears the line at the prompt)\n"
    + _COMMANDS_HELP
)

CHAT_REPL_HELP = (
    "Type a message and press Enter; the assistant's reply streams below it.\n"
    + _INPUT_HELP
    + "  Ctrl-C stops a reply (and clears the line at the prompt)\n"
    + "  /reset           forgets the conversation (a --system message stays)\n"
    + _COMMANDS_HELP
)


def _error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def _read_prompt(marker: str = "» ") -> str:
    """A message typed at the REPL (lines ending in \\ continue it). Piped input shows no prompt
    markers (a transcript of the output holds the replies, not a "» " per line read), and a reader
    of the output that went away (`| head`) ends the session as the end of input does."""
    if console.quiet:  # the output's reader went away (`on_broken_pipe`): nobody reads replies
        raise EOFError
    piped = not sys.stdin.isatty()
    try:
        text = _read_lines("" if piped else marker, piped)
    except BrokenPipeError:
        raise EOFError from None
    return text.removeprefix("\ufeff")  # (a byte-order mark is no part of a message)


def _read_lines(marker: str, piped: bool = False) -> str:
    while True:
        lines = [input(marker)]
        while lines[-1].endswith("\\") and not lines[-1].endswith("\\\\"):
            lines[-1] = lines[-1][:-1]
            try:
                lines.append(input("… " if marker else ""))
            except EOFError:  # the end of input ends the message (the next read ends the session)
                break
        text = "\n".join(lines)
        problem = utf8_problem(text)
        if problem is None:
            return text
        if piped:  # nobody to type it again: as --prompt-file - refuses it
            require_utf8(text, "standard input")
        _error(f"{problem}; type it again (is the terminal's encoding UTF-8?)")


def _enable_history() -> None:
    try:  # line editing and history (arrow keys) where the platform has readline
        import readline  # noqa: F401
    except ImportError:
        pass


def _command(session: Session, cmd: str, help_text: str) -> bool:
    """Handle /help, /show, /set; True if `cmd` was one of them."""
    if cmd == "/help":
        err_console.print(f"[dim]{escape(help_text)}", soft_wrap=True)
    elif cmd == "/show":
        g, smp = session.gen, session.gen.sampling
        settings = (
            f"max_new_tokens={g.max_new_tokens} greedy={str(smp.greedy).lower()} temperature={smp.temperature:g} "
            f"top_k={smp.top_k} top_p={smp.top_p:g} min_p={smp.min_p:g} "
            f"repetition_penalty={smp.repetition_penalty:g} seed={session.seed}"
        )
        err_console.print(f"[dim]{escape(settings)}", soft_wrap=True)
    elif cmd.startswith("/set"):
        _set(session, cmd.split()[1:])
    elif re.fullmatch(r"/[A-Za-z]+", cmd):  # a lone /word is a command, mistyped (text has more)
        _error(f"unknown command {cmd}; /help lists the commands")
    else:
        return False
    return True


def repl(session: Session) -> None:
    """Read prompts until EOF; Ctrl-C interrupts a generation without quitting."""
    _enable_history()
    err_console.print(f"[dim]{escape(REPL_HELP)}", soft_wrap=True)
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
        if cmd == "" or _command(session, cmd, REPL_HELP):
            continue
        try:
            session.stream(session.rows([Prompt(unescape(line), "input")]))
        except KeyboardInterrupt:
            console.file.write("\n")
            err_console.print("[yellow]interrupted[/]", soft_wrap=True)
            session.rows_done += 1
        except (ConfigError, DataError) as e:
            _error(str(e))


def _set(session: Session, args: list[str]) -> None:
    if len(args) != 2:
        _error("usage: /set KEY VALUE, e.g. /set temperature 0.5")
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
        now = session.gen.max_new_tokens if key == "max_new_tokens" else getattr(session.gen.sampling, key)
        shown = ("on" if now else "off") if isinstance(now, bool) else now
        err_console.print(f"[dim]({key} = {escape(str(shown))})", soft_wrap=True)
    except ValueError:
        whole = key == "max_new_tokens" or _SETTABLE.get(key) is int
        _error(f"{key}: {value!r} is not a {'whole number' if whole else 'number'}")
    except ConfigError as e:
        _error(str(e))


# ----- chat --------------------------------------------------------------------------------------
class Chat:
    """A conversation rendered with a chat template: roles[role] = head + {content} + tail."""

    def __init__(self, template: Any, system: str | None) -> None:
        self.roles: dict[str, str] = dict(template.roles)
        for role in ("user", "assistant"):
            if role not in self.roles:
                raise ConfigError(
                    f"the run's finetune.chat_template has no `{role}` role; chat needs user and assistant"
                )
        if system and "system" not in self.roles:
            raise ConfigError("--system given but the run's finetune.chat_template has no `system` role")
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.unseen = 0  # messages dropped from the conversation so far (the model no longer sees them)
        head, tail = self.roles["assistant"].split("{content}")
        self.reply_head = head
        self.end = tail.strip()  # "<|end|>": the stop string of a reply

    def render(self, messages: list[dict[str, str]] | None = None) -> str:
        """The conversation so far (or `messages`) plus the assistant header the reply continues."""
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + (
            self.messages if messages is None else messages
        )
        return (
            "".join(self.roles[m["role"]].replace("{content}", m["content"]) for m in msgs) + self.reply_head
        )

    def fit(self, tokenizer: Any, limit: int, room: int = 1) -> tuple[str, list[int], int]:
        """(rendered text, ids, messages dropped): the oldest exchanges are dropped, a user turn
        with the replies after it at a time (the system message stays), until the rendering
        leaves `room` new tokens for the reply in `limit`, or only the newest message is left
        (which needs room for one); `unseen` counts the dropped messages. A DataError when the
        newest message alone does not fit: it is taken back and the conversation is as it was."""
        from difftrain.infer.generate import prompt_ids

        dropped = 0
        messages = list(self.messages)
        text = self.render(messages)
        ids = prompt_ids(tokenizer, text, document_start=False)
        while len(ids) > limit - max(1, room) and len(messages) > 1:
            messages.pop(0)
            dropped += 1
            while len(messages) > 1 and messages[0]["role"] != "user":
                messages.pop(0)
                dropped += 1
            text = self.render(messages)
            ids = prompt_ids(tokenizer, text, document_start=False)
        if len(ids) > limit - 1:
            self.messages.pop()
            raise DataError(
                f"the message is {len(ids)} tokens with the template; the context is {limit}: shorten it "
                "(the conversation before it is kept)"
            )
        self.messages = messages
        self.unseen += dropped
        return text, ids, dropped


def chat_repl(session: Session, chat: Chat) -> None:
    """Read user turns until EOF; stream each reply; drop old turns when the context is full."""
    _enable_history()
    err_console.print(f"[dim]{escape(CHAT_REPL_HELP)}", soft_wrap=True)
    tokenizer, limit = session.run.tokenizer, session.run.config.max_seq_len
    while True:
        try:
            line = _read_prompt("you » ")
        except EOFError:
            err_console.print()
            return
        except KeyboardInterrupt:
            err_console.print("\n[dim](Ctrl-D or /quit exits)", soft_wrap=True)
            continue
        cmd = line.strip()
        if cmd in ("/quit", "/exit"):
            return
        if cmd == "/reset":
            chat.messages.clear()
            chat.unseen = 0
            err_console.print("[dim](conversation cleared)", soft_wrap=True)
            continue
        if cmd == "" or _command(session, cmd, CHAT_REPL_HELP):
            continue
        chat.messages.append({"role": "user", "content": unescape(line)})
        try:
            # a reply gets room for its max_new_tokens, at most a quarter of the context
            text, ids, dropped = chat.fit(tokenizer, limit, room=min(session.gen.max_new_tokens, limit // 4))
        except DataError as e:
            _error(str(e))
            continue
        if dropped:
            n = chat.unseen  # all dropped so far, not only this turn's
            err_console.print(
                f"[dim](the conversation outgrew the context of {limit} tokens: the oldest {n} "
                f"message{'s' if n > 1 else ''} {'are' if n > 1 else 'is'} no longer seen; "
                "/reset starts over)",
                soft_wrap=True,
            )
        row = Row(session.seed + session.rows_done, 0, Prompt(line, "input"), text, ids)
        console.print("[bold cyan]assistant »[/] ", end="")
        try:
            (result,) = session.stream([row], echo=False)
            chat.messages.append({"role": "assistant", "content": result["completion"]})
        except KeyboardInterrupt:
            console.file.write("\n")
            err_console.print("[yellow]interrupted[/] (the partial reply is dropped)", soft_wrap=True)
            chat.messages.pop()
            session.rows_done += 1


# ----- the commands ----------------------------------------------------------------------------
MAX_SEED = 2**62  # torch's generators take 64-bit seeds; each sample draws with seed + its number


def _seed(seed: int | None) -> int:
    """--seed, checked (torch's generators take 64-bit seeds), or a random one."""
    if seed is None:
        return secrets.randbelow(2**31)
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed {seed} is out of range; use a whole number from 0 to 2^62 ({MAX_SEED})")
    return seed


def _sampling_config(temperature, top_k, top_p, min_p, repetition_penalty, greedy) -> Any:
    from difftrain.infer.settings import SamplingConfig

    return SamplingConfig(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        greedy=greedy,
    )


COMPILE_HELP = (
    "Run the decode step under torch.compile: each new prompt length (or batch shape) waits for a compilation "
    "(seconds to tens of seconds; its footer says so), then tokens come faster (about 1.1× on CPU in "
    "difftrain bench): worth it for long or many same-length generations. Needs a C++ compiler on CPU, "
    "Triton on CUDA."
)


def _check_compile(compile: bool, device: str) -> None:
    """With --compile, a missing toolchain is refused before the model loads."""
    if compile:
        from difftrain.infer.device import require_compiler, resolve_device

        require_compiler(resolve_device(device))


def _load(run_dir: Path, device: str, dtype: str) -> tuple[Any, float]:
    from difftrain.infer.device import resolve_device, resolve_dtype
    from difftrain.rundir import load_run

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    run = load_run(run_dir, device=dev, dtype=dt)
    return run, time.perf_counter() - t0


def _stdin_has_data() -> bool:
    """Whether text was piped into standard input (`echo hi | difftrain generate RUN`), which
    generate without --prompt-file - does not read: one read that does not wait (the bytes it takes
    are not used anyway). False on a terminal, at end of input, or where stdin is no file."""
    import select

    try:
        if sys.stdin is None or sys.stdin.isatty():
            return False
        fd = sys.stdin.fileno()
        ready, _, _ = select.select([fd], [], [], 0)
        return bool(ready) and os.read(fd, 1) != b""
    except (OSError, ValueError, AttributeError):
        return False


def _banner(run: Any, load_s: float, seed: int, style: PromptStyle, greedy: bool = False) -> None:
    """The run's one-line description; `greedy`: decoding draws nothing, so no seed is shown."""
    w = run.model.lm_head.weight
    n_params = sum(p.numel() for p in run.model.parameters())
    kind = "instruction-tuned" if style.instruction else "pretrained"
    err_console.print(
        f"[dim]{escape(str(run.path))} · {run.config.arch} · {kind} · {fmt_count(n_params)} parameters · "
        f"max_seq_len {run.config.max_seq_len} · {w.device} {str(w.dtype).removeprefix('torch.')} · "
        f"loaded in {load_s:.1f} s · " + ("greedy" if greedy else f"seed {seed}"),
        soft_wrap=True,
    )


RUN_DIR_HELP = "Run directory (holds config.json, model.safetensors, tokenizer.json)."


def generate_command(
    run_dir: Path = typer.Argument(..., help=RUN_DIR_HELP),
    prompt: list[str] = typer.Option(
        None, "--prompt", "-p", help="Prompt text (repeat for several). \\n is a newline."
    ),
    prompt_file: Path = typer.Option(
        None,
        "--prompt-file",
        help='One prompt per line, or a .jsonl with a "prompt" field per line; - reads lines from stdin.',
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
        None, "--stop", help="Stop when the completion contains this string (repeatable). \\n is a newline."
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
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
) -> None:
    from difftrain.rundir import require_model_files

    # Arguments first: a mistyped path or option fails before torch loads, a missing compiler
    # before the model loads.
    require_model_files(run_dir)
    from difftrain.infer.settings import GenerationConfig

    sampling = _sampling_config(temperature, top_k, top_p, min_p, repetition_penalty, greedy)
    if compile and not cache:
        raise ConfigError("--compile runs the cached decode step; leave out --no-cache (or --compile)")
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=tuple(unescape(x) for x in stop or ()),
        use_cache=cache,
        compile=compile,
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
        if not interactive and _stdin_has_data():
            warn(
                "standard input is not read without --prompt-file - (or --interactive); generating "
                "from the start of a document"
            )
    for p in prompts:  # before the model loads
        require_utf8(p.text, p.where)
    _check_compile(compile, device)
    seed = _seed(seed)

    run, load_s = _load(run_dir, device, dtype)
    style = prompt_style(run.path)
    session = Session(run, gen, num_samples=num_samples, seed=seed, batch_size=batch_size, style=style)
    rows = [] if interactive else session.rows(prompts)  # every prompt fits, before anything is printed

    if not as_json:
        _banner(run, load_s, seed, style, greedy=sampling.is_greedy and not interactive)
        from difftrain.rundir import record_kinds

        if record_kinds(run.path) == ["messages"] and (prompt or prompt_file is not None or interactive):
            err_console.print(
                f"[yellow]note:[/] {escape(str(run.path))} was fine-tuned on `messages` records only: `difftrain chat "
                f"{escape(shlex.quote(str(run.path)))}` talks to it in its chat template; here a prompt is "
                "rendered as prompt/response records are (finetune.prompt_format), which it never saw",
                soft_wrap=True,
            )
        if sampling.is_greedy and num_samples > 1:
            err_console.print(
                f"[yellow]warning:[/] greedy decoding gives the same completion {num_samples} times",
                soft_wrap=True,
            )
    if interactive:
        repl(session)
    elif as_json:
        t1 = time.perf_counter()
        results = session.batch(rows, show=False)
        seconds = time.perf_counter() - t1
        tokens = sum(r["completion_tokens"] for r in results)
        w = run.model.lm_head.weight
        doc = {
            "run": str(run.path),
            "arch": run.config.arch,
            "prompt_style": "instruction" if style.instruction else "document",
            "device": str(w.device),
            "dtype": str(w.dtype).removeprefix("torch."),
            # greedy decoding draws nothing: the sampling settings and seeds it does not use are null
            "settings": {
                "max_new_tokens": max_new_tokens,
                "temperature": None if sampling.is_greedy else temperature,
                "top_k": None if sampling.is_greedy else top_k,
                "top_p": None if sampling.is_greedy else top_p,
                "min_p": None if sampling.is_greedy else min_p,
                "repetition_penalty": repetition_penalty,
                "greedy": sampling.is_greedy,
                "stop": list(gen.stop),
                "num_samples": num_samples,
                "seed": None if sampling.is_greedy else seed,
                "cache": cache,
            },
            "results": [{**r, "seed": None} for r in results] if sampling.is_greedy else results,
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
        session.stream(rows)
    else:
        session.batch(rows, show=True)


def chat_command(
    run_dir: Path = typer.Argument(..., help=RUN_DIR_HELP),
    system: str = typer.Option(None, "--system", help="A system message that opens the conversation."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens per reply."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", help="Softmax temperature (0 = greedy)."),
    top_k: int = typer.Option(50, "--top-k", help="Sample among the k most probable tokens (0 = off)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus probability mass, in (0, 1] (1 = off)."),
    min_p: float = typer.Option(
        0.0, "--min-p", help="Drop tokens below min_p × the top probability (0 = off)."
    ),
    repetition_penalty: float = typer.Option(
        1.0, "--repetition-penalty", help="Penalise tokens already present (1 = off)."
    ),
    seed: int = typer.Option(None, "--seed", help="Seed for sampling (default: a random seed, printed)."),
    greedy: bool = typer.Option(False, "--greedy", help="Always take the most probable token."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N | mps."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16."
    ),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
) -> None:
    from difftrain.rundir import require_model_files

    require_model_files(run_dir)  # a mistyped path or option fails before torch loads
    from difftrain.infer.settings import GenerationConfig
    from difftrain.recipe import ChatTemplateConfig

    sampling = _sampling_config(temperature, top_k, top_p, min_p, repetition_penalty, greedy)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, compile=compile)
    require_utf8(system or "", "--system")
    _check_compile(compile, device)
    seed = _seed(seed)
    run, load_s = _load(run_dir, device, dtype)
    style = prompt_style(run.path)
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
    from difftrain.rundir import record_kinds

    if not style.instruction:
        err_console.print(
            f"[yellow]note:[/] {escape(str(run.path))} is not instruction-tuned; it reads the chat template as plain "
            "text (fine-tune it on `messages` records with `difftrain finetune` for a model that follows it)",
            soft_wrap=True,
        )
    elif record_kinds(run.path) == ["prompt/response"]:
        err_console.print(
            f"[yellow]note:[/] {escape(str(run.path))} was fine-tuned on prompt/response records, not `messages`: "
            "it never saw the chat template; `difftrain generate "
            f"{escape(shlex.quote(str(run.path)))} -p TEXT` gives it prompts in the format it learned",
            soft_wrap=True,
        )
    session = Session(run, gen, num_samples=1, seed=seed, batch_size=1, style=style)
    session.stop_reason = f"end of reply ({chat.end})"
    chat_repl(session, chat)


def register(app: typer.Typer) -> None:
    app.command("generate", help=HELP)(generate_command)
    app.command("chat", help=CHAT_HELP)(chat_command)
