"""Lightning data modules: pretraining windows from token shards, and SFT records.

Both are exactly resumable: the batch at global sample index g is a pure function of (seed, g),
and `state_dict()` holds the samples consumed, counted in `on_after_batch_transfer` (a
LightningModule must not override it). Rank r of w reads g = c + k·w + r (c = samples consumed),
so ranks are disjoint and together read what one process would. IterableDatasets keep
Lightning from adding a sampler.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from difftrain.data.config import DataConfig
from difftrain.data.recall import recall_records, record_segments
from difftrain.data.sft import PromptResponseTemplate, Template
from difftrain.data.shards import (
    PreparedData,
    check_split_sizes,
    held_out,
    open_shards,
    training_repeats,
    val_window_offsets,
)
from difftrain.data.sources import SourceStats, check_distinct, require_documents, resolve_sources
from difftrain.data.tokenizer import Tokenizer, load_tokenizer, record_start_id
from difftrain.errors import DataError

IGNORE_INDEX = -100
"""Target that the cross-entropy loss ignores (prompt and padding positions)."""

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def window_offsets(seed: int, indices: np.ndarray, n_tokens: int, window: int) -> np.ndarray:
    """Start offsets of the training windows with global sample indices `indices`.

    offset(g) = h(h(seed) ⊕ g) mod (N − window + 1), with h = SplitMix64 and N the number of
    training tokens: any sample is computed directly from (seed, g), without a random stream.
    """
    span = n_tokens - window + 1
    key = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
    h = _splitmix64(np.asarray(indices, dtype=np.uint64) ^ key)
    return (h % np.uint64(span)).astype(np.int64)


class _ResumableDataModule(L.LightningDataModule):
    """Counts consumed training samples and restores the train loader's position; rank and
    world size come from the attached Trainer unless given."""

    def __init__(
        self,
        micro_batch_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool | Literal["auto"] = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise DataError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        self.micro_batch_size, self.seed, self.num_workers = micro_batch_size, seed, num_workers
        self.pin_memory, self._rank, self._world_size = pin_memory, rank, world_size
        self.consumed_samples = 0
        """Global training samples consumed (all ranks); the next batch starts here."""

    @property
    def rank(self) -> int:
        trainer = getattr(self, "trainer", None)
        return self._rank if self._rank is not None else trainer.global_rank if trainer else 0

    @property
    def world_size(self) -> int:
        trainer = getattr(self, "trainer", None)
        return self._world_size if self._world_size is not None else trainer.world_size if trainer else 1

    def _loader(self, dataset: IterableDataset) -> DataLoader:
        pin = torch.cuda.is_available() if self.pin_memory == "auto" else bool(self.pin_memory)
        # batch_size=None: the datasets yield whole batches
        return DataLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=pin)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            self.consumed_samples += int(batch["input_ids"].shape[0]) * self.world_size
        return batch

    def advance(self, batches: int = 1) -> None:
        """Mark `batches` micro-batches per rank as consumed (for loops without Lightning)."""
        self.consumed_samples += batches * self.micro_batch_size * self.world_size

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed_samples = int(state_dict.get("consumed_samples", 0))


def _worker_slice() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class _Endless(IterableDataset):
    """Endless batches of one rank: local batch j holds the global samples `batch_indices(j)`,
    made into a batch by `make` (DataLoader workers take every n-th j, in order)."""

    def __init__(
        self, make: Callable[[np.ndarray], Any], batch: int, start: int, rank: int, world: int
    ) -> None:
        self.make, self.batch, self.start, self.rank, self.world = make, batch, start, rank, world

    def batch_indices(self, j: int) -> np.ndarray:
        k = np.arange(j * self.batch, (j + 1) * self.batch, dtype=np.int64)
        return self.start + k * self.world + self.rank

    def __iter__(self) -> Iterator[Any]:
        worker, n_workers = _worker_slice()
        for j in itertools.count(worker, n_workers):
            yield self.make(self.batch_indices(j))


class _Fixed(IterableDataset):
    """One rank's share (`items[rank::world]`) of a fixed list, in batches made by `make`."""

    def __init__(self, make: Callable[[Any], Any], items: Any, batch: int, rank: int, world: int) -> None:
        self.make, self.items, self.batch = make, items[rank::world], batch

    def __len__(self) -> int:
        return -(-len(self.items) // self.batch)

    def __iter__(self) -> Iterator[Any]:
        worker, n_workers = _worker_slice()
        for j in range(worker, len(self), n_workers):
            yield self.make(self.items[j * self.batch : (j + 1) * self.batch])


@dataclass
class _Memmap:
    """A token file opened lazily in each process (picklable for DataLoader workers)."""

    path: Path
    dtype: np.dtype
    n_tokens: int
    _mm: np.memmap | None = None
    _pid: int = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_mm": None, "_pid": -1}

    def windows(self, offsets: np.ndarray, length: int) -> torch.Tensor:
        if self._mm is None or self._pid != os.getpid():
            self._mm = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
            self._pid = os.getpid()
        rows = np.stack([self._mm[o : o + length] for o in offsets.tolist()])
        return torch.from_numpy(rows.astype(np.int64))


@dataclass(frozen=True)
class _WindowBatches:
    """Batches of windows of `data`: by start offset, or (`seed` set) by training sample index."""

    data: _Memmap
    seq_len: int
    seed: int | None = None

    def __call__(self, at: np.ndarray) -> dict[str, torch.Tensor]:
        if self.seed is not None:
            at = window_offsets(self.seed, at, self.data.n_tokens, self.seq_len + 1)
        w = self.data.windows(at, self.seq_len + 1)
        return {"input_ids": w[:, :-1], "targets": w[:, 1:]}


class PretrainDataModule(_ResumableDataModule):
    """Windows of seq_len + 1 tokens from the token shards: input_ids = w[:-1], targets = w[1:].

    Training sample g starts at `window_offsets(seed, g)`, uniform over the training tokens and
    across document boundaries (with replacement, as nanoGPT's memmap reader). Validation:
    `val_windows` windows evenly spaced over the validation split, split over ranks.
    `prepared`: the `PreparedData` of `prepare_data`, or a shard folder.
    """

    def __init__(
        self,
        prepared: PreparedData | str | os.PathLike[str],
        *,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        val_windows: int = 64,
        num_workers: int = 0,
        pin_memory: bool | Literal["auto"] = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__(micro_batch_size, seed, num_workers, pin_memory, rank, world_size)
        if isinstance(prepared, PreparedData):
            index, train_path, val_path = prepared.index, prepared.train_path, prepared.val_path
        else:
            index, train_path, val_path = open_shards(prepared)
        dtype = np.dtype(index["dtype"])
        self.seq_len = seq_len
        self.train_data = _Memmap(train_path, dtype, index["train"]["tokens"])
        self.val_data = _Memmap(val_path, dtype, index["val"]["tokens"])
        check_split_sizes(self.train_data.n_tokens, self.val_data.n_tokens, seq_len, val_windows)
        distinct = self.val_data.n_tokens - seq_len  # windows with different starts
        self.val_note: str | None = None
        if val_windows > distinct:
            self.val_note = (
                f"data.val_windows={val_windows:,} is more than the {distinct:,} different windows the validation "
                f"split holds ({self.val_data.n_tokens:,} tokens): validating on those {distinct:,}; raise "
                "data.val_fraction for more"
            )
            val_windows = distinct
        self.val_offsets = val_window_offsets(self.val_data.n_tokens, seq_len + 1, val_windows)

    @classmethod
    def from_config(
        cls,
        prepared: PreparedData,
        data_cfg: DataConfig,
        *,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
    ) -> PretrainDataModule | SFTDataModule:
        """Build from the recipe's data section. `builtin:recall` data gives an `SFTDataModule`:
        one example per sequence, trained on its answers only."""
        specs = data_cfg.recall_specs
        if specs is not None:
            train, val = recall_records(specs)
            dm = SFTDataModule(
                train,
                val if data_cfg.val_windows > 0 else [],
                tokenizer=load_tokenizer(prepared.tokenizer_path),
                max_seq_len=seq_len,
                micro_batch_size=micro_batch_size,
                seed=seed,
                template=record_segments,
                add_eos=False,
                num_workers=data_cfg.num_workers,
                pin_memory=data_cfg.pin_memory,
            )
            dm.setup()
            if dm.truncated:
                raise DataError(
                    f"builtin:recall: {dm.truncated:,} examples are longer than model.max_seq_len={seq_len} "
                    "tokens and would lose part of their context; raise model.max_seq_len, or lower n_pairs "
                    "or distractor_rate"
                )
            return dm
        return cls(
            prepared,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            seed=seed,
            val_windows=data_cfg.val_windows,
            num_workers=data_cfg.num_workers,
            pin_memory=data_cfg.pin_memory,
        )

    def train_dataset(self) -> _Endless:
        make = _WindowBatches(self.train_data, self.seq_len, self.seed)
        return _Endless(make, self.micro_batch_size, self.consumed_samples, self.rank, self.world_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset())

    def val_dataloader(self) -> DataLoader | list:
        if len(self.val_offsets) == 0:
            return []
        make = _WindowBatches(self.val_data, self.seq_len)
        return self._loader(_Fixed(make, self.val_offsets, self.micro_batch_size, self.rank, self.world_size))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "seq_len": self.seq_len}


def _empty_response(record: Mapping[str, Any]) -> bool:
    """Whether a record's response is blank, or every assistant turn of its chat is."""
    if "messages" in record and "response" not in record:
        replies = [
            m.get("content")
            for m in record["messages"]
            if isinstance(m, Mapping) and m.get("role") == "assistant"
        ]
        return bool(replies) and all(not str(c or "").strip() for c in replies)
    return "response" in record and not str(record["response"] or "").strip()


def _segments_to_example(
    pieces: Sequence[tuple[list[int], bool]],
    *,
    max_seq_len: int,
    bos_id: int | None,
    eos_id: int | None,
    train_on_prompt: bool,
) -> tuple[list[int], list[int], bool]:
    bos = [] if bos_id is None else [bos_id]
    eos = [] if eos_id is None else [eos_id]
    ids = bos + [i for toks, _ in pieces for i in toks] + eos
    trained = (
        [False] * len(bos) + [t or train_on_prompt for toks, t in pieces for _ in toks] + [True] * len(eos)
    )
    limit = max_seq_len + 1
    truncated = len(ids) > limit
    if truncated:
        # keep the end of the prompt and at least half the window of response; a start token
        # stays first (the model always saw one before a text)
        head = len(bos)
        body, flags, room = ids[head:], trained[head:], limit - head
        first = next((i for i, t in enumerate(flags) if t), len(body))
        keep_resp = min(len(body) - first, max(room - first, room // 2))
        sl = slice(first - (room - keep_resp), first + keep_resp)
        ids, trained = ids[:head] + body[sl], trained[:head] + flags[sl]
    targets = [ids[i + 1] if trained[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)]
    return ids[:-1], targets, truncated


def encode_sft_record(
    record: Mapping[str, Any],
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    template: Template | None = None,
    train_on_prompt: bool = False,
    add_bos: bool = False,
    add_eos: bool = True,
) -> tuple[list[int], list[int]]:
    """One record → (input_ids, targets) for next-token training with a loss mask.

    tokens x = [bos] + tokens(segment₁) + ... + [eos]; input_ids = x[:-1];
    targets[t] = x[t+1] if x[t+1] belongs to a trained segment (the response) or is the final
    eos, else -100 (ignored). So the model learns the response and to stop, not the prompt
    (unless train_on_prompt). Longer than max_seq_len + 1 tokens: the prompt is cut from the
    left, the response from the right, keeping at least half the window for the response.
    """
    segments = (template or PromptResponseTemplate())(record)
    pieces = [(tokenizer.encode(text), trained) for text, trained in segments]
    ids, targets, _ = _segments_to_example(
        pieces,
        max_seq_len=max_seq_len,
        bos_id=tokenizer.bos_id if add_bos else record_start_id(tokenizer),
        eos_id=tokenizer.eos_id if add_eos else None,
        train_on_prompt=train_on_prompt,
    )
    return ids, targets


def pad_sft_batch(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, length: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad examples to the longest (or `length`): inputs with pad_id, targets with -100
    (causal attention: right padding needs no mask)."""
    T = length if length is not None else max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)
    for b, (ids, tg) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        targets[b, : len(tg)] = torch.tensor(tg, dtype=torch.long)
    return {"input_ids": input_ids, "targets": targets}


@dataclass
class _SFTBatches:
    """Padded batches of SFT examples: by slice, or (`seed` set) by training sample index g,
    which is example perm_e[g mod N] of the seeded permutation of epoch e = g div N."""

    examples: list[tuple[list[int], list[int]]]
    pad_id: int
    length: int | None
    seed: int | None = None
    _perms: dict[int, np.ndarray] = field(default_factory=dict)

    def record_index(self, g: int) -> int:
        epoch, pos = divmod(g, len(self.examples))
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed & _MASK64, epoch]).permutation(len(self.examples))  # type: ignore[operator]
            self._perms = {epoch: perm}  # keep only the current epoch's permutation
        return int(perm[pos])

    def __call__(self, at: Any) -> dict[str, torch.Tensor]:
        if self.seed is not None:
            at = [self.examples[self.record_index(int(g))] for g in at]
        return pad_sft_batch(at, self.pad_id, self.length)


class SFTDataModule(_ResumableDataModule):
    """Prompt/response records → right-padded batches {"input_ids", "targets"} with a loss mask.

    Records are tokenized once in `setup`. `template` turns a record into (text, trained)
    segments; `add_eos` ends each example with a trained end-of-sequence token;
    `pad_to_max_seq_len` gives static shapes (for torch.compile).
    """

    def __init__(
        self,
        train_records: Sequence[Mapping[str, Any]],
        val_records: Sequence[Mapping[str, Any]] = (),
        *,
        tokenizer: Tokenizer,
        max_seq_len: int,
        micro_batch_size: int,
        seed: int,
        template: Template | None = None,
        train_on_prompt: bool = False,
        add_eos: bool = True,
        pad_to_max_seq_len: bool = False,
        num_workers: int = 0,
        pin_memory: bool | Literal["auto"] = False,
    ) -> None:
        super().__init__(micro_batch_size, seed, num_workers, pin_memory)
        if not train_records:
            raise DataError("no fine-tuning records: the training set is empty; check data.sources")
        self.tokenizer, self.max_seq_len, self.add_eos = tokenizer, max_seq_len, add_eos
        self.template, self.train_on_prompt = template or PromptResponseTemplate(), train_on_prompt
        self.length = max_seq_len if pad_to_max_seq_len else None
        self._records = (list(train_records), list(val_records))
        self.train_examples: list[tuple[list[int], list[int]]] = []
        self.val_examples: list[tuple[list[int], list[int]]] = []
        self.truncated = 0
        self.empty_responses = 0
        """Records whose response is empty: only the end-of-sequence token is trained on them."""
        self.val_note: str | None = None

    def _encode(self, records: list[Mapping[str, Any]]) -> list[tuple[list[int], list[int]]]:
        segs = [self.template(r) for r in records]
        flat = [text for s in segs for text, _ in s]
        ids = iter(self.tokenizer.encode_batch(flat) if flat else [])
        out = []
        for s in segs:
            inp, tgt, cut = _segments_to_example(
                [(next(ids), trained) for _, trained in s],
                max_seq_len=self.max_seq_len,
                bos_id=record_start_id(self.tokenizer),
                eos_id=self.tokenizer.eos_id if self.add_eos else None,
                train_on_prompt=self.train_on_prompt,
            )
            self.truncated += cut
            out.append((inp, tgt))
        self.empty_responses += sum(_empty_response(r) for r in records)
        return out

    def setup(self, stage: str | None = None) -> None:
        if not self.train_examples:  # encoded once (there is at least one training record)
            self.train_examples = self._encode(self._records[0])
            self.val_examples = self._encode(self._records[1])

    def train_dataloader(self) -> DataLoader:
        self.setup()
        make = _SFTBatches(self.train_examples, self.tokenizer.pad_id, self.length, self.seed)
        return self._loader(
            _Endless(make, self.micro_batch_size, self.consumed_samples, self.rank, self.world_size)
        )

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        if not self.val_examples:
            return []
        make = _SFTBatches(self.val_examples, self.tokenizer.pad_id, self.length)
        return self._loader(
            _Fixed(make, self.val_examples, self.micro_batch_size, self.rank, self.world_size)
        )


def load_sft_records(
    data_cfg: DataConfig,
    *,
    seed: int,
    base_dir: str | os.PathLike[str],
    check_messages: Callable[[list[Any]], object] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[SourceStats]]:
    """(train records, val records, per-source stats) of the recipe's instruction records, split
    and weighted like the token shards (`check_messages`: see `Source.records`)."""
    train: list[dict[str, Any]] = []
    val: list[dict[str, Any]] = []
    all_stats = []
    sources = resolve_sources(data_cfg, base_dir)
    check_distinct(sources)
    for src in sources:
        stats = SourceStats(src.spec.source)
        all_stats.append(stats)
        for d, rec in enumerate(src.records(stats, data_cfg.on_bad_record, check_messages)):
            if held_out(data_cfg.val_fraction, seed, src.index, d):
                val.append(rec)
            else:
                train.extend([rec] * training_repeats(src.spec.weight, seed, src.index, d))
        require_documents(src, stats)
    return train, val, all_stats
