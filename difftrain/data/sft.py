"""Supervised fine-tuning templates: an instruction record → (text, trained) segments.

Prompt/response records go through prompt_format (masked) and response_format (trained);
`messages` records through the chat template (`render_messages`). The SFT data module
tokenizes the segments and trains on the `trained` ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from difftrain.data.tokenizer import Tokenizer
from difftrain.errors import DataError

Segment = tuple[str, bool]
"""A piece of an SFT example: (text, trained); trained pieces contribute to the loss."""

Template = Callable[[Mapping[str, Any]], Sequence[Segment]]


def render_messages(messages: Any, chat: Any) -> list[Segment]:
    """A `messages` list → (text, trained) segments with the chat template.

    Each message becomes roles[role] with {content} filled in. For a trained role the text from
    {content} to the end of its format (the content and its <|end|>) is trained; the header before
    it is not. Consecutive pieces with the same flag are joined.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError("a `messages` record must hold a non-empty list of {role, content} objects")
    pieces: list[Segment] = []
    for i, m in enumerate(messages):
        if not (
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"message {i} of a `messages` record is {str(m)[:80]!r}; each message needs a string "
                "`role` and a string `content`"
            )
        role, content = m["role"], m["content"]
        if (fmt := chat.roles.get(role)) is None:
            snippet = content[:40] + ("…" if len(content) > 40 else "")
            raise DataError(
                f"message {i} of a `messages` record has role '{role}' ({snippet!r}), which the chat template "
                f"does not know (roles: {', '.join(chat.roles)}); fix the record or add a format for it under "
                "finetune.chat_template.roles"
            )
        head, tail = fmt.split("{content}")
        pieces += [(head, False), (content + tail, role in chat.trained_roles)]
    segments = [
        ("".join(t for t, _ in group), trained)
        for trained, group in itertools.groupby((p for p in pieces if p[0]), key=lambda p: p[1])
    ]
    if not any(t for _, t in segments):
        raise DataError(
            f"a `messages` record has no message of a trained role ({', '.join(chat.trained_roles)}): nothing "
            "to learn from it; add the reply, or change finetune.chat_template.trained_roles"
        )
    return segments


@dataclass(frozen=True)
class PromptResponseTemplate:
    """prompt_format.format_map(record) (masked) + response_format (trained)."""

    prompt_format: str = "{prompt}"
    response_format: str = "{response}"

    def __call__(self, record: Mapping[str, Any]) -> list[Segment]:
        try:
            return [
                (self.prompt_format.format_map(record), False),
                (self.response_format.format_map(record), True),
            ]
        except KeyError as e:
            raise DataError(
                f"the SFT template uses field {e} that a record lacks (fields: {', '.join(map(str, record))}); "
                "fix finetune.prompt_format/response_format or the data"
            ) from e


@dataclass(frozen=True)
class SFTTemplate(PromptResponseTemplate):
    """A recipe's finetune: templates; `messages` records go through its chat template."""

    chat: Any = None

    @classmethod
    def from_config(cls, ft: Any) -> SFTTemplate:
        return cls(ft.prompt_format, ft.response_format, ft.chat_template)

    def __call__(self, record: Mapping[str, Any]) -> list[Segment]:
        if "messages" in record and "prompt" not in record:
            return render_messages(record["messages"], self.chat)
        return super().__call__(record)


def add_special_tokens(tokenizer: Any, tokens: Sequence[str]) -> tuple[Any, list[int]]:
    """The tokenizer with `tokens` added as special tokens where missing; (tokenizer, new ids)."""
    missing = [t for t in tokens if tokenizer.token_to_id(t) is None]
    if not missing:
        return tokenizer, []
    tokenizer.tk.add_special_tokens(missing)
    grown = Tokenizer(tokenizer.tk)
    return grown, [grown.token_to_id(t) for t in missing]
