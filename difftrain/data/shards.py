"""Token shards and the data cache: `prepare_data` tokenizes the corpus once.

Layout of the cache (default ~/.cache/difftrain, see `DataConfig.cache_dir`):

    tokenizers/<key>/tokenizer.json   trained (or copied) tokenizer; key = hash(sources, config)
    shards/<key>/index.json           token counts, documents, bytes, fingerprint, tokenizer hash
    shards/<key>/train.bin            uint16 (vocab ≤ 65536) or uint32 token ids, flat
    shards/<key>/val.bin

Each document's tokens are followed by <|eos|>, so the flat stream is doc₁ eos doc₂ eos ...
A document goes to validation when u(seed, source, position) < val_fraction, with u a hash
mapped to [0, 1): the split is by document and deterministic for the seed. A training document
of a source with weight w is written ⌊w⌋ times, plus once more when u'(seed, ...) < w − ⌊w⌋.

Cache keys hash the source fingerprints (spec, paths, sizes, mtimes), the settings and, for
shards, the tokenizer, so unchanged data is never read again. Every entry is built in a `.tmp-*`
folder renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from difftrain.data.builtin import stable_seed
from difftrain.data.config import DataConfig, TokenizerConfig
from difftrain.data.sources import Source, SourceStats, check_distinct, require_documents, resolve_sources
from difftrain.data.tokenizer import (
    Tokenizer,
    load_tokenizer,
    text_batches,
    train_tokenizer,
    word_start_pieces,
)
from difftrain.errors import DataError, TokenizerError
from difftrain.io import atomic_write_json, fsync_dir

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrepareProgress:
    """A progress report from `prepare_data`: stage "tokenizer" (reading text to train it) or
    "shards" (tokenizing); total_bytes estimates the stage's text size (None: unknown)."""

    stage: str
    source: str
    documents: int
    bytes: int
    tokens: int
    total_bytes: int | None


ProgressFn = Callable[[PrepareProgress], None]


@dataclass
class PrepareStats:
    """Figures of a prepared dataset (the `difftrain prepare` table)."""

    documents: int
    bytes: int
    tokens: int
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    bad_records: int
    vocab_size: int
    seconds: float
    tokenizer_seconds: float
    cache_bytes: int
    split: str
    sources: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_byte(self) -> float:
        return self.tokens / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class PreparedData:
    """The result of `prepare_data`: where the tokenizer and token shards are."""

    tokenizer_path: Path
    train_path: Path
    val_path: Path
    index: dict[str, Any]
    cache_dir: Path
    stats: PrepareStats
    from_cache: bool
    tokenizer_from_cache: bool

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.index["dtype"])


TOKENIZER_SAMPLE_PIECE = 1 << 16
"""Characters: the unit of the tokenizer's training sample (see `_training_texts`)."""


def unit_hash(*parts: object) -> float:
    """A deterministic u ∈ [0, 1) from the parts (`stable_seed` / 2⁶⁴)."""
    return stable_seed(*parts) / 2.0**64


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def held_out(val_fraction: float, seed: int, source: int, doc: int) -> bool:
    """Whether document `doc` of a source is a validation document (see the module docstring)."""
    return val_fraction > 0 and unit_hash("val", seed, source, doc) < val_fraction


def _clean_stale_tmp(parent: Path) -> None:
    """Remove the temporary folders of crashed builds (their process is gone)."""
    for p in parent.glob(".tmp-*") if parent.is_dir() else []:
        try:
            os.kill(int(p.name.rsplit("-", 2)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (IndexError, ValueError, OSError):  # not a build's folder, or its process lives
            pass


@contextlib.contextmanager
def _building(final: Path) -> Iterator[Path]:
    """Yield a temp folder next to `final`; rename it to `final` (replacing a damaged, edited or
    incomplete entry) if the block completes."""
    tmp2 = final.parent / f".tmp-{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
    shutil.rmtree(final, ignore_errors=True)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale_tmp(final.parent)
        tmp2.mkdir()
    except OSError as e:  # check_cache_dir passed, yet the folder cannot be made (/proc, a race)
        raise DataError(
            f"cannot write the cache folder {final.parent}: {e.strerror or e}; set $DIFFTRAIN_CACHE "
            "(or data.cache_dir) to a folder you can write"
        ) from e
    try:
        yield tmp2
        for p in tmp2.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp2)
        try:
            os.rename(tmp2, final)
        except OSError:
            if not final.exists():
                raise
            shutil.rmtree(tmp2, ignore_errors=True)  # another process finished the same entry first
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp2, ignore_errors=True)
        raise


def _dir_bytes(path: Path) -> int:
    """Bytes of the files in `path`; a file another run renames or removes meanwhile counts 0."""
    total = 0
    for p in path.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size if p.is_file() else 0
    return total


def _training_texts(
    sources: list[Source], data_cfg: DataConfig, max_bytes: int, progress: ProgressFn | None
) -> Iterator[str]:
    """Text for tokenizer training: at most `max_bytes`, sampled evenly over the corpus.

    Documents are cut into pieces of about TOKENIZER_SAMPLE_PIECE characters at word starts.
    With an estimated corpus size S > max_bytes, piece k of document d of source s is kept when
    u("tok", s, d[, k]) < max_bytes / S (the same for every seed). A non-empty corpus always
    gives some text (its first piece, if the sample missed every piece).
    """
    estimates = [s.estimated_bytes() for s in sources]
    known = sum(e for e in estimates if e)
    keep = min(1.0, max_bytes / known) if known and None not in estimates else 1.0
    total = min(known, max_bytes) if known else None
    used = docs = 0
    first: str | None = None
    for s in sources:
        stats = SourceStats(s.spec.source)
        for d, text in enumerate(s.documents(stats, data_cfg.on_bad_record)):
            if used >= max_bytes:
                break
            taken = False
            for k, piece in enumerate(word_start_pieces(text, TOKENIZER_SAMPLE_PIECE)):
                if first is None and piece:
                    first = piece[:max_bytes]
                if keep < 1.0 and unit_hash("tok", s.index, d, *([k] if k else [])) >= keep:
                    continue
                piece = piece[: max_bytes - used]
                if not piece:
                    break
                used += len(piece)
                taken = True
                yield piece
            docs += taken
            if progress is not None and taken and docs % 64 == 0:
                progress(PrepareProgress("tokenizer", s.spec.source, docs, used, 0, total))
        require_documents(s, stats)
    if used == 0 and first is not None:
        used, docs = len(first), 1
        yield first
    if progress is not None:
        progress(PrepareProgress("tokenizer", "", docs, used, 0, total))


def _tokenizer_key(data_cfg: DataConfig, tok_cfg: TokenizerConfig, sources: list[Source]) -> str:
    return _key(
        {
            "format": FORMAT_VERSION,
            "sources": [s.fingerprint() for s in sources],
            "on_bad_record": data_cfg.on_bad_record,
            "train": tok_cfg.train.model_dump(mode="json"),
            "tokenizers": ".".join(tokenizers.__version__.split(".")[:2]),
            "sample": 2,  # _training_texts samples pieces of documents (1: whole documents)
        }
    )


def _trained_tokenizer(final: Path) -> Tokenizer | None:
    """The tokenizer of a trained cache entry; None where it is missing, damaged or edited."""
    try:
        tok = load_tokenizer(final / "tokenizer.json")
        meta = json.loads((final / "meta.json").read_text(encoding="utf-8"))
    except (DataError, OSError, ValueError):
        return None
    return tok if isinstance(meta, dict) and meta.get("sha256") == tok.sha256 else None


def _tokenizer_entry(
    data_cfg: DataConfig, tok_cfg: TokenizerConfig, base_dir: Path, sources: list[Source] | None
) -> tuple[Path, Tokenizer | None, bool]:
    """(cache folder, tokenizer, complete) of the tokenizer `tok_cfg` names: a copy of its
    tokenizer.path, or one trained on `sources` (None until trained)."""
    root = data_cfg.resolved_cache_dir() / "tokenizers"
    tok_file = tok_cfg.file(base_dir)
    if tok_file is not None:
        tok = load_tokenizer(tok_file)
        final = root / f"file-{tok.sha256[:20]}"
        return final, tok, (final / "tokenizer.json").is_file()
    sources = resolve_sources(data_cfg, base_dir) if sources is None else sources
    final = root / _tokenizer_key(data_cfg, tok_cfg, sources)
    tok = _trained_tokenizer(final)
    return final, tok, tok is not None


def prepare_tokenizer(
    data_cfg: DataConfig,
    tok_cfg: TokenizerConfig,
    *,
    base_dir: Path,
    sources: list[Source] | None = None,
    progress: ProgressFn | None = None,
) -> tuple[Path, bool, float]:
    """Load or train the tokenizer into the cache; returns (tokenizer.json path, from cache, seconds)."""
    t0 = time.perf_counter()
    # the cache must be writable only to build: a complete (e.g. shared, read-only) one is read
    final, tok, complete = _tokenizer_entry(data_cfg, tok_cfg, base_dir, sources)
    if complete:
        return final / "tokenizer.json", True, time.perf_counter() - t0
    data_cfg.check_cache_dir()
    if trained := tok is None:
        sources = resolve_sources(data_cfg, base_dir) if sources is None else sources
        tok = train_tokenizer(
            _training_texts(sources, data_cfg, tok_cfg.train.max_bytes, progress), tok_cfg.train
        )
    with _building(final) as tmp:
        tok.save(tmp / "tokenizer.json")
        if trained:
            train = tok_cfg.train.model_dump(mode="json")
            atomic_write_json(
                tmp / "meta.json", {"train": train, "sha256": tok.sha256, "vocab_size": tok.vocab_size}
            )
    return final / "tokenizer.json", False, time.perf_counter() - t0


class _ShardWriter:
    """Appends token arrays to a flat binary file (fsynced by `_building`)."""

    def __init__(self, path: Path) -> None:
        self.path, self.f, self.tokens, self.documents = path, open(path, "wb"), 0, 0

    def write(self, ids: np.ndarray, copies: int = 1) -> None:
        self.f.write(ids.tobytes() * copies)
        self.tokens += len(ids) * copies
        self.documents += copies


def val_window_offsets(n_tokens: int, window: int, count: int) -> np.ndarray:
    """`count` window starts evenly spaced over [0, n_tokens − window] (fixed: no randomness)."""
    if count <= 1:
        return np.zeros(max(count, 0), dtype=np.int64)
    return np.floor(np.arange(count) * ((n_tokens - window) / (count - 1))).astype(np.int64)


def training_repeats(weight: float, seed: int, source: int, doc: int) -> int:
    """How often training document `doc` of a source is written (see the module docstring)."""
    whole = math.floor(weight)
    return whole + int(weight > whole and unit_hash("weight", seed, source, doc) < weight - whole)


def _build_shards(
    out: Path,
    sources: list[Source],
    tok: Tokenizer,
    data_cfg: DataConfig,
    seed: int,
    progress: ProgressFn | None,
    tail_at: int | None = None,
) -> dict[str, Any]:
    """Tokenize `sources` into out/train.bin and out/val.bin; the index's counts.

    Where the document split leaves one side empty, validation is the tail of the data instead:
    `tail_at` is where it starts in the unweighted stream (with every weight 1, the training
    stream's tail, cut in place; else the data is read again with `tail_at` set). A tokenizer
    that puts a start token before every text (Llama's <s>) starts each document with it."""
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    eos = np.array([tok.eos_id], dtype=dtype)
    start = np.array([tok.document_start_id] if tok.document_start_id != tok.eos_id else [], dtype=dtype)
    train, val = _ShardWriter(out / "train.bin"), _ShardWriter(out / "val.bin")
    estimates = [s.estimated_bytes() for s in sources]
    total = sum(e for e in estimates if e) if None not in estimates else None
    all_stats: list[SourceStats] = []
    seen_bytes = seen_docs = seen_tokens = 0
    try:
        for s in sources:
            stats = SourceStats(s.spec.source)
            all_stats.append(stats)
            d = 0
            for batch in text_batches(s.documents(stats, data_cfg.on_bad_record), 4096):
                for ids in tok.encode_arrays(batch, dtype, allow_special=s.spells_special_tokens):
                    arr = np.concatenate([start, ids, eos])
                    if tail_at is not None:  # the unweighted stream's tail is validation
                        cut = min(max(tail_at - seen_tokens, 0), len(arr))
                        copies = training_repeats(s.spec.weight, seed, s.index, d)
                        if cut and copies:
                            train.write(arr[:cut], copies)
                        if cut < len(arr):
                            val.write(arr[cut:])
                    elif held_out(data_cfg.val_fraction, seed, s.index, d):
                        val.write(arr)
                    elif copies := training_repeats(s.spec.weight, seed, s.index, d):
                        train.write(arr, copies)
                    seen_tokens += len(arr)
                    d += 1
                seen_docs += len(batch)
                seen_bytes += sum(map(len, batch))
                if progress is not None:
                    progress(
                        PrepareProgress("shards", s.spec.source, seen_docs, seen_bytes, seen_tokens, total)
                    )
            require_documents(s, stats)
    finally:
        train.f.close()
        val.f.close()

    split = "document" if tail_at is None else "tail"
    if tail_at is None and data_cfg.val_fraction > 0 and (train.tokens == 0 or val.tokens == 0):
        if any(s.spec.weight != 1 for s in sources):
            # a weighted stream's tail would hold copies of training text (or none of a document
            # a weight below 1 left out): cut the tail from the documents as they are, read again
            n_val = max(1, math.ceil(seen_tokens * data_cfg.val_fraction))
            return _build_shards(out, sources, tok, data_cfg, seed, progress, max(0, seen_tokens - n_val))
        if train.tokens == 0:
            # every document (e.g. the only one) landed in validation: make it the stream to split
            os.replace(val.path, train.path)
            train.tokens, train.documents, val.tokens, val.documents = val.tokens, val.documents, 0, 0
            val.path.touch()
        # too few documents for a document split (e.g. one big text file): hold out the tail
        n_val = max(1, math.ceil(train.tokens * data_cfg.val_fraction))
        cut = (train.tokens - n_val) * dtype.itemsize
        np.fromfile(train.path, dtype=dtype, offset=cut).tofile(val.path)
        os.truncate(train.path, cut)
        train.tokens, val.tokens = train.tokens - n_val, n_val
        split = "tail"
    return {
        "dtype": dtype.name,
        "train": {"file": "train.bin", "tokens": train.tokens, "documents": train.documents},
        "val": {"file": "val.bin", "tokens": val.tokens, "documents": val.documents},
        "documents": sum(st.documents for st in all_stats),
        "bytes": sum(st.bytes for st in all_stats),
        "tokens": seen_tokens,
        "bad_records": sum(st.bad_records for st in all_stats),
        "split": split,
        "sources": [asdict(st) for st in all_stats],
    }


def _valid_entry(final: Path) -> dict[str, Any] | None:
    """The index of a complete cache entry, or None if it is missing or damaged."""
    try:
        index = json.loads((final / "index.json").read_text())
        itemsize = np.dtype(index["dtype"]).itemsize
        for split in ("train", "val"):
            st = (final / index[split]["file"]).stat()
            # a shard of another size, or changed in place after it was built
            if (
                st.st_size != index[split]["tokens"] * itemsize
                or index[split].get("mtime_ns", st.st_mtime_ns) != st.st_mtime_ns
            ):
                return None
        return index if index.get("format") == FORMAT_VERSION else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _shards_key(
    sources: list[Source], tok: Tokenizer, data_cfg: DataConfig, seed: int
) -> tuple[str, dict[str, Any], str]:
    """(sources' fingerprint, the split settings, the cache key) of the shards `prepare_data` builds."""
    fingerprint = hashlib.sha256("".join(s.fingerprint() for s in sources).encode()).hexdigest()
    settings = {
        "val_fraction": data_cfg.val_fraction,
        "on_bad_record": data_cfg.on_bad_record,
        "seed": seed,
        "weights": [s.spec.weight for s in sources],
    }
    if tok.document_start_id != tok.eos_id:  # each document written after its start token
        settings["document_start_id"] = tok.document_start_id
    key = _key({"format": FORMAT_VERSION, "fingerprint": fingerprint, "tokenizer": tok.sha256, **settings})
    return fingerprint, settings, key


def cached_index(
    data_cfg: DataConfig, tok_cfg: TokenizerConfig, *, seed: int, base_dir: str | os.PathLike[str]
) -> dict[str, Any] | None:
    """The index.json of the shards `prepare_data` would serve from the cache, or None when it
    would build them (or its tokenizer) first. Reads no documents, writes nothing."""
    base = Path(base_dir).expanduser().resolve()
    sources = resolve_sources(data_cfg, base)
    try:  # not copied or trained yet, damaged or edited: the run makes it (again)
        _, tok, complete = _tokenizer_entry(data_cfg, tok_cfg, base, sources)
    except TokenizerError:
        return None
    if tok is None or not complete:
        return None
    return _valid_entry(
        data_cfg.resolved_cache_dir() / "shards" / _shards_key(sources, tok, data_cfg, seed)[2]
    )


def check_split_sizes(train_tokens: int, val_tokens: int, seq_len: int, val_windows: int) -> None:
    """DataError for a split too short for one window (validation only if `val_windows`)."""
    window = seq_len + 1
    if train_tokens < window:
        raise DataError(
            f"the training split has {train_tokens} tokens, fewer than one window of "
            f"max_seq_len + 1 = {window}; add data or lower model.max_seq_len"
        )
    if val_windows > 0 and val_tokens < window:
        raise DataError(
            f"the validation split has {val_tokens} tokens, fewer than one window of "
            f"max_seq_len + 1 = {window}; raise data.val_fraction, or set data.val_windows: 0"
        )


def prepare_data(
    data_cfg: DataConfig,
    tok_cfg: TokenizerConfig,
    *,
    seed: int,
    base_dir: str | os.PathLike[str],
    progress: ProgressFn | None = None,
    sources: list[Source] | None = None,
) -> PreparedData:
    """Tokenizer + token shards for a recipe's data, built once and then served from the cache.
    `base_dir`: what relative paths resolve against; `sources`: `data_cfg.sources` resolved."""
    t0 = time.perf_counter()
    base = Path(base_dir).expanduser().resolve()
    if sources is None:  # the recipe's: refused where two of them read the same documents
        sources = resolve_sources(data_cfg, base)
        check_distinct(sources)
    for source in sources:  # before the cache can answer for them
        source.check_local_files()
    tok_path, tok_cached, tok_seconds = prepare_tokenizer(
        data_cfg, tok_cfg, base_dir=base, sources=sources, progress=progress
    )
    tok = load_tokenizer(tok_path)
    fingerprint, settings, key = _shards_key(sources, tok, data_cfg, seed)
    final = data_cfg.resolved_cache_dir() / "shards" / key
    index = _valid_entry(final)
    from_cache = index is not None
    t1 = time.perf_counter()
    if index is None:
        data_cfg.check_cache_dir()
        with _building(final) as tmp:
            built = _build_shards(tmp, sources, tok, data_cfg, seed, progress)
            for split in ("train", "val"):  # written once: a later change to a shard is damage
                built[split]["mtime_ns"] = (tmp / built[split]["file"]).stat().st_mtime_ns
            index = {
                "format": FORMAT_VERSION,
                "fingerprint": fingerprint,
                "tokenizer_sha256": tok.sha256,
                "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id,
                **settings,
                **built,
                "build_seconds": round(time.perf_counter() - t1, 3),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            atomic_write_json(tmp / "index.json", index)
    stats = PrepareStats(
        **{k: index[k] for k in ("documents", "bytes", "tokens", "bad_records", "split", "sources")},
        **{f"{split}_{k}": index[split][k] for split in ("train", "val") for k in ("tokens", "documents")},
        vocab_size=tok.vocab_size,
        seconds=time.perf_counter() - t0,
        tokenizer_seconds=tok_seconds,
        cache_bytes=_dir_bytes(final) + _dir_bytes(tok_path.parent),
    )
    return PreparedData(
        tokenizer_path=tok_path,
        train_path=final / index["train"]["file"],
        val_path=final / index["val"]["file"],
        index=index,
        cache_dir=final,
        stats=stats,
        from_cache=from_cache,
        tokenizer_from_cache=tok_cached,
    )


def open_shards(shard_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], Path, Path]:
    """(index, train path, val path) of a shard folder written by `prepare_data`."""
    d = Path(shard_dir)
    index = _valid_entry(d)
    if index is None:
        raise DataError(
            f"{d} is not a complete token-shard folder (no valid index.json); run `difftrain prepare` "
            "on the recipe to build it"
        )
    return index, d / index["train"]["file"], d / index["val"]["file"]
