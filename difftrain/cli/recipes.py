"""`difftrain recipes list | show | cp | explain`: the shipped recipes and the recipe reference."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import typer

from difftrain.cli.common import console, warn
from difftrain.cli.complete import override_items, recipe_refs
from difftrain.errors import RecipeError

recipes_app = typer.Typer(help="List, show, copy and explain recipes.", no_args_is_help=True)


@recipes_app.command("list")
def list_recipes() -> None:
    """List the shipped recipes with a one-line description each."""
    from rich.table import Table

    from difftrain.recipe import recipe_summary, shipped_recipes

    table = Table(title="shipped recipes", title_justify="left")
    table.add_column("name", style="bold cyan", no_wrap=True)
    table.add_column("description")
    for name, path in shipped_recipes().items():
        table.add_row(name, recipe_summary(path))
    console.print(table)


@recipes_app.command("show")
def show(
    name: str = typer.Argument(..., autocompletion=recipe_refs, help="Shipped recipe name or recipe path."),
    overrides: list[str] = typer.Argument(
        None, autocompletion=override_items, help="With --resolved: overrides as key.sub=value."
    ),
    resolved: bool = typer.Option(
        False, "--resolved", help="Print the recipe as a run uses it: extends, overrides, defaults applied."
    ),
) -> None:
    """Print a recipe file as written (comments included; colored on a terminal, the exact text
    when redirected, so `difftrain recipes show NAME > my.yaml` is a copy); --resolved prints
    the whole recipe a run would use."""
    from rich.syntax import Syntax

    from difftrain.recipe import find_recipe, load_recipe, read_recipe_text

    if overrides and not resolved:
        raise RecipeError("overrides work with --resolved only: `difftrain recipes show NAME --resolved k=v`")
    text = load_recipe(name, overrides or []).to_yaml() if resolved else read_recipe_text(find_recipe(name))
    if not console.is_terminal:
        typer.echo(text, nl=False)
        return
    console.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default", word_wrap=True))


@recipes_app.command("cp")
def cp(
    name: str = typer.Argument(..., autocompletion=recipe_refs, help="Shipped recipe name or recipe path."),
    dest: str = typer.Argument(..., help="Destination file, or folder (existing, or a name ending in /)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Copy a shipped recipe (or any recipe file) to DEST so you can edit it (like `tune cp`)."""
    from difftrain.recipe import find_recipe

    if not dest.strip():
        raise RecipeError("DEST is empty; give the file to write (mine.yaml) or a folder to copy into (./)")
    src = find_recipe(name)
    path = Path(dest).expanduser()
    target = path / src.name if dest.endswith(("/", os.sep)) or path.is_dir() else path
    if target.exists() and not force:
        raise RecipeError(f"{target} already exists; pass --force to overwrite it or pick another name")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    except OSError as e:
        raise RecipeError(f"cannot write {target}: {e.strerror or e}; choose a writable DEST") from e
    typer.echo(f"copied {src.name} to {target}")
    run_name = _own_key(target, "name", (str, int))  # a copy to edit runs into the original's folder
    if run_name is not None and str(run_name) != target.stem:
        typer.echo(
            f"its name is still {run_name}: a run of it goes to the original's run folder (out_dir/{run_name}); "
            "change `name:` to keep the two apart"
        )
    moved = _paths_read_elsewhere(src, target)
    if moved:
        more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
        warn(
            f"{target} reads {moved[0]}{more} relative to its own folder {target.parent.resolve()}, "
            f"no longer from {src.resolve().parent}; make such paths absolute, or copy what they name too"
        )


def _or_none(f: Any, *args: Any, **kwargs: Any) -> Any:
    """`f(*args, **kwargs)`, or None where it raises a DifftrainError or an OSError."""
    from difftrain.errors import DifftrainError

    try:
        return f(*args, **kwargs)
    except (DifftrainError, OSError):
        return None


def _own_key(path: Path, key: str, types: Any = str) -> Any:
    """A top-level key of a recipe file as written, not what it extends (None where it has none
    of `types`, or the file does not read)."""
    from difftrain.recipe import read_yaml

    doc = _or_none(read_yaml, path)
    value = doc[0].get(key) if doc is not None else None
    return value if isinstance(value, types) else None


def _paths_read_elsewhere(src: Path, target: Path) -> list[str]:
    """The relative paths of a recipe (read against its own folder) that name something else once
    it is copied from `src` to `target`; none for a shipped recipe or one that does not load."""
    from difftrain.recipe import find_recipe, load_recipe, shipped_recipes_dir

    old, new = src.resolve().parent, target.resolve().parent
    if old == new or old == shipped_recipes_dir().resolve():
        return []
    parent = _own_key(src, "extends")  # the parent's own paths are read against its folder
    if parent is not None:
        found = [_or_none(lambda d: find_recipe(parent, relative_to=d).resolve(), d) for d in (old, new)]
        if found[0] != found[1]:
            return [f"extends: {parent}"]
    here = _or_none(load_recipe, src)
    if here is None:
        return []
    there = here.model_copy()
    there._recipe_dir = new
    a, b = here.with_absolute_paths(), there.with_absolute_paths()
    moved: list[str] = []
    for spec, x, y in zip(here.data.sources, a.data.sources, b.data.sources, strict=True):
        files = zip(spec.data_files or (), x.data_files or (), y.data_files or (), strict=True)
        moved += [raw for raw, p, q in [(spec.source, x.source, y.source), *files] if p != q]
    if a.tokenizer.path != b.tokenizer.path:
        moved.append(str(here.tokenizer.path))
    return moved


@recipes_app.command("explain")
def explain(
    section: str = typer.Argument(
        None, help="A section (model, data, tokenizer, train, optim, ...) or a key (train.max_steps)."
    ),
    markdown: bool = typer.Option(False, "--markdown", help="Print the Markdown table of docs/recipes.md."),
) -> None:
    """Print every recipe key (of a section, or one key) with its type, default and description."""
    from rich.markup import escape
    from rich.table import Table

    from difftrain.recipe import explain_rows, recipe_reference_markdown

    if markdown:
        typer.echo(recipe_reference_markdown(section), nl=False)
        return
    table = Table(title=f"recipe keys{': ' + section if section else ''}", title_justify="left")
    table.add_column("key", style="bold cyan", no_wrap=True)
    table.add_column("type", style="magenta")
    table.add_column("default", style="green")
    table.add_column("description")
    for row in explain_rows(section):  # escaped: `list[str]`, 'hf:<dataset>[:<config>]' are no markup
        table.add_row(*map(escape, row))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(recipes_app, name="recipes")
