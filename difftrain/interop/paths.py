"""The folder checks of `export` and `import`, free of torch: a mistyped path is answered before
torch loads."""

from __future__ import annotations

import shlex
from pathlib import Path

from difftrain.errors import InteropError
from difftrain.io import uncreatable_reason
from difftrain.rundir import RECIPE

EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # the weight dtypes `export` writes


def same_dir(a: Path, b: Path) -> bool:
    """Whether a and b name the same folder (False when either cannot be resolved)."""
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symbolic link loop (Python < 3.13)
        return False


def check_destination(path: Path, what: str) -> None:
    """InteropError when the folder to write (and its missing parents) cannot be created."""
    why = uncreatable_reason(path)
    if why is not None:
        raise InteropError(f"cannot write the {what} {path}: {why}; choose a folder you can write")


def check_export_paths(run_dir: Path, out_dir: Path, dtype: str) -> None:
    """InteropError for an export dtype we do not write or an export folder that is the run itself."""
    if dtype not in EXPORT_DTYPES:
        raise InteropError(
            f"dtype {dtype!r} is not supported for export; choose one of {', '.join(EXPORT_DTYPES)}"
        )
    if same_dir(run_dir, out_dir):
        raise InteropError(f"the export folder {out_dir} is the run directory itself; choose another folder")
    check_destination(out_dir, "export folder")


def check_import_paths(src: Path, dst: Path) -> None:
    """InteropError when `src` is not a folder, is the run directory to write, or is a difftrain run."""
    if src.is_file():
        raise InteropError(
            f"{src} is a file; import takes the checkpoint's folder (the one holding config.json, the "
            f"weights and tokenizer.json), e.g. `difftrain import {shlex.quote(str(src.parent))} {shlex.quote(str(dst))}`"
        )
    if not src.is_dir():
        raise InteropError(
            f"no checkpoint folder {src}; download one first, e.g. `hf download ORG/MODEL --local-dir {src}` (huggingface_hub before 1.0: huggingface-cli download)"
        )
    if same_dir(src, dst):
        raise InteropError(f"the run directory {dst} is the checkpoint folder itself; choose another folder")
    check_destination(dst, "run directory")
    if (src / RECIPE).is_file():
        raise InteropError(
            f"{src} is a difftrain run directory, not a transformers checkpoint: generate, eval and finetune "
            "take it as it is (`difftrain export` makes a transformers checkpoint of it)"
        )
