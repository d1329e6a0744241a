"""Data pipeline: sources → tokenizer → cached token shards → Lightning data modules.

Public API (the rest of difftrain imports from here):

- config: `DataConfig`, `SourceSpec`, `TokenizerConfig`, `TokenizerTrainConfig` (recipe schema)
- `prepare_data(data_cfg, tok_cfg, *, seed, base_dir, progress=None) -> PreparedData`
- `load_tokenizer(path) -> Tokenizer`, `check_vocab_fits(tokenizer, vocab_size)`, `StreamDecoder`
- `PretrainDataModule`, `SFTDataModule`, `encode_sft_record`, `load_sft_records`
- `make_needle_example` (builtin:needles, for the retrieval evaluation)
- `RecallSpec`, `make_recall_example`, `held_out_examples` (builtin:recall, for the recall suite)

Heavy modules (torch, lightning) load only when `modules` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from difftrain.data.builtin import Needle, NeedleExample, make_needle_example
    from difftrain.data.modules import (
        IGNORE_INDEX,
        PretrainDataModule,
        PromptResponseTemplate,
        SFTDataModule,
        encode_sft_record,
        load_sft_records,
        pad_sft_batch,
    )
    from difftrain.data.recall import RecallExample, held_out_examples, make_recall_example
    from difftrain.data.shards import PreparedData, PrepareProgress, PrepareStats, prepare_data
    from difftrain.data.tokenizer import StreamDecoder, Tokenizer, check_vocab_fits, load_tokenizer

_LAZY = {
    "Needle": "builtin",
    "NeedleExample": "builtin",
    "make_needle_example": "builtin",
    "IGNORE_INDEX": "modules",
    "PretrainDataModule": "modules",
    "PromptResponseTemplate": "modules",
    "SFTDataModule": "modules",
    "encode_sft_record": "modules",
    "load_sft_records": "modules",
    "pad_sft_batch": "modules",
    "RecallExample": "recall",
    "held_out_examples": "recall",
    "make_recall_example": "recall",
    "PreparedData": "shards",
    "PrepareProgress": "shards",
    "PrepareStats": "shards",
    "prepare_data": "shards",
    "StreamDecoder": "tokenizer",
    "Tokenizer": "tokenizer",
    "check_vocab_fits": "tokenizer",
    "load_tokenizer": "tokenizer",
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
    "Needle",
    "NeedleExample",
    "make_needle_example",
    "IGNORE_INDEX",
    "PretrainDataModule",
    "PromptResponseTemplate",
    "SFTDataModule",
    "encode_sft_record",
    "load_sft_records",
    "pad_sft_batch",
    "RecallExample",
    "held_out_examples",
    "make_recall_example",
    "PreparedData",
    "PrepareProgress",
    "PrepareStats",
    "prepare_data",
    "StreamDecoder",
    "Tokenizer",
    "check_vocab_fits",
    "load_tokenizer",
]
