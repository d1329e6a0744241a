"""`difftrain compare`: the side-by-side table, shared suites, curves, and refusals."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from test_eval import make_run

from difftrain.cli.app import main
from difftrain.errors import ConfigError, RunDirError
from difftrain.evals import EvalOptions, evaluate, save_result
from difftrain.evals.compare import compare_runs
from difftrain.rundir import load_run


def write_training_files(
    run, *, tokens_per_step: int, seconds_per_step: float, loss0: float, params: int, resumed: bool = False
) -> None:
    """summary.json and metrics.csv as `difftrain pretrain` writes them (same columns)."""
    rows = []
    for step in range(1, 11):
        loss = loss0 / (1 + 0.1 * step)
        row = {
            "step": step,
            "train/loss": loss,
            "train/tokens": step * tokens_per_step,
            "train/time_s": step * seconds_per_step,
        }
        if step % 5 == 0:
            row["val/loss"] = loss + 0.05
        rows.append(row)
    keys = ["step", "train/loss", "train/time_s", "train/tokens", "val/loss"]
    with open(run / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    summary = {
        "name": run.name,
        "params": params,
        "steps": 10,
        "tokens": 10 * tokens_per_step,
        "wall_time_s": 10 * seconds_per_step + 1.0,
        # a resumed run: the last session's wall time, all sessions' training time (older
        # summaries have no train_time_s)
        **({"wall_time_s": 3.0, "train_time_s": 10 * seconds_per_step} if resumed else {}),
        "tokens_per_s": tokens_per_step / seconds_per_step,
        "final_train_loss": rows[-1]["train/loss"],
        "final_val_loss": rows[-1]["val/loss"],
        "best_val_loss": min(r["val/loss"] for r in rows if "val/loss" in r),
    }
    (run / "summary.json").write_text(json.dumps(summary))


def read_corpus_of(run, other) -> None:
    """Point run's recipe at the data sources of `other` (make_run gives each folder its own)."""
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["data"]["sources"] = yaml.safe_load((other / "recipe.yaml").read_text())["data"]["sources"]
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    a = make_run(root, "a-diff", "diff")
    b = make_run(root, "b-base", "baseline", tokenizer=load_run(a).tokenizer)
    write_training_files(
        a, tokens_per_step=1000, seconds_per_step=2.0, loss0=6.0, params=61_000, resumed=True
    )
    write_training_files(b, tokens_per_step=1000, seconds_per_step=1.0, loss0=6.5, params=60_000)
    for run in (a, b):
        save_result(run, evaluate(load_run(run), "ppl", EvalOptions(windows=2)))
    save_result(a, evaluate(load_run(a), "icl-order", EvalOptions(demos=2, permutations=2, items=2)))
    return a, b


def test_compare_puts_training_figures_and_every_shared_suite_side_by_side(pair):
    a, b = pair
    cmp = compare_runs([a, b])
    rows = {r.name: r for r in cmp.training}
    assert rows["params"].values == [61_000, 60_000]
    assert rows["tokens"].values == [10_000, 10_000]
    assert rows["training time (s)"].values == [20.0, 11.0] and rows["training time (s)"].best() == 1
    assert rows["tokens/s"].values == [500.0, 1000.0] and rows["tokens/s"].best() == 1
    assert rows["final val loss"].values == pytest.approx([6.0 / 2 + 0.05, 6.5 / 2 + 0.05])
    assert rows["final val loss"].best() == 0 and rows["best val loss"].best() == 0
    assert rows["arch"].values == ["diff", "baseline"]
    assert list(cmp.suites) == ["ppl"]  # icl-order exists in one run only
    assert cmp.partial == {"icl-order": ["b-base"]}
    ppl = {r.name: r for r in cmp.suites["ppl"]}
    for i, run in enumerate((a, b)):
        stored = json.loads((run / "eval" / "ppl.json").read_text())
        assert ppl["loss"].values[i] == stored["results"]["loss"]
    assert not cmp.notes


def test_compare_cli_prints_the_table_and_writes_the_curves(pair, tmp_path, capsys):
    a, b = pair
    png = tmp_path / "curves.png"
    assert main(["compare", str(a), str(b), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert "a-diff" in out and "b-base" in out and "final val loss" in out and "bits/byte" in out
    assert str(png) in out
    assert "`icl-order` is not in every run (missing in b-base)" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_compare_plot_format_follows_the_suffix_and_an_unknown_one_is_refused_first(pair, tmp_path, capsys):
    a, b = pair
    svg = tmp_path / "curves.SVG"
    assert main(["compare", str(a), str(b), "--plot", str(svg)]) == 0
    assert b"<svg" in svg.read_bytes()[:2000]
    capsys.readouterr()
    for bad, why in (("curves.txt", "ends in '.txt'"), ("curves", "has no suffix")):
        assert main(["compare", str(a), str(b), "--plot", str(tmp_path / "new" / bad)]) == 2
        out, err = capsys.readouterr()
        assert why in err and ".png, .svg, .pdf" in err and "Traceback" not in err
        assert out == ""  # refused before the table is printed
    assert not (tmp_path / "new").exists()  # and nothing was written
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "adir.png").mkdir()
    for bad, why in (
        (tmp_path / "afile" / "c.png", "afile is not a folder; choose another path"),
        (tmp_path / "adir.png", "is a folder; name a file in it"),
        (Path("/proc/c.png"), "cannot write the figure"),
    ):
        assert main(["compare", str(a), str(b), "--plot", str(bad)]) == 2
        out, err = capsys.readouterr()
        assert why in err and len(err.strip().splitlines()) == 1 and out == ""
    assert (tmp_path / "afile").read_text() == "mine"


def test_compare_json_holds_rows_with_a_value_per_run(pair, capsys):
    a, b = pair
    assert main(["compare", str(a), str(b), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in doc["runs"]] == ["a-diff", "b-base"]
    assert all(len(r["values"]) == 2 for r in doc["training"] + doc["suites"]["ppl"])


def test_a_run_named_dot_is_labelled_by_its_folder_name(pair, capsys, monkeypatch):
    a, b = pair
    monkeypatch.chdir(a)
    assert main(["compare", ".", str(b), "--json"]) == 0
    assert [r["label"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["a-diff", "b-base"]
    monkeypatch.chdir(a / "eval")
    assert main(["compare", "..", str(b), "--json"]) == 0
    assert [r["label"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["a-diff", "b-base"]


def test_compare_notes_results_computed_with_different_settings(pair, tmp_path):
    a, _ = pair
    c = make_run(tmp_path, "c", "diff2", tokenizer=load_run(a).tokenizer)
    save_result(c, evaluate(load_run(c), "ppl", EvalOptions(windows=3)))
    cmp = compare_runs([a, c])
    assert any(
        "ppl: a-diff and c were evaluated with different settings (windows 2 vs 3)" in n for n in cmp.notes
    )
    # the note gives the command that evaluates c as a-diff was; run, it evens them out
    note = next(n for n in cmp.notes if "different settings" in n)
    assert f"`difftrain eval {c} --suite ppl --windows 2` evaluates c as a-diff was" in note
    assert main(["eval", str(c), "--suite", "ppl", "--windows", "2"]) == 0
    assert not any("different settings" in n for n in compare_runs([a, c]).notes)
    assert any("c has no summary.json" in n for n in cmp.notes)


def test_runs_with_different_tokenizers_are_not_ranked_by_per_token_figures(pair, tmp_path):
    """A token is another unit in each: loss and ppl are shown unranked, with a note; bits/byte
    and the figures that are no per-token ones are still ranked."""
    a, _ = pair
    from difftrain.data.config import TokenizerTrainConfig
    from difftrain.data.tokenizer import train_tokenizer

    texts = [" ".join(f"word{i % 97} w{i % 13}" for i in range(j, j + 400)) for j in range(30)]
    own = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300))
    c = make_run(tmp_path, "c-own", "diff", tokenizer=own)
    assert (c / "tokenizer.json").read_bytes() != (a / "tokenizer.json").read_bytes()
    write_training_files(c, tokens_per_step=1000, seconds_per_step=1.0, loss0=7.0, params=61_000)
    save_result(c, evaluate(load_run(c), "ppl", EvalOptions(windows=2)))
    cmp = compare_runs([a, c])
    (note,) = [n for n in cmp.notes if "different tokenizers" in n]
    assert "a-diff" in note and "c-own" in note and "bits/byte compares the runs" in note
    rows = {r.name: r for r in cmp.training}
    assert rows["final val loss"].best() is None and rows["best val loss"].best() is None
    assert rows["tokens/s"].best() is not None
    ppl = {r.name: r for r in cmp.suites["ppl"]}
    assert ppl["loss"].best() is None and ppl["ppl"].best() is None and ppl["bits/byte"].best() is not None


def test_suites_chosen_with_suite_get_no_not_in_every_run_note(pair):
    a, b = pair
    assert compare_runs([a, b]).partial == {"icl-order": ["b-base"]}
    assert compare_runs([a, b], suites=["ppl"]).partial == {}  # the user chose; before: "missing in " (empty)


def test_a_result_is_stale_when_the_weights_change_not_when_the_run_is_copied(pair, tmp_path):
    a, b = pair
    copy = tmp_path / "a-copy"
    shutil.copytree(a, copy, copy_function=shutil.copyfile)  # `cp -r`: new modification times
    assert not compare_runs([copy, b]).notes  # the same weights: its results still hold
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # another step's weights, the same size
    weights.write_bytes(bytes(data))
    notes = compare_runs([copy, b]).notes
    assert any("the result of a-copy predates its current weights" in n for n in notes), notes
    shutil.copyfile(a / "model.safetensors", weights)  # the evaluated weights again, a new time
    assert not compare_runs([copy, b]).notes
    doc = json.loads((copy / "eval" / "ppl.json").read_text())
    del doc["weights"]["sample"]  # a result written before the sample was kept: the time decides
    (copy / "eval" / "ppl.json").write_text(json.dumps(doc))
    assert compare_runs([copy, b]).notes
    os.utime(weights, ns=(doc["weights"]["mtime_ns"], doc["weights"]["mtime_ns"]))
    assert not compare_runs([copy, b]).notes


def test_an_imported_run_is_noted_as_imported_not_unfinished(pair, tmp_path):
    from difftrain.io import atomic_save_safetensors
    from difftrain.rundir import read_safetensors

    a, b = pair
    imp = tmp_path / "imp"
    shutil.copytree(a, imp)
    (imp / "summary.json").unlink()
    sd = read_safetensors(imp / "model.safetensors")
    atomic_save_safetensors(
        imp / "model.safetensors", sd, metadata={"format": "pt", "imported_from": "hf/qs"}
    )
    notes = compare_runs([imp, b]).notes
    assert any(
        "imp was imported from hf/qs (`difftrain import`): it has no training figures" in n for n in notes
    )
    assert not any("training unfinished" in n for n in notes)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_compare_refusals_are_one_line_with_exit_code_2(pair, tmp_path, capsys):
    a, b = pair
    assert main(["compare", str(a)]) == 2
    assert "compare needs two or more run directories" in _error(capsys)
    assert main(["compare", str(a), str(b), str(a) + "/"]) == 2
    assert "are the same run; compare different runs" in _error(capsys)
    assert main(["compare", str(a), str(b), "--suite", "icl-order"]) == 2
    assert f"{b} has no `icl-order` result" in _error(capsys)
    assert main(["compare", str(a), str(b), "--suite", "needel"]) == 2
    assert "did you mean `needle`?" in _error(capsys)
    assert main(["compare", str(a), str(tmp_path / "nope")]) == 2
    assert "no run directory" in _error(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(a), str(tmp_path / "empty")]) == 2
    assert "is not a difftrain run directory" in _error(capsys)


def test_a_stopped_run_is_noted_with_the_command_that_finishes_it(pair, tmp_path):
    a, b = pair
    stopped = tmp_path / "stopped run"
    shutil.copytree(a, stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps({**summary, "steps": 6, "finished": False}))
    (stopped / "recipe.yaml").write_text((stopped / "recipe.yaml").read_text() + "finetune: null\n")
    notes = compare_runs([stopped, b]).notes
    assert any(
        "stopped run stopped at step 6, before the end of its training" in n
        and f"`difftrain pretrain '{stopped}' --resume` finishes it" in n
        for n in notes
    ), notes
    assert not compare_runs([a, b]).notes  # finished runs: no note
    from difftrain.io import RunLock

    lock = RunLock(stopped)
    assert lock.acquire() is None
    try:
        assert any(
            "stopped run is still training: its final figures are those of step 6" in n
            for n in compare_runs([stopped, b]).notes
        )
    finally:
        lock.release()


def test_a_lock_file_that_cannot_be_read_is_a_note_not_a_failed_compare(pair, tmp_path, monkeypatch):
    from difftrain.errors import DifftrainError
    from difftrain.io import RunLock

    a, b = pair
    stopped = tmp_path / "stopped"
    shutil.copytree(a, stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps({**summary, "steps": 6, "finished": False}))

    def unreadable(self):  # as another user's lock file without read permission
        raise DifftrainError(f"cannot open {self.path}: permission denied")

    monkeypatch.setattr(RunLock, "holder", unreadable)
    cmp = compare_runs([stopped, b])
    assert any(
        "stopped stopped at step 6 or is still training (its lock file cannot be read" in n for n in cmp.notes
    )
    assert list(cmp.suites) == ["ppl"]  # its results are still compared


def test_a_context_length_difference_is_noted_without_advice_no_option_can_follow(pair, tmp_path):
    a, _ = pair
    short = make_run(tmp_path, "short", "diff", tokenizer=load_run(a).tokenizer, max_seq_len=64)
    read_corpus_of(short, a)  # the same validation data: the context length is the only difference
    save_result(short, evaluate(load_run(short), "ppl", EvalOptions(windows=2)))
    notes = [n for n in compare_runs([a, short]).notes if n.startswith("ppl:")]
    assert notes == [
        "ppl: a-diff and short were evaluated at different context lengths (seq_len 160 vs 64: each model's "
        "max_seq_len), which no eval option changes; compare them with that in mind"
    ]


def test_eval_on_another_source_keeps_the_validation_result_and_compare_shows_both(pair, tmp_path, capsys):
    import random

    from test_eval import filler_sentence

    a0, b0 = pair
    a, b = tmp_path / a0.name, tmp_path / b0.name
    shutil.copytree(a0, a)
    shutil.copytree(b0, b)
    val = (a / "eval" / "ppl.json").read_bytes()
    src = tmp_path / "texts" / "wiki.txt"
    src.parent.mkdir()
    src.write_text(" ".join(filler_sentence(random.Random(3)) for _ in range(80)))
    assert (
        main(["eval", str(a), "--suite", "ppl,needle", "--data", str(src), "--windows", "2", "--no-plot"])
        == 0
    )
    assert "ppl@wiki.json" in capsys.readouterr().out
    assert (a / "eval" / "ppl.json").read_bytes() == val  # the validation-split result is kept
    doc = json.loads((a / "eval" / "ppl@wiki.json").read_text())
    assert doc["suite"] == "ppl" and doc["label"] == "wiki" and doc["settings"]["data"] == str(src)
    assert json.loads((a / "eval" / "needle.json").read_text())["label"] is None  # needle reads no --data

    cmp = compare_runs([a, b])  # b lacks ppl@wiki: a note with the command that makes it
    assert list(cmp.suites) == ["ppl"] and cmp.partial == {
        "ppl@wiki": ["b-base"],
        "needle": ["b-base"],
        "icl-order": ["b-base"],
    }
    # with the options and precision a-diff's result was measured with, not today's defaults
    assert (
        cmp.commands["ppl@wiki"] == f"difftrain eval RUN --suite ppl --data {src} --windows 2 --dtype float32"
    )
    with pytest.raises(
        RunDirError, match=f"has no `ppl@wiki` result .*--suite ppl --data {src} --windows 2 --dtype float32`"
    ):
        compare_runs([a, b], ["ppl@wiki"])

    assert main(["eval", str(b), "--data", str(src), "--windows", "2"]) == 0
    capsys.readouterr()
    cmp = compare_runs([a, b])
    assert list(cmp.suites) == ["ppl", "ppl@wiki"] and cmp.partial == {
        "needle": ["b-base"],
        "icl-order": ["b-base"],
    }
    wiki = {r.name: r.values for r in cmp.suites["ppl@wiki"]}
    own = {r.name: r.values for r in cmp.suites["ppl"]}
    assert wiki["loss"] != own["loss"]
    assert wiki["loss"][1] == json.loads((b / "eval" / "ppl@wiki.json").read_text())["results"]["loss"]
    assert list(compare_runs([a, b], ["PPL@wiki"]).suites) == ["ppl@wiki"]

    # an explicit label, and the refusals
    assert main(["eval", str(a), "--data", str(src), "--data-label", "wiki-2", "--windows", "2"]) == 0
    assert (a / "eval" / "ppl@wiki-2.json").is_file()
    capsys.readouterr()
    for args, why in (
        (["--data-label", "x"], "give --data SOURCE with it"),
        (["--data", str(src), "--data-label", "../up"], "--data-label '../up' must be"),
        (["--data", str(src), "--suite", "needle"], "--data applies to the suites that read text"),
    ):
        assert main(["eval", str(a), *args]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err
    # a label no result file can have is refused as written, not sent looking outside eval/
    for argv in (
        ["eval", str(a), "--show", "--suite", "ppl@../up"],
        ["compare", str(a), str(b), "-s", "ppl@../up"],
    ):
        assert main(argv) == 2
        assert "--suite ppl@../up: the label '../up' must be 1-64 letters" in capsys.readouterr().err
    assert sorted(p.name for p in (a / "eval").glob("ppl*.json")) == [
        "ppl.json",
        "ppl@wiki-2.json",
        "ppl@wiki.json",
    ]
    # a source typed relative, read through --text-field: the command names it absolute (it works
    # from any folder) and with the field (without it the rerun failed on the records)
    (tmp_path / "notes.jsonl").write_text(
        "".join(json.dumps({"body": filler_sentence(random.Random(i))}) + "\n" for i in range(40))
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["eval", str(a), "--data", "notes.jsonl", "--text-field", "body", "--windows", "1"]) == 0
    finally:
        os.chdir(cwd)
    capsys.readouterr()
    assert compare_runs([a, b]).commands["ppl@notes"] == (
        f"difftrain eval RUN --suite ppl --data {tmp_path / 'notes.jsonl'} --text-field body --windows 1 --dtype float32"
    )


def test_data_labels_name_the_source():
    from difftrain.evals.common import data_label

    cases = {
        "builtin:tiny-stories": "tiny-stories",
        "data/wiki.txt": "wiki",
        "data/*.txt": "data",
        "hf:wikitext:wikitext-2-raw-v1@test": "wikitext-wikitext-2-raw-v1-test",
        "hf:org/set": "set",
        "notes/my file.jsonl": "my-file",
        "**/*.md": "data",
        "données/日本語 ファイル.txt": "日本語-ファイル",  # letters of any script name a result
        "café.txt": "café",
    }
    assert {s: data_label(s) for s in cases} == cases


def test_a_label_may_hold_letters_of_any_script_and_a_literal_bracket_file_names_itself(
    tmp_path, monkeypatch
):
    from difftrain.evals.common import check_label, data_label

    assert check_label("日本") == "日本" and check_label("wiki-2") == "wiki-2"
    for bad in ("_x", "../up", "a/b", "x.json", ""):
        with pytest.raises(ConfigError, match="must be 1-64 letters"):
            check_label(bad)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes[1].txt").write_text("x")  # a file whose name holds glob characters
    assert data_label("notes[1].txt") == "notes-1" and data_label("other[1].txt") == "data"


def test_compare_notes_results_measured_on_different_data_or_at_different_precisions(pair, tmp_path, capsys):
    import random

    from test_eval import filler_sentence

    a, _ = pair
    other = make_run(tmp_path, "other", "diff", tokenizer=load_run(a).tokenizer)
    corpus = tmp_path / "other-corpus"
    corpus.mkdir()
    (corpus / "x.txt").write_text(" ".join(filler_sentence(random.Random(9)) for _ in range(400)))
    recipe = yaml.safe_load((other / "recipe.yaml").read_text())
    recipe["data"]["sources"] = [str(corpus)]
    (other / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    save_result(other, evaluate(load_run(other, dtype=torch.bfloat16), "ppl", EvalOptions(windows=2)))
    doc = json.loads((other / "eval" / "ppl.json").read_text())
    # both say `data: validation`; what the split was drawn from tells them apart
    assert doc["settings"]["data"] == "validation" and doc["settings"]["sources"] == [str(corpus)]
    a_corpus = yaml.safe_load((a / "recipe.yaml").read_text())["data"]["sources"][0]
    notes = [n for n in compare_runs([a, other]).notes if n.startswith("ppl:")]
    assert notes == [
        f"ppl: a-diff and other were measured on different data (the validation split of {a_corpus} vs the "
        f"validation split of {corpus}); to rank them on the same text, evaluate both on one source neither "
        "trained on, `difftrain eval RUN --suite ppl --data PATH`, and compare the `ppl@<label>` results",
        f"ppl: a-diff was evaluated in float32 and other in bfloat16; rerun `difftrain eval {other} --suite ppl "
        "--windows 2 --dtype float32` to compare them at one precision",
    ]
    # the same sources split with another seed: other documents, and the note names the seeds
    reseeded = tmp_path / "reseeded"
    shutil.copytree(a, reseeded)
    recipe = yaml.safe_load((reseeded / "recipe.yaml").read_text())
    recipe["seed"] += 1
    (reseeded / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    save_result(reseeded, evaluate(load_run(reseeded), "ppl", EvalOptions(windows=2)))
    fraction = recipe["data"]["val_fraction"]
    notes = [n for n in compare_runs([a, reseeded]).notes if n.startswith("ppl:")]
    assert notes == [
        f"ppl: a-diff and reseeded were measured on different data (the validation split of {a_corpus} "
        f"(seed {recipe['seed'] - 1}, val_fraction {fraction:g}) vs the validation split of {a_corpus} "
        f"(seed {recipe['seed']}, val_fraction {fraction:g})); to rank them on the same text, evaluate both on "
        "one source neither trained on, `difftrain eval RUN --suite ppl --data PATH`, and compare the "
        "`ppl@<label>` results",
    ]
    # --show says the precision; the suggested rerun replaces the result, says so, and the note goes
    assert main(["eval", str(other), "--show", "--suite", "ppl"]) == 0
    assert " on cpu in bfloat16" in capsys.readouterr().out
    assert main(["eval", str(other), "--suite", "ppl", "--windows", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "ppl.json (float32, " in out and "s; replaced the bfloat16 result)" in out
    assert not any("precision" in n for n in compare_runs([a, other]).notes)

    # results written before `sources` was recorded still compare, by the text they name
    for run in (a, other):
        shutil.copytree(run, tmp_path / "old" / run.name)
    old_a, old_other = tmp_path / "old" / a.name, tmp_path / "old" / "other"
    for run in (old_a, old_other):
        stored = json.loads((run / "eval" / "ppl.json").read_text())
        del stored["settings"]["sources"]
        (run / "eval" / "ppl.json").write_text(json.dumps(stored))
    notes = [n for n in compare_runs([old_a, old_other]).notes if n.startswith("ppl:")]
    assert (
        len(notes) == 1 and f"different data (validation split of {a_corpus} vs validation split" in notes[0]
    )
    del stored["results"]["source"]  # nothing says what other's split was drawn from: unknown, not different
    (old_other / "eval" / "ppl.json").write_text(json.dumps(stored))
    notes = [n for n in compare_runs([old_a, old_other]).notes if n.startswith("ppl:")]
    assert notes == [
        "ppl: the result of other does not record what its validation split was drawn from (an older difftrain "
        "wrote it), so a-diff and other may have been measured on different data; rerun `difftrain eval RUN "
        "--suite ppl` on it to record that"
    ]


def test_the_best_run_is_judged_on_the_figures_shown_so_rounding_noise_picks_no_winner():
    from difftrain.evals.compare import Row

    assert Row("Δloss@4", [5.4e-7, 3.7e-7, -1.37e-6], "lower", "+.4f").best() is None  # all +0.0000
    assert Row("loss", [4.1234, 4.1236], "lower", ".4f").best() == 0
    assert Row("tokens/s", [1000.4, 1000.3], "higher", ",.0f").best() is None
    assert Row("tokens/s", [1001.0, 1000.3], "higher", ",.0f").best() == 0
    assert Row("count", [3, 5], "higher", "").best() == 1  # no fixed-point format: compared as they are


def test_a_figure_that_rounds_to_zero_prints_without_a_minus_sign():
    from difftrain.cli.compare import _cell

    assert _cell(-1.37e-6, "+.4f") == "+0.0000" and _cell(-0.5, "+.4f") == "-0.5000"
    assert _cell(-3.0, ".4f") == "-3.0000" and _cell(-1e-9, ".2%") == "0.00%"
