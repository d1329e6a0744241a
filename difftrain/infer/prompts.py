"""Prompts as a user gives them: text typed or passed as an argument (`unescape`), lines or JSON
records of a prompt file (`parse_prompts`), each a `Prompt` that knows where it came from so that
an error can name it. Free of torch: `difftrain generate` checks its prompts before torch loads."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from difftrain.errors import DataError
from difftrain.io import json_error_reason

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
_ONE_OBJECT = 'each line must be an object like {"prompt": "..."}'


def unescape(text: str) -> str:
    r"""Turn the two-character sequences \n, \t, \\ into newline, tab and backslash."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


@dataclass
class Prompt:
    text: str
    where: str  # "--prompt", "prompts.jsonl, line 3", "input"
    record: dict[str, Any] = field(default_factory=dict)  # fields for finetune.prompt_format


def utf8_problem(text: str) -> str | None:
    """Why `text` is no UTF-8 text (None when it is): bytes that are not UTF-8 (in argv, stdin) and
    JSON escapes of half an emoji reach Python as lone surrogates, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"a lone surrogate U+{ch:04X}"
        return f"{what} at character {e.start + 1} is not UTF-8 text"
    return None


def require_utf8(text: str, where: str) -> None:
    """A DataError naming `where` when `text` is no UTF-8 text."""
    if (problem := utf8_problem(text)) is not None:
        raise DataError(f"{where}: {problem}; give UTF-8 text")


def parse_prompts(text: str, name: str, *, jsonl: bool) -> list[Prompt]:
    """The prompts of a prompt file's `text`: one per non-blank line, or with `jsonl` one JSON
    object with a "prompt" field per line (its other fields kept in `Prompt.record`). A leading
    byte-order mark is dropped; `name` is what each prompt's `where` calls the file."""
    prompts = []
    for n, line in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}, line {n}"
        if not jsonl:
            prompts.append(Prompt(line, where))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({json_error_reason(e)}); {_ONE_OBJECT}") from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise DataError(f'{where}: no "prompt" field; {_ONE_OBJECT}')
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise DataError(f'{where}: "prompt" must be some text, got {record["prompt"]!r}')
        prompts.append(Prompt(record["prompt"], where, record))
    return prompts
