"""Recipe schema of the `data:` and `tokenizer:` sections: each field's `description` is its
documentation. The data library takes these sections, never the whole recipe.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUILTIN_SOURCES = ("python-stdlib", "needles", "python-docstrings", "recall")
_BUILTIN_PARAMS = {"needles": "needles", "docstrings": "python-docstrings", "recall": "recall"}
"""The parameter sections of a source and the builtin each applies to."""


class NeedlesSpec(BaseModel):
    """Parameters of the synthetic multi-needle retrieval corpus (`builtin:needles`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    context_tokens: int = Field(
        1024,
        ge=32,
        description="Target length of each document's haystack in tokens. The corpus is generated "
        "before the tokenizer exists, so the haystack holds context_tokens × chars_per_token "
        "characters; the retrieval evaluation measures real token counts.",
    )
    chars_per_token: float = Field(
        4.0,
        gt=0,
        description="Characters per token assumed when turning context_tokens into a character "
        "budget (English filler text with a BPE tokenizer: about 3-4.5).",
    )
    n_needles: int = Field(
        4,
        ge=1,
        le=64,
        description="Number of needles (facts 'The magic number of <city> is <7 digits>.') "
        "hidden in each haystack.",
    )
    n_queries: int = Field(
        1,
        ge=1,
        description="How many of the needles are asked for at the end of each document (R in the "
        "paper's multi-needle test); at most n_needles.",
    )
    depths: list[float] | None = Field(
        None,
        description="Depths (0 = start, 1 = end of the haystack) at which the needles are "
        "inserted: one value per needle, or a single value for all. Unset: each document draws "
        "its depths uniformly at random.",
    )
    num_documents: int = Field(
        1000, ge=1, description="Number of documents (haystack + question + answer) generated."
    )
    seed: int = Field(
        0,
        description="Seed of the corpus generator; the corpus is a pure function of these "
        "parameters (independent of the recipe's top-level seed).",
    )

    @model_validator(mode="after")
    def _check(self) -> NeedlesSpec:
        if self.n_queries > self.n_needles:
            raise ValueError(
                f"n_queries={self.n_queries} is larger than n_needles={self.n_needles}: "
                "only hidden needles can be queried"
            )
        if self.depths is not None:
            if len(self.depths) not in (1, self.n_needles):
                raise ValueError(
                    f"depths has {len(self.depths)} values; give one per needle "
                    f"(n_needles={self.n_needles}) or a single value"
                )
            if any(not 0.0 <= d <= 1.0 for d in self.depths):
                raise ValueError(f"depths must lie in [0, 1], got {self.depths}")
        return self


class RecallSpec(BaseModel):
    """Parameters of the multi-query associative recall task (`builtin:recall`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n_pairs: int = Field(16, ge=1, description="N: the number of key→value pairs in each example's context.")
    n_queries: int = Field(
        4,
        ge=1,
        description="How many of the pairs' keys are asked for after the context (each followed by "
        "its value, the answer); at most n_pairs.",
    )
    distractor_rate: float = Field(
        0.0,
        ge=0.0,
        le=16.0,
        description="Mean number of distractor tokens (values that no key precedes) after each "
        "pair: ⌊rate⌋ of them, plus one more with probability rate − ⌊rate⌋.",
    )
    key_vocab: int = Field(
        64,
        ge=1,
        le=676,
        description="Number of distinct keys (written AA, AB, ...); at least n_pairs.",
    )
    value_vocab: int = Field(64, ge=1, le=676, description="Number of distinct values (written aa, ab, ...).")
    num_documents: int = Field(20_000, ge=1, description="Number of training examples generated.")
    val_documents: int = Field(
        256,
        ge=0,
        description="Number of validation examples, drawn from other seeds than the training "
        "examples, none equal to one of them (with data.val_windows: 0 there is no validation).",
    )
    seed: int = Field(
        0,
        description="Seed of the generator; the examples are a pure function of these parameters "
        "(independent of the recipe's top-level seed).",
    )

    @model_validator(mode="after")
    def _check(self) -> RecallSpec:
        if self.n_pairs > self.key_vocab:
            raise ValueError(
                f"n_pairs={self.n_pairs} is larger than key_vocab={self.key_vocab}: the keys of an "
                "example are distinct, so raise key_vocab or lower n_pairs"
            )
        if self.n_queries > self.n_pairs:
            raise ValueError(
                f"n_queries={self.n_queries} is larger than n_pairs={self.n_pairs}: only the context's "
                "pairs can be queried"
            )
        return self


class DocstringsSpec(BaseModel):
    """Parameters of the stdlib instruction dataset (`builtin:python-docstrings`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min_docstring_chars: int = Field(
        20, ge=1, description="Skip functions whose docstring is shorter than this many characters."
    )
    max_response_lines: int = Field(
        60,
        ge=1,
        description="Skip functions whose body (the response) is longer than this many lines.",
    )


def resolve_path(raw: str, base_dir: Path) -> Path:
    """A path of a recipe: ~ expanded, relative to `base_dir` (the recipe's folder) unless absolute."""
    p = Path(os.path.expanduser(raw))
    return p if p.is_absolute() else Path(base_dir) / p


class SourceSpec(BaseModel):
    """One entry of `data.sources`: where documents come from and how much they weigh."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    source: str = Field(
        ...,
        min_length=1,
        description="A file, a directory (read recursively), a glob ('corpus/**/*.md'), "
        "'builtin:python-stdlib' | 'builtin:needles' | 'builtin:python-docstrings' | 'builtin:recall', or "
        "'hf:<dataset>[:<config>][@<split>]' (Hugging Face `datasets`; a local folder saved with "
        "save_to_disk also works, e.g. 'hf:./my_dataset'; without @<split> the train split is read, and "
        "validation is drawn from it by data.val_fraction, as from every source). Relative paths are resolved against the "
        "recipe's folder. .txt/.md/code files are one document each; .jsonl/.json/.parquet hold "
        "one document per record (see text_field); .gz files are decompressed.",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="Repeat factor of this source in the training split: each training document "
        "appears floor(weight) times plus once more with probability frac(weight) (seeded), so 2.0 "
        "doubles a source and 0.5 keeps a random half. Validation documents always appear once, "
        "so the validation loss measures the unweighted data.",
    )
    text_field: str = Field(
        "text",
        min_length=1,
        description="Field (jsonl/json/hf) or column (parquet) that holds a record's text.",
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="Field holding the prompt of an instruction record (fine-tuning only).",
    )
    response_field: str = Field(
        "response",
        min_length=1,
        description="Field holding the response of an instruction record (fine-tuning only).",
    )
    data_files: list[str] | None = Field(
        None,
        description="hf: sources only: files (paths or globs, relative to the recipe's folder) "
        "passed to datasets.load_dataset as data_files, e.g. source 'hf:json' with "
        "data_files: [dump.jsonl].",
    )
    streaming: bool = Field(
        False,
        description="hf: sources only: stream the dataset instead of downloading it whole.",
    )
    max_documents: int | None = Field(
        None,
        ge=1,
        description="Read at most this many documents (records) from this source; unset reads all.",
    )
    needles: NeedlesSpec | None = Field(
        None,
        description="Parameters of builtin:needles (defaults apply when unset).",
    )
    docstrings: DocstringsSpec | None = Field(
        None,
        description="Parameters of builtin:python-docstrings (defaults apply when unset).",
    )
    recall: RecallSpec | None = Field(
        None,
        description="Parameters of builtin:recall (defaults apply when unset).",
    )

    @field_validator("data_files", mode="before")
    @classmethod
    def _one_file(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> SourceSpec:
        src = self.source
        if self.kind == "builtin":
            if src.removeprefix("builtin:") not in BUILTIN_SOURCES:
                known = ", ".join(f"builtin:{n}" for n in BUILTIN_SOURCES)
                raise ValueError(f"unknown builtin source '{src}'; known: {known}")
            fields = [  # only a changed one counts: a run's recipe.yaml spells out the defaults
                f
                for f in ("text_field", "prompt_field", "response_field")
                if getattr(self, f) != type(self).model_fields[f].default
            ]
            if fields:
                verb = "applies" if len(fields) == 1 else "apply"
                raise ValueError(f"{', '.join(fields)} {verb} to record files and datasets, not to '{src}'")
        for params, name in _BUILTIN_PARAMS.items():
            if getattr(self, params) is not None and src != f"builtin:{name}":
                raise ValueError(f"'{params}' parameters apply only to source 'builtin:{name}'")
        if self.kind != "hf":
            if self.data_files is not None:
                raise ValueError("'data_files' applies only to hf: sources (e.g. source: 'hf:json')")
            if self.streaming:
                raise ValueError("'streaming' applies only to hf: sources")
        elif len(src) == 3:
            raise ValueError(
                "hf: source needs a dataset name, e.g. 'hf:json' or 'hf:wikitext:wikitext-2-raw-v1@train'"
            )
        return self

    def hf_parts(self) -> tuple[str, str | None, str]:
        """An hf: source's (dataset, config or None, split: "train" when not given)."""
        rest, at, split = self.source[3:].rpartition("@")
        name, _, config = (rest if at else split).partition(":")
        return name, config or None, split if at else "train"

    def hf_local_dir(self, base_dir: Path) -> Path | None:
        """The local folder an hf: source names (starting with '.', '/' or '~', or an existing
        path with a separator), resolved against `base_dir`; None for a hub dataset."""
        name = self.hf_parts()[0]
        p = resolve_path(name, base_dir)
        return p if name.startswith((".", "/", "~")) or (os.sep in name and p.exists()) else None

    @property
    def kind(self) -> Literal["builtin", "hf", "path"]:
        return next((k for k in ("builtin", "hf") if self.source.startswith(f"{k}:")), "path")  # type: ignore[return-value]


def absolute_path(raw: str, base_dir: Path) -> str:
    """A recipe's local path made absolute against `base_dir`, as text (an absolute one, ~
    expanded, is kept as written)."""
    return raw if Path(os.path.expanduser(raw)).is_absolute() else str(Path(base_dir).resolve() / raw)


def absolute_source(raw: str, base_dir: Path) -> str:
    """A `data.sources` entry with its local path (file, folder, glob, or an hf: source's folder:
    `hf:./saved@test` → `hf:/abs/saved@test`) made absolute against `base_dir`; other entries,
    valid or not, are kept as written."""
    try:
        spec = SourceSpec(source=raw)
    except ValueError:
        return raw
    if spec.kind == "path":
        return absolute_path(raw, base_dir)
    if spec.kind == "hf" and spec.hf_local_dir(base_dir) is not None:
        name = spec.hf_parts()[0]
        return f"hf:{absolute_path(name, base_dir)}{raw[3 + len(name) :]}"
    return raw


def _colon_string(item: Any) -> Any:
    """A source that YAML read as a mapping because it ends in a colon (`hf:` unquoted is
    {hf: None}) back as the string it was written as, so that its own message names it."""
    if isinstance(item, dict) and len(item) == 1:
        ((key, value),) = item.items()
        if value is None and isinstance(key, str) and key not in SourceSpec.model_fields:
            return f"{key}:"
    return item


class DataConfig(BaseModel):
    """The `data:` section: sources, validation split, bad-record policy, cache and loaders."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    sources: list[SourceSpec] = Field(
        default_factory=lambda: [SourceSpec(source="builtin:python-stdlib")],
        min_length=1,
        description="Where the text comes from: a list of sources, each a string (path, glob, "
        "builtin:NAME, hf:NAME) or a mapping {source, weight, text_field, ...}. Each file is read "
        "by one source (two that share a file are refused: each would be split into train and "
        "validation on its own); weight counts a source more than once.",
    )
    val_fraction: float = Field(
        0.01,
        ge=0.0,
        lt=0.5,
        description="Fraction of documents held out for validation, in [0, 0.5) (chosen by a hash of the seed "
        "and the document's position, so the split is deterministic). A corpus too small to give "
        "the validation split any document holds out the last val_fraction of its tokens instead.",
    )
    val_windows: int = Field(
        64,
        ge=0,
        description="Number of fixed validation windows of max_seq_len+1 tokens, evenly spaced over "
        "the validation split: the same windows for every run and architecture on the same data "
        "and seed, so validation losses are comparable. 0 disables validation.",
    )
    on_bad_record: Literal["error", "skip"] = Field(
        "error",
        description="What a malformed record (jsonl line that is not JSON or lacks the text field, "
        "non-UTF-8 text file, null value) does: 'error' stops with the file and line; 'skip' drops "
        "it, counts it and reports the count.",
    )
    cache_dir: str | None = Field(
        None,
        description="Folder of the tokenizer and token-shard cache (relative to the recipe's folder, like "
        "the data paths). Unset: $DIFFTRAIN_CACHE, else $XDG_CACHE_HOME/difftrain, else ~/.cache/difftrain.",
    )
    num_workers: int = Field(
        0,
        ge=0,
        description="DataLoader worker processes. Reading windows from memory-mapped shards is "
        "cheap, so 0 (load in the training process) is usually fastest; raise it for SFT data "
        "or slow disks.",
    )
    pin_memory: bool | Literal["auto"] = Field(
        "auto",
        description="Pin host memory of batches for faster copies to the GPU; 'auto' = on when "
        "CUDA is available.",
    )

    @field_validator("sources", mode="before")
    @classmethod
    def _strings_to_specs(cls, v: Any) -> Any:
        if isinstance(v, (str, dict)):
            v = [v]
        if isinstance(v, list):
            return [{"source": s} if isinstance(s, str) else s for s in map(_colon_string, v)]
        return v

    @model_validator(mode="after")
    def _recall_alone(self) -> DataConfig:
        recall = [s.source == "builtin:recall" for s in self.sources]
        if any(recall) and not all(recall):
            raise ValueError(
                "builtin:recall is trained on its answers only, so it cannot share data.sources with "
                "text sources; list only builtin:recall sources (several, e.g. with different n_pairs, "
                "are fine)"
            )
        return self

    @property
    def recall_specs(self) -> list[RecallSpec] | None:
        """The settings of each source when every one is `builtin:recall` (None otherwise)."""
        if all(s.source == "builtin:recall" for s in self.sources):
            return [s.recall or RecallSpec() for s in self.sources]
        return None

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    def check_cache_dir(self) -> Path:
        """The cache folder; a DataError naming the setting it came from when it cannot be created
        or written (writing nothing)."""
        from difftrain.errors import DataError
        from difftrain.io import uncreatable_reason

        path = self.resolved_cache_dir()
        if (why := uncreatable_reason(path)) is None:
            return path
        if self.cache_dir:
            origin, fix = "data.cache_dir", "set data.cache_dir to a folder you can write"
        else:
            env = "DIFFTRAIN_CACHE" if os.environ.get("DIFFTRAIN_CACHE") else "XDG_CACHE_HOME"
            origin = f"${env}" if os.environ.get(env) else "the default cache"
            fix = "set $DIFFTRAIN_CACHE (or data.cache_dir) to a folder you can write"
        raise DataError(f"cannot use the cache folder {path} ({origin}): {why}; {fix}")


def default_cache_dir() -> Path:
    """$DIFFTRAIN_CACHE, else $XDG_CACHE_HOME/difftrain, else ~/.cache/difftrain."""
    if env := os.environ.get("DIFFTRAIN_CACHE"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "difftrain"
    return Path.home() / ".cache" / "difftrain"


SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
"""Special tokens of every trained tokenizer, with ids 0..6 in this order (the chat tokens are
reserved so that fine-tuning with a chat template does not change the vocabulary)."""


class TokenizerTrainConfig(BaseModel):
    """How to train a byte-level BPE tokenizer on the recipe's sources."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    vocab_size: int = Field(
        8192,
        le=1 << 20,
        description="Size of the trained vocabulary, special tokens and the 256 byte tokens included "
        f"(at least {len(SPECIAL_TOKENS) + 256 + 1}: those and one merge; tokenizer.train.extra_special_tokens "
        "add to that).",
    )
    min_frequency: int = Field(
        2, ge=1, description="A pair of tokens is merged only if it occurs at least this often."
    )
    max_bytes: int = Field(
        32_000_000,
        ge=1,
        description="At most this many bytes of text are used to train the tokenizer: documents "
        "sampled evenly across the corpus by a fixed hash when its size is known (local files, "
        "builtin sources), else the first max_bytes (hf: sources). BPE merges stabilise long "
        "before that, and training time grows with it.",
    )
    individual_digits: bool = Field(
        True,
        description="Split numbers into single digits before BPE (as Llama does): every number "
        "is spelled digit by digit, which helps copying and arithmetic (and the needle task).",
    )
    extra_special_tokens: list[str] = Field(
        default_factory=list,
        description="Further special tokens to reserve, after <|bos|> <|eos|> <|pad|> <|system|> "
        "<|user|> <|assistant|> <|end|>.",
    )

    @field_validator("vocab_size")
    @classmethod
    def _room_for_merges(cls, v: int) -> int:
        least = len(SPECIAL_TOKENS) + 256 + 1
        if v < least:
            raise ValueError(
                f"must be at least {least}: the {len(SPECIAL_TOKENS)} special tokens and the 256 byte tokens "
                "come first, and a BPE vocabulary needs at least one merge on top (8192 is the default)"
            )
        return v

    @property
    def fixed_tokens(self) -> int:
        """The tokens every trained vocabulary holds before its merges: bytes and special tokens."""
        return 256 + len(SPECIAL_TOKENS) + len(self.extra_special_tokens)

    @model_validator(mode="after")
    def _room_after_extra_tokens(self) -> TokenizerTrainConfig:
        least = self.fixed_tokens + 1
        if self.vocab_size < least:
            raise ValueError(
                f"vocab_size {self.vocab_size} leaves no room for a merge after the "
                f"{len(self.extra_special_tokens)} extra_special_tokens: make it at least {least}"
            )
        return self

    @field_validator("extra_special_tokens")
    @classmethod
    def _no_duplicates(cls, v: list[str]) -> list[str]:
        dup = [t for t in v if t in SPECIAL_TOKENS or v.count(t) > 1 or not t]
        if dup:
            raise ValueError(f"extra_special_tokens has duplicate or empty tokens: {sorted(set(dup))}")
        return v


class TokenizerConfig(BaseModel):
    """The `tokenizer:` section: load an existing tokenizer.json, or train one."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str | None = Field(
        None,
        description="An existing Hugging Face tokenizer.json (or a folder holding one), e.g. "
        "GPT-2's or Llama's, relative to the recipe's folder. Unset: train one (see train).",
    )
    train: TokenizerTrainConfig = Field(
        default_factory=TokenizerTrainConfig,
        description="Settings of the byte-level BPE trained on the sources; ignored when path is set.",
    )

    def file(self, base_dir: Path) -> Path | None:
        """`path` resolved against `base_dir` (the recipe's folder); None when unset."""
        return None if self.path is None else resolve_path(self.path, base_dir)
