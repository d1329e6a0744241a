"""Interop with other tools: export runs to Hugging Face transformers and import checkpoints back.

`difftrain.interop.convert` holds the layout conversion (head permutation, subln folding). The
names below load `difftrain.interop.hf` (and torch) on first use, so that
`difftrain.interop.paths`, the folder checks the CLI runs first, stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_ARCHITECTURES", "ExportResult", "ImportResult", "export_hf", "import_hf"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from difftrain.interop import convert, hf

        return getattr(convert if name == "SUPPORTED_ARCHITECTURES" else hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
