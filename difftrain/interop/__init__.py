"""Interop with other tools: export runs to Hugging Face transformers and import checkpoints back.

See `difftrain.interop.hf` for the layout conversion between difftrain's `diff` attention and
transformers' DiffLlama (head permutation, subln folding) and its proof.
"""

from __future__ import annotations

from difftrain.interop.hf import (
    SUPPORTED_ARCHITECTURES,
    ExportResult,
    ImportResult,
    export_hf,
    import_hf,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "ExportResult", "ImportResult", "export_hf", "import_hf"]
