"""Recipes: loading, extends, overrides, and the error messages users see."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from difftrain.errors import RecipeError
from difftrain.recipe import (
    Recipe,
    deep_merge,
    explain_rows,
    load_recipe,
    recipe_reference_markdown,
    run_dir_for,
    shipped_recipes,
)

MINIMAL = """\
name: tiny
model:
  d_model: 64
  n_layers: 2
  n_heads: 4
  max_seq_len: 32
data:
  sources: [builtin:python-stdlib]
train:
  max_steps: 3
  micro_batch_size: 2
"""


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_minimal_recipe_fills_defaults(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL))
    assert r.model.n_kv_heads == 4 and r.model.head_dim == 16
    assert r.optim.name == "auto" and r.train.precision == "auto"
    assert r.recipe_dir == tmp_path.resolve()
    assert r.run_dir == Path("runs/tiny")


def test_unknown_key_names_line_and_suggests_the_right_key(tmp_path):
    p = write(tmp_path, MINIMAL + "optim:\n  learning_rate: 0.001\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert (
        "line 13" in msg and "unknown key `optim.learning_rate`" in msg and "did you mean `optim.lr`" in msg
    )


def test_close_misspelling_is_suggested(tmp_path):
    p = write(tmp_path, MINIMAL.replace("micro_batch_size", "micro_bach_size"))
    with pytest.raises(RecipeError, match=r"did you mean `train.micro_batch_size`"):
        load_recipe(p)


def test_wrong_type_names_key_and_value(tmp_path):
    p = write(tmp_path, MINIMAL.replace("max_steps: 3", "max_steps: lots"))
    with pytest.raises(RecipeError, match=r"line 10.*train.max_steps.*'lots'"):
        load_recipe(p)


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    p = write(tmp_path, "name: x\nmodel: {d_model: 64\n")
    with pytest.raises(RecipeError, match=r"line \d+, column \d+: invalid YAML"):
        load_recipe(p)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "is empty"),
        ("- a\n- b\n", "must be a mapping"),
        ("name: x\n", "missing key `model`"),
        (
            "name: " + "é" * 130 + "\nmodel: {d_model: 64, n_layers: 1, n_heads: 2}\ntrain: {max_steps: 1}\n",
            r"name is 260 bytes long, more than a folder name may be \(255 bytes\); shorten it",
        ),
        (
            'name: "run\\t1"\nmodel: {d_model: 64, n_layers: 1, n_heads: 2}\ntrain: {max_steps: 1}\n',
            r"name 'run\\t1' holds the control character '\\t'; use letters, digits",
        ),
        (
            "name: x\nmodel: {d_model: 64, n_layers: 1, n_heads: 2}\n",
            r"missing key `train`: a recipe needs a train: section with max_steps or max_tokens, e\.g\. `train: \{max_steps: 1000\}`$",
        ),
        (
            "name: x\nmodel: {d_model: 64, n_layers: 1, n_heads: 2}\ntrain: {max_steps: 1}\ndata: {sources: [{weight: 2}]}\n",
            r"missing key `data\.sources\.0\.source`; add it \(`difftrain recipes explain data\.sources\[\]\.source` says",
        ),
        ("!!python/object/apply:os.system ['echo hi']\n", "invalid YAML"),
    ],
)
def test_malformed_recipes_are_recipe_errors(tmp_path, text, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(write(tmp_path, text))


def test_non_utf8_recipe_is_refused(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(RecipeError, match="not UTF-8"):
        load_recipe(p)


def test_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    with pytest.raises(RecipeError, match="aliases"):
        load_recipe(write(tmp_path, "\n".join(lines) + "\n"))


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    write(tmp_path, MINIMAL + "optim:\n  betas: [0.8, 0.9]\n  lr: 0.01\n", "base.yaml")
    child = write(
        tmp_path,
        "extends: base.yaml\nname: child\nmodel: {arch: baseline}\noptim: {betas: [0.7, 0.8]}\n"
        "data: {sources: [a.txt, b.txt]}\n",
        "child.yaml",
    )
    r = load_recipe(child)
    assert r.name == "child" and r.model.arch == "baseline"
    assert r.model.d_model == 64  # merged from the base
    assert r.optim.lr == 0.01 and r.optim.betas == (0.7, 0.8)
    assert [s.source for s in r.data.sources] == ["a.txt", "b.txt"]  # list replaced, not appended


def test_extends_cycle_is_reported(tmp_path):
    write(tmp_path, "extends: b.yaml\nname: a\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\nname: b\n", "b.yaml")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_extends_a_shipped_recipe_by_name(tmp_path):
    r = load_recipe(write(tmp_path, "extends: quickstart\nname: mine\ntrain: {max_steps: 7}\n"))
    assert r.name == "mine" and r.train.max_steps == 7 and r.model.arch == "diff"


def test_overrides_are_typed_by_the_schema(tmp_path):
    r = load_recipe(
        write(tmp_path, MINIMAL),
        [
            "train.max_steps=100",
            "optim.betas=[0.8, 0.99]",
            "model.tie_embeddings=true",
            "optim.lr=3e-4",
            "train.grad_clip=null",
        ],
    )
    assert r.train.max_steps == 100 and r.optim.betas == (0.8, 0.99)
    assert r.model.tie_embeddings is True and r.optim.lr == pytest.approx(3e-4)
    assert r.train.grad_clip is None


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("name=123", "name", "123"),
        ("name=on", "name", "on"),
        ("name=2024-01-01", "name", "2024-01-01"),
        ("description=Run: small", "description", "Run: small"),
        ("description=null", "description", "null"),  # a key that must hold text takes the word
        ("finetune.prompt_format={prompt}", "finetune.prompt_format", "{prompt}"),
        ("finetune.prompt_format=### {prompt}", "finetune.prompt_format", "### {prompt}"),
        ("tokenizer.path=null", "tokenizer.path", None),  # a key that may be unset is unset
        ("tokenizer.path=~", "tokenizer.path", None),
    ],
)
def test_a_text_key_takes_the_override_as_typed_where_yaml_would_read_something_else(override, key, value):
    # YAML makes 123 a number, on a boolean, a date a date, `a: b` and {prompt} mappings, `# x` nothing
    r = load_recipe("finetune-quickstart", [override])
    got = r
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value


def test_bad_override_says_override(tmp_path):
    with pytest.raises(RecipeError, match=r"override `train.max_steps`"):
        load_recipe(write(tmp_path, MINIMAL), ["train.max_steps=-5"])
    with pytest.raises(RecipeError, match="not key=value"):
        load_recipe(write(tmp_path, MINIMAL), ["train.max_steps"])
    with pytest.raises(RecipeError, match="did you mean `train.max_steps`"):
        load_recipe(write(tmp_path, MINIMAL), ["train.max_step=5"])
    # an item of an overridden value is the override's fault, not the file's
    with pytest.raises(
        RecipeError,
        match=r"^override `optim.betas`: `optim.betas` has too few values \(no item 1\); give all 2, "
        r"e.g. `optim.betas=\[0.9,0.95\]`$",
    ):
        load_recipe(write(tmp_path, MINIMAL), ["optim.betas=[0.9]"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "optim.betas=0.9,0.99",
            "override `optim.betas`='0.9,0.99' must be a list in brackets, e.g. `optim.betas=[0.9,0.99]`",
        ),
        (
            "optim.betas=0.9",
            "override `optim.betas`=0.9 must be a list in brackets; give all 2, e.g. `optim.betas=[0.9,0.95]`",
        ),
        (
            "data.sources=[]",
            "override `data.sources` is empty; it needs at least 1 item such as `data.sources=[path/to/texts]`",
        ),
        (  # YAML reads a bare `hf:` as the mapping {hf: null}: the source's own message, not two about keys
            "data.sources=[hf:]",
            "override `data.sources`: `data.sources.0`: hf: source needs a dataset name, e.g. 'hf:json' or "
            "'hf:wikitext:wikitext-2-raw-v1@train'",
        ),
        (  # parentheses, as Python writes a tuple: the same values in brackets
            "optim.betas=(0.9,0.99)",
            "override `optim.betas`='(0.9,0.99)' must be a list in brackets, e.g. `optim.betas=[0.9,0.99]`",
        ),
        (
            "optim.betas=[0.9,0.95,0.99]",
            "override `optim.betas` has too many values (it takes 2); give 2, e.g. `optim.betas=[0.9,0.95]`",
        ),
        (  # one bracket too many: the example is the values in brackets, not the input again
            "optim.betas=[0.9,0.95]]",
            "override `optim.betas`='[0.9,0.95]]' must be a list in brackets, e.g. `optim.betas=[0.9,0.95]`",
        ),
        (  # one line for the list, not one per missing item
            "optim.betas=[]",
            "override `optim.betas`: `optim.betas` has too few values (no item 0); give all 2, e.g. "
            "`optim.betas=[0.9,0.95]`",
        ),
        (  # an unclosed bracket was read as a path: "[data/train.txt matches no files"
            "data.sources=[corpus",
            "override `data.sources=[corpus`: the value has an unclosed `[`; write it as `data.sources=[a, b]` "
            "(quoted for the shell)",
        ),
        (
            "data.sources.0.weight=2",
            "override `data.sources.0.weight=2`: `data.sources` is a list, not a section; set the whole list: `data.sources=[...]`",
        ),
    ],
)
def test_list_override_mistakes_say_how_to_write_the_list(tmp_path, override, message):
    """Each message carries a fix that works: the example it gives loads."""
    p = write(tmp_path, MINIMAL)
    with pytest.raises(RecipeError) as e:
        load_recipe(p, [override])
    assert str(e.value) == message
    if "e.g. `" in message:
        load_recipe(p, [message.split("e.g. `")[1].rstrip("`")])


def test_a_yaml_mapping_without_a_space_after_the_colon_is_named_first(tmp_path):
    """`{source:x}` is one key ("source:x") to YAML: the message says what YAML needs first."""
    p = write(tmp_path, MINIMAL)
    with pytest.raises(RecipeError) as e:
        load_recipe(p, ["data.sources=[{source:corpus,max_documents:3}]"])
    assert str(e.value).startswith(
        "override `data.sources`: unknown key `data.sources.0.source:corpus` — YAML needs a space after ':': "
        "write `source: corpus`"
    )


def test_override_messages_speak_the_recipes_terms(tmp_path):
    p = write(tmp_path, MINIMAL)
    cases = {
        # the key itself named once, pydantic's "Input should be" in the recipe's words
        "train.max_steps=abc": r"^override `train.max_steps`='abc': must be a valid integer",
        "model.arch=dif": r"^override `model.arch`='dif': must be 'baseline', 'diff' or 'diff2'$",
        # a section given a scalar says what a section is
        "model=3": r"^override `model` must be a section of keys such as `model.arch`, not 3$",
        # a section's own check that an override under it broke names the override, not only the file
        "train.max_steps=": r"r.yaml, line 9, with override `train.max_steps`: `train`: set train.max_steps",
    }
    for override, message in cases.items():
        with pytest.raises(RecipeError, match=message):
            load_recipe(p, [override])


def test_a_section_given_a_value_names_the_file_line(tmp_path):
    with pytest.raises(
        RecipeError,
        match=r"r.yaml, line 2: `train` must be a section of keys such as `train\.max_steps`, not 5$",
    ):
        load_recipe(write(tmp_path, "name: x\ntrain: 5\nmodel: {d_model: 64}\n"))


def test_a_key_set_twice_is_refused_with_both_lines(tmp_path):
    twice = MINIMAL + "  max_steps: 7\n"  # train.max_steps again, at the end of train:
    with pytest.raises(
        RecipeError, match=r"r.yaml, line 12: `train.max_steps` is set twice \(also on line 10\); keep one"
    ):
        load_recipe(write(tmp_path, twice))
    with pytest.raises(RecipeError, match=r"line 3: `name` is set twice \(also on line 1\)"):
        load_recipe(write(tmp_path, "name: a\nmodel: {d_model: 64}\nname: b\n"))
    # in a list item too; the same key in different mappings is fine, and so is a YAML merge key
    with pytest.raises(RecipeError, match=r"`data.sources.0.weight` is set twice"):
        load_recipe(
            write(
                tmp_path,
                MINIMAL.replace(
                    "sources: [builtin:python-stdlib]",
                    "sources: [{source: builtin:python-stdlib, weight: 1, weight: 2}]",
                ),
            )
        )
    merged = MINIMAL.replace("train:\n", "base: &b {micro_batch_size: 2}\ntrain:\n  <<: *b\n").replace(
        "  micro_batch_size: 2\n", "", 1
    )
    assert "base" in yaml.safe_load(merged)
    ok = write(tmp_path, merged.replace("base: &b", "x-base: &b"))
    with pytest.raises(RecipeError, match="unknown key `x-base`"):  # parsed: the merge key is no duplicate
        load_recipe(ok)


def test_extends_a_missing_recipe_names_the_line(tmp_path):
    with pytest.raises(RecipeError, match=r"r.yaml, line 2: `extends: nosuch`: no recipe file `nosuch`"):
        load_recipe(write(tmp_path, "name: x\nextends: nosuch\n"))
    # a relative path: where it was looked for (the recipe's own folder)
    with pytest.raises(
        RecipeError, match=rf"no recipe file `../base.yaml` \(looked for {tmp_path}/../base.yaml\)"
    ):
        load_recipe(write(tmp_path, "name: x\nextends: ../base.yaml\n"))


def test_missing_recipe_suggests_a_shipped_one():
    with pytest.raises(RecipeError, match="did you mean `quickstart`"):
        load_recipe("quickstrat")


def test_out_dir_cannot_climb_out_through_dotdot():
    with pytest.raises(RecipeError, match=r"climbs out"):
        run_dir_for("../elsewhere", "x")
    assert run_dir_for("/abs/runs", "x") == Path("/abs/runs/x")


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", ""])
def test_name_must_be_a_plain_folder_name(tmp_path, bad):
    with pytest.raises(RecipeError, match="name"):
        load_recipe(write(tmp_path, MINIMAL.replace("name: tiny", f"name: '{bad}'")))


def test_every_field_is_documented():
    rows = explain_rows()
    assert len(rows) > 40
    undocumented = [key for key, _, _, desc in rows if not desc.strip()]
    assert undocumented == []
    keys = {r[0] for r in rows}
    for key in ("train.max_steps", "optim.lr", "model.arch", "data.sources", "tokenizer.train.vocab_size"):
        assert key in keys


def test_explain_takes_a_section_a_key_or_a_group_of_keys():
    train = explain_rows("train")
    assert [r for r in train if r[0] == "train.max_steps"] == explain_rows("train.max_steps")
    lora = [r[0] for r in explain_rows("finetune.lora")]
    assert "finetune.lora.rank" in lora and all(k.startswith("finetune.lora.") for k in lora)
    with pytest.raises(RecipeError, match="no recipe key `train.max_step` — did you mean `train.max_steps`"):
        explain_rows("train.max_step")
    with pytest.raises(RecipeError, match="no recipe section `trian` — did you mean `train`"):
        explain_rows("trian.max_steps")


def test_docs_recipe_reference_is_generated_from_the_schema():
    page = (Path(__file__).resolve().parent.parent / "docs" / "recipes.md").read_text()
    start, end = "<!-- recipe-reference:start -->\n", "<!-- recipe-reference:end -->"
    table = page[page.index(start) + len(start) : page.index(end)]
    assert table == recipe_reference_markdown(), "docs/recipes.md is stale: run `make docs`"


def test_every_shipped_recipe_validates():
    shipped = shipped_recipes()
    assert {
        "quickstart",
        "quickstart-baseline",
        "diff-124m",
        "baseline-124m",
        "diff2-124m",
        "diff-350m-8gb",
    } <= set(shipped)
    # listed by name: quickstart before its variant quickstart-baseline (the file names sort the
    # other way, '-' < '.')
    assert list(shipped) == sorted(shipped)
    for name, path in shipped.items():
        r = load_recipe(name)
        assert isinstance(r, Recipe) and r.name == name
        assert yaml.safe_load(path.read_text()).get("description") or r.description


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL))
    again = load_recipe(write(tmp_path, r.to_yaml(), "resolved.yaml"))
    assert again.model_dump() == r.model_dump()


def test_deep_merge_does_not_mutate_inputs():
    a = {"x": {"y": 1, "z": [1]}}
    b = {"x": {"y": 2}}
    out = deep_merge(a, b)
    assert out == {"x": {"y": 2, "z": [1]}} and a == {"x": {"y": 1, "z": [1]}}


def test_atomic_writes_get_ordinary_file_permissions(tmp_path):
    import os

    import torch

    from difftrain.io import atomic_save_safetensors, atomic_write_text

    atomic_write_text(tmp_path / "f.txt", "x")
    atomic_save_safetensors(tmp_path / "w.safetensors", {"w": torch.zeros(2)})  # its writer makes 0600 files
    mask = os.umask(0)
    os.umask(mask)
    for name in ("f.txt", "w.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_a_recipe_yaml_outside_a_run_directory_keeps_out_dir_and_name(tmp_path):
    """Only a run directory's own recipe.yaml stands for its folder: a user's recipe.yaml next to
    an unrelated config.json must not turn the project folder into the run directory."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "recipe.yaml").write_text(MINIMAL)
    (proj / "config.json").write_text("{}")
    assert load_recipe(proj / "recipe.yaml").run_dir == Path("runs") / "tiny"
    (proj / "tokenizer.json").write_text("{}")
    (proj / "checkpoints").mkdir()
    assert load_recipe(proj / "recipe.yaml").run_dir == proj  # now it is laid out as a run
    assert load_recipe(proj).run_dir == proj  # and the folder stands for its recipe
    assert load_recipe(proj / "recipe.yaml", ["name=other"]).run_dir == Path("runs") / "other"


def test_copies_of_a_recipe_keep_its_folder_source_and_own_model_keys(tmp_path):
    # the loader's private state survives model_copy (resolve_auto, the fine-tune's model swap and
    # the run's vocabulary rely on it): a relative data path must keep meaning the recipe's folder
    r = load_recipe(write(tmp_path, MINIMAL))
    assert r.model_keys == {"d_model", "n_layers", "n_heads", "max_seq_len"}
    for copy in (r.model_copy(), r.model_copy(deep=True), r.model_copy(update={"seed": 9})):
        assert (copy.recipe_dir, copy.source, copy.model_keys) == (r.recipe_dir, r.source, r.model_keys)
        assert copy.recipe_dir == tmp_path.resolve()


def test_reading_a_recipe_does_not_import_torch():
    # A mistyped recipe name or key must be reported at once: importing torch takes seconds on a
    # small CPU, and torch._dynamo seconds more, so neither may load on the recipe path.
    code = (
        "import sys, difftrain.recipe as r; r.load_recipe('quickstart')\n"
        "print(sorted(m for m in ('torch', 'torch._dynamo') if m in sys.modules))\n"
        "import difftrain.model.kernels\n"
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"]


@pytest.mark.parametrize(
    "override", ["optim.lr=1e400", "optim.lr=inf", "optim.eps=nan", "train.grad_clip=1e999"]
)
def test_numbers_that_become_infinite_are_refused(tmp_path, override):
    # YAML reads 1e400 (no dot) as a string, which pydantic turned into inf after the
    # finiteness check of the YAML tree: the run started with `lr inf` and diverged.
    key = override.split("=")[0]
    with pytest.raises(RecipeError, match=rf"`{key}`='.*': must be a finite number"):
        load_recipe(write(tmp_path, MINIMAL), [override])
    section, field = key.split(".")
    value = override.split("=")[1]
    child = write(tmp_path, f"extends: r.yaml\n{section}:\n  {field}: {value}\n", "r2.yaml")
    with pytest.raises(RecipeError, match=rf"r2.yaml, line 3: `{key}`(='{value}':)? must be a finite number"):
        load_recipe(child)


def test_explain_shows_brackets_and_explains_top_level_keys(capsys, monkeypatch):
    # rich read `[:<config>]` and `[builtin:python-stdlib]` as markup and dropped them
    from difftrain.cli.app import main

    monkeypatch.setenv("COLUMNS", "250")
    assert main(["recipes", "explain", "data.sources"]) == 0
    out = capsys.readouterr().out
    assert "[builtin:python-stdlib]" in out and "hf:<dataset>[:<config>][@<split>]" in out
    assert "list[SourceSpec]" in out
    assert main(["recipes", "explain", "seed"]) == 0
    assert "Seed for initialisation" in capsys.readouterr().out
    assert main(["recipes", "explain", "nme"]) == 2
    assert "did you mean `name`?" in capsys.readouterr().err
    assert main(["recipes", "explain", "optim.lr", "--markdown"]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "| `optim.lr` | float | 0.0003 | Peak learning rate. |"
    ]


def test_an_extended_recipe_in_another_folder_keeps_its_paths(tmp_path):
    # The parent's `corpus` was resolved against the child's folder: sub/corpus, not parent/corpus.
    (tmp_path / "parent").mkdir()
    (tmp_path / "child").mkdir()
    (tmp_path / "parent" / "data" / "saved").mkdir(
        parents=True
    )  # a local folder without ./ (as the run reads it)
    write(
        tmp_path / "parent",
        MINIMAL.replace(
            "sources: [builtin:python-stdlib]",
            "sources: [corpus, {source: 'hf:./saved@test'}, {source: 'hf:json', data_files: [d.jsonl]}, "
            "builtin:needles, /abs/x, 'hf:data/saved:cfg', 'hf:org/hub-set']",
        )
        + "tokenizer:\n  path: tok.json\n",
        "base.yaml",
    )
    r = load_recipe(write(tmp_path / "child", "extends: ../parent/base.yaml\nname: c\n", "c.yaml"))
    p = (tmp_path / "parent").resolve()
    assert [s.source for s in r.data.sources] == [
        str(p / "corpus"),
        f"hf:{p / './saved@test'}",
        "hf:json",
        "builtin:needles",
        "/abs/x",
        f"hf:{p / 'data' / 'saved'}:cfg",
        "hf:org/hub-set",  # a hub dataset: not a path
    ]
    assert r.data.sources[2].data_files == [str(p / "d.jsonl")]
    assert r.tokenizer.file(r.recipe_dir) == p / "tok.json"
    # the child's own sources stay relative to the child
    r = load_recipe(
        write(
            tmp_path / "child", "extends: ../parent/base.yaml\nname: c\ndata:\n  sources: [mine]\n", "c2.yaml"
        )
    )
    assert [s.source for s in r.data.sources] == ["mine"]


@pytest.mark.parametrize(
    "overrides",
    [["train.max_steps", "=", "3"], ["train.max_steps=", "3"], ["train.max_steps", "=3"]],
)
def test_spaces_around_the_equals_sign_are_named(tmp_path, overrides):
    with pytest.raises(
        RecipeError, match=r"has spaces around `=`; write it as one word: `train.max_steps=3`"
    ):
        load_recipe(write(tmp_path, MINIMAL), overrides)


def test_an_empty_override_value_before_another_override_is_not_taken_for_spaces(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL), ["data.cache_dir=", "train.max_steps=3"])
    assert r.data.cache_dir is None and r.train.max_steps == 3


def test_an_override_given_before_the_recipe_says_so():
    with pytest.raises(
        RecipeError, match=r"`train.max_steps=3` is an override, not a recipe: the recipe comes first"
    ):
        load_recipe("train.max_steps=3")


def test_paths_in_overrides_start_at_the_current_folder_and_paths_in_the_file_at_its_folder(
    tmp_path, monkeypatch
):
    # a path typed on the command line is the shell's, relative to where it was typed: a recipe in
    # recipes/ with `data.sources=data/a.txt` read recipes/data/a.txt before
    (tmp_path / "recipes").mkdir()
    p = write(tmp_path / "recipes", MINIMAL.replace("sources: [builtin:python-stdlib]", "sources: [corpus]"))
    monkeypatch.chdir(tmp_path)
    r = load_recipe(p)
    assert r.data.sources[0].source == "corpus" and r.recipe_dir == tmp_path / "recipes"  # the file's folder
    r = load_recipe(
        p,
        [
            "data.sources=[data/a.txt, {source: data/b.jsonl}, {source: 'hf:json', data_files: [x.json]}, builtin:needles]",
            "tokenizer.path=tok/tokenizer.json",
        ],
    )
    s = r.data.sources
    assert s[0].source == str(tmp_path / "data" / "a.txt") and s[1].source == str(
        tmp_path / "data" / "b.jsonl"
    )
    assert s[2].data_files == [str(tmp_path / "x.json")] and s[3].source == "builtin:needles"
    assert r.tokenizer.path == str(tmp_path / "tok" / "tokenizer.json")
    whole = load_recipe(p, ["data={sources: [data/c.txt]}"])  # a whole section set at once
    assert whole.data.sources[0].source == str(tmp_path / "data" / "c.txt")


def test_the_runs_length_is_the_one_asked_last_and_never_both(tmp_path):
    """A child recipe or an override that gives max_tokens drops the max_steps it inherits (it
    was silently ignored); both given at one level is refused."""
    parent = write(tmp_path, MINIMAL)  # max_steps: 3
    child = write(tmp_path, "extends: r.yaml\nname: child\ntrain:\n  max_tokens: 1000\n", "child.yaml")
    r = load_recipe(child)
    assert r.train.max_tokens == 1000 and r.train.max_steps is None
    r = load_recipe(parent, ["train.max_tokens=1000"])
    assert r.train.max_tokens == 1000 and r.train.max_steps is None
    assert load_recipe(child, ["train.max_steps=7"]).train.max_tokens is None  # and back
    r = load_recipe(parent, ["train={max_tokens: 1000}"])  # the section form merges alike
    assert r.train.max_tokens == 1000 and r.train.max_steps is None and r.train.micro_batch_size == 2
    with pytest.raises(RecipeError, match="max_steps=5 and max_tokens=1000 are both set"):
        load_recipe(parent, ["train.max_steps=5", "train.max_tokens=1000"])
    both = write(tmp_path, MINIMAL.replace("max_steps: 3", "max_steps: 3\n  max_tokens: 1000"), "both.yaml")
    with pytest.raises(RecipeError, match="both set; give the run's length one way"):
        load_recipe(both)


def test_numbers_in_exponent_notation_read_as_numbers(tmp_path):
    """YAML 1.1 reads 1e6 as text; a token budget is written that way (nanoGPT, litgpt)."""
    p = write(tmp_path, MINIMAL.replace("max_steps: 3", "max_tokens: 1e6"))
    assert load_recipe(p).train.max_tokens == 1_000_000
    r = load_recipe(p, ["train.max_tokens=2.5e6", "optim.lr=3e-4", "seed=1e3", "description=1e3"])
    assert (r.train.max_tokens, r.optim.lr, r.seed, r.description) == (2_500_000, 3e-4, 1000, "1e3")
    with pytest.raises(RecipeError, match="got a number with a fractional part"):
        load_recipe(p, ["train.max_tokens=1.5e0"])


def test_a_section_override_or_an_empty_child_section_merges_as_extends_does(tmp_path):
    p = write(tmp_path, MINIMAL)
    r = load_recipe(p, ["model={d_model: 32}"])  # the other model keys stay the recipe's
    assert (r.model.d_model, r.model.n_layers, r.model.n_heads, r.model.max_seq_len) == (32, 2, 4, 32)
    # a child whose model: keys are all commented out (null) keeps the parent's model
    child = write(tmp_path, "extends: r.yaml\nname: c\nmodel:\n#  d_model: 128\n", "c.yaml")
    assert load_recipe(child).model == load_recipe(p).model


def test_a_section_check_names_only_the_overrides_its_message_is_about(tmp_path):
    p = write(tmp_path, MINIMAL)
    with pytest.raises(RecipeError) as e:
        load_recipe(p, ["model.n_layers=3", "model.max_seq_len=64", "model.n_heads=5"])
    msg = str(e.value)
    assert "with override `model.n_heads`:" in msg and "n_layers" not in msg and "max_seq_len" not in msg


def test_boolean_mistakes_are_answered_in_yamls_spellings(tmp_path):
    p = write(tmp_path, MINIMAL)
    for override, says in (
        ("train.compile=maybe", "must be auto, true or false"),
        ("logging.progress=maybe", "must be true or false (yes/no, on/off and 1/0 read as them too)"),
    ):
        with pytest.raises(RecipeError, match=re.escape(says)):
            load_recipe(p, [override])
    assert load_recipe(p, ["logging.progress=off"]).logging.progress is False


def test_explain_knows_extends_and_finds_a_key_named_without_its_section():
    from difftrain.recipe import explain_rows

    assert explain_rows("extends")[0][0] == "extends" and explain_rows()[0][0] == "extends"
    with pytest.raises(
        RecipeError,
        match=r"`max_steps` is the key `train.max_steps`: `difftrain recipes explain train.max_steps`",
    ):
        explain_rows("max_steps")
    with pytest.raises(RecipeError, match=r"`lora.rank` is the key `finetune.lora.rank`"):
        explain_rows("lora.rank")
    with pytest.raises(RecipeError, match=r"did you mean `train`"):
        explain_rows("trian")


def test_a_bare_star_in_a_list_override_says_to_quote_it(tmp_path):
    """`[*]` is no list to YAML (a bare * starts an alias): the message gives the quoted form,
    which loads."""
    p = write(tmp_path, MINIMAL + "finetune:\n  base: runs/base\n")
    with pytest.raises(RecipeError, match=r"YAML reads a bare \* as an alias; quote the patterns") as e:
        load_recipe(p, ["finetune.lora.target_modules=[*]"])
    fixed = str(e.value).split("quote the patterns: `")[1].split("`")[0]
    assert load_recipe(p, [fixed]).finetune.lora.target_modules == ["*"]


def test_a_run_name_a_shell_would_read_as_home_is_refused(tmp_path):
    p = write(tmp_path, MINIMAL)
    for name in ("~", "~me"):
        with pytest.raises(RecipeError, match="reads as your home folder"):
            load_recipe(p, [f"name={name}"])
    assert load_recipe(p, ["name=a~b"]).name == "a~b"


def test_grad_clip_zero_says_how_to_train_without_clipping():
    from difftrain.errors import RecipeError

    with pytest.raises(RecipeError, match=r"to train without clipping set train.grad_clip: null"):
        load_recipe("quickstart", ["train.grad_clip=0"])
    assert load_recipe("quickstart", ["train.grad_clip=null"]).train.grad_clip is None


def test_an_empty_section_or_an_extends_override_is_named(tmp_path):
    # `model=` said the file lacked `model`, `extends=x` that extends is an unknown key
    p = write(tmp_path, MINIMAL)
    for override in ("model=", "train=null", "data="):
        with pytest.raises(
            RecipeError, match=rf"override `{re.escape(override)}` gives the section \w+ no value"
        ):
            load_recipe(p, [override])
    with pytest.raises(RecipeError, match="extends is read with the recipe file, before overrides"):
        load_recipe(p, ["extends=quickstart"])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "name: 2024-01-01",
            "`name`: YAML reads 2024-01-01 as a date, not text; quote it: `name: '2024-01-01'`",
        ),
        ("name: 12", "`name`: YAML reads 12 as a number, not text; quote it: `name: '12'`"),
        ("description: yes", "`description`: YAML reads the value as true (yes/no, on/off and true/false"),
        (  # a datetime, as typed (not its isoformat's T)
            "name: 2024-01-01 10:00:00",
            "`name`: YAML reads 2024-01-01 10:00:00 as a date, not text; quote it: `name: '2024-01-01 10:00:00'`",
        ),
    ],
)
def test_text_that_yaml_reads_as_a_date_number_or_boolean_says_to_quote_it(tmp_path, line, message):
    # it said "`name`=datetime.date(2024, 1, 1): must be a valid string"
    p = write(tmp_path, MINIMAL.replace("name: tiny", line))
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(p)
    fixed = message.split("quote it: `")[1].rstrip("`") if "quote it" in message else None
    if fixed:
        assert load_recipe(write(tmp_path, MINIMAL.replace("name: tiny", fixed))).name == fixed.split("'")[1]


def test_chat_roles_given_in_part_say_they_replace_the_default_roles(tmp_path):
    p = write(tmp_path, MINIMAL + "finetune:\n  base: runs/base\n")
    with pytest.raises(
        RecipeError, match=r"roles replaces the default roles \(system, user, assistant\) as a whole"
    ):
        load_recipe(p, ['finetune.chat_template.roles={user: "U: {content}"}'])


def test_a_key_missing_from_a_section_the_command_line_made_names_the_override(tmp_path):
    # it blamed the recipe file (a shipped one too) for a finetune section only the override made
    p = write(tmp_path, MINIMAL)
    with pytest.raises(RecipeError, match=r"^override `finetune.method`: missing key `finetune.base`"):
        load_recipe(p, ["finetune.method=full"])
    with pytest.raises(RecipeError, match="gives the section finetune no value"):
        load_recipe(p, ["finetune=null"])
    q = write(tmp_path, MINIMAL + "finetune:\n  base: runs/base\n", "ft.yaml")
    for r in (p, q):  # a section inside a section too: one message, not a missing finetune.base as well
        with pytest.raises(
            RecipeError, match=r"^override `finetune.lora=null` gives the section finetune.lora no value"
        ):
            load_recipe(r, ["finetune.lora=null"])
    with pytest.raises(RecipeError, match=r"override `finetune.lora.rank`=null: must be a valid integer"):
        load_recipe(q, ["finetune.lora.rank=null"])  # YAML's word, not Python's None


def test_a_chat_role_override_is_text_even_when_it_starts_like_a_list():
    # `[INST {content}` was read as an unclosed list; a role's format is text
    from difftrain.recipe import apply_overrides

    out = apply_overrides({}, ["finetune.chat_template.roles.user=[INST {content}"])
    assert out["finetune"]["chat_template"]["roles"]["user"] == "[INST {content}"


def test_an_empty_finetune_base_is_named_not_taken_for_a_pretraining_recipe(tmp_path):
    p = write(
        tmp_path,
        "name: ft\nfinetune:\n  base: runs/base\ndata:\n  sources: [builtin:python-docstrings]\ntrain: {max_steps: 1}\n",
    )
    with pytest.raises(RecipeError, match="finetune.base is empty; name the run directory to start from"):
        load_recipe(p, ["finetune.base="])  # it said "a pretraining recipe needs a model: section"
