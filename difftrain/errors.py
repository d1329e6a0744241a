"""Every failure a user can cause is a DifftrainError: the CLI prints it as one red line (what
is wrong, where, how to fix it) and exits 2, with no traceback unless `--debug`.
"""

from __future__ import annotations

import datetime
import difflib
import re
import typing
from typing import Any


class DifftrainError(Exception):
    exit_code = 2


class ConfigError(DifftrainError):
    """A model or recipe setting is invalid (bad value, impossible shape, unknown key)."""


class RecipeError(ConfigError):
    """A recipe file could not be read, parsed or validated."""


class DataError(DifftrainError):
    """A data source is missing, empty or malformed."""


class TokenizerError(DataError):
    """A tokenizer could not be trained, loaded or does not fit the model."""


class RunDirError(DifftrainError):
    """A run directory is missing, incomplete, or holds a different run."""


class CheckpointError(DifftrainError):
    """A checkpoint or weights file is missing, damaged or does not match its config."""


class DeviceError(DifftrainError):
    """The requested device, precision or kernel is not available on this machine."""


class InteropError(DifftrainError):
    """An import or export to another format is not possible."""


class TrainingError(DifftrainError):
    """Training stopped on a fault the user can act on (non-finite loss, out of memory, disk full)."""


class StopRequested(Exception):
    """A graceful stop (signal) after the checkpoint is written: the CLI prints the resume command
    and exits 130 / 143."""

    def __init__(self, signum: int, step: int, is_global_zero: bool = True) -> None:
        super().__init__(f"stopped by signal {signum} at step {step}")
        self.signum = signum
        self.step = step
        self.is_global_zero = is_global_zero  # (the other processes of a run say nothing)


# Names users bring from other tools → our key (did-you-mean when string similarity fails).
ALIASES: dict[str, str] = dict(
    pair.split("=")
    for pair in """
    learning_rate=lr lr_schedule=schedule scheduler=schedule optimizer=name
    batch_size=micro_batch_size gradient_accumulation_steps=global_batch_size steps=max_steps
    num_steps=max_steps warmup=warmup_steps clip_grad=grad_clip gradient_clip_val=grad_clip
    block_size=max_seq_len context_length=max_seq_len n_layer=n_layers n_head=n_heads
    n_embd=d_model hidden_size=d_model num_hidden_layers=n_layers num_attention_heads=n_heads
    num_key_value_heads=n_kv_heads intermediate_size=ffn_hidden dataset=sources source=sources
    """.split()
)


def field_model(annotation: Any) -> Any:
    """The pydantic model class in a field's annotation (`X`, `X | None`, `list[X]`), else None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in typing.get_args(annotation) if (m := field_model(a)) is not None), None)


def submodel(model: Any, loc: tuple[Any, ...]) -> Any:
    """The pydantic model that `loc` (a path of field names from `model`) names, else None."""
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = field_model(model.model_fields[part].annotation)
    return model


def validation_message(
    e: Any,
    model: Any = None,
    *,
    prefix: str = "",
    lines: dict[str, tuple[Any, int]] | None = None,
    source: str = "",
    overridden: set[str] | frozenset[str] = frozenset(),
) -> str:
    """One line for pydantic ValidationError `e` of `model` (three errors at most, then a count):
    each error's place (its file and line from `lines`, dotted key → (file, line); the override in
    `overridden` that set it; else `source`), its dotted key under `prefix`, and what is wrong in
    YAML's terms, with a did-you-mean for an unknown key."""
    msgs: list[str] = []
    for err in e.errors():
        loc = tuple(p for p in err["loc"] if p not in ("function-after", "function-before"))
        dotted = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc)
        place, what = _place(loc, dotted, err["msg"], lines or {}, source, overridden)
        line = _describe(err, model, loc, dotted, what, bool(place), msgs)
        if line is not None:
            msgs.append(f"{place}: {line}" if place else line)
    msgs.sort(key=lambda m: "YAML needs a space" not in m)  # the cause of the others comes first
    return "; ".join(msgs[:3]) + (f" (and {len(msgs) - 3} more)" if len(msgs) > 3 else "")


def _place(
    loc: tuple[Any, ...], dotted: str, msg: str, lines: dict, source: str, overridden: Any
) -> tuple[str, str]:
    """(where the error is, how its key is named after that)."""
    keys = [".".join(str(p) for p in loc[:n]) for n in range(len(loc), 0, -1)]  # the key, its sections
    place = next((f"{lines[k][0]}, line {lines[k][1]}" for k in keys if k in lines), source)
    what = f"`{dotted}`" if dotted else "recipe"
    set_key = next((k for k in keys if k in overridden), None)
    if set_key == dotted:  # "override `k`='x': …", not "override `k`: `k`='x': …"
        return "", f"override `{set_key}`"
    if set_key is not None:
        return f"override `{set_key}`", what
    # a section's own check after keys under it were set: the keys its message names, else all
    inside = sorted(k for k in overridden if dotted and k.startswith(dotted + "."))
    named = [k for k in inside if re.search(rf"\b{re.escape(k.rsplit('.', 1)[-1])}\b", msg)]
    if named or inside:
        return f"{place + ', ' if place else ''}with override " + ", ".join(
            f"`{k}`" for k in named or inside
        ), what
    section = ".".join(str(p) for p in loc[:-1])
    beside = sorted(k for k in overridden if k.startswith(section + "."))
    if len(loc) > 1 and beside and not any(k == section or k.startswith(section + ".") for k in lines):
        return "override " + ", ".join(f"`{k}`" for k in beside), what  # a section only overrides made
    return (place, what) if place else ("", dotted or "recipe")


def _describe(
    err: Any, model: Any, loc: tuple[Any, ...], dotted: str, what: str, placed: bool, msgs: list[str]
) -> str | None:
    """What is wrong with one error, after its place (None: already said by an earlier line)."""
    kind, given = err["type"], err.get("input")
    if kind == "extra_forbidden":
        options = list(getattr(submodel(model, loc[:-1]), "model_fields", ()))
        hint = difflib.get_close_matches(str(loc[-1]), options, n=1, cutoff=0.5)
        if not hint and ALIASES.get(str(loc[-1])) in options:
            hint = [ALIASES[str(loc[-1])]]
        section = dotted.rpartition(".")[0]
        suggestion = f" — did you mean `{section + '.' if section else ''}{hint[0]}`?" if hint else ""
        key, colon, value = str(loc[-1]).partition(":")
        if colon and key and value and not value.startswith(" "):  # `{source:x}` is one key to YAML
            hint, suggestion = [key], f" — YAML needs a space after ':': write `{key}: {value}`"
        valid = f" (valid keys: {', '.join(options)})" if options and not hint else ""
        named = f"unknown key `{dotted}`" if placed or what.startswith("`") else f"{what}: unknown key"
        return named + suggestion + valid
    if kind == "missing" and loc and isinstance(loc[-1], int):  # a tuple too short: one line per list
        section = dotted.rpartition(".")[0]
        if any(f"`{section}` has too few values" in m for m in msgs):
            return None
        return f"`{section}` has too few values (no item {loc[-1]})" + _list_example(model, loc[:-1], section)
    if kind == "too_short":  # an empty list that needs items
        n = (err.get("ctx") or {}).get("min_length", 1)
        example = " such as `data.sources=[path/to/texts]`" if dotted == "data.sources" else ""
        return f"{what} is empty; it needs at least {n} item{'s' if n != 1 else ''}{example}"
    if kind in ("tuple_type", "list_type") and not isinstance(given, dict):
        if isinstance(given, str) and given.startswith("[") and "*" in given:  # YAML: a bare * is an alias
            quoted = ", ".join(f"'{p.strip()}'" for p in given.strip("[]").split(","))
            return (
                f"{what}={given!r}: YAML reads a bare * as an alias; quote the patterns: "
                f'`{dotted}=[{quoted}]` (in a shell: "{dotted}=[{quoted}]")'
            )
        if isinstance(given, str) and "," in given:  # `0.9,0.99`, `(0.9,0.99)`: the values in brackets
            return f"{what}={given!r} must be a list in brackets, e.g. `{dotted}=[{given.strip().strip('[]()')}]`"
        return f"{what}={given!r} must be a list in brackets" + _list_example(model, loc, dotted)
    if kind == "too_long" and loc:  # a tuple given too many values
        n = (err.get("ctx") or {}).get("max_length")
        example = _list_example(model, loc, dotted).replace("; give all", "; give")
        return f"{what} has too many values" + (f" (it takes {n})" if n else "") + example
    if kind == "missing":
        if dotted == "train":
            return (
                "missing key `train`: a recipe needs a train: section with max_steps or max_tokens, "
                "e.g. `train: {max_steps: 1000}`"
            )
        key = re.sub(r"\.\d+(?=\.|$)", "[]", dotted)  # as `recipes explain` names it: data.sources[].source
        return f"missing key `{dotted}`; add it (`difftrain recipes explain {key}` says what it takes)"
    if kind in ("model_type", "model_attributes_type", "dict_type"):  # `train: 5`
        shown = repr(given) if len(repr(given)) < 60 else type(given).__name__
        shown = "empty (null)" if given is None else shown
        section = submodel(model, loc)
        example = f" such as `{dotted}.{next(iter(section.model_fields))}`" if section else ""
        return f"{what} must be a section of keys{example}, not {shown}"
    shown = repr(given) if not isinstance(given, dict) and len(repr(given)) < 60 else ""
    shown = "null" if given is None else shown  # YAML's word for what was typed
    # pydantic's wording ("Input should be a valid integer") in YAML's terms
    msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    msg = msg.replace("'auto', True or False", "auto, true or false").replace(
        "must be a valid boolean, unable to interpret input",
        "must be true or false (yes/no, on/off and 1/0 read as them too)",
    )
    if kind == "string_type" and isinstance(given, (datetime.date, bool, int, float)):
        # YAML read the text as a date, a boolean or a number: how to keep it text, as written
        item = bool(loc) and isinstance(loc[-1], int)
        key = str(loc[-2] if item and len(loc) > 1 else loc[-1]) if loc else dotted
        line = f"`{key}: ['{{}}']`" if item else f"`{key}: '{{}}'`"
        if isinstance(given, bool):  # the word typed is gone: yes, on, true all read as True
            return (
                f"{what}: YAML reads the value as {str(given).lower()} (yes/no, on/off and true/false are "
                f"booleans to it), not text; put the text in quotes: {line.format('...')}"
            )
        text = str(given) if isinstance(given, datetime.date) else shown  # a datetime as typed
        typed = "a date" if isinstance(given, datetime.date) else "a number"
        return f"{what}: YAML reads {text} as {typed}, not text; quote it: {line.format(text)}"
    if dotted and isinstance(given, dict) and re.match(r"\w+=", msg):  # a section's check on `key=value`
        return f"{dotted}.{msg}"
    return f"{what}{'=' + shown if shown else ''}: {msg}"


def _list_example(model: Any, loc: tuple[Any, ...], dotted: str) -> str:
    """The example a list's message ends with (`optim.betas=[0.9,0.95]`), from the field's default."""
    parent = submodel(model, loc[:-1])
    field = parent.model_fields.get(str(loc[-1])) if parent else None
    default = getattr(field, "default", None)
    if isinstance(default, (tuple, list)) and default:
        return f"; give all {len(default)}, e.g. `{dotted}=[{','.join(str(x) for x in default)}]`"
    return ""


def user_message(e: BaseException) -> str | None:
    """The one line a command ends with for an exception a user can cause or fix (DifftrainError,
    ValidationError, YAML error, full disk, denied permission); None for a bug."""
    import errno

    if isinstance(e, DifftrainError):
        return str(e)
    if type(e).__name__ == "ValidationError" and hasattr(e, "errors"):  # pydantic's, not imported here
        return validation_message(e)
    if any(c.__module__.startswith("yaml") and c.__name__ == "YAMLError" for c in type(e).__mro__):
        return f"invalid YAML: {' '.join(str(e).split())}"
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full{f' while writing {e.filename}' if e.filename else ''}; free some space and retry"
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = f" {e.filename}" if e.filename else ""
        return f"cannot use{where}: {e.strerror}; check its permissions or choose another location"
    return None
