"""`difftrain prepare`: builds then reuses the cache, prints the figures, fails in one red line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from difftrain.cli.app import main

RECIPE = """\
name: prep
model:
  arch: diff
  d_model: 32
  n_layers: 1
  n_heads: 4
  max_seq_len: 32
  vocab_size: {vocab}
data:
  sources: [corpus, {{source: extra.jsonl, weight: 2}}]
  val_fraction: 0.1
  on_bad_record: skip
  cache_dir: {cache}
tokenizer:
  train: {{vocab_size: 300}}
train:
  max_steps: 10
  micro_batch_size: 2
"""


def write_recipe(tmp_path: Path, vocab: str = "auto") -> Path:
    (tmp_path / "corpus").mkdir()
    for i in range(12):
        (tmp_path / "corpus" / f"{i}.txt").write_text(f"text number {i} " * 30)
    (tmp_path / "extra.jsonl").write_text('{"text": "jsonl record"}\nnot json\n')
    recipe = tmp_path / "prep.yaml"
    recipe.write_text(RECIPE.format(cache=tmp_path / "cache", vocab=vocab))
    return recipe


def test_prepare_prints_the_figures_and_reuses_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    out = capsys.readouterr()
    for label in ("documents", "bytes", "tokens/byte", "train tokens", "val tokens", "time", "cache"):
        assert label in out.out
    assert "13 (" in out.out  # 12 files + 1 good jsonl record
    assert "skipped records" in out.out and "extra.jsonl, line 2: not valid JSON" in out.err
    assert "built now" in out.out and str(tmp_path / "cache") in out.out
    # extra.jsonl has weight 2: its record counts twice in train, and the table says why
    assert "train counts each weighted copy" in out.out and "(weighted copies included)" in out.out
    assert main(["prepare", str(recipe), "data.val_fraction=0.1"]) == 0
    assert "reused from cache" in capsys.readouterr().out
    assert main(["prepare", str(recipe), f"data.sources=[{tmp_path / 'corpus'}]"]) == 0
    assert "weighted" not in capsys.readouterr().out


def test_prepare_says_when_the_trained_tokenizer_is_smaller_than_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["prepare", str(recipe), "--no-progress", "tokenizer.train.vocab_size=5000"]) == 0
    out = capsys.readouterr().out
    size = int(re.search(r"vocabulary\s+(\d+) tokens", out).group(1))
    assert size < 5000 and f"{size} of the 5,000 asked for (tokenizer.train.vocab_size)" in out
    # as many as it can learn asked for: no note
    assert main(["prepare", str(recipe), "--no-progress", f"tokenizer.train.vocab_size={size}"]) == 0
    assert "asked for" not in capsys.readouterr().out
    # a small max_bytes sample, not the data, ran out of pairs: the note says so
    assert main(["prepare", str(recipe), "--no-progress", "tokenizer.train.max_bytes=300"]) == 0
    out = capsys.readouterr().out
    assert "its sample of 300 bytes (tokenizer.train.max_bytes, of " in out and "raise max_bytes" in out


def test_prepare_names_a_loaded_tokenizer_and_counts_the_skipped_records_it_does_not_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")
    (tmp_path / "extra.jsonl").write_text('{"text": "ok"}\n' + "not json\n" * 9)
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    tok = re.search(r"tokenizer\s+(\S+tokenizer\.json)", out).group(1)
    assert err.count("skipped:") == 6 and "… and 4 more in extra.jsonl" in err  # 5 listed of 9
    assert main(["prepare", str(recipe), "--no-progress", f"tokenizer.path={tok}"]) == 0
    out = capsys.readouterr().out
    assert f"(loaded from {tok})" in out and "trained in" not in out


def test_prepare_errors_are_one_red_line_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path)
    assert main(["prepare", str(recipe), "data.sources=[missing_dir]", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "missing_dir does not exist" in err and "Traceback" not in err


def test_prepare_refuses_a_tokenizer_larger_than_the_model_vocab(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path, vocab="256")
    assert main(["prepare", str(recipe), "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(r"has \d+ tokens but model\.vocab_size is 256.*set model\.vocab_size: auto", err)


def test_a_cache_folder_that_cannot_be_made_is_one_line_naming_its_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(["prepare", str(recipe), f"data.cache_dir={tmp_path / 'afile'}"]) == 2
    assert f"afile (data.cache_dir): {tmp_path / 'afile'} is not a folder; set data.cache_dir to" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "afile" / "sub"))
    assert main(["prepare", str(recipe), "data.cache_dir=null"]) == 2
    assert "($DIFFTRAIN_CACHE): " in capsys.readouterr().err
    # the dry run finds it too, and writes nothing
    assert (
        main(["pretrain", str(recipe), "--dry-run", "data.cache_dir=null", f"out_dir={tmp_path / 'runs'}"])
        == 2
    )
    assert "($DIFFTRAIN_CACHE)" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_prepare_sends_a_fine_tuning_recipe_to_its_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    # prepare trained a new tokenizer for it, and read instruction records as text documents
    assert main(["prepare", "finetune-quickstart"]) == 2
    err = capsys.readouterr().err
    assert "finetune-quickstart is a fine-tuning recipe (finetune.base: runs/quickstart)" in err
    assert "`difftrain finetune finetune-quickstart --dry-run`" in err


def test_the_dry_run_checks_the_splits_of_prepared_data_as_the_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", str(recipe), "data.val_fraction=0", "--dry-run"]) == 0  # not prepared:
    assert "not prepared yet" in capsys.readouterr().out  # the run finds out, and the row says so
    for overrides in (["data.val_fraction=0"], []):
        assert main(["prepare", str(recipe), "--no-progress", *overrides]) == 0
    capsys.readouterr()
    # prepared: an empty validation split is refused by the dry run in the run's words
    assert main(["pretrain", str(recipe), "data.val_fraction=0", "--dry-run"]) == 2
    assert "error: the validation split has 0 tokens, fewer than one window of max_seq_len + 1 = 33" in (
        capsys.readouterr().err
    )
    assert main(["pretrain", str(recipe), "data.val_fraction=0", "data.val_windows=0", "--dry-run"]) == 0
    assert main(["pretrain", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"prepared: [\d,]+ training · [\d,]+ validation tokens", out), out
    assert main(["pretrain", str(recipe), "model.max_seq_len=100000", "--dry-run"]) == 2
    assert "the training split has" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_read_only_cache_that_holds_the_prepared_data_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared, read-only cache was refused ("not writable") even where it held every entry the
    run reads; it is refused only where something must be built."""
    import difftrain.io

    recipe = write_recipe(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    capsys.readouterr()
    real = difftrain.io.uncreatable_reason
    cache = tmp_path / "cache"

    def read_only(folder: Path) -> str | None:  # (root may write anywhere: os.access cannot show it)
        inside = Path(folder).absolute() == cache or cache in Path(folder).absolute().parents
        return f"{cache} is not writable" if inside else real(folder)

    monkeypatch.setattr(difftrain.io, "uncreatable_reason", read_only)
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert "reused from cache" in capsys.readouterr().out
    assert main(["pretrain", str(recipe), "--dry-run"]) == 0
    capsys.readouterr()
    for argv in (
        ["prepare", str(recipe), "seed=7", "--no-progress"],
        ["pretrain", str(recipe), "seed=7", "--dry-run"],
    ):
        assert main(argv) == 2  # another split: it must be built, and cannot be
        assert (
            f"cannot use the cache folder {cache} (data.cache_dir): {cache} is not writable"
            in capsys.readouterr().err
        )


def test_record_fields_that_text_reading_would_ignore_are_refused_before_torch_loads(
    tmp_path: Path, cli_probe
) -> None:
    recipe = write_recipe(tmp_path)
    runs = f"out_dir={tmp_path / 'runs'}"
    corpus, extra = tmp_path / "corpus", tmp_path / "extra.jsonl"  # (overrides: from the current folder)
    asks = f"data.sources=[{corpus}, {{source: {extra}, prompt_field: question}}]"
    commands = [
        ["prepare", str(recipe), asks, "--no-progress"],
        ["pretrain", str(recipe), asks, runs, "--dry-run"],
        ["pretrain", str(recipe), asks, runs],
    ]
    done = cli_probe(commands, tmp_path)
    assert done.codes == [2, 2, 2] and done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 3 and all(
        "data.sources[1] (" in e
        and "extra.jsonl) sets prompt_field, which only instruction records of a "
        "fine-tune use; pretraining reads each record's text_field ('text')"
        in e
        for e in errors
    ), errors
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()
    # the defaults spelled out (as a run's recipe.yaml has them) are no mistake
    spelled = f"data.sources=[{corpus}, {{source: {extra}, prompt_field: prompt, response_field: response}}]"
    assert main(["prepare", str(recipe), spelled, "--no-progress"]) == 0
