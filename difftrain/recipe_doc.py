"""The recipe reference generated from the schema: `difftrain recipes explain`, docs/recipes.md."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from difftrain.data.config import DataConfig, TokenizerConfig
from difftrain.errors import RecipeError, field_model
from difftrain.model.config import ModelConfig
from difftrain.recipe_schema import FinetuneConfig, LoggingConfig, OptimConfig, Recipe, TrainConfig

SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "logging": LoggingConfig,
    "finetune": FinetuneConfig,
}


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_repr(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "…"
        if isinstance(value, BaseModel):
            return "(section)"
        if isinstance(value, list):
            return "[" + ", ".join(str(getattr(v, "source", v)) for v in value) + "]"
        return repr(value)
    value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)


def _row(key: str, field: Any, type_name: str | None = None) -> tuple[str, str, str, str]:
    return (key, type_name or _type_name(field.annotation), _default_repr(field), field.description or "")


EXTENDS_ROW = (
    "extends",
    "str | null",
    "null",
    "A recipe this one starts from: a path (relative to this recipe's folder) or a shipped recipe's name. "
    "Mappings merge key by key, lists and values replace; a section left empty changes nothing; relative "
    "data and tokenizer paths stay relative to the recipe that names them.",
)


def explain_rows(section: str | None = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every field of a section (or all), nested ones dotted."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = field_model(field.annotation)
            listed = sub is not None and typing.get_origin(field.annotation) is list
            if sub is None or listed:  # a section's keys are listed under it, a list of sections too
                rows.append(_row(prefix + name, field, f"list[{sub.__name__}]" if listed else None))
            if sub is not None:
                walk(sub, f"{prefix}{name}{'[]' if listed else ''}.")

    if section is None:
        rows.append(EXTENDS_ROW)
        top = [(n, f) for n, f in Recipe.model_fields.items() if n not in SECTIONS]
        rows += [_row(name, field) for name, field in top]
        for name, model in SECTIONS.items():
            field = Recipe.model_fields[name]
            default = {"model": "required to pretrain", "finetune": "null"}.get(name, "defaults below")
            default = "required" if field.is_required() else default
            rows.append((name, "section", default, field.description or ""))
            walk(model, f"{name}.")
        return rows
    if section == "extends":
        return [EXTENDS_ROW]
    head = section.split(".", 1)[0]
    top = Recipe.model_fields.get(section)
    if top is not None and section not in SECTIONS:  # name, seed, out_dir, ...
        return [_row(section, top)]
    if head not in SECTIONS:
        # a key named without its section (max_steps, lora.rank): the one key it ends
        owners = [k for k, *_ in explain_rows() if k.replace("[]", "").endswith("." + section)]
        if len(owners) == 1:
            raise RecipeError(
                f"no recipe section `{head}`; `{section}` is the key `{owners[0]}`: "
                f"`difftrain recipes explain {owners[0]}`"
            )
        hint = difflib.get_close_matches(head, list(Recipe.model_fields), n=1)
        raise RecipeError(
            f"no recipe section `{head}`{' — did you mean `' + hint[0] + '`?' if hint else ''} (sections: "
            f"{', '.join(SECTIONS)}; top-level keys: {', '.join(n for n in Recipe.model_fields if n not in SECTIONS)})"
        )
    walk(SECTIONS[head], f"{head}.")
    if head == section:
        return rows
    # a key (train.max_steps) or a group of keys (finetune.lora): the rows under it
    picked = [r for r in rows if r[0] == section or r[0].startswith((section + ".", section + "[]."))]
    if not picked:
        hint = difflib.get_close_matches(section, [r[0] for r in rows], n=1)
        raise RecipeError(
            f"no recipe key `{section}`{' — did you mean `' + hint[0] + '`?' if hint else ''} "
            f"(`difftrain recipes explain {head}` lists the keys of {head})"
        )
    return picked


def recipe_reference_markdown(section: str | None = None) -> str:
    """The recipe reference table of docs/recipes.md (or of one section or key), from the schema."""
    out = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, typ, default, desc in explain_rows(section):
        cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        out.append(f"| `{key}` | {cell(typ)} | {cell(default)} | {cell(desc)} |")
    return "\n".join(out) + "\n"
