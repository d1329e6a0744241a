"""Resource faults: a full disk while saving, and CUDA out of memory at the first step.

A full disk is simulated by writers that put part of the bytes on disk and then raise
OSError(ENOSPC), as a real write on a full disk does: for the checkpoint, model.safetensors,
checkpoints/index.json and metrics.csv. Each time the error says "disk full" and names the
file, nothing half-written is left under a final name, and the run resumes from the previous
checkpoint. Out-of-memory is raised from the fault hook at the first step; the CLI answers with
plan-style advice carrying this recipe's numbers, exit code 2, no traceback.
"""

from __future__ import annotations

import errno
import io

import pytest
import torch
from conftest import assert_checkpoints_verify, flat, resume_point, safetensors_step, tmp_leftovers

import difftrain.io
from difftrain.cli.app import main
from difftrain.errors import DifftrainError
from difftrain.recipe import load_recipe
from difftrain.rundir import load_run
from difftrain.train.checkpoint import read_index, step_file
from difftrain.train.run import pretrain


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


class FullAfter:
    """A file-write wrapper: the `nth` write to a file whose name contains `name` writes half of
    its bytes, then fails with ENOSPC."""

    def __init__(self, name: str, nth: int) -> None:
        self.name, self.nth, self.calls = name, nth, 0

    def hit(self, path) -> bool:
        if self.name in str(path):
            self.calls += 1
            return self.calls == self.nth
        return False


def full_checkpoint_disk(monkeypatch, nth: int) -> None:
    real = torch.save
    gate = FullAfter(".ckpt", nth)

    def save(obj, f, *a, **kw):
        if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
            if gate.hit(f):
                buf = io.BytesIO()
                real(obj, buf)
                with open(f, "wb") as out:
                    out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                raise enospc()
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)


def full_safetensors_disk(monkeypatch, nth: int) -> None:
    import safetensors.torch as st

    real = st.save_file
    gate = FullAfter("model.safetensors", nth)

    def save_file(tensors, filename, metadata=None):
        if gate.hit(filename):
            with open(filename, "wb") as out:
                out.write(b"\x00" * 100)
            raise enospc()
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st, "save_file", save_file)


def full_text_disk(monkeypatch, name: str, nth: int) -> None:
    """atomic_write_* open their temporary file with difftrain.io's `open`."""
    gate = FullAfter(name, nth)

    class Full(io.FileIO):
        def write(self, b):
            super().write(bytes(b)[: len(b) // 2])
            raise enospc()

    def fake_open(file, mode="r", *a, **kw):
        if "w" in mode and gate.hit(file):
            return Full(file, "w")
        return open(file, mode, *a, **kw)

    monkeypatch.setattr(difftrain.io, "open", fake_open, raising=False)


FAULTS = {
    "checkpoint": lambda mp: full_checkpoint_disk(mp, 2),
    "model.safetensors": lambda mp: full_safetensors_disk(mp, 2),
    "index.json": lambda mp: full_text_disk(mp, "checkpoints/.index.json", 2),
    "metrics.csv": lambda mp: full_text_disk(mp, "metrics.csv", 2),
}


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_full_disk_while_saving_says_so_and_keeps_the_previous_checkpoint(workspace, monkeypatch, where):
    recipe = load_recipe(workspace(steps=6, save_every=2))
    FAULTS[where](monkeypatch)
    with pytest.raises(DifftrainError, match="disk full while writing") as err:
        pretrain(recipe)
    name = step_file(4) if where == "checkpoint" else where
    assert name in str(err.value) and "intact" in str(err.value)
    monkeypatch.undo()
    run = recipe.run_dir
    assert tmp_leftovers(run) == []  # the half-written temporary file was removed
    assert_checkpoints_verify(run)
    point = resume_point(run)
    # the checkpoint of step 4 is complete when only model.safetensors failed after it
    assert point.step == (4 if where == "model.safetensors" else 2) and point.warnings == []
    assert safetensors_step(run / "model.safetensors") == 2
    load_run(run)  # the weights a user generates from are whole
    # once there is room again, --resume continues from the previous checkpoint to the end
    result = pretrain(load_recipe(recipe.source), resume=True)
    assert result.resumed_from == point.step and result.summary["steps"] == 6
    assert [e["step"] for e in read_index(run / "checkpoints")] == [2, 4, 6]


def test_the_cli_reports_a_full_disk_in_one_line_and_exits_2(workspace, monkeypatch, capsys):
    recipe = workspace(steps=4, save_every=2)
    full_checkpoint_disk(monkeypatch, 1)
    assert main(["pretrain", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("error: disk full while writing") and "Traceback" not in err


def oom_at_first_step(step, loss):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_at_the_first_step_prints_plan_style_advice(workspace, monkeypatch, capsys):
    import difftrain.train.run as run_mod

    real = run_mod.pretrain
    monkeypatch.setattr(run_mod, "pretrain", lambda *a, **kw: real(*a, **kw, fault_hook=oom_at_first_step))
    recipe = workspace(steps=4, save_every=2)
    argv = ["pretrain", str(recipe), "--no-progress", "train.micro_batch_size=4", "train.global_batch_size=8"]
    assert main(argv) == 2
    err = flat(capsys.readouterr().err)
    assert err.startswith("error: out of GPU memory (micro_batch_size 4 × seq_len 32)")
    assert "train.micro_batch_size=2 train.global_batch_size=8 (accumulation 2 → 4, same global batch)" in err
    assert "train.activation_checkpointing=true" in err and "optim.name=adamw8bit" in err
    assert "Traceback" not in err and "Tried to allocate" not in err
    # nothing was trained, so nothing but the run's description was written; a rerun can start
    run = load_recipe(recipe).run_dir
    assert resume_point(run) is None
    monkeypatch.setattr(run_mod, "pretrain", real)
    assert main([*argv[:3], "train.micro_batch_size=2", "train.global_batch_size=8", "--overwrite"]) == 0


def test_oom_advice_offers_resume_only_with_the_changes_a_resume_takes():
    """The advice said "add --resume" after train.seq_len and optim.name, which --resume refuses
    ("holds a different run"): each change is checked here against the resume's own comparison."""
    import re

    from difftrain.cli.common import oom_advice
    from difftrain.train.runcheck import recipe_differences

    base = ["train.micro_batch_size=4", "train.global_batch_size=8", "train.accelerator=cpu"]
    msg = flat(oom_advice(load_recipe("quickstart", base), device="CPU"))
    advice = msg.partition("; `difftrain plan")[0]  # (the plan command repeats the recipe's overrides)
    keep, said, new = advice.partition(" — then run again (add --resume if a checkpoint was saved)")
    assert said and "another name=... or --overwrite" in new
    old = load_recipe("quickstart", base).model_dump(mode="json")
    for part, resumable in ((keep, True), (new, False)):
        overrides = re.findall(r"(\w+\.\w+=\S+)", part)
        assert overrides, part
        for override in overrides:
            changed = load_recipe("quickstart", [*base, override]).model_dump(mode="json")
            assert (recipe_differences(old, changed) == []) == resumable, override
    assert "optim.name=adamw8bit" in new and "train.seq_len=" in new and "train.micro_batch_size=2" in keep


def cpu_oom_at_first_step(step, loss):  # what torch's CPU allocator raises (a plain RuntimeError)
    raise RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried "
        "to allocate 402653184 bytes. Error code 12 (Cannot allocate memory)"
    )


def test_the_cpu_running_out_of_memory_gets_the_same_advice_not_a_traceback(workspace, monkeypatch, capsys):
    import difftrain.train.run as run_mod

    real = run_mod.pretrain
    monkeypatch.setattr(
        run_mod, "pretrain", lambda *a, **kw: real(*a, **kw, fault_hook=cpu_oom_at_first_step)
    )
    recipe = workspace(steps=4, save_every=2)
    assert (
        main(
            [
                "pretrain",
                str(recipe),
                "--no-progress",
                "train.micro_batch_size=4",
                "train.global_batch_size=8",
            ]
        )
        == 2
    )
    err = flat(capsys.readouterr().err)
    assert err.startswith("error: out of CPU memory (micro_batch_size 4 × seq_len 32)")
    assert "Traceback" not in err and "alloc_cpu" not in err
