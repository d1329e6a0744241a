"""Supervised fine-tuning data: instruction records rendered into (text, trained) segments.

Prompt/response records go through finetune.prompt_format / response_format; `messages`
records through the chat template (`render_messages`). The SFT data module tokenizes the
segments and trains on the `trained` ones. `add_special_tokens` grows a tokenizer by the
template's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from difftrain.data.tokenizer import Tokenizer
from difftrain.errors import DataError

Segment = tuple[str, bool]


def render_messages(messages: Any, chat: Any) -> list[Segment]:
    """A `messages` list → (text, trained) segments with the chat template.

    Each message becomes roles[role] with {content} filled in. For a trained role the text from
    {content} to the end of its format (the content and its <|end|>) is trained; the header before
    it is not. Consecutive pieces with the same flag are joined.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError("a `messages` record must hold a non-empty list of {role, content} objects")
    segments: list[Segment] = []

    def add(text: str, trained: bool) -> None:
        if not text:
            return
        if segments and segments[-1][1] == trained:
            segments[-1] = (segments[-1][0] + text, trained)
        else:
            segments.append((text, trained))

    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"message {i} of a `messages` record is {str(m)[:80]!r}; each message needs a string "
                "`role` and a string `content`"
            )
        role, content = m["role"], m["content"]
        fmt = chat.roles.get(role)
        if fmt is None:
            snippet = content[:40] + ("…" if len(content) > 40 else "")
            raise DataError(
                f"message {i} of a `messages` record has role '{role}' ({snippet!r}), which the chat template "
                f"does not know (roles: {', '.join(chat.roles)}); fix the record or add a format for it under "
                "finetune.chat_template.roles"
            )
        head, tail = fmt.split("{content}")
        trained = role in chat.trained_roles
        add(head, False)
        add(content + tail, trained)
    if not any(t for _, t in segments):
        raise DataError(
            f"a `messages` record has no message of a trained role ({', '.join(chat.trained_roles)}): nothing "
            "to learn from it; add the reply, or change finetune.chat_template.trained_roles"
        )
    return segments


@dataclass(frozen=True)
class SFTTemplate:
    """Prompt/response records through prompt_format/response_format; `messages` records through
    the chat template. Called by the SFT data module on every record."""

    prompt_format: str
    response_format: str
    chat: Any

    @classmethod
    def from_config(cls, ft: Any) -> SFTTemplate:
        """From a recipe's finetune: section."""
        return cls(ft.prompt_format, ft.response_format, ft.chat_template)

    def __call__(self, record: Mapping[str, Any]) -> list[Segment]:
        if "messages" in record and "prompt" not in record:
            return render_messages(record["messages"], self.chat)
        try:
            return [
                (self.prompt_format.format_map(record), False),
                (self.response_format.format_map(record), True),
            ]
        except KeyError as e:
            raise DataError(
                f"finetune.prompt_format/response_format use field {e} that a record lacks (fields: "
                f"{', '.join(map(str, record))}); fix the format or the data"
            ) from e


def add_special_tokens(tokenizer: Any, tokens: Sequence[str]) -> tuple[Any, list[int]]:
    """The tokenizer with `tokens` added as special tokens where missing; (tokenizer, new ids)."""
    missing = [t for t in tokens if tokenizer.token_to_id(t) is None]
    if not missing:
        return tokenizer, []
    tk = tokenizer.tk
    tk.add_special_tokens(missing)
    grown = Tokenizer(tk, path=None)
    return grown, [grown.token_to_id(t) for t in missing]
