"""The model family: baseline, Differential Transformer V1 (`diff`) and V2 (`diff2`).

Imports nothing from the rest of difftrain except the leaf modules `errors` and `io`.
"""

from __future__ import annotations

from difftrain.model.config import ModelConfig, lambda_init, num_params
from difftrain.model.kernels import AttnMask
from difftrain.model.transformer import KVCache, LMOutput, Transformer

__all__ = ["AttnMask", "KVCache", "LMOutput", "ModelConfig", "Transformer", "lambda_init", "num_params"]
