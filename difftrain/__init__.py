"""difftrain: pretrain, fine-tune, evaluate and sample Differential Transformers from YAML recipes."""

from __future__ import annotations

__version__ = "0.1.0"
