"""Data modules: windows are pure functions of (seed, sample), so resume is exact and ranks disjoint."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from difftrain.data.config import DataConfig, TokenizerTrainConfig
from difftrain.data.modules import (
    IGNORE_INDEX,
    PretrainDataModule,
    PromptResponseTemplate,
    SFTDataModule,
    encode_sft_record,
    load_sft_records,
    pad_sft_batch,
)
from difftrain.data.shards import FORMAT_VERSION
from difftrain.data.tokenizer import Tokenizer, train_tokenizer
from difftrain.errors import DataError

N_TRAIN, N_VAL = 5000, 800


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    """Synthetic shards whose token at position i is i: a window's first token is its offset."""
    d = tmp_path / "shards"
    d.mkdir()
    np.arange(N_TRAIN, dtype=np.uint16).tofile(d / "train.bin")
    (np.arange(N_VAL, dtype=np.uint16) + 10_000).tofile(d / "val.bin")
    index = {
        "format": FORMAT_VERSION,
        "dtype": "uint16",
        "train": {"file": "train.bin", "tokens": N_TRAIN, "documents": 1},
        "val": {"file": "val.bin", "tokens": N_VAL, "documents": 1},
    }
    (d / "index.json").write_text(json.dumps(index))
    return d


def batches(dm, n: int) -> list[dict[str, torch.Tensor]]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def dm_for(shard_dir: Path, **kw) -> PretrainDataModule:
    return PretrainDataModule(
        shard_dir, **{"seq_len": 16, "micro_batch_size": 4, "seed": 7, "val_windows": 10, **kw}
    )


def test_windows_are_contiguous_next_token_pairs(shard_dir: Path) -> None:
    (b,) = batches(dm_for(shard_dir), 1)
    x, y = b["input_ids"], b["targets"]
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    for row_x, row_y in zip(x, y, strict=True):
        o = int(row_x[0])
        assert row_x.tolist() == list(range(o, o + 16)) and row_y.tolist() == list(range(o + 1, o + 17))
        assert 0 <= o <= N_TRAIN - 17


def test_offsets_cover_the_data_uniformly_and_depend_on_the_seed(shard_dir: Path) -> None:
    starts = torch.cat([b["input_ids"][:, 0] for b in batches(dm_for(shard_dir), 250)]).float()
    assert abs(starts.mean().item() - (N_TRAIN - 17) / 2) < 150  # uniform over [0, N-17]
    assert len(set(starts.tolist())) > 800
    other = batches(dm_for(shard_dir, seed=8), 1)[0]["input_ids"]
    assert not torch.equal(other, batches(dm_for(shard_dir), 1)[0]["input_ids"])


def test_a_loader_resumed_at_sample_k_yields_the_batches_from_k_on(shard_dir: Path) -> None:
    full = batches(dm_for(shard_dir), 10)
    dm = dm_for(shard_dir)
    dm.load_state_dict({"consumed_samples": 6 * 4})
    resumed = batches(dm, 4)
    for a, b in zip(full[6:], resumed, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["targets"], b["targets"])
    dm2 = dm_for(shard_dir)
    dm2.advance(6)  # a loop without Lightning marks progress itself
    assert dm2.state_dict()["consumed_samples"] == 24
    assert torch.equal(batches(dm2, 1)[0]["input_ids"], full[6]["input_ids"])


def test_ranks_read_disjoint_samples_that_together_match_one_process(shard_dir: Path) -> None:
    single = dm_for(shard_dir, micro_batch_size=8, rank=0, world_size=1)
    r0 = dm_for(shard_dir, rank=0, world_size=2)
    r1 = dm_for(shard_dir, rank=1, world_size=2)
    for j in range(3):
        g0, g1 = r0.train_dataset().batch_indices(j), r1.train_dataset().batch_indices(j)
        assert not set(g0.tolist()) & set(g1.tolist())
        assert sorted(g0.tolist() + g1.tolist()) == single.train_dataset().batch_indices(j).tolist()
    s, a, b = batches(single, 3), batches(r0, 3), batches(r1, 3)
    for j in range(3):
        both = torch.cat([a[j]["input_ids"], b[j]["input_ids"]])
        assert sorted(both[:, 0].tolist()) == sorted(s[j]["input_ids"][:, 0].tolist())


def test_worker_processes_yield_the_same_batches_in_the_same_order(shard_dir: Path) -> None:
    plain = batches(dm_for(shard_dir), 6)
    workers = batches(dm_for(shard_dir, num_workers=2), 6)
    for a, b in zip(plain, workers, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_validation_windows_are_fixed_evenly_spaced_and_seed_independent(shard_dir: Path) -> None:
    def val_starts(**kw) -> list[int]:
        return [
            int(s) - 10_000 for b in dm_for(shard_dir, **kw).val_dataloader() for s in b["input_ids"][:, 0]
        ]

    starts = val_starts()
    assert len(starts) == 10 and starts[0] == 0 and starts[-1] == N_VAL - 17
    gaps = np.diff(starts)
    assert gaps.max() - gaps.min() <= 1
    assert val_starts(seed=123) == starts == val_starts()
    assert sorted(val_starts(rank=0, world_size=2) + val_starts(rank=1, world_size=2)) == starts
    assert dm_for(shard_dir, val_windows=0).val_dataloader() == []


def test_too_little_data_for_one_window_is_a_clear_error(shard_dir: Path) -> None:
    with pytest.raises(DataError, match="training split has 5000 tokens, fewer than one window"):
        dm_for(shard_dir, seq_len=6000, val_windows=0)
    with pytest.raises(DataError, match=r"validation split has 800 tokens.*val_fraction.*val_windows: 0"):
        dm_for(shard_dir, seq_len=1000)
    with pytest.raises(DataError, match="not a complete token-shard folder"):
        dm_for(shard_dir.parent)


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"][:, 0].tolist())
        return (self.w * batch["input_ids"].float().mean() / 1000).pow(2).sum() + self.w.pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(shard_dir: Path, tmp: Path, max_steps: int, ckpt: str | None = None) -> _Recorder:
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = _Recorder()
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(model, datamodule=dm_for(shard_dir), ckpt_path=ckpt)
    return model


def test_lightning_resume_continues_with_exactly_the_batches_of_an_uninterrupted_run(
    shard_dir: Path, tmp_path: Path
) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = _fit(shard_dir, tmp_path / "a", max_steps=4).seen  # 4 steps × 2 micro-batches
        _fit(shard_dir, tmp_path / "b", max_steps=2)
        (ckpt,) = (tmp_path / "b").glob("*.ckpt")
        assert torch.load(ckpt, weights_only=False)["PretrainDataModule"]["consumed_samples"] == 2 * 2 * 4
        resumed = _fit(shard_dir, tmp_path / "c", max_steps=4, ckpt=str(ckpt)).seen
    assert len(full) == 8 and resumed == full[4:]


# ---------------------------------------------------------------------------------------------
# SFT


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    text = ["Question: what is two plus two?\nAnswer: four.\n", "def f(x):\n    return x + 1\n"] * 10
    return train_tokenizer(text, TokenizerTrainConfig(vocab_size=300))


def test_sft_targets_mask_the_prompt_and_train_the_response_and_eos(tok: Tokenizer) -> None:
    rec = {"prompt": "Question: what is two plus two?\n", "response": "Answer: four."}
    p, r = tok.encode(rec["prompt"]), tok.encode(rec["response"])
    ids, targets = encode_sft_record(rec, tok, max_seq_len=64)
    full = p + r + [tok.eos_id]
    assert ids == full[:-1]
    assert targets == [IGNORE_INDEX] * (len(p) - 1) + r + [tok.eos_id]
    _, all_targets = encode_sft_record(rec, tok, max_seq_len=64, train_on_prompt=True)
    assert all_targets == full[1:]
    ids_bos, t_bos = encode_sft_record(rec, tok, max_seq_len=64, add_bos=True)
    assert ids_bos[0] == tok.bos_id and t_bos[: len(p)] == [IGNORE_INDEX] * len(p)


def test_sft_examples_of_a_tokenizer_with_a_text_start_token_begin_with_it(tok: Tokenizer) -> None:
    # an imported Llama's tokenizer puts <s> before a text: its model saw <s> first, and
    # generation starts a prompt with it, so a fine-tuning example starts with it too
    import tokenizers

    llama = tokenizers.Tokenizer.from_str(tok.to_str())
    bos = llama.token_to_id("<|bos|>")
    llama.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]
    )
    started = Tokenizer(llama)
    assert started.document_start_id == bos != started.eos_id
    rec = {"prompt": "Question: what is two plus two?\n", "response": "Answer: four."}
    ids, targets = encode_sft_record(rec, started, max_seq_len=64)
    plain, plain_targets = encode_sft_record(rec, tok, max_seq_len=64)
    assert ids == [bos, *plain] and targets == [IGNORE_INDEX, *plain_targets]
    # a prompt cut from the left keeps the start token first
    long = {"prompt": "Question: what is two plus two? " * 20, "response": "Answer: four."}
    cut, cut_targets = encode_sft_record(long, started, max_seq_len=32)
    assert cut[0] == bos and bos not in cut[1:] and len(cut) == 32 and len(cut_targets) == 32
    # and generation and chat prompt such a fine-tune as its examples began
    from difftrain.infer.chat import Chat
    from difftrain.infer.session import PromptStyle
    from difftrain.recipe import ChatTemplateConfig

    assert PromptStyle(instruction=True).ids(started, "Question: hi\n")[0] == bos
    assert PromptStyle(instruction=True).ids(tok, "Question: hi\n") == tok.encode("Question: hi\n")
    chat = Chat(ChatTemplateConfig(), None)
    chat.messages = [{"role": "user", "content": "hi"}]
    text, chat_ids, _ = chat.fit(started, limit=64)
    assert chat_ids == [bos, *started.encode(text)]


def test_sft_template_hook_builds_multi_segment_examples(tok: Tokenizer) -> None:
    def chat(record):
        return [
            ("<|user|>" + record["q"] + "<|end|>", False),
            ("<|assistant|>", False),
            (record["a"] + "<|end|>", True),
        ]

    ids, targets = encode_sft_record({"q": "hi", "a": "four"}, tok, max_seq_len=64, template=chat)
    assert ids[0] == tok.token_to_id("<|user|>")
    trained = [t for t in targets if t != IGNORE_INDEX]
    assert trained == tok.encode("four<|end|>") + [tok.eos_id]
    fmt = PromptResponseTemplate("### Q: {prompt}\n### A: ", "{response}")
    ids, _ = encode_sft_record({"prompt": "x", "response": "y"}, tok, max_seq_len=64, template=fmt)
    assert tok.decode(ids) == "### Q: x\n### A: y"
    with pytest.raises(DataError, match="template uses field 'prompt'"):
        encode_sft_record({"question": "x"}, tok, max_seq_len=64)


def test_sft_long_examples_keep_the_end_of_the_prompt_and_the_start_of_the_response(tok: Tokenizer) -> None:
    rec = {"prompt": "plus two " * 40, "response": "four " * 40}
    ids, targets = encode_sft_record(rec, tok, max_seq_len=32)
    assert len(ids) == len(targets) == 32
    n_trained = sum(t != IGNORE_INDEX for t in targets)
    assert n_trained >= 16  # at least half the window is response
    keep_prompt = 33 - n_trained
    assert ids[:keep_prompt] == tok.encode(rec["prompt"])[-keep_prompt:]
    assert [t for t in targets if t != IGNORE_INDEX] == tok.encode(rec["response"])[:n_trained]


def test_sft_batches_pad_right_with_ignored_targets(tok: Tokenizer) -> None:
    ex = [([5, 6, 7], [IGNORE_INDEX, 7, 8]), ([9], [10])]
    b = pad_sft_batch(ex, pad_id=tok.pad_id)
    assert b["input_ids"].tolist() == [[5, 6, 7], [9, tok.pad_id, tok.pad_id]]
    assert b["targets"].tolist() == [[IGNORE_INDEX, 7, 8], [10, IGNORE_INDEX, IGNORE_INDEX]]
    assert pad_sft_batch(ex, pad_id=2, length=5)["input_ids"].shape == (2, 5)


def test_sft_module_visits_every_record_once_per_epoch_and_resumes_exactly(tok: Tokenizer) -> None:
    records = [{"prompt": f"q{i} ", "response": "x" * (i % 5 + 1)} for i in range(12)]

    def make(**kw) -> SFTDataModule:
        return SFTDataModule(
            records, records[:3], tokenizer=tok, max_seq_len=32, micro_batch_size=3, seed=5, **kw
        )

    dm = make()
    dm.setup()
    full = batches(dm, 8)  # two epochs of 12 records
    seen = [tuple(row[row != tok.pad_id].tolist()) for b in full[:4] for row in b["input_ids"]]
    assert len(set(seen)) == 12  # each record exactly once in the first epoch
    for b in full:
        assert ((b["input_ids"] == tok.pad_id) <= (b["targets"] == IGNORE_INDEX)).all()
    resumed = make()
    resumed.load_state_dict({"consumed_samples": 5 * 3})
    for a, b in zip(full[5:], batches(resumed, 3), strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["targets"], b["targets"])
    assert sum(b["input_ids"].shape[0] for b in make().val_dataloader()) == 3
    static = make(pad_to_max_seq_len=True)
    assert batches(static, 1)[0]["input_ids"].shape == (3, 32)


def test_sft_records_load_from_jsonl_fields_and_from_stdlib_docstrings(tmp_path: Path) -> None:
    (tmp_path / "sft.jsonl").write_text(
        "".join(
            json.dumps({"instruction": f"do {i}", "output": f"done {i}", "id": i}) + "\n" for i in range(40)
        )
    )
    cfg = DataConfig(
        sources=[{"source": "sft.jsonl", "prompt_field": "instruction", "response_field": "output"}],
        val_fraction=0.1,
    )
    train, val, stats = load_sft_records(cfg, seed=0, base_dir=tmp_path)
    assert len(train) + len(val) == 40 and 0 < len(val) < 15 and stats[0].documents == 40
    assert {"prompt", "response", "id"} <= set(train[0]) and train[0]["prompt"].startswith("do ")
    # the record's own names stay: a prompt_format may say {instruction} as the file does
    assert train[0]["instruction"] == train[0]["prompt"] and train[0]["output"] == train[0]["response"]
    bad = DataConfig(sources=[{"source": "sft.jsonl", "prompt_field": "instruction"}])
    with pytest.raises(
        DataError, match=r"sft\.jsonl, line 1: record has no field 'response'.*response_field"
    ):
        load_sft_records(bad, seed=0, base_dir=tmp_path)
    doc_cfg = DataConfig(
        sources=[{"source": "builtin:python-docstrings", "max_documents": 20}], val_fraction=0.0
    )
    train, val, _ = load_sft_records(doc_cfg, seed=0, base_dir=tmp_path)
    assert len(train) == 20 and not val and train[0]["prompt"].strip()
    with pytest.raises(DataError, match="holds plain documents, not prompt/response records"):
        load_sft_records(DataConfig(sources=["builtin:needles"]), seed=0, base_dir=tmp_path)


def test_more_validation_windows_than_the_split_holds_are_capped_with_a_note(shard_dir: Path) -> None:
    # 800 validation tokens hold 800 - 17 + 1 = 784 different windows of 17: asking for 100,000
    # ran for minutes over repeats of the same windows
    dm = dm_for(shard_dir, val_windows=100_000)
    assert len(dm.val_offsets) == 784 and len(set(dm.val_offsets.tolist())) == 784
    assert dm.val_note is not None and "more than the 784 different windows" in dm.val_note
    assert dm_for(shard_dir, val_windows=784).val_note is None
