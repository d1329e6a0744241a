"""Tab completion of recipe names and files, key=value overrides and eval suites: each function maps
the word being typed to (value, help) pairs at every TAB press, so it imports nothing heavy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_OPEN_TYPES = {"int", "float", "str", "null", "list", "tuple", "dict", "section"}


def recipe_refs(incomplete: str) -> list[tuple[str, str]]:
    """Shipped recipe names starting with `incomplete`, then recipe files and folders that do."""
    from difftrain.recipe import recipe_summary, shipped_recipes

    out: list[tuple[str, str]] = []
    if os.sep not in incomplete and "/" not in incomplete:
        out = [
            (name, (recipe_summary(path).strip().splitlines() or [""])[0])
            for name, path in sorted(shipped_recipes().items())
            if name.startswith(incomplete)
        ]
    return out + _recipe_files(incomplete)


def _recipe_files(incomplete: str) -> list[tuple[str, str]]:
    """.yaml/.yml files and folders whose path starts with `incomplete` (hidden ones only when
    the typed name starts with a dot)."""
    folder, slash, stem = incomplete.rpartition("/")
    folder = folder or slash  # "/x": in the root folder
    base = Path(os.path.expanduser(folder)) if folder else Path(".")
    try:
        entries = sorted(base.iterdir(), key=lambda p: p.name)
    except OSError:
        return []
    out: list[tuple[str, str]] = []
    for entry in entries:
        name = entry.name
        if not name.startswith(stem) or (name.startswith(".") and not stem.startswith(".")):
            continue
        shown = f"{folder.rstrip('/')}/{name}" if folder else name
        try:
            if entry.is_dir():
                out.append((shown + "/", "folder"))
            elif entry.suffix.lower() in (".yaml", ".yml"):
                out.append((shown, "recipe file"))
        except OSError:
            continue
    return out


def _choices(type_text: str) -> list[str]:
    """The values an `explain_rows` type allows when it is a closed set ("baseline | diff", "bool"),
    else [] ("int | null", "str")."""
    parts = [p.strip() for p in type_text.split("|")]
    if any(p.split("[")[0] in _OPEN_TYPES for p in parts):
        return []
    return [v for p in parts for v in (["true", "false"] if p == "bool" else [p])]


def override_items(ctx: Any, incomplete: str) -> list[tuple[str, str]]:
    """Dotted recipe keys starting with `incomplete` (as `key=`), or after `key=` its choices.

    zsh and fish pass `key=va` as one word; bash splits it at the `=`, so that the overrides parsed
    so far (ctx.params) end [..., key, "="], or [..., key] with an empty word right after the `=`."""
    from difftrain.recipe import explain_rows

    args = [str(a) for a in (getattr(ctx, "params", {}).get("overrides") or [])]
    rows = {r[0]: r for r in explain_rows() if r[1] != "section" and "[]" not in r[0]}
    if "=" in incomplete:
        key, _, typed = incomplete.partition("=")
        row = rows.get(key)
        return [] if row is None else [(f"{key}={c}", "") for c in _choices(row[1]) if c.startswith(typed)]
    if len(args) >= 2 and args[-1] == "=" and args[-2] in rows:
        return [(c, "") for c in _choices(rows[args[-2]][1]) if c.startswith(incomplete)]
    if not incomplete and args and args[-1] in rows:  # readline completes the empty word after '='
        return [(c, "") for c in _choices(rows[args[-1]][1])]
    return [
        (f"{key}=", f"{type_text} (default {default})" if default != "required" else type_text)
        for key, (_, type_text, default, _doc) in rows.items()
        if key.startswith(incomplete)
    ]


def suite_names(incomplete: str) -> list[tuple[str, str]]:
    """Eval suites (and `all`) for the last part of a comma-separated --suite value."""
    from difftrain.evals import SUITES

    done, comma, last = incomplete.rpartition(",")
    names = SUITES if done else [*SUITES, "all"]
    return [(done + comma + n, "") for n in names if n.startswith(last) and n not in done.split(",")]


BASH_SCRIPT = r"""
%(complete_func)s() {
    local IFS=$'\n' c i cur=${COMP_WORDS[COMP_CWORD]}
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \
                   COMP_CWORD=$COMP_CWORD \
                   %(autocomplete_var)s=complete_bash $1 ) )
    for i in "${!COMPREPLY[@]}"; do
        c=${COMPREPLY[$i]}
        # `key=` and `folder/` are typed on from: no space after them
        [[ $c == *= || $c == */ ]] && compopt -o nospace
        # a file name with a space or a shell character is inserted quoted (unless typed after a quote)
        if [[ $cur != [\"\']* && $c == *[[:space:]\'\"\$\&\;\(\)\<\>\|\`]* ]]; then
            if [[ $c == "~/"* ]]; then  # ~ stays unquoted, or the shell would not expand it
                COMPREPLY[$i]="~/$(printf '%%q' "${c#\~/}")"
            else
                COMPREPLY[$i]=$(printf '%%q' "$c")
            fi
        fi
    done
    return 0
}

complete -o default -F %(complete_func)s %(prog_name)s
"""
"""Typer's bash script, with no space after a completed `key=` or folder, and file names quoted."""


def use_bash_script() -> None:
    """Make `--show-completion bash` / `--install-completion bash` write `BASH_SCRIPT` (where this
    Typer keeps its scripts in the private table it does)."""
    try:
        from typer import _completion_shared
    except ImportError:
        return
    scripts = getattr(_completion_shared, "_completion_scripts", None)
    if isinstance(scripts, dict) and "bash" in scripts:
        scripts["bash"] = BASH_SCRIPT
