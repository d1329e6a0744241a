"""Damaged checkpoints are detected, skipped with a warning, and never the only one kept.

A run with checkpoints at steps 2, 4 and 6 is trained once; each case copies it and damages it:
truncated, bit-flipped (header, middle, end), emptied, deleted while listed, a damaged or lost
index, several damaged at once, all damaged. Weights that do not fit the config (a tensor of
another shape, a missing or an extra tensor; a checkpoint copied from a different model) are
refused with an error that names the tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_checkpoints_verify, flat, read_json, resume_point, write_recipe
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from difftrain.cli.app import main
from difftrain.errors import CheckpointError
from difftrain.recipe import load_recipe
from difftrain.rundir import load_run, read_safetensors
from difftrain.train.checkpoint import find_resume_checkpoint, read_index, record_checkpoint, step_file
from difftrain.train.run import pretrain


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data):
    """A finished 6-step run with checkpoints at 2, 4, 6, trained with `out_dir: runs` (relative
    to the current folder), so that a copy under another folder is the same run there."""
    root = tmp_path_factory.mktemp("integrity")
    corpus, cache = shared_data
    recipe = write_recipe(
        root, "base", steps=6, save_every=2, keep=3, out=Path("runs"), corpus=corpus, cache=cache
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        pretrain(load_recipe(recipe))
    return recipe, root / "runs" / "base"


@pytest.fixture()
def run_copy(trained, tmp_path, monkeypatch):
    """A private copy of the trained run at tmp_path/runs/base, with the current folder tmp_path."""
    recipe, run = trained
    monkeypatch.chdir(tmp_path)
    dest = tmp_path / "runs" / "base"
    shutil.copytree(run, dest)
    return recipe, dest


def _truncate(frac: float):
    def damage(p: Path) -> None:
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * frac)])

    return damage


def _flip(where: str):
    def damage(p: Path) -> None:
        data = bytearray(p.read_bytes())
        i = {"header": 0, "middle": len(data) // 2, "end": len(data) - 1}[where]
        data[i] ^= 0x01  # one bit
        p.write_bytes(bytes(data))

    return damage


def _replace_file(p: Path) -> None:
    """Rewrite the file (new inode) so last.ckpt, a hard link, keeps the old contents."""
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x80
    p.unlink()
    p.write_bytes(bytes(data))


DAMAGES = {
    "truncated-half": _truncate(0.5),
    "truncated-to-empty": _truncate(0.0),
    "truncated-last-byte": lambda p: p.write_bytes(p.read_bytes()[:-1]),
    "bitflip-header": _flip("header"),
    "bitflip-middle": _flip("middle"),
    "bitflip-end": _flip("end"),
    "bitflip-new-inode": _replace_file,
    "deleted-but-listed": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(run_copy, damage):
    _, run = run_copy
    DAMAGES[damage](run / "checkpoints" / step_file(6))
    point = resume_point(run)
    assert point.step == 4 and point.path.name == step_file(4)
    assert len(point.warnings) == 1 and step_file(6) in point.warnings[0]
    assert ("missing" if damage == "deleted-but-listed" else "damaged") in point.warnings[0]


def test_resume_warns_and_continues_from_the_previous_checkpoint(run_copy, capsys):
    recipe, run = run_copy
    _flip("middle")(run / "checkpoints" / step_file(6))
    assert main(["pretrain", str(recipe), "--resume", "train.max_steps=7", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "resuming from step 4" in flat(out)
    assert "warning:" in err and f"{step_file(6)} is damaged" in err
    assert read_json(run / "summary.json")["steps"] == 7
    # step 6 was written again (save_every=2) over the damaged file; the index lists good files
    assert_checkpoints_verify(run)
    assert [e["step"] for e in read_index(run / "checkpoints")] == [4, 6, 7]
    assert resume_point(run).warnings == []


def test_two_damaged_checkpoints_fall_back_two_steps(run_copy):
    _, run = run_copy
    _truncate(0.3)(run / "checkpoints" / step_file(6))
    _flip("middle")(run / "checkpoints" / step_file(4))
    point = resume_point(run)
    assert point.step == 2 and len(point.warnings) == 2
    assert point.warnings[0].endswith(f"; resuming from the older {step_file(2)}")


def test_a_damaged_index_falls_back_to_the_step_files_that_load(run_copy):
    _, run = run_copy
    (run / "checkpoints" / "index.json").write_text('{"checkpoints": [{"file": ')
    _truncate(0.5)(run / "checkpoints" / step_file(6))
    point = resume_point(run)
    assert point.step == 4 and "cannot be loaded" in point.warnings[0]
    # the integrity check is gone with the index: the resume says so rather than go on silently
    assert point.warnings[-1].startswith(
        f"checkpoints/index.json is unreadable: {step_file(4)} was checked by loading it"
    )
    (run / "checkpoints" / "index.json").unlink()
    point = resume_point(run)
    assert point.step == 4 and point.warnings[-1].startswith("checkpoints/index.json is missing: ")


def test_no_intact_checkpoint_is_an_error_that_says_what_to_do(run_copy, capsys):
    recipe, run = run_copy
    for s in (2, 4, 6):
        _flip("middle")(run / "checkpoints" / step_file(s))
    with pytest.raises(CheckpointError, match="no intact checkpoint.*--overwrite"):
        find_resume_checkpoint(run / "checkpoints")
    assert main(["pretrain", str(recipe), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err and "falling back" not in err and "resuming from" not in err


def test_pruning_never_deletes_the_only_good_checkpoint(run_copy, capsys):
    """keep_checkpoints=1 after resuming past a damaged newest checkpoint: the old pruning sorted
    the new step-5 before the damaged step-6 and deleted it, keeping only the damaged file."""
    recipe, run = run_copy
    _flip("middle")(run / "checkpoints" / step_file(6))
    argv = ["pretrain", str(recipe), "--resume", "--no-progress"]
    assert main([*argv, "train.keep_checkpoints=1", "train.save_every=1", "train.max_steps=5"]) == 0
    files = sorted(p.name for p in (run / "checkpoints").glob("step-*.ckpt"))
    assert files == [step_file(5)]
    point = resume_point(run)
    assert point.step == 5 and point.warnings == []


# -- the pruning rule under any sequence of saves, damages and resumes -------------------------


@settings(settings.get_profile("reliability"), max_examples=60)
@given(
    keep=st.integers(1, 3),
    ops=st.lists(
        st.sampled_from(["save", "save", "save", "damage-newest", "damage-random", "resume"]), max_size=25
    ),
    picks=st.randoms(use_true_random=False),
)
def test_record_checkpoint_keeps_a_good_newest_checkpoint_under_any_history(
    tmp_path_factory, keep, ops, picks
):
    d = tmp_path_factory.mktemp("prune")
    step = 0
    for op in ops:
        files = sorted(d.glob("step-*.ckpt"))
        if op == "save":
            step += 1
            p = d / step_file(step)
            p.write_bytes(f"checkpoint {step}".encode() * 10)
            record_checkpoint(d, p, step, keep)
            point = find_resume_checkpoint(d)
            assert point.step == step and point.warnings == []  # the newest save is intact and used
            kept = sorted(d.glob("step-*.ckpt"))
            assert len(kept) <= keep and d / step_file(step) in kept
            assert all(e["step"] <= step for e in read_index(d))
        elif op.startswith("damage") and files:
            victim = files[-1] if op == "damage-newest" else picks.choice(files)
            victim.write_bytes(b"garbage")
        elif op == "resume":
            try:
                point = find_resume_checkpoint(d)
            except CheckpointError:
                point = None  # nothing intact: a user starts again with --overwrite
            step = point.step if point else 0


# -- shapes and keys against the config ----------------------------------------------------


def _rewrite_weights(run: Path, change) -> None:
    sd = read_safetensors(run / "model.safetensors")
    change(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(run / "model.safetensors"), {"step": "6"})


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda sd: sd.update({"model.norm.weight": torch.ones(33)}),
            r"model\.norm\.weight has shape \(33,\)",
        ),
        (
            lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"),
            r"missing 1 tensors \(e\.g\. model\.layers\.1\.mlp",
        ),
        (
            lambda sd: sd.update({"model.layers.2.extra": torch.zeros(1)}),
            r"unexpected tensors \(e\.g\. model\.layers\.2",
        ),
    ],
    ids=["wrong-shape", "missing-tensor", "extra-tensor"],
)
def test_weights_that_do_not_fit_the_config_are_refused_naming_the_tensor(run_copy, change, message):
    _, run = run_copy
    _rewrite_weights(run, change)
    with pytest.raises(CheckpointError, match=message):
        load_run(run)


def test_a_checkpoint_from_a_different_model_is_refused_on_resume(run_copy, tmp_path, capsys, shared_data):
    """A checkpoint copied in from another run (a bigger model), even listed with a matching
    checksum, is refused with an error naming the mismatch — not a traceback."""
    recipe, run = run_copy
    corpus, cache = shared_data
    other = write_recipe(
        tmp_path, "other", steps=2, save_every=2, out=tmp_path / "elsewhere", corpus=corpus, cache=cache
    )
    other.write_text(other.read_text().replace("d_model: 32", "d_model: 64"))
    pretrain(load_recipe(other))
    planted = run / "checkpoints" / step_file(8)
    shutil.copy(tmp_path / "elsewhere" / "other" / "checkpoints" / step_file(2), planted)
    index = json.loads((run / "checkpoints" / "index.json").read_text())
    from difftrain.train.checkpoint import sha256_file

    index["checkpoints"].append({"file": planted.name, "step": 8, "sha256": sha256_file(planted), "bytes": 1})
    (run / "checkpoints" / "index.json").write_text(json.dumps(index))
    assert main(["pretrain", str(recipe), "--resume", "train.max_steps=9", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert step_file(8) in err and "shape" in err and "Traceback" not in err, err
