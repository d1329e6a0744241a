"""The REPLs: `Repl` streams continuations of typed prompts (`difftrain generate --interactive`);
`ChatRepl` keeps a `Chat` rendered with the run's chat template (`difftrain chat`). Both read
through `read_line` and show `ReplEvent`s through `write`; they print nothing themselves."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Union

from difftrain.errors import ConfigError, DataError
from difftrain.infer.generate import Token, prompt_ids
from difftrain.infer.prompts import Prompt, unescape
from difftrain.infer.session import Result, Row, Session


class Chat:
    """A conversation rendered with a chat template: roles[role] = head + {content} + tail."""

    def __init__(self, template: Any, system: str | None) -> None:
        self.roles: dict[str, str] = dict(template.roles)
        for role in ("user", "assistant"):
            if role not in self.roles:
                raise ConfigError(f"the run's finetune.chat_template has no `{role}` role; chat needs it")
        if system and "system" not in self.roles:
            raise ConfigError("--system given but the run's finetune.chat_template has no `system` role")
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.unseen = 0  # messages dropped so far (the model no longer sees them)
        self.reply_head, tail = self.roles["assistant"].split("{content}")
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
        """(rendered text, ids, messages dropped): drop the oldest exchanges (a user turn with the
        replies after it; the system message stays) until the rendering leaves `room` new tokens
        in `limit`, or only the newest message is left (which needs room for one). A DataError
        when that message alone does not fit: it is taken back, the conversation kept as it was."""
        messages = list(self.messages)
        while True:
            text = self.render(messages)
            ids = prompt_ids(tokenizer, text, document_start=False)
            if len(ids) <= limit - max(1, room) or len(messages) <= 1:
                break
            messages.pop(0)
            while len(messages) > 1 and messages[0]["role"] != "user":
                messages.pop(0)
        if len(ids) > limit - 1:
            self.messages.pop()
            raise DataError(
                f"the message is {len(ids)} tokens with the template; the context is {limit}: shorten it "
                "(the conversation before it is kept)"
            )
        dropped = len(self.messages) - len(messages)
        self.messages = messages
        self.unseen += dropped
        return text, ids, dropped


@dataclass(frozen=True)
class Note:
    """Text for the user: a "note", an "error" (a line or command refused; the session goes on), or
    "interrupted" (Ctrl-C stopped a generation; `text` says what became of it)."""

    text: str
    kind: Literal["note", "error", "interrupted"] = "note"


ReplEvent = Union[Note, Row, Token, Result]  # a note, or what `Session.stream` yields


_SWITCH = dict.fromkeys(("1", "true", "on", "yes"), True) | dict.fromkeys(("0", "false", "off", "no"), False)


def _switch(value: str) -> bool:
    if (on := _SWITCH.get(value.lower())) is None:
        raise ConfigError(f"greedy: {value!r} is not on or off; use /set greedy on (or off)")
    return on


_SETTABLE: dict[str, Callable[[str], Any]] = {  # /set KEY VALUE: how VALUE is read
    "max_new_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "greedy": _switch,
}

_INPUT_HELP = "  a line ending in \\ continues on the next line; \\n and \\t are a newline and a tab\n"
_COMMANDS_HELP = f"""  /set KEY VALUE   changes a setting: {", ".join(_SETTABLE)}
  /show            prints the settings
  /help            prints this
  /quit            exits (so do /exit and Ctrl-D)"""


@dataclass
class Repl:
    """Stream the continuation of each line read. `read_line(marker)` returns the next line
    (EOFError ends the session, KeyboardInterrupt abandons the line)."""

    session: Session
    read_line: Callable[[str], str]
    write: Callable[[ReplEvent], None]
    marker: ClassVar[str] = "» "
    help: ClassVar[str] = (
        "Type a prompt and press Enter; its continuation streams below it.\n"
        + _INPUT_HELP
        + "  Ctrl-C stops a generation (and clears the line at the prompt)\n"
        + _COMMANDS_HELP
    )
    interrupted: ClassVar[Note] = Note("", "interrupted")

    def run(self) -> None:
        self.write(Note(self.help))
        while True:
            try:
                line = self.read_line(self.marker)
            except EOFError:
                self.write(Note(""))
                return
            except KeyboardInterrupt:
                self.write(Note("\n(Ctrl-D or /quit exits)"))
                continue
            cmd = line.strip()
            if cmd in ("/quit", "/exit"):
                return
            if cmd == "" or self.command(cmd):
                continue
            try:
                self.turn(line)
            except KeyboardInterrupt:
                self.write(self.interrupted)
                self.drop_turn()
            except (ConfigError, DataError) as e:
                self.write(Note(str(e), "error"))

    def turn(self, line: str) -> None:
        self.stream(self.session.rows([Prompt(unescape(line), "input")]))

    def drop_turn(self) -> None:
        """After an interrupted generation: its seed stays used."""
        self.session.rows_done += 1

    def stream(self, rows: list[Row]) -> list[Result]:
        results = []
        for ev in self.session.stream(rows):
            self.write(ev)
            if isinstance(ev, Result):
                results.append(ev)
        return results

    def command(self, cmd: str) -> bool:
        """Handle /help, /show, /set; True if `cmd` was one of them."""
        if cmd == "/help":
            self.write(Note(self.help))
        elif cmd == "/show":
            g, smp = self.session.gen, self.session.gen.sampling
            shown = (
                f"max_new_tokens={g.max_new_tokens} greedy={str(smp.greedy).lower()} temperature={smp.temperature:g} "
                f"top_k={smp.top_k} top_p={smp.top_p:g} min_p={smp.min_p:g} "
                f"repetition_penalty={smp.repetition_penalty:g} seed={self.session.seed}"
            )
            self.write(Note(shown))
        elif cmd.startswith("/set"):
            self.set(cmd.split()[1:])
        elif re.fullmatch(r"/[A-Za-z]+", cmd):  # a lone /word is a command, mistyped (text has more)
            self.write(Note(f"unknown command {cmd}; /help lists the commands", "error"))
        else:
            return False
        return True

    def set(self, args: list[str]) -> None:
        if len(args) != 2:
            self.write(Note("usage: /set KEY VALUE, e.g. /set temperature 0.5", "error"))
            return
        key, value = args
        gen = self.session.gen
        try:
            if key not in _SETTABLE:
                raise ConfigError(f"unknown setting {key!r}; one of {', '.join(_SETTABLE)}")
            v = _SETTABLE[key](value)
            if key == "max_new_tokens":
                self.session.gen = replace(gen, max_new_tokens=v)
            else:
                self.session.gen = replace(gen, sampling=replace(gen.sampling, **{key: v}))
        except ValueError:
            whole = _SETTABLE.get(key) is int
            self.write(Note(f"{key}: {value!r} is not a {'whole number' if whole else 'number'}", "error"))
            return
        except ConfigError as e:
            self.write(Note(str(e), "error"))
            return
        self.write(Note(f"({key} = {('on' if v else 'off') if isinstance(v, bool) else v})"))


@dataclass
class ChatRepl(Repl):
    """Stream a reply to each user turn; drop the oldest turns when the context is full."""

    chat: Chat
    marker: ClassVar[str] = "you » "
    help: ClassVar[str] = (
        "Type a message and press Enter; the assistant's reply streams below it.\n"
        + _INPUT_HELP
        + "  Ctrl-C stops a reply (and clears the line at the prompt)\n"
        + "  /reset           forgets the conversation (a --system message stays)\n"
        + _COMMANDS_HELP
    )
    interrupted: ClassVar[Note] = Note(" (the partial reply is dropped)", "interrupted")

    def command(self, cmd: str) -> bool:
        if cmd != "/reset":
            return super().command(cmd)
        self.chat.messages.clear()
        self.chat.unseen = 0
        self.write(Note("(conversation cleared)"))
        return True

    def turn(self, line: str) -> None:
        chat, s = self.chat, self.session
        limit = s.run.config.max_seq_len
        chat.messages.append({"role": "user", "content": unescape(line)})
        # a reply gets room for its max_new_tokens, at most a quarter of the context
        text, ids, dropped = chat.fit(s.run.tokenizer, limit, room=min(s.gen.max_new_tokens, limit // 4))
        if dropped:
            n = chat.unseen  # all dropped so far, not only this turn's
            self.write(
                Note(
                    f"(the conversation outgrew the context of {limit} tokens: the oldest {n} "
                    f"message{'s' if n > 1 else ''} {'are' if n > 1 else 'is'} no longer seen; "
                    "/reset starts over)"
                )
            )
        (result,) = self.stream([Row(s.seed + s.rows_done, 0, Prompt(line, "input"), text, ids)])
        chat.messages.append({"role": "assistant", "content": result.completion.text})

    def drop_turn(self) -> None:
        """After an interrupted reply: the partial reply and the message it answered are dropped."""
        self.chat.messages.pop()
        super().drop_turn()
