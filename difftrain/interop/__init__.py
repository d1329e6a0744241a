"""Interop with Hugging Face transformers: `hf` exports runs and imports checkpoints, `convert`
holds the layout conversion, `paths` the folder checks the CLI runs before torch loads (the names
below load torch on first use)."""

from __future__ import annotations

from difftrain.io import lazy_getattr

__all__ = ["SUPPORTED_ARCHITECTURES", "ExportResult", "ImportResult", "export_hf", "import_hf"]
__getattr__ = lazy_getattr(
    __name__, {name: "hf" for name in __all__} | {"SUPPORTED_ARCHITECTURES": "convert"}
)
