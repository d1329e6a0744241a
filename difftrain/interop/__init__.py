"""Interop with other tools: export runs to Hugging Face transformers and import checkpoints back.

See `difftrain.interop.hf` for the layout conversion between difftrain's `diff` attention and
transformers' DiffLlama (head permutation, subln folding) and its proof. The names below load
`difftrain.interop.hf` (and torch) on first use, so that `difftrain.interop.paths` — the folder
checks the CLI runs first — stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_ARCHITECTURES", "ExportResult", "ImportResult", "export_hf", "import_hf"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from difftrain.interop import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
