"""Tokenizers: train a byte-level BPE, load any HF `tokenizer.json`, stream-decode.

A trained tokenizer is byte-level BPE (GPT-2 style, `tokenizers` library): numbers split into
single digits (optional), then GPT-2's regex and byte-to-unicode map, so decode(encode(x)) == x
for any string x (no normalisation, no unknown token); the special tokens `SPECIAL_TOKENS` get
ids 0..6; no post-processor (`encode` adds <|bos|> / <|eos|> only when asked).

Any HF tokenizer.json (GPT-2, Llama, ...) loads too; its bos/eos/pad are found by their usual
names.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from difftrain.data.config import SPECIAL_TOKENS, TokenizerTrainConfig
from difftrain.errors import DifftrainError, TokenizerError
from difftrain.io import atomic_write_text

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

# Names under which other tokenizers spell the same roles (first match wins).
_EOS_NAMES = (EOS, "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
_BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
_PAD_NAMES = (PAD, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")

ENCODE_PIECE = 1 << 18
"""Characters: a longer text is encoded in pieces of about this size (`tokenizers` holds ~130
bytes per character while it encodes a text)."""


def word_start_pieces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of at most about `size` characters, each cut before a space that
    starts a word of letters (" x"): GPT-2's pre-tokenizer splits there anyway (a run of spaces
    gives its last one to the word), so byte-level BPE encodes the pieces to the same ids as the
    whole. (Not before " 4": with single-digit splitting, the space does not join the digit.) A
    stretch of `size` characters with no such space is cut where it reaches `size`."""
    if len(text) <= size:
        return [text]
    pieces: list[str] = []
    start = 0
    while len(text) - start > size:
        lo, cut = start + size // 2, start + size
        j = text.rfind(" ", lo, cut)
        while j > lo and not text[j + 1].isalpha():
            j = text.rfind(" ", lo, j)
        cut = j if j > lo else cut
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's map from the 256 byte values to printable unicode characters:
    printable bytes map to themselves, the others in order to chr(256), chr(257), ..."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_UNICODE_TO_BYTE = _unicode_to_byte()


class Tokenizer:
    """A `tokenizers.Tokenizer` with difftrain's conventions (special-token ids, hashing, saving)."""

    def __init__(self, tk: tokenizers.Tokenizer, path: Path | None = None) -> None:
        self.tk = tk
        self.path = path
        self.eos_id = self._find(_EOS_NAMES)
        if self.eos_id is None:
            where = f"{path}: " if path else ""
            raise TokenizerError(
                f"{where}tokenizer has no end-of-document token (looked for {', '.join(_EOS_NAMES)}); "
                "add one as a special token, or let difftrain train a tokenizer (unset tokenizer.path)"
            )
        self.bos_id: int = self._find(_BOS_NAMES, self.eos_id)
        self.pad_id: int = self._find(_PAD_NAMES, self.eos_id)

    @functools.cached_property
    def document_start_id(self) -> int:
        """The token a document starts after: the one token this tokenizer's post-processor puts
        before a text (an imported Llama's `<s>`: what that model saw first in training), else
        <|eos|> (difftrain's stream is `doc eos doc eos …`, so eos precedes every document)."""
        if self.tk.post_processor is not None:
            plain = self.tk.encode("a", add_special_tokens=False).ids
            full = self.tk.encode("a", add_special_tokens=True).ids
            if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
                return full[0]  # one token before the text (any after it is not a start)
        return self.eos_id

    def _find(self, names: Sequence[str], default: int | None = None) -> int | None:
        return next((i for i in map(self.tk.token_to_id, names) if i is not None), default)

    def _ids(self) -> tuple[int, list[int]]:
        """(max id + 1, the ids below it that stand for no token), added tokens included;
        recomputed when tokens are added."""
        count = self.tk.get_vocab_size(with_added_tokens=True)
        if getattr(self, "_ids_for", None) != count:
            used = set(self.tk.get_vocab(with_added_tokens=True).values())
            size = max(count, max(used, default=-1) + 1)
            self._ids_for, self._ids_of = count, (size, [i for i in range(size) if i not in used])
        return self._ids_of

    @property
    def vocab_size(self) -> int:
        """The rows a model needs: more than the count of tokens where a tokenizer.json's ids
        have gaps (never for a tokenizer difftrain trains)."""
        return self._ids()[0]

    @property
    def unused_ids(self) -> list[int]:
        """Ids below `vocab_size` that stand for no token (a tokenizer.json whose ids have gaps)."""
        return self._ids()[1]

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def encode_batch(self, texts: Sequence[str], allow_special: bool = True) -> list[list[int]]:
        """Encode many texts in parallel; no special tokens added. allow_special=False encodes
        text that spells a special token ("<|eos|>") as ordinary bytes, so raw documents can
        never forge a document boundary."""
        fast = getattr(self.tk, "encode_batch_fast", None) or self.tk.encode_batch
        self.tk.encode_special_tokens = not allow_special
        try:
            return [e.ids for e in fast(list(texts), add_special_tokens=False)]
        finally:
            self.tk.encode_special_tokens = False

    def encode_arrays(
        self, texts: Sequence[str], dtype: np.dtype, allow_special: bool = True
    ) -> list[np.ndarray]:
        """`encode_batch` as arrays, in bounded memory: long texts are encoded in pieces where
        that gives the same ids (`splits_exactly`), a `text_batches` batch at a time."""
        pieces = [
            (i, p)
            for i, text in enumerate(texts)
            for p in (word_start_pieces(text, ENCODE_PIECE) if self.splits_exactly else [text])
        ]
        out: list[list[np.ndarray]] = [[] for _ in texts]
        owners = iter(i for i, _ in pieces)
        for group in text_batches(p for _, p in pieces):
            for ids in self.encode_batch(group, allow_special):
                out[next(owners)].append(np.asarray(ids, dtype=dtype))
        return [
            parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, dtype)
            for parts in out
        ]

    @cached_property
    def splits_exactly(self) -> bool:
        """Whether encoding a text in `word_start_pieces` gives the ids of encoding it whole: true
        for byte-level BPE with GPT-2's regex (the tokenizers difftrain trains, GPT-2's), without
        a normaliser or a prefix space; others are encoded whole."""
        spec = json.loads(self.tk.to_str())
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]

        def gpt2_byte_level(p: dict) -> bool:
            return p.get("type") == "ByteLevel" and not p.get("add_prefix_space") and p.get("use_regex", True)

        return (
            spec.get("normalizer") is None
            and any(gpt2_byte_level(p) for p in steps)
            and all(gpt2_byte_level(p) or p.get("type") == "Digits" for p in steps)
        )

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(i)

    @property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self.tk.get_added_tokens_decoder().items() if t.special}

    def to_str(self) -> str:
        return self.tk.to_str()

    @cached_property
    def sha256(self) -> str:
        """Hash of the serialised tokenizer: the identity token shards are keyed by."""
        return hashlib.sha256(self.tk.to_str().encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike[str]) -> Path:
        atomic_write_text(Path(path), self.tk.to_str(pretty=True))
        return Path(path)

    @cached_property
    def is_byte_level(self) -> bool:
        spec = json.loads(self.tk.to_str())
        return (spec.get("decoder") or {}).get("type") == "ByteLevel" and spec.get("normalizer") is None

    @cached_property
    def _id_bytes(self) -> list[bytes]:
        """For byte-level tokenizers: the raw bytes each id stands for."""
        added = {i: t.content for i, t in self.tk.get_added_tokens_decoder().items()}

        def raw(tok: str) -> bytes:
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in tok)
            except KeyError:
                return tok.encode("utf-8")

        return [
            added[i].encode("utf-8") if i in added else raw(self.tk.id_to_token(i) or "")
            for i in range(self.vocab_size)
        ]

    def stream_decoder(self, skip_special_tokens: bool = False, context: Sequence[int] = ()) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens, context=context)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, path={self.path})"
        )


def record_start_id(tokenizer: Tokenizer) -> int | None:
    """The token a fine-tuning example (and a prompt) starts with: the tokenizer's own text-start
    token (an imported Llama's <s>, `document_start_id`); None for difftrain's tokenizers, whose
    documents follow the previous one's eos."""
    start = getattr(tokenizer, "document_start_id", None)
    return start if start is not None and start != tokenizer.eos_id else None


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the text that became complete (whole UTF-8
    characters only); `flush()` returns what is left at the end of generation.

    Byte-level tokenizers feed each id's bytes to an incremental UTF-8 decoder; others re-decode
    the tail of the ids from a moving offset and hold text back while it ends in U+FFFD.
    `context`: the ids before the first pushed one (the prompt), decoded before new ids so that
    a continuation piece ("▁world" after "Hello") decodes as one (" world").
    """

    CONTEXT = 6  # context ids kept for the generic path (as vLLM's detokenizer keeps 5 and more)

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = False, context: Sequence[int] = ()
    ) -> None:
        self.tok = tokenizer
        self.skip = set(tokenizer.special_tokens.values()) if skip_special_tokens else set()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        n = tokenizer.vocab_size
        self._ids: list[int] = [int(i) for i in context if 0 <= int(i) < n][-self.CONTEXT :]
        self._prefix = 0  # start of the window re-decoded (generic path)
        self._read = len(self._ids)  # ids whose text has been emitted (generic path)

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            return ""
        if self.tok.is_byte_level:
            # ids past the tokenizer's vocabulary (the model's padded rows) stand for no text
            table = self.tok._id_bytes
            return self._utf8.decode(table[token_id] if 0 <= token_id < len(table) else b"")
        self._ids.append(token_id)
        prefix_text, new_text = self._texts()
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return out
        return ""

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        if self.tok.is_byte_level:
            return self._utf8.decode(b"", final=True)
        prefix_text, new_text = self._texts()
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    def _texts(self) -> tuple[str, str]:
        """The window's text before and after the ids not yet emitted (generic path)."""
        return self.tok.decode(self._ids[self._prefix : self._read]), self.tok.decode(
            self._ids[self._prefix :]
        )


def tokenizer_file(path: str | os.PathLike[str]) -> Path:
    """The tokenizer.json that `path` (the file, or a folder holding one) names; TokenizerError
    when there is none (checked before a run loads torch, `cli.common.check_files`)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(
            f"tokenizer file {p} does not exist; point tokenizer.path to a Hugging Face tokenizer.json "
            "(or a folder holding one), or unset it to train a tokenizer on the data"
        )
    return p


def load_tokenizer(path: str | os.PathLike[str], fix: str | None = None) -> Tokenizer:
    """Load a HF tokenizer.json (or a folder holding one). `fix`: what the error for an invalid
    file advises (default: about a recipe's tokenizer.path)."""
    p = tokenizer_file(path)
    try:
        tk = tokenizers.Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises plain Exception with a serde message
        fix = fix or (
            "use a file written by the `tokenizers` library (tokenizer.save / save_pretrained), or "
            "unset tokenizer.path to train one"
        )
        raise TokenizerError(
            f"{p}: not a valid tokenizer.json ({str(e).splitlines()[0] if str(e) else type(e).__name__}); {fix}"
        ) from e
    return Tokenizer(tk, path=p)


def check_vocab_fits(tokenizer: Tokenizer, vocab_size: int | str) -> int:
    """The model's vocabulary size ("auto": the tokenizer's); TokenizerError where a token id
    would have no embedding row (a larger model vocabulary is fine: unused rows)."""
    if vocab_size == "auto":
        return tokenizer.vocab_size
    if not isinstance(vocab_size, int) or vocab_size < tokenizer.vocab_size:
        where = f" ({tokenizer.path})" if tokenizer.path else ""
        raise TokenizerError(
            f"the tokenizer{where} has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}: "
            f"ids up to {tokenizer.vocab_size - 1} would have no embedding; set model.vocab_size: auto "
            f"(or at least {tokenizer.vocab_size})"
        )
    return vocab_size


def text_batches(texts: Iterable[str], max_texts: int | None = None) -> Iterator[list[str]]:
    """`texts` in batches of about 1 MiB of characters (and at most `max_texts` texts)."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= 1 << 20 or len(batch) == max_texts:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def train_tokenizer(
    texts: Iterable[str], cfg: TokenizerTrainConfig, *, length: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE on `texts`: deterministic for the same texts and config (ties
    between pairs are broken by the pair); fewer than `cfg.vocab_size` tokens when the text runs
    out of pairs occurring `min_frequency` times."""
    tk = tokenizers.Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = [pre_tokenizers.Digits(individual_digits=True)] if cfg.individual_digits else []
    tk.pre_tokenizer = pre_tokenizers.Sequence([*digits, byte_level]) if digits else byte_level
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *cfg.extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    batches = text_batches(texts)
    first = next(batches, None)
    if first is None:
        raise TokenizerError("no text to train the tokenizer on: the data sources yielded no documents")
    try:
        tk.train_from_iterator(itertools.chain([first], batches), trainer=trainer, length=length)
    except DifftrainError:
        raise  # a data error raised while reading the sources
    except Exception as e:
        raise TokenizerError(f"tokenizer training failed: {e}") from e
    return Tokenizer(tk)
