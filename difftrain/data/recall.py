"""`builtin:recall`: multi-query associative recall (MQAR), the task of Arora et al., "Zoology"
(2023), which separates attention variants at small scale.

An example is a context of N key→value pairs, optionally with distractor tokens between the
pairs, followed by queries of some of the keys, each followed by its value:

    AC ka BF qd mo AA ka ... BF qd AC ka
    (pairs AC→ka, BF→qd, AA→ka; `mo` a distractor; then the queries BF and AC, each answered)

Keys are upper-case letter pairs (`AA`, `AB`, ...), values and distractors lower-case ones,
each after a space (one BPE token each). Keys are distinct within an example, values drawn with
replacement, and a distractor is a value no key precedes, so every query has one answer. The
queries name distinct pairs in a random order; training puts the loss on the answers only
(`segments`). Example i of a split is a pure function of (spec, split, i); validation and
evaluation examples skip any whose text is a training example's.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from difftrain.data.builtin import stable_seed
from difftrain.data.config import RecallSpec
from difftrain.errors import DataError

MAX_VOCAB = 26 * 26
"""The most keys (and the most values) there are symbols for: two letters each."""

SPLITS = ("train", "val", "eval")


def key_symbol(i: int) -> str:
    """Key i as text: two upper-case letters (0 → AA, 1 → AB, ... 675 → ZZ)."""
    if not 0 <= i < MAX_VOCAB:
        raise ValueError(f"key index {i} is outside [0, {MAX_VOCAB})")
    return chr(65 + i // 26) + chr(65 + i % 26)


def value_symbol(j: int) -> str:
    """Value j as text: two lower-case letters (0 → aa, ... 675 → zz)."""
    return key_symbol(j).lower()


@dataclass(frozen=True)
class RecallExample:
    """One MQAR example: `context` is the symbols of the pairs and distractors, `queries` the
    queried pair indices in query order."""

    keys: tuple[int, ...]
    values: tuple[int, ...]
    context: tuple[str, ...]
    queries: tuple[int, ...]

    @property
    def answers(self) -> list[str]:
        return [value_symbol(self.values[q]) for q in self.queries]

    @property
    def query_keys(self) -> list[str]:
        return [key_symbol(self.keys[q]) for q in self.queries]

    def segments(self) -> list[tuple[str, bool]]:
        """(text, trained) pieces: the context and each query key untrained, each answer trained."""
        out = [("".join(" " + s for s in self.context), False)]
        for k, v in zip(self.query_keys, self.answers, strict=True):
            out += [(" " + k, False), (" " + v, True)]
        return out

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments())


def make_recall_example(
    *, n_pairs: int, n_queries: int, distractor_rate: float, key_vocab: int, value_vocab: int, seed: int
) -> RecallExample:
    """One example, deterministic for `seed`: after each pair come ⌊distractor_rate⌋
    distractors, plus one more with probability distractor_rate − ⌊distractor_rate⌋."""
    if not 1 <= n_pairs <= key_vocab <= MAX_VOCAB:
        raise ValueError(f"need 1 <= n_pairs={n_pairs} <= key_vocab={key_vocab} <= {MAX_VOCAB}")
    if not 1 <= value_vocab <= MAX_VOCAB:
        raise ValueError(f"value_vocab must be in [1, {MAX_VOCAB}], got {value_vocab}")
    if not 1 <= n_queries <= n_pairs:
        raise ValueError(f"n_queries must be in [1, n_pairs={n_pairs}], got {n_queries}")
    if distractor_rate < 0:
        raise ValueError(f"distractor_rate must be >= 0, got {distractor_rate}")
    rng = random.Random(seed)
    pool = list(range(key_vocab))
    keys = tuple(pool.pop(int(rng.random() * len(pool))) for _ in range(n_pairs))
    values = tuple(int(rng.random() * value_vocab) for _ in range(n_pairs))
    whole, frac = divmod(distractor_rate, 1.0)
    context: list[str] = []
    for k, v in zip(keys, values, strict=True):
        context += [key_symbol(k), value_symbol(v)]
        n = int(whole) + (rng.random() < frac)
        context += [value_symbol(int(rng.random() * value_vocab)) for _ in range(n)]
    order = list(range(n_pairs))
    queries = tuple(order.pop(int(rng.random() * len(order))) for _ in range(n_queries))
    return RecallExample(keys=keys, values=values, context=tuple(context), queries=queries)


def spec_example(spec: RecallSpec, split: str, index: int) -> RecallExample:
    """Example `index` of a split ("train", "val" or "eval") of the task `spec`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    shape = spec.model_dump(include={"n_pairs", "n_queries", "distractor_rate", "key_vocab", "value_vocab"})
    return make_recall_example(**shape, seed=stable_seed("recall", split, spec.seed, index))


def train_examples(spec: RecallSpec) -> Iterator[RecallExample]:
    """The `num_documents` training examples of a source."""
    return (spec_example(spec, "train", i) for i in range(spec.num_documents))


def held_out_examples(
    spec: RecallSpec, count: int, *, split: str = "val", exclude: Iterable[str] = ()
) -> list[RecallExample]:
    """`count` examples of the held-out `split`, none of whose texts is in `exclude` (the training
    texts) or repeated. A DataError when the task has too few distinct examples to give them."""
    seen, out = set(exclude), []
    for i in range(20 * count + 1000):
        if len(out) == count:
            break
        ex = spec_example(spec, split, i)
        if ex.text not in seen:
            seen.add(ex.text)
            out.append(ex)
    if len(out) < count:
        raise DataError(
            f"builtin:recall: only {len(out)} of {count} held-out examples differ from the training "
            f"examples (n_pairs={spec.n_pairs}, key_vocab={spec.key_vocab}, value_vocab={spec.value_vocab}): "
            "the task has too few distinct examples; raise key_vocab or value_vocab"
        )
    return out


def recall_documents(spec: RecallSpec) -> Iterator[str]:
    """The documents of `builtin:recall` as plain text (what the tokenizer is trained on)."""
    return (ex.text for ex in train_examples(spec))


def estimated_bytes(spec: RecallSpec) -> int:
    return int(spec.num_documents * (spec.n_pairs * (6 + 3 * spec.distractor_rate) + 6 * spec.n_queries))


def record_segments(record: dict[str, object]) -> list[tuple[str, bool]]:
    """The SFT template of recall records: their own segments (answers trained, the rest not)."""
    return [(str(t), bool(trained)) for t, trained in record["segments"]]  # type: ignore[union-attr]


def recall_records(specs: list[RecallSpec]) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(training records, validation records) of the recall sources: each source's training
    examples, and its `val_documents` validation examples, none of which is a training text.
    A record is {"segments": the example's segments}."""
    train: list[RecallExample] = []
    val: list[RecallExample] = []
    for spec in specs:
        exs = list(train_examples(spec))
        train += exs
        val += held_out_examples(spec, spec.val_documents, split="val", exclude=(ex.text for ex in exs))
    return [{"segments": ex.segments()} for ex in train], [{"segments": ex.segments()} for ex in val]
