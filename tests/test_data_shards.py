"""prepare_data: exact token shards, deterministic split, weights, and a cache that never lies."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from difftrain.data import shards
from difftrain.data import sources as sources_mod
from difftrain.data.config import DataConfig, TokenizerConfig, TokenizerTrainConfig
from difftrain.data.shards import prepare_data
from difftrain.data.tokenizer import load_tokenizer
from difftrain.errors import DataError, TokenizerError

TOK = TokenizerConfig(train=TokenizerTrainConfig(vocab_size=300))


def make_corpus(root: Path, n: int = 30) -> Path:
    c = root / "corpus"
    c.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (c / f"doc{i:03d}.txt").write_text(
            f"Document {i}: " + " ".join(f"word{(i * j) % 17}" for j in range(40))
        )
    return c


def cfg(tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(
        **{"sources": ["corpus"], "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.2, **kw}
    )


def read_docs(path: Path, dtype: np.dtype, eos: int) -> list[list[int]]:
    arr = np.fromfile(path, dtype=dtype).tolist()
    out, cur = [], []
    for t in arr:
        if t == eos:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    assert cur == []  # every document ends with eos
    return out


def test_shards_hold_every_document_encoded_and_eos_separated(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    p = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    tok = load_tokenizer(p.tokenizer_path)
    assert p.index["dtype"] == "uint16" and p.dtype == np.uint16
    train = read_docs(p.train_path, p.dtype, tok.eos_id)
    val = read_docs(p.val_path, p.dtype, tok.eos_id)
    expected = [tok.encode((tmp_path / "corpus" / f"doc{i:03d}.txt").read_text()) for i in range(30)]
    assert sorted(train + val) == sorted(expected)
    assert 1 <= len(val) < 15 and p.stats.val_documents == len(val)
    total = sum(len(d) + 1 for d in expected)
    assert p.stats.tokens == total == p.stats.train_tokens + p.stats.val_tokens
    assert p.index["train"]["tokens"] * 2 == p.train_path.stat().st_size
    assert p.stats.documents == 30 and p.stats.bytes == sum(len(t.encode()) for t in _texts(tmp_path))
    assert not p.from_cache and not p.tokenizer_from_cache


def _texts(tmp_path: Path) -> list[str]:
    return [f.read_text() for f in sorted((tmp_path / "corpus").iterdir())]


def test_split_is_deterministic_for_the_seed_and_changes_with_it(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    a = prepare_data(cfg(tmp_path), TOK, seed=1, base_dir=tmp_path)
    a_val = a.val_path.read_bytes()
    b = prepare_data(cfg(tmp_path, cache_dir=str(tmp_path / "other")), TOK, seed=1, base_dir=tmp_path)
    assert b.val_path.read_bytes() == a_val and b.train_path.read_bytes() == a.train_path.read_bytes()
    c = prepare_data(cfg(tmp_path), TOK, seed=2, base_dir=tmp_path)
    assert c.val_path.read_bytes() != a_val
    assert c.tokenizer_path == a.tokenizer_path  # the tokenizer does not depend on the seed


def test_second_run_reuses_the_cache_without_reading_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_corpus(tmp_path)
    first = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)

    def no_reading(*a, **k):
        raise AssertionError("the text was read again")

    monkeypatch.setattr(sources_mod.Source, "documents", no_reading)
    again = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    assert again.from_cache and again.tokenizer_from_cache
    assert again.train_path == first.train_path and again.index == first.index
    assert again.stats.cache_bytes > 0


def test_the_same_files_however_their_path_is_spelled_reuse_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's recipe.yaml records its sources absolute: resuming it must not tokenize again what
    `prepare` of the recipe (relative paths) built; nor must '../x', './x' or a symbolic link."""
    make_corpus(tmp_path)
    (tmp_path / "one.txt").write_text("some text " * 40)
    (tmp_path / "link").symlink_to(tmp_path / "corpus")
    first = prepare_data(cfg(tmp_path, sources=["corpus", "one.txt"]), TOK, seed=0, base_dir=tmp_path)

    def no_reading(*a, **k):
        raise AssertionError("the text was read again")

    monkeypatch.setattr(sources_mod.Source, "documents", no_reading)
    for spelled in (
        [str(tmp_path / "corpus"), str(tmp_path / "one.txt")],
        [f"../{tmp_path.name}/corpus", "./one.txt"],
        ["link", "one.txt"],
    ):
        again = prepare_data(cfg(tmp_path, sources=spelled), TOK, seed=0, base_dir=tmp_path)
        assert again.from_cache and again.tokenizer_from_cache and again.cache_dir == first.cache_dir, spelled


def test_a_changed_file_invalidates_the_cache(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    first = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    f = tmp_path / "corpus" / "doc005.txt"
    f.write_text(f.read_text() + " appended")
    second = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    assert not second.from_cache and second.cache_dir != first.cache_dir
    assert second.stats.bytes == first.stats.bytes + len(" appended")


def test_a_crash_half_way_leaves_no_cache_that_looks_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_corpus(tmp_path)
    real = shards._ShardWriter.write
    calls = {"n": 0}

    def crash(self, ids, copies=1):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt  # the user pressed Ctrl-C while tokenizing
        real(self, ids, copies)

    monkeypatch.setattr(shards._ShardWriter, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    shard_root = tmp_path / "cache" / "shards"
    assert [p.name for p in shard_root.iterdir()] == []  # no entry, no temp folder left behind
    monkeypatch.setattr(shards._ShardWriter, "write", real)
    p = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    assert not p.from_cache and p.tokenizer_from_cache  # the finished tokenizer stage was kept


def test_a_damaged_or_killed_entry_is_rebuilt(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    p = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    with open(p.train_path, "r+b") as f:
        f.truncate(10)  # e.g. disk trouble
    # a temp folder of a process that died (pid that cannot exist) is swept
    stale = p.cache_dir.parent / f".tmp-{p.cache_dir.name}-999999999-abcd"
    stale.mkdir()
    q = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    assert not q.from_cache and q.train_path.stat().st_size == p.index["train"]["tokens"] * 2
    assert not stale.exists()


def test_a_shard_or_tokenizer_changed_in_place_is_rebuilt_not_used(tmp_path: Path) -> None:
    """Damage that keeps a shard's size (its tokens overwritten) was served from the cache and
    trained on; an edited or deleted cached tokenizer was used, or refused with advice about a
    tokenizer.path the recipe never set."""
    make_corpus(tmp_path)
    p = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    good = p.train_path.read_bytes()
    with open(p.train_path, "r+b") as f:
        f.write(b"\x05\x00" * 100)  # the same size, other tokens
    q = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    assert not q.from_cache and q.train_path.read_bytes() == good
    tok_file = q.tokenizer_path
    doc = json.loads(tok_file.read_text())
    vocab = doc["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: still a valid tokenizer
    tok_file.write_text(json.dumps(doc))
    r = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    assert (
        not r.tokenizer_from_cache
        and json.loads(r.tokenizer_path.read_text())["model"]["vocab"][a] != vocab[a]
    )
    assert r.from_cache  # the tokenizer trained again is the one the shards were made with
    r.tokenizer_path.unlink()  # its meta.json left behind
    s = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    assert not s.tokenizer_from_cache and s.tokenizer_path.is_file() and s.from_cache


def test_weights_repeat_training_documents_but_not_validation(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    one = prepare_data(cfg(tmp_path, val_fraction=0.1), TOK, seed=0, base_dir=tmp_path)
    three = prepare_data(
        cfg(tmp_path, val_fraction=0.1, sources=[{"source": "corpus", "weight": 3}]),
        TOK,
        seed=0,
        base_dir=tmp_path,
    )
    assert three.stats.train_tokens == 3 * one.stats.train_tokens
    assert three.val_path.read_bytes() == one.val_path.read_bytes()
    half = prepare_data(
        cfg(tmp_path, val_fraction=0.1, sources=[{"source": "corpus", "weight": 0.5}]),
        TOK,
        seed=0,
        base_dir=tmp_path,
    )
    assert 0.2 * one.stats.train_documents < half.stats.train_documents < 0.8 * one.stats.train_documents


def test_a_single_document_corpus_holds_out_its_tail_for_validation(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("a single long document about word0 word1 word2 " * 50)
    p = prepare_data(cfg(tmp_path, sources=["one.txt"], val_fraction=0.1), TOK, seed=0, base_dir=tmp_path)
    assert p.stats.split == "tail"
    assert p.stats.val_tokens == -(-p.stats.tokens * 0.1 // 1)
    tok = load_tokenizer(p.tokenizer_path)
    whole = tok.encode((tmp_path / "one.txt").read_text()) + [tok.eos_id]
    assert (
        np.fromfile(p.train_path, np.uint16).tolist() + np.fromfile(p.val_path, np.uint16).tolist() == whole
    )


@pytest.mark.parametrize("weight", [3, 0.5])
def test_a_weighted_single_document_corpus_holds_out_text_training_never_sees(tmp_path: Path, weight) -> None:
    """The tail is cut from the document as it is, not from its weighted copies: with weight 3 a
    tail of the third copy would leave the same text in the first two (training)."""
    (tmp_path / "one.txt").write_text(" ".join(f"sentence {i} about word{i % 7}." for i in range(300)))
    p = prepare_data(
        cfg(tmp_path, sources=[{"source": "one.txt", "weight": weight}], val_fraction=0.1),
        TOK,
        seed=0,
        base_dir=tmp_path,
    )
    tok = load_tokenizer(p.tokenizer_path)
    whole = tok.encode((tmp_path / "one.txt").read_text()) + [tok.eos_id]
    n_val = -(-len(whole) // 10)
    train = np.fromfile(p.train_path, np.uint16).tolist()
    val = np.fromfile(p.val_path, np.uint16).tolist()
    assert p.stats.split == "tail" and val == whole[-n_val:] and p.stats.val_tokens == n_val
    head = whole[:-n_val]  # training: the head, as often as the weight says (0 or 1 copies for 0.5)
    assert train in ([head * 3] if weight == 3 else [[], head])
    assert p.stats.train_tokens == len(train)


def test_bad_records_are_counted_in_the_stats_when_skipped(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"record {i} " * 20}) for i in range(20)]
    lines[3] = "{oops"
    lines[7] = json.dumps({"body": "x"})
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl, line 4: not valid JSON"):
        prepare_data(cfg(tmp_path, sources=["d.jsonl"]), TOK, seed=0, base_dir=tmp_path)
    p = prepare_data(cfg(tmp_path, sources=["d.jsonl"], on_bad_record="skip"), TOK, seed=0, base_dir=tmp_path)
    assert p.stats.bad_records == 2 and p.stats.documents == 18
    assert len(p.stats.sources[0]["bad_examples"]) == 2


def test_an_existing_tokenizer_file_is_used_and_copied_into_the_cache(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    trained = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    mine = tmp_path / "mine" / "tokenizer.json"
    mine.parent.mkdir()
    mine.write_bytes(trained.tokenizer_path.read_bytes())
    p = prepare_data(cfg(tmp_path), TokenizerConfig(path="mine"), seed=0, base_dir=tmp_path)
    assert p.tokenizer_path != mine and p.tokenizer_path.read_bytes() == mine.read_bytes()
    assert p.train_path.read_bytes() == trained.train_path.read_bytes()
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(TokenizerError, match=r"broken\.json: not a valid tokenizer\.json"):
        prepare_data(cfg(tmp_path), TokenizerConfig(path="broken.json"), seed=0, base_dir=tmp_path)


def test_progress_reports_cover_both_stages(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    reports: list[shards.PrepareProgress] = []
    p = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path, progress=reports.append)
    assert {r.stage for r in reports} == {"tokenizer", "shards"}
    last = [r for r in reports if r.stage == "shards"][-1]
    assert last.documents == 30 and last.tokens == p.stats.tokens
    assert last.total_bytes == sum(f.stat().st_size for f in (tmp_path / "corpus").iterdir())


def test_cache_entries_are_not_world_writable_temp_names(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    p = prepare_data(cfg(tmp_path), TOK, seed=0, base_dir=tmp_path)
    names = {q.name for q in p.cache_dir.iterdir()}
    assert names == {"index.json", "train.bin", "val.bin"}
    index = json.loads((p.cache_dir / "index.json").read_text())
    assert index["tokenizer_sha256"] == load_tokenizer(p.tokenizer_path).sha256
    assert index["fingerprint"] and index["eos_id"] == 1
    assert not any(n.startswith(".tmp") for n in os.listdir(p.cache_dir.parent))


def test_a_document_spelling_a_special_token_cannot_forge_a_document_boundary(tmp_path: Path) -> None:
    make_corpus(tmp_path, n=5)
    (tmp_path / "corpus" / "tricky.txt").write_text("before <|eos|> after <|bos|>")
    p = prepare_data(cfg(tmp_path, val_fraction=0.0), TOK, seed=0, base_dir=tmp_path)
    tok = load_tokenizer(p.tokenizer_path)
    docs = read_docs(p.train_path, p.dtype, tok.eos_id)
    assert len(docs) == 6 and "before <|eos|> after <|bos|>" in [tok.decode(d) for d in docs]
    assert tok.bos_id not in np.fromfile(p.train_path, p.dtype).tolist()


def test_a_tokenizer_that_starts_texts_with_a_bos_starts_every_document_with_it(tmp_path: Path) -> None:
    # A Llama-style tokenizer.json (its post-processor puts <s> before a text): generation and the
    # evals start a prompt with <s>, so pretraining must have seen <s> before every document
    import tokenizers

    make_corpus(tmp_path, n=8)
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tk.train_from_iterator([f.read_text() for f in (tmp_path / "corpus").iterdir()], trainer)
    tk.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(tmp_path / "llama-ish.json"))
    tok = load_tokenizer(tmp_path / "llama-ish.json")
    assert (tok.document_start_id, tok.eos_id) == (1, 2)
    p = prepare_data(
        cfg(tmp_path, val_fraction=0.0),
        TokenizerConfig(path=str(tmp_path / "llama-ish.json")),
        seed=0,
        base_dir=tmp_path,
    )
    docs = read_docs(p.train_path, p.dtype, tok.eos_id)
    assert len(docs) == 8 and all(d[0] == 1 and 1 not in d[1:] for d in docs)
    texts = sorted(f.read_text() for f in (tmp_path / "corpus").iterdir())
    assert sorted(tok.decode(d[1:]) for d in docs) == texts
    # difftrain's own tokenizer (no post-processor): documents follow the previous eos, as before
    own = prepare_data(cfg(tmp_path, val_fraction=0.0), TOK, seed=0, base_dir=tmp_path)
    own_tok = load_tokenizer(own.tokenizer_path)
    assert own_tok.document_start_id == own_tok.eos_id
    assert [own_tok.decode(d) for d in read_docs(own.train_path, own.dtype, own_tok.eos_id)].count(
        texts[0]
    ) == 1


def test_the_tokenizer_sample_of_a_few_huge_documents_is_never_empty_nor_past_max_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whole documents were kept with probability max_bytes / S: two big files could both be
    # dropped ("no documents"), or one taken whole, far past max_bytes.
    monkeypatch.setattr(shards, "TOKENIZER_SAMPLE_PIECE", 1000)
    c = tmp_path / "corpus"
    c.mkdir()
    for i in range(2):
        (c / f"big{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 97}" for j in range(20000)))
    srcs = sources_mod.resolve_sources(cfg(tmp_path), tmp_path)
    for max_bytes in (50, 3000, 40000):
        texts = list(shards._training_texts(srcs, cfg(tmp_path), max_bytes, None))
        used = sum(map(len, texts))
        assert 0 < used <= max_bytes
        if max_bytes == 40000:  # sampled over both files, not the head of the first
            assert len(texts) > 10 and any(t in (c / "big1.txt").read_text() for t in texts[-3:])
    # most documents are one piece: a small-document corpus samples as before (the same tokenizer)
    make_corpus(tmp_path / "small")
    small = sources_mod.resolve_sources(cfg(tmp_path, sources=["small/corpus"]), tmp_path)
    texts = list(shards._training_texts(small, cfg(tmp_path), 800, None))
    kept = [
        t
        for d, t in enumerate(_texts(tmp_path / "small"))
        if shards.unit_hash("tok", 0, d) < 800 / sum(map(len, _texts(tmp_path / "small")))
    ]
    assert texts and texts[:-1] == kept[: len(texts) - 1] and kept[len(texts) - 1].startswith(texts[-1])
