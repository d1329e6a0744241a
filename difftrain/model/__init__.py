"""The model family: baseline, Differential Transformer V1 (`diff`) and V2 (`diff2`).

Imports nothing from the rest of difftrain except the leaf modules `errors` and `io`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from difftrain.io import lazy_getattr
from difftrain.model.config import ModelConfig, lambda_init, num_params

if TYPE_CHECKING:
    from difftrain.model.kernels import AttnMask
    from difftrain.model.transformer import KVCache, LMOutput, Transformer

__all__ = ["AttnMask", "KVCache", "LMOutput", "ModelConfig", "Transformer", "lambda_init", "num_params"]

# The torch modules load on first use, so that reading a recipe (difftrain.model.config) does not
# import torch: a mistyped recipe name or key is reported at once instead of after seconds.
_LAZY = {
    "AttnMask": "kernels",
    "KVCache": "transformer",
    "LMOutput": "transformer",
    "Transformer": "transformer",
}

__getattr__ = lazy_getattr(__name__, _LAZY)
