"""Checkpoints of a run: atomic, verified, pruned, and resumable.

Layout under `runs/<name>/checkpoints/`:

    step-00000500.ckpt   Lightning checkpoints (weights, optimizer, scheduler, loops, data position)
    last.ckpt            a hard link to the newest step file (always a complete checkpoint)
    index.json           [{file, step, sha256, bytes}] newest last: what `--resume` trusts

Every file is written atomically (`AtomicCheckpointIO`). A resume takes the newest checkpoint
whose SHA-256 matches the index, skipping damaged ones with a warning. Checkpoints are loaded
with `weights_only=True`: a pickle planted in their place cannot run code.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from difftrain.errors import CheckpointError
from difftrain.io import atomic_path, atomic_write_json, fsync_dir, sha256_file

INDEX = "index.json"
LAST = "last.ckpt"


class AtomicCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO: torch.save to a temp file in the same folder, fsync, rename."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_checkpoint_file(Path(path), map_location=map_location)

    def remove_checkpoint(self, path: Any) -> None:
        Path(path).unlink(missing_ok=True)


def load_checkpoint_file(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """torch.load with weights_only=True; anything else is a CheckpointError."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} does not exist") from e
    except Exception as e:  # unpickling refused, truncated zip, bad magic...
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded safely ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
            "it is damaged or not a difftrain checkpoint"
        ) from e


def remove_checkpoint_path(path: Path) -> None:
    """Delete a checkpoint file, or the folder of a sharded one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def step_file(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def read_index(ckpt_dir: Path) -> list[dict[str, Any]]:
    return _read_index(ckpt_dir)[0]


def _read_index(ckpt_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """The index's entries, and its state: "missing", "unreadable" or "read"."""
    f = ckpt_dir / INDEX
    if not f.is_file():
        return [], "missing"
    try:
        entries = json.loads(f.read_text())["checkpoints"]
        return [e for e in entries if isinstance(e, dict) and "file" in e and "sha256" in e], "read"
    except (OSError, ValueError, KeyError, TypeError):
        return [], "unreadable"


def record_checkpoint(ckpt_dir: Path, path: Path, step: int, keep: int) -> list[str]:
    """Add `path` to the index, point last.ckpt at it, prune to the newest `keep` step files
    (the new one always kept); returns the names of the files deleted.

    Entries of later steps (a timeline the run abandoned when it resumed from an earlier
    checkpoint) and step files the index never listed are dropped. The index is written before
    any file is deleted, so a kill in between leaves only unlisted files."""
    files = path.rglob("*") if path.is_dir() else [path]
    size = sum(f.stat().st_size for f in files if f.is_file())
    entry = {"file": path.name, "step": step, "sha256": sha256_file(path), "bytes": size}
    entries = [
        e
        for e in read_index(ckpt_dir)
        if e["file"] != path.name and int(e.get("step", -1)) < step and (ckpt_dir / e["file"]).exists()
    ]
    entries = sorted([*entries, entry], key=lambda e: e["step"])[-max(keep, 1) :]
    # last.ckpt: a hard link (a symlink to a sharded folder), made under a temp name and renamed
    tmp = ckpt_dir / f".{LAST}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        if path.is_dir():
            os.symlink(path.name, tmp)
        else:
            os.link(path, tmp)
    except OSError:  # filesystems without hard links: copy
        shutil.copyfile(path, tmp)
    os.replace(tmp, ckpt_dir / LAST)
    atomic_write_json(ckpt_dir / INDEX, {"checkpoints": entries, "last": entry["file"]})
    keep_names = {e["file"] for e in entries}
    removed = [old.name for old in sorted(ckpt_dir.glob("step-*.ckpt")) if old.name not in keep_names]
    for name in removed:
        remove_checkpoint_path(ckpt_dir / name)
    fsync_dir(ckpt_dir)
    return removed


@dataclass
class ResumePoint:
    path: Path
    step: int
    warnings: list[str]


def find_resume_checkpoint(ckpt_dir: Path) -> ResumePoint | None:
    """The newest checkpoint whose contents match its recorded SHA-256 (None if there is none);
    damaged newer files are skipped, each with a warning. Step files the index does not list
    are tried newest first and accepted if they load."""
    if not ckpt_dir.is_dir():
        return None
    warnings: list[str] = []
    entries, state = _read_index(ckpt_dir)
    for e in reversed(entries):
        path = ckpt_dir / e["file"]
        if not path.exists():
            warnings.append(f"checkpoint {path.name} is listed but missing")
        elif sha256_file(path) != e["sha256"]:
            warnings.append(f"checkpoint {path.name} is damaged (checksum mismatch)")
        else:
            return ResumePoint(path, int(e["step"]), _falling_back(warnings, path))
    for path in sorted(ckpt_dir.glob("step-*.ckpt"), reverse=True):
        if any(path.name == e["file"] for e in entries) or path.is_dir():
            continue  # already judged above (or an unindexed sharded folder: not trusted)
        try:
            ckpt = load_checkpoint_file(path)
        except CheckpointError:
            warnings.append(f"checkpoint {path.name} cannot be loaded")
            continue
        unchecked = (
            f"{ckpt_dir.name}/{INDEX} {'has no entry for it' if state == 'read' else 'is ' + state}: "
            f"{path.name} was checked by loading it, "
            "not against a recorded checksum (the next checkpoint writes a new index)"
        )
        return ResumePoint(path, int(ckpt.get("global_step", 0)), [*_falling_back(warnings, path), unchecked])
    if warnings:
        raise CheckpointError(
            f"no intact checkpoint in {ckpt_dir} ({'; '.join(warnings)}); start the run again with --overwrite"
        )
    return None


def _falling_back(reasons: list[str], used: Path) -> list[str]:
    """The warnings of a resume that skipped newer checkpoints: each, and where it resumes."""
    return [f"{r}; resuming from the older {used.name}" for r in reasons]
