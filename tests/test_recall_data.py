"""builtin:recall: examples are seeded, answerable by construction, held out from training, and
trained on their answers only."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from difftrain.data.config import DataConfig, RecallSpec, TokenizerConfig, TokenizerTrainConfig
from difftrain.data.modules import IGNORE_INDEX, PretrainDataModule, SFTDataModule
from difftrain.data.recall import (
    held_out_examples,
    key_symbol,
    make_recall_example,
    recall_records,
    train_examples,
    value_symbol,
)
from difftrain.data.shards import prepare_data
from difftrain.errors import DataError


def _example(seed: int, **kw: object):
    args = {"n_pairs": 8, "n_queries": 3, "distractor_rate": 1.5, "key_vocab": 20, "value_vocab": 10}
    return make_recall_example(**{**args, **kw}, seed=seed)  # type: ignore[arg-type]


def test_an_example_is_a_pure_function_of_its_seed() -> None:
    assert _example(5) == _example(5)
    assert _example(5).text == _example(5).text
    assert len({_example(s).text for s in range(20)}) == 20
    spec = RecallSpec(n_pairs=4, num_documents=5, seed=3)
    assert [e.text for e in train_examples(spec)] == [e.text for e in train_examples(spec)]
    other = spec.model_copy(update={"seed": 4})
    assert [e.text for e in train_examples(spec)] != [e.text for e in train_examples(other)]


def test_each_query_is_answered_by_the_value_that_follows_its_key_in_the_context() -> None:
    for seed in range(30):
        ex = _example(seed)
        ctx = list(ex.context)
        keys = [s for s in ctx if s.isupper()]
        assert len(keys) == len(set(keys)) == 8  # distinct keys, one per pair
        assert len(ex.queries) == len(set(ex.queries)) == 3  # distinct pairs are asked
        for k, answer in zip(ex.query_keys, ex.answers, strict=True):
            assert ctx.count(k) == 1 and ctx[ctx.index(k) + 1] == answer
        # after each pair, 1 or 2 distractors (rate 1.5): values that no key precedes
        starts = [i for i, s in enumerate(ctx) if s.isupper()] + [len(ctx)]
        gaps = [b - a - 2 for a, b in zip(starts, starts[1:], strict=False)]
        assert set(gaps) <= {1, 2} and all(ctx[i].islower() for i in range(len(ctx)) if i not in starts)
        assert ex.text == "".join(" " + s for s in ctx) + "".join(
            f" {k} {v}" for k, v in zip(ex.query_keys, ex.answers, strict=True)
        )


def test_a_whole_distractor_rate_puts_exactly_that_many_after_every_pair() -> None:
    ex = _example(1, distractor_rate=2.0)
    assert len(ex.context) == 8 * 4
    assert len(_example(1, distractor_rate=0.0).context) == 16


def test_symbols_name_keys_and_values_apart() -> None:
    assert [key_symbol(i) for i in (0, 1, 26, 675)] == ["AA", "AB", "BA", "ZZ"]
    assert value_symbol(27) == "bb"
    with pytest.raises(ValueError):
        key_symbol(676)


def test_validation_examples_never_repeat_a_training_example() -> None:
    # a task with few distinct examples (1 pair of 3 keys × 3 values: 9), so that seeds collide
    spec = RecallSpec(
        n_pairs=1, n_queries=1, key_vocab=3, value_vocab=3, num_documents=5, val_documents=5, seed=3
    )
    train, val = recall_records([spec])
    train_texts = {"".join(t for t, _ in r["segments"]) for r in train}
    val_texts = ["".join(t for t, _ in r["segments"]) for r in val]
    assert len(train) == 5 and len(val) == 5
    assert len(train_texts) == 2  # the training seeds did repeat examples ...
    assert not train_texts & set(val_texts) and len(set(val_texts)) == 5  # ... validation never does
    with pytest.raises(DataError, match="too few distinct examples"):
        held_out_examples(spec, 8, exclude=train_texts)  # 9 - 2 are left


def test_settings_a_user_gets_wrong_are_refused_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="larger than key_vocab"):
        RecallSpec(n_pairs=70, key_vocab=64)
    with pytest.raises(ValidationError, match="larger than n_pairs"):
        RecallSpec(n_pairs=4, n_queries=5)
    with pytest.raises(ValidationError, match="apply only to source 'builtin:recall'"):
        DataConfig(sources=[{"source": "builtin:needles", "recall": {"n_pairs": 4}}])
    with pytest.raises(ValidationError, match="cannot share data.sources"):
        DataConfig(sources=["builtin:recall", "builtin:python-stdlib"])
    ok = DataConfig(sources=["builtin:recall", {"source": "builtin:recall", "recall": {"n_pairs": 4}}])
    assert [s.n_pairs for s in ok.recall_specs or []] == [16, 4]


def _prepared(tmp_path, spec: RecallSpec):
    data = DataConfig(
        sources=[{"source": "builtin:recall", "recall": spec.model_dump()}],
        val_fraction=0.0,
        cache_dir=str(tmp_path),
    )
    tok = TokenizerConfig(train=TokenizerTrainConfig(vocab_size=400))
    return data, prepare_data(data, tok, seed=0, base_dir=tmp_path)


def test_training_puts_the_loss_on_the_answers_only(tmp_path) -> None:
    spec = RecallSpec(n_pairs=6, n_queries=3, distractor_rate=0.5, num_documents=200, val_documents=8, seed=2)
    data, prepared = _prepared(tmp_path, spec)
    dm = PretrainDataModule.from_config(prepared, data, seq_len=64, micro_batch_size=4, seed=0)
    assert isinstance(dm, SFTDataModule) and len(dm.val_examples) == 8
    tok = dm.tokenizer
    for (ids, targets), ex in zip(dm.train_examples[:20], train_examples(spec), strict=False):
        answers = [tok.encode(" " + v) for v in ex.answers]
        trained = [(i, t) for i, t in enumerate(targets) if t != IGNORE_INDEX]
        assert [[t] for _, t in trained] == answers  # one token per answer, and nothing else trained
        full = ids + [targets[-1]]
        assert full == [t for text, _ in ex.segments() for t in tok.encode(text)]
        for i, t in trained:  # the target at i is the token after position i: the answer itself
            assert full[i + 1] == t and tok.decode([full[i]]).strip() in ex.query_keys
    batch = next(iter(dm.train_dataloader()))
    assert (batch["targets"] != IGNORE_INDEX).sum().item() == 4 * 3


def test_examples_longer_than_the_context_are_refused(tmp_path) -> None:
    spec = RecallSpec(n_pairs=16, n_queries=4, num_documents=50, val_documents=4)
    data, prepared = _prepared(tmp_path, spec)
    with pytest.raises(DataError, match="longer than model.max_seq_len=24"):
        PretrainDataModule.from_config(prepared, data, seq_len=24, micro_batch_size=4, seed=0)
