"""Data pipeline: sources → tokenizer → cached token shards → Lightning data modules.

Names outside `config` load their modules on first use, so torch and Lightning load only
when `modules` is used.
"""

from __future__ import annotations

from difftrain.data.config import (
    SPECIAL_TOKENS,
    DataConfig,
    DocstringsSpec,
    NeedlesSpec,
    RecallSpec,
    SourceSpec,
    TokenizerConfig,
    TokenizerTrainConfig,
)
from difftrain.io import lazy_getattr

_LAZY = {
    name: module
    for module, names in {
        "builtin": ("Needle", "NeedleExample", "make_needle_example"),
        "modules": (
            "IGNORE_INDEX",
            "PretrainDataModule",
            "PromptResponseTemplate",
            "SFTDataModule",
            "encode_sft_record",
            "load_sft_records",
            "pad_sft_batch",
        ),
        "recall": ("RecallExample", "held_out_examples", "make_recall_example"),
        "shards": ("PreparedData", "PrepareProgress", "PrepareStats", "prepare_data"),
        "tokenizer": ("StreamDecoder", "Tokenizer", "check_vocab_fits", "load_tokenizer"),
    }.items()
    for name in names
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = [
    "SPECIAL_TOKENS",
    "DataConfig",
    "DocstringsSpec",
    "NeedlesSpec",
    "RecallSpec",
    "SourceSpec",
    "TokenizerConfig",
    "TokenizerTrainConfig",
    *_LAZY,
]
