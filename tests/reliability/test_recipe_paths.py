"""Paths in a recipe mean the same thing from any current folder, and a run cannot escape.

Data sources, `extends:` and the tokenizer are resolved against the recipe's own folder; the
run directory is `out_dir/name` with out_dir relative to the current folder (the runs folder
of the project a user works in), and neither out_dir nor name can climb out of it through '..'
unless out_dir is given as an absolute path on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import flat, make_corpus

from difftrain.cli.app import main
from difftrain.errors import RecipeError
from difftrain.recipe import load_recipe
from difftrain.spec import resolve

RECIPE = """\
name: {name}
out_dir: {out_dir}
model: {{arch: diff, d_model: 32, n_layers: 2, n_heads: 4, max_seq_len: 32}}
data: {{sources: [{source}], val_windows: 0, cache_dir: {cache}}}
tokenizer: {{train: {{vocab_size: 320}}}}
train: {{max_steps: 1, micro_batch_size: 2}}
logging: {{progress: false, tensorboard: false}}
"""


@pytest.fixture()
def project(tmp_path, monkeypatch):
    """tmp/proj/{recipe.yaml, corpus/} and a decoy tmp/elsewhere/corpus/ as the current folder."""
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    proj.mkdir()
    elsewhere.mkdir()
    make_corpus(proj, n_docs=12)
    (elsewhere / "corpus").mkdir()
    (elsewhere / "corpus" / "decoy.py").write_text("decoy = 1\n")
    monkeypatch.chdir(elsewhere)

    def recipe(name="r", out_dir="runs", source="corpus", where=proj) -> Path:
        p = where / f"{name}.yaml"
        p.write_text(RECIPE.format(name=name, out_dir=out_dir, source=source, cache=tmp_path / "cache"))
        return p

    return tmp_path, recipe


def test_data_sources_are_found_next_to_the_recipe_not_in_the_current_folder(project, capsys):
    root, recipe = project
    assert main(["prepare", str(recipe())]) == 0
    out = flat(capsys.readouterr().out)
    assert "documents 12" in out  # the 12 files of proj/corpus, not the decoy


def test_extends_is_resolved_against_the_recipe_file(project):
    root, recipe = project
    base = recipe("base")
    child = root / "proj" / "variants" / "child.yaml"
    child.parent.mkdir()
    child.write_text("extends: ../base.yaml\nname: child\n")
    r = load_recipe(child)
    assert r.name == "child" and r.model.d_model == 32
    assert load_recipe(base).recipe_dir == (root / "proj").resolve()


def test_a_relative_cache_dir_is_next_to_the_recipe_and_absolute_in_the_run(project):
    # it started at the current folder, and the run's recipe.yaml kept it relative: a resume
    # from another folder made a new cache there and tokenized the data again
    root, recipe = project
    p = recipe()
    p.write_text(p.read_text().replace(f"cache_dir: {root / 'cache'}", "cache_dir: mycache"))
    assert load_recipe(p).data.cache_dir == str((root / "proj" / "mycache").resolve())
    child = root / "proj" / "variants" / "child.yaml"  # a parent's, from the parent's folder
    child.parent.mkdir()
    child.write_text("extends: ../r.yaml\nname: child\n")
    assert load_recipe(child).data.cache_dir == str((root / "proj" / "mycache").resolve())
    # typed on the command line: from the folder it was typed in, as a data path there is
    assert load_recipe(p, ["data.cache_dir=here"]).data.cache_dir == str(
        (root / "elsewhere" / "here").resolve()
    )
    assert main(["prepare", str(p)]) == 0
    assert (root / "proj" / "mycache" / "shards").is_dir() and not (root / "elsewhere" / "mycache").exists()
    # a recipe built in memory follows the same rule (the recipe_dir it is given)
    import yaml

    from difftrain.recipe import recipe_from_dict

    data = yaml.safe_load(p.read_text())
    assert recipe_from_dict(data, root / "proj").data.cache_dir == str((root / "proj" / "mycache").resolve())


def test_a_linked_recipe_reads_its_parent_and_its_data_from_the_folder_of_the_file_it_links_to(project):
    # data paths started at the linked file's folder and `extends:` at the link's: two rules
    root, recipe = project
    recipe("base")
    child = root / "proj" / "variants" / "child.yaml"
    child.parent.mkdir()
    child.write_text("extends: ../base.yaml\nname: child\n")
    links = root / "links" / "deep"
    links.mkdir(parents=True)
    (links / "child.yaml").symlink_to(child)
    r = load_recipe(links / "child.yaml")
    assert r.name == "child" and r.data.sources[0].source == str((root / "proj" / "corpus").resolve())
    assert r.recipe_dir == child.parent.resolve()


def test_a_relative_out_dir_is_under_the_current_folder(project):
    root, recipe = project
    assert resolve(load_recipe(recipe())).run_dir.resolve() == (root / "elsewhere" / "runs" / "r").resolve()


@pytest.mark.parametrize("out_dir", ["..", "../runs", "runs/../../x", "./../runs"])
def test_out_dir_cannot_climb_out_through_dotdot(project, out_dir, capsys):
    root, recipe = project
    with pytest.raises(RecipeError, match="climbs out of the current folder"):
        resolve(load_recipe(recipe(out_dir=out_dir)))
    assert main(["pretrain", str(recipe(out_dir=out_dir)), "--dry-run"]) == 2
    assert main(["pretrain", str(recipe()), f"out_dir={out_dir}"]) == 2
    assert "climbs out" in capsys.readouterr().err
    assert not (root / "runs").exists() and not (root / "x").exists()


@pytest.mark.parametrize("name", ["..", "../x", "a/b", "/etc", "a\\\\b", "''"])
def test_a_run_name_is_a_plain_folder_name(project, name, capsys):
    root, recipe = project
    assert main(["pretrain", str(recipe()), f"name={name}", "--dry-run"]) == 2
    assert "name" in capsys.readouterr().err


def test_an_absolute_out_dir_is_allowed_on_purpose(project, capsys):
    root, recipe = project
    target = root / "shared-runs"
    r = load_recipe(recipe(out_dir=str(target)))
    assert resolve(r).run_dir == target / "r"
    assert main(["pretrain", str(recipe(out_dir=str(target))), "--no-progress"]) == 0
    assert (target / "r" / "model.safetensors").is_file()
    # the run went where out_dir says: no runs/ next to the recipe or in the current folder
    assert not (root / "elsewhere" / "runs").exists() and not (root / "proj" / "runs").exists()


def test_a_run_recipe_makes_local_hf_folders_absolute_and_leaves_hub_names_alone(project):
    root, recipe = project
    proj = root / "proj"
    (proj / "saved").mkdir()
    p = recipe(
        source="'hf:./saved@test', 'hf:~/ds:cfg', 'hf:wikitext:wikitext-2-raw-v1@train', "
        "{source: 'hf:json', data_files: [corpus/a.jsonl]}, corpus"
    )
    r = load_recipe(p).with_absolute_paths()
    src = [s.source for s in r.data.sources]
    assert src[0] == f"hf:{(proj / 'saved').resolve()}@test"  # not the current folder's ./saved
    assert src[1] == "hf:~/ds:cfg"  # absolute already, kept as written (as path sources are)
    assert src[2:4] == ["hf:wikitext:wikitext-2-raw-v1@train", "hf:json"]  # hub names and builders
    assert r.data.sources[3].data_files == [str(proj.resolve() / "corpus/a.jsonl")]
    assert src[4] == str(proj.resolve() / "corpus")
    assert r.data.sources[0].hf_parts() == (str((proj / "saved").resolve()), None, "test")
