"""Every file difftrain writes appears under its final name only through an atomic rename.

A whole life of a run — prepare, pretrain (checkpoints, index, metrics, weights, summary),
resume, eval (result JSON), export (HF folder) — runs with every way of writing a file watched:
Python's `open` in a write mode, `torch.save` and safetensors' `save_file` (which write from
native code). Each write must go to a temporary name (`.NAME.PID.XXXX.tmp`, or a file inside a
`.tmp-*` build folder); the final names only ever appear through `os.replace` / `os.rename`.
"""

from __future__ import annotations

import builtins
from pathlib import Path

import safetensors.torch
import torch

from difftrain.cli.app import main


def _is_temporary(path: Path, root: Path) -> bool:
    rel = path.resolve().relative_to(root.resolve())
    return (path.name.startswith(".") and path.name.endswith((".tmp", ".partial"))) or any(
        part.startswith(".tmp-") for part in rel.parts[:-1]
    )


def test_no_file_is_ever_written_in_place(workspace, tmp_path, monkeypatch, shared_data):
    root = tmp_path
    written: list[Path] = []

    def note(target) -> None:
        if isinstance(target, (str, Path)):
            p = Path(target)
            if p.is_absolute() is False:
                p = Path.cwd() / p
            if root.resolve() in p.resolve().parents:
                written.append(p)

    real_open, real_save, real_save_file = builtins.open, torch.save, safetensors.torch.save_file

    def open_(file, mode="r", *a, **kw):
        if any(c in mode for c in "wax+"):
            note(file)
        return real_open(file, mode, *a, **kw)

    def save(obj, f, *a, **kw):
        note(f)
        return real_save(obj, f, *a, **kw)

    def save_file(tensors, filename, *a, **kw):
        note(filename)
        return real_save_file(tensors, filename, *a, **kw)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    recipe = workspace(steps=4, save_every=2, cache=root / "cache")  # a cache built under watch
    run = root / "runs" / "r"
    assert main(["prepare", str(recipe)]) == 0
    assert main(["pretrain", str(recipe), "--no-progress"]) == 0
    assert main(["pretrain", str(run / "recipe.yaml"), "--resume", "train.max_steps=6", "--no-progress"]) == 0
    assert main(["eval", str(run), "--suite", "ppl"]) == 0
    assert main(["export", str(run), str(root / "hf")]) == 0
    monkeypatch.undo()
    final = {p.name for p in written}
    assert {"step-00000004.ckpt", "index.json", "metrics.csv", "model.safetensors", "summary.json"} <= {
        p.name for p in run.rglob("*") if p.is_file()
    }
    in_place = sorted(str(p.relative_to(root)) for p in written if not _is_temporary(p, root))
    assert in_place == [], f"written in place (not atomically): {in_place}"
    assert len(written) > 20, final  # the watch saw the writes (a sanity check of the test itself)


def test_a_folder_written_with_atomic_dir_replaces_the_old_one_only_when_whole(tmp_path):
    import pytest

    from difftrain.io import atomic_dir

    dest = tmp_path / "merged"
    dest.mkdir()
    (dest / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(dest) as new:  # killed halfway: the old run stays
        (new / "config.json").write_text("{}")
        raise RuntimeError("killed")
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    assert (dest / "model.safetensors").read_text() == "old"
    with atomic_dir(dest) as new:
        (new / "model.safetensors").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # no temporary or old folder left
    assert [p.name for p in dest.iterdir()] == ["model.safetensors"]
    assert (dest / "model.safetensors").read_text() == "new"
