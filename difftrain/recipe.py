"""Loading a recipe: read the YAML safely (no tags, no code) with the line of every key, follow
`extends:` (mappings merge key by key, lists and scalars replace), apply `key.sub=value`
overrides, validate against `difftrain.recipe_schema` (an error names file, line and key).
Also the values that depend on the machine (`resolve_auto`, `global_batch`, `train_seq_len`).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from difftrain.data.config import absolute_path
from difftrain.errors import RecipeError, submodel, validation_message
from difftrain.layout import is_run_recipe
from difftrain.recipe_doc import explain_rows, recipe_reference_markdown  # noqa: F401 - re-exported
from difftrain.recipe_schema import (  # noqa: F401 - re-exported: `from difftrain.recipe import Recipe`
    ChatTemplateConfig,
    FinetuneConfig,
    OptimConfig,
    Recipe,
    TrainConfig,
    check_record_fields,
    rebase_paths,
    require_finetuning,
    resolve_data_format,
    run_dir_for,
)

MAX_YAML_NODES = 100_000  # guards against alias "billion laughs" bombs
MAX_RECIPE_BYTES = 1_000_000


def shipped_recipes_dir() -> Path:
    """The repo's recipes/ folder, installed as difftrain.recipes."""
    repo = Path(__file__).resolve().parent.parent / "recipes"
    if repo.is_dir():
        return repo
    try:
        from importlib.resources import files

        return Path(str(files("difftrain.recipes")))
    except (ModuleNotFoundError, TypeError):
        return repo


def shipped_recipes() -> dict[str, Path]:
    d = shipped_recipes_dir()
    return {p.stem: p for p in sorted(d.glob("*.yaml"), key=lambda p: p.stem)} if d.is_dir() else {}


def recipe_summary(path: Path) -> str:
    """The `description:` of a recipe file, or its first comment line."""
    text = path.read_text(encoding="utf-8")
    with contextlib.suppress(yaml.YAMLError):
        data = yaml.safe_load(text)
        if isinstance(data, dict) and data.get("description"):
            return str(data["description"])
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def find_recipe(ref: str | os.PathLike[str], relative_to: Path | None = None) -> Path:
    """A recipe path from a file path or a shipped recipe name."""
    ref_s = str(ref)
    if not ref_s.strip():
        raise RecipeError(
            "the recipe name is empty; give a recipe file or a shipped recipe name (see `difftrain recipes list`)"
        )
    p = Path(ref_s).expanduser()
    for c in ([relative_to / p] if relative_to is not None and not p.is_absolute() else []) + [p]:
        if c.is_file():
            return c
        if c.is_dir():
            if is_run_recipe(c / "recipe.yaml"):  # a run directory: its own recipe
                return c / "recipe.yaml"
            if (c / "recipe.yaml").is_file():
                raise RecipeError(
                    f"{c} holds a recipe.yaml but not a run's files (config.json, checkpoints/, ...); "
                    f"pass {c / 'recipe.yaml'} to use it as a recipe"
                )
            raise RecipeError(
                f"{c} is a folder, not a recipe file (nor a run directory with a recipe.yaml); "
                "pass a .yaml file or a shipped recipe name"
            )
    shipped = shipped_recipes()
    name = ref_s.removesuffix(".yaml")
    if name in shipped and os.sep not in ref_s:
        return shipped[name]
    hint = difflib.get_close_matches(name, list(shipped), n=1)
    suggestion = f" — did you mean `{hint[0]}`?" if hint else ""
    if "=" in ref_s and not suggestion:  # `prepare train.max_steps=3 mine.yaml`
        raise RecipeError(f"`{ref_s}` is an override, not a recipe: the recipe comes first (RECIPE {ref_s})")
    looked = f" (looked for {relative_to / p})" if relative_to is not None and not p.is_absolute() else ""
    raise RecipeError(
        f"no recipe file `{ref_s}`{looked} and no shipped recipe of that name{suggestion} (see `difftrain recipes list`)"
    )


def _count_nodes(node: yaml.Node, budget: list[int], seen_depth: int = 0) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise RecipeError("recipe is too large or expands too many YAML aliases; write it out plainly")
    if seen_depth > 50:
        raise RecipeError("recipe nests deeper than 50 levels; write it out plainly")
    children = [c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode) else node.value
    for child in children if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) else ():
        _count_nodes(child, budget, seen_depth + 1)


def _key_lines(node: yaml.Node, path: Path, prefix: str, out: dict[str, int]) -> None:
    """Record the line of every dotted key under `node` in `out`. A key given twice in one mapping
    (not a `<<:` merge key) is a RecipeError: YAML loaders would keep the last silently."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode):
                key, line = f"{prefix}{k.value}", k.start_mark.line + 1
                if k.value in seen and k.tag != "tag:yaml.org,2002:merge":
                    raise RecipeError(
                        f"{path}, line {line}: `{key}` is set twice (also on line {seen[k.value]}); keep one"
                    )
                seen[k.value] = line
                out.setdefault(key, line)
                _key_lines(v, path, key + ".", out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            key = f"{prefix}{i}"
            out.setdefault(key, v.start_mark.line + 1)
            _key_lines(v, path, key + ".", out)


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e)
    return f"{path}{where}: invalid YAML: {' '.join(str(problem).split())}"


def read_recipe_text(path: Path) -> str:
    """A recipe file's text; a RecipeError where it cannot be read, is too big or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)  # never read a huge file whole
    except OSError as e:
        raise RecipeError(f"cannot read recipe {path}: {e.strerror}") from e
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path} is too large for a recipe (limit {MAX_RECIPE_BYTES} bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text (byte {e.start}); save the recipe as UTF-8") from e


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse a recipe file safely: its mapping and the line of every dotted key. Every way a file
    can be bad (too big, not UTF-8, not YAML, a tag, too deep, an alias bomb, a huge number) is a
    RecipeError."""
    text = read_recipe_text(path)
    lines: dict[str, int] = {}
    try:
        node = yaml.compose(text, Loader=RecipeLoader)
        if node is not None:
            _count_nodes(node, [MAX_YAML_NODES])
            _key_lines(node, path, "", lines)  # and refuses a key given twice
            data = yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - a SafeLoader: no tags, no code
    except yaml.YAMLError as e:
        raise RecipeError(_yaml_error(path, e)) from e
    except RecursionError as e:
        raise RecipeError(f"{path}: the recipe nests too deeply; write it out plainly") from e
    except ValueError as e:  # an integer with more digits than Python converts (4300)
        raise RecipeError(f"{path}: a number has too many digits ({str(e).split(';')[0]})") from e
    if node is None:
        raise RecipeError(
            f"{path} is empty; a recipe needs at least `name`, `train` (with max_steps or max_tokens) and, "
            "to pretrain, `model`"
        )
    if not isinstance(data, dict):
        raise RecipeError(
            f"{path}: a recipe must be a mapping of keys (name:, model:, ...), not {type(data).__name__}"
        )
    return data, lines


LENGTH_KEYS = ("max_steps", "max_tokens")


def one_length(merged: dict[str, Any], setter: Any) -> None:
    """Where `setter` (a recipe's or the command line's train: keys) sets one of max_steps /
    max_tokens and not the other, drop the inherited other: the length is the one asked last."""
    train = merged.get("train")
    if not isinstance(setter, dict) or not isinstance(train, dict):
        return
    given = [k for k in LENGTH_KEYS if setter.get(k) is not None]
    if len(given) == 1:
        other = LENGTH_KEYS[1 - LENGTH_KEYS.index(given[0])]
        if other not in setter:
            train[other] = None


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; lists and scalars in `over` replace those in `base`. A section
    left empty in `over` (`model:` with every key commented out: null) changes nothing."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None and isinstance(out.get(k), dict):
            continue
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _load_tree(
    path: Path, chain: tuple[Path, ...] = ()
) -> tuple[dict[str, Any], dict[str, tuple[Path, int]]]:
    """Read a recipe and everything it extends; return merged data and key → (file, line)."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " → ".join(str(p) for p in (*chain, resolved))
        raise RecipeError(f"`extends:` forms a cycle: {cycle}")
    if len(chain) > 16:
        raise RecipeError(f"{path}: `extends:` chain is deeper than 16 recipes")
    data, lines = read_yaml(path)
    where = {k: (path, ln) for k, ln in lines.items()}
    parent = data.pop("extends", None)
    if parent is None:
        return data, where
    if not isinstance(parent, str):
        raise RecipeError(
            f"{path}, line {lines.get('extends', '?')}: `extends` must be a recipe path or name"
        )
    try:
        # from the folder of the file itself (a symbolic link's target), as its data paths are
        parent_path = find_recipe(parent, relative_to=resolved.parent)
    except RecipeError as e:
        raise RecipeError(f"{path}, line {lines.get('extends', '?')}: `extends: {parent}`: {e}") from e
    base, base_where = _load_tree(parent_path, (*chain, resolved))
    if parent_path.resolve().parent != resolved.parent:
        rebase_paths(base, parent_path.resolve().parent)
    base_where.update(where)
    merged = deep_merge(base, data)
    one_length(merged, data.get("train"))
    return merged, base_where


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads 1e6, 3e-4, 1_000e3 as floats (YAML 1.1 wants 1.0e+6)."""


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=100` → (['train', 'max_steps'], 100). Values are parsed as YAML."""
    if "=" not in text:
        raise RecipeError(f"override `{text}` is not key=value (e.g. train.max_steps=100)")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override `{text}` has an empty key; write it as section.key=value")
    try:
        node = yaml.compose(value, Loader=RecipeLoader) if value.strip() else None
        if node is not None:  # the file's guards: no alias bombs, no self-referencing values
            _count_nodes(node, [MAX_YAML_NODES])
        parsed = yaml.load(value, Loader=RecipeLoader) if value.strip() else None  # noqa: S506 - safe
    except RecipeError as e:
        raise RecipeError(f"override `{key}`: {e}") from e
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # not YAML: the schema judges the string
        opened = value.strip()[:1]
        closer = {"[": "]", "{": "}"}.get(opened)
        if closer and closer not in value and _text_key(key.split(".")) is None:  # a list or mapping, cut
            example = "[a, b]" if opened == "[" else "{key: value}"
            raise RecipeError(
                f"override `{text}`: the value has an unclosed `{opened}`; write it as `{key}={example}` "
                "(quoted for the shell)"
            ) from e
        parsed = value
    return key.split("."), parsed


def _text_key(keys: list[str]) -> str | None:
    """ "text" where the recipe key `keys` holds a `str`, "optional" for `str | None`, else None."""
    parent = submodel(Recipe, tuple(keys[:-1])) if len(keys) > 1 else Recipe
    if parent is None and len(keys) > 2:  # a value of a mapping of texts (chat_template.roles.user)
        owner = submodel(Recipe, tuple(keys[:-2]))
        field = owner.model_fields.get(keys[-2]) if owner is not None else None
        if (
            field is not None
            and typing.get_origin(field.annotation) is dict
            and typing.get_args(field.annotation)[1:] == (str,)
        ):
            return "text"
    if parent is None or keys[-1] not in parent.model_fields:
        return None
    annotation = parent.model_fields[keys[-1]].annotation
    if annotation is str:
        return "text"
    return "optional" if set(typing.get_args(annotation)) == {str, type(None)} else None


def apply_overrides(data: dict[str, Any], overrides: list[str], folder: Path | None = None) -> dict[str, Any]:
    """`data` with the `key.sub=value` overrides set; relative data and tokenizer paths in them
    are made absolute against `folder` (the current folder, where the user typed them)."""
    for i, text in enumerate(overrides):  # `train.max_steps = 3`: the shell made three words of it
        prev = overrides[i - 1] if i > 0 else None
        nxt = overrides[i + 1] if i + 1 < len(overrides) else None
        if (
            text == "="
            or (text.startswith("=") and prev is not None and "=" not in prev)
            or (text.endswith("=") and nxt is not None and "=" not in nxt)
        ):
            joined = " ".join(overrides[max(i - 1, 0) : i + 2])
            raise RecipeError(
                f"override `{joined}` has spaces around `=`; write it as one word: `{joined.replace(' ', '')}`"
            )
    out = copy.deepcopy(data)
    lengths: dict[str, Any] = {}  # train.max_steps / max_tokens as the command line sets them
    for text in overrides:
        keys, value = parse_override(text)
        if keys == ["extends"]:
            raise RecipeError(
                f"override `{text}`: extends is read with the recipe file, before overrides; write it in "
                "the file (or give the other recipe as RECIPE and this one's keys as overrides)"
            )
        if value is None and submodel(Recipe, tuple(keys)) is not None:  # model=, finetune.lora=null
            dotted = ".".join(keys)
            raise RecipeError(
                f"override `{text}` gives the section {dotted} no value; set its keys, e.g. "
                f"`{dotted}.KEY=value` or `{dotted}={{KEY: value}}`"
            )
        if len(keys) == 2 and keys[0] == "train" and keys[1] in LENGTH_KEYS:
            lengths[keys[1]] = value
        elif keys == ["train"] and isinstance(value, dict):  # `train={max_tokens: 1e6}`
            lengths.update({k: value[k] for k in LENGTH_KEYS if k in value})
        text_kind = None if isinstance(value, str) else _text_key(keys)
        if text_kind is not None:
            # a text key takes the text as typed: name=2024-01-01, description=Run: small,
            # finetune.prompt_format={prompt} (YAML would make a date, a mapping, a mapping);
            # null stays null where the key may be unset
            raw = text.partition("=")[2]
            if not (
                text_kind == "optional" and value is None and raw.strip() in ("", "~", "null", "Null", "NULL")
            ):
                value = raw
        if folder is not None and keys[0] in ("data", "tokenizer"):
            tree: dict[str, Any] = {}
            leaf = tree
            for k in keys[:-1]:
                leaf = leaf.setdefault(k, {})
            leaf[keys[-1]] = value
            rebase_paths(tree, folder)  # (sets the rebased value in `leaf`)
            value = leaf[keys[-1]]
        node = out
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if isinstance(nxt, list):
                raise RecipeError(
                    f"override `{text}`: `{'.'.join(keys[: i + 1])}` is a list, not a section; set the whole "
                    f"list: `{'.'.join(keys[: i + 1])}=[...]`"
                )
            if not isinstance(nxt, dict):
                raise RecipeError(f"override `{text}`: `{'.'.join(keys[: i + 1])}` is not a section")
            node = nxt
        if isinstance(value, dict) and isinstance(node.get(keys[-1]), dict):
            node[keys[-1]] = deep_merge(node[keys[-1]], value)  # `model={d_model: 32}` as extends merges
        else:
            node[keys[-1]] = value
    one_length(out, lengths)
    return out


def _non_finite(data: Any, prefix: str = "") -> str | None:
    """The dotted key of the first NaN or infinite number in a recipe tree, or None."""
    if isinstance(data, float) and not math.isfinite(data):
        return prefix or "recipe"
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{prefix}.{k}" if prefix else str(k))
        if found:
            return found
    return None


def _check_finite(
    data: dict[str, Any],
    where: dict[str, tuple[Path, int]],
    source: str,
    overrides: dict[str, str] | None = None,
) -> None:
    """Refuse .nan / .inf / 1e400 (valid YAML, meant by no setting), naming the override
    (`overrides`: dotted key → its text) or the file's line."""
    key = _non_finite(data)
    if key:
        if overrides and key in overrides:
            raise RecipeError(f"override `{key}`='{overrides[key]}': must be a finite number")
        f, line = where.get(key, (source, None))
        raise RecipeError(f"{f}{f', line {line}' if line else ''}: `{key}` must be a finite number")


def load_recipe(ref: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load, merge, override and validate a recipe (a path or a shipped recipe's name)."""
    path = find_recipe(ref)
    data, where = _load_tree(path)
    data = apply_overrides(data, list(overrides), Path.cwd().resolve())
    given = {".".join(parse_override(o)[0]): o.partition("=")[2] for o in overrides}
    _check_finite(data, where, str(path), given)
    # relative data paths in a shipped recipe mean the user's current folder, else the recipe's own
    is_shipped = path.resolve().parent == shipped_recipes_dir().resolve()
    folder = Path.cwd() if is_shipped else path.resolve().parent
    recipe = _validated(data, folder, lines=where, source=str(path), overridden=set(given))
    recipe._source = f"shipped:{path.stem}" if is_shipped else str(path)
    recipe._overrides = tuple(overrides)
    if is_run_recipe(path) and not given.keys() & {"name", "out_dir"}:
        recipe._own_run_dir = path.parent
    return recipe


def recipe_from_dict(data: dict[str, Any], recipe_dir: Path | None = None) -> Recipe:
    """Validate an in-memory recipe (tests, programmatic use)."""
    _check_finite(data, {}, "recipe")
    return _validated(data, recipe_dir or Path.cwd())


def _validated(data: dict[str, Any], recipe_dir: Path, **place: Any) -> Recipe:
    """`data` as a Recipe whose relative paths start in `recipe_dir` (data.cache_dir made absolute
    against it, as the data paths are read); `place`: where `validation_message` says errors are."""
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(validation_message(e, Recipe, **place)) from e
    recipe._recipe_dir = recipe_dir
    if recipe.data.cache_dir:
        cache = absolute_path(recipe.data.cache_dir, recipe_dir)  # (an absolute one as written)
        recipe.data = recipe.data.model_copy(update={"cache_dir": cache})
    return recipe


def train_seq_len(train: TrainConfig, max_seq_len: int) -> int:
    """train.seq_len, else the model's max_seq_len; RecipeError when longer than max_seq_len."""
    seq_len = train.seq_len or max_seq_len
    if seq_len > max_seq_len:
        raise RecipeError(
            f"train.seq_len={seq_len} is longer than model.max_seq_len={max_seq_len}; lower train.seq_len "
            "or raise model.max_seq_len"
        )
    return seq_len


def global_batch(train: TrainConfig, devices: int) -> tuple[int, int]:
    """(global batch in sequences, micro-batches accumulated per step) on `devices` devices per
    node; RecipeError when the global batch is not a whole number of steps of micro-batches."""
    t = train
    per_step = t.micro_batch_size * devices * t.num_nodes
    global_bs = t.global_batch_size or per_step
    if global_bs < per_step:
        raise RecipeError(
            f"train.global_batch_size={global_bs} is smaller than one step of micro-batches "
            f"(micro_batch_size×devices×nodes = {t.micro_batch_size}×{devices}×{t.num_nodes} = {per_step}); "
            f"raise it to {per_step} or lower train.micro_batch_size"
        )
    if global_bs % per_step:
        raise RecipeError(
            f"train.global_batch_size={global_bs} is not divisible by micro_batch_size×devices×nodes = "
            f"{t.micro_batch_size}×{devices}×{t.num_nodes} = {per_step}; pick a multiple of {per_step}"
        )
    return global_bs, global_bs // per_step


def resolve_auto(recipe: Recipe, *, cuda: bool, bf16: bool) -> Recipe:
    """A copy with the machine's `auto` values (precision, compile, optimizer) fixed."""
    r = recipe.model_copy(deep=True)  # private attributes (folder, source, model keys) included
    if r.train.precision == "auto":
        r.train.precision = ("bf16-mixed" if bf16 else "16-mixed") if cuda else "32-true"
    if r.train.compile == "auto":
        r.train.compile = bool(cuda)
    if r.optim.name == "auto":
        # FSDP cannot gather bitsandbytes' quantized states into checkpoints: plain AdamW there
        r.optim.name = "adamw8bit" if cuda and r.train.strategy != "fsdp" else "adamw"
    return r
