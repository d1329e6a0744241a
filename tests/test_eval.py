"""`difftrain eval`: every suite on tiny random models — schema, exact figures, determinism, errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from difftrain.cli.app import main
from difftrain.data.builtin import filler_sentence, needle_documents
from difftrain.data.config import NeedlesSpec, TokenizerTrainConfig
from difftrain.data.tokenizer import train_tokenizer
from difftrain.errors import ConfigError
from difftrain.evals import EvalOptions, evaluate, save_result
from difftrain.evals.attention import spans
from difftrain.evals.common import load_result
from difftrain.evals.icl import label_scores
from difftrain.evals.needle import (
    NeedleGrid,
    build_prompt,
    evaluate_grid,
    grid_prompts,
    parse_needles,
    score,
)
from difftrain.evals.quant import fake_quantize
from difftrain.evals.windows import eval_windows
from difftrain.model import ModelConfig, Transformer
from difftrain.model.transformer import LMOutput
from difftrain.rundir import load_run, save_weights

SEQ = 160


def make_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for i in range(24):
        (corpus / f"d{i:02d}.txt").write_text(" ".join(filler_sentence(rng) for _ in range(30)))
    return corpus


def make_run(
    root: Path,
    name: str,
    arch: str,
    *,
    seed: int = 0,
    tokenizer=None,
    init_std: float = 0.1,
    max_seq_len: int = SEQ,
) -> Path:
    """A run directory holding a random tiny model: config, weights, tokenizer, recipe.yaml."""
    corpus = make_corpus(root)
    if tokenizer is None:
        texts = list(needle_documents(NeedlesSpec(context_tokens=64, num_documents=30)))
        texts += [p.read_text() for p in sorted(corpus.iterdir())]
        tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=420))
    run = root / name
    run.mkdir(parents=True)
    torch.manual_seed(seed)
    # vocab 448 > the tokenizer's 420 ids: the padded rows a real run has too
    cfg = ModelConfig(
        arch=arch,
        vocab_size=448,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=max_seq_len,
        init_std=init_std,
    )
    cfg.to_json(run / "config.json")
    save_weights(run / "model.safetensors", Transformer(cfg))
    tokenizer.save(run / "tokenizer.json")
    recipe = {
        "name": name,
        "seed": 3,
        "out_dir": str(root),
        "model": cfg.model_dump(mode="json"),
        "data": {
            "sources": [str(corpus)],
            "val_fraction": 0.25,
            "val_windows": 4,
            "cache_dir": str(root / "cache"),
        },
        "train": {"max_steps": 1, "micro_batch_size": 1},
    }
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalruns")
    first = make_run(root, "baseline", "baseline")
    tok = load_run(first).tokenizer
    return {
        "baseline": first,
        "diff": make_run(root, "diff", "diff", tokenizer=tok),
        "diff2": make_run(root, "diff2", "diff2", tokenizer=tok),
    }


SMALL_NEEDLE = EvalOptions(lengths=[70], depths=[0.0, 0.5, 1.0], needles=[(1, 1)], samples=1, plot=False)


# ----- ppl -------------------------------------------------------------------------------------
def test_ppl_reports_the_loss_of_the_validation_windows_and_bits_per_byte(runs, capsys, monkeypatch):
    monkeypatch.chdir(runs["diff"].parent)
    assert main(["eval", str(runs["diff"]), "--suite", "ppl", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["ppl"]
    assert doc == load_result(runs["diff"], "ppl")
    for key in (
        "suite",
        "format",
        "run",
        "arch",
        "params",
        "weights",
        "settings",
        "results",
        "headline",
        "plots",
    ):
        assert key in doc
    res = doc["results"]
    assert res["windows"] == 4  # the recipe's data.val_windows: the windows of the training val loss

    # independent reference: the same windows through the model's own loss
    run = load_run(runs["diff"])
    tw = eval_windows(run, data=None, count=4, full=False)
    with torch.no_grad():
        ref = run.model(tw.windows[:, :-1], tw.windows[:, 1:]).loss.item()
    text = "".join(run.tokenizer.decode(w[1:].tolist(), skip_special_tokens=True) for w in tw.windows)
    n_tok = tw.windows[:, 1:].numel()
    assert res["loss"] == pytest.approx(ref, abs=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(ref), rel=1e-5)
    assert res["bytes"] == len(text.encode("utf-8"))
    assert res["bits_per_byte"] == pytest.approx(ref * n_tok / math.log(2) / res["bytes"], rel=1e-5)
    assert {h["name"] for h in doc["headline"]} == {"loss", "ppl", "bits/byte"}


def test_ppl_on_another_source_reads_all_of_it(runs, tmp_path):
    src = tmp_path / "other.txt"
    rng = random.Random(5)
    src.write_text(" ".join(filler_sentence(rng) for _ in range(80)))
    run = load_run(runs["baseline"])
    doc = evaluate(run, "ppl", EvalOptions(data=str(src), windows=3))
    assert doc["settings"]["data"] == str(src) and doc["results"]["source"] == str(src)
    tokens = len(run.tokenizer.encode(src.read_text())) + 1  # + the document's eos
    assert doc["results"]["split_tokens"] == tokens and doc["results"]["windows"] == 3


def test_ppl_on_an_instruction_fine_tune_scores_its_records_through_its_template(runs, tmp_path, capsys):
    assert "note" not in evaluate(load_run(runs["baseline"]), "ppl", EvalOptions(windows=2))["results"]
    sft, _ = _instruction_run(runs, tmp_path)  # records, not text: the run's validation split is records
    run = load_run(sft)
    res = evaluate(run, "ppl", EvalOptions(windows=2))["results"]
    assert "scored the responses only" in res["note"]
    # every window is the records as training rendered them: the template's words, the chat's roles
    text = run.tokenizer.decode(
        eval_windows(run, data=None, count=None, full=True).windows.flatten().tolist()
    )
    assert text.count("Q>") >= 10 and text.count(" A> ") >= 10 and "<|user|>" in text
    recipe = yaml.safe_load((sft / "recipe.yaml").read_text())
    recipe["finetune"]["prompt_format"] = "R> {prompt} A> "  # another template: other shards, not the cached
    (sft / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    windows = eval_windows(run, data=None, count=None, full=True).windows
    assert "Q>" not in run.tokenizer.decode(windows.flatten().tolist())
    assert main(["eval", str(sft), "--suite", "ppl", "--windows", "2"]) == 0
    assert "prompts too" in capsys.readouterr().out
    src = tmp_path / "other.txt"  # another source is plain text: nothing to note
    src.write_text(" ".join(filler_sentence(random.Random(1)) for _ in range(40)))
    assert "note" not in evaluate(load_run(sft), "ppl", EvalOptions(data=str(src), windows=2))["results"]


def test_an_instruction_fine_tunes_template_markers_are_scored_as_the_special_tokens_it_trained_on(
    runs, tmp_path
):
    """A chat fine-tune adds <|user|>, <|assistant|>, <|end|> as special tokens and trains on them
    as single tokens: eval's windows of its records hold those tokens, not their spelling."""
    from difftrain.data.sft import add_special_tokens

    sft, _ = _instruction_run(runs, tmp_path)
    run = load_run(sft)
    markers = ["<|user|>", "<|assistant|>", "<|end|>"]
    tokenizer, _ = add_special_tokens(run.tokenizer, markers)  # (where the base lacks them)
    tokenizer.save(sft / "tokenizer.json")
    ids = [tokenizer.token_to_id(m) for m in markers]
    chats = tmp_path / "chats.jsonl"
    turns = [{"role": "user", "content": filler_sentence(random.Random(i))} for i in range(30)]
    chats.write_text(
        "".join(json.dumps({"messages": [t, {"role": "assistant", "content": "yes"}]}) + "\n" for t in turns)
    )
    run = load_run(sft)
    flat = eval_windows(run, data=str(chats), count=None, full=True).windows.flatten().tolist()
    user, assistant, end = ids
    assert flat.count(user) >= 10 and flat.count(assistant) >= 10 and flat.count(end) >= 20
    # the record's own text has no marker spelled out in ordinary tokens
    rest = run.tokenizer.decode([i for i in flat if i not in ids])
    assert not any(m in rest for m in markers)


# ----- needle ----------------------------------------------------------------------------------
def test_needle_generator_places_the_queried_needles_at_the_requested_depths(runs):
    tok = load_run(runs["baseline"]).tokenizer
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        for seed in range(3):
            p = build_prompt(tok, 2048, 1200, 5, 2, depth, seed)
            ex = p.example
            filler = [s + "." for s in ex.haystack.split(".") if s.strip() and "magic number" not in s]
            step = max(len(s) + 1 for s in filler) / (
                len(ex.haystack) - sum(len(n.sentence) for n in ex.needles)
            )
            assert len(p.measured_depths) == 2
            for got in p.measured_depths:
                assert abs(got - depth) <= step, (depth, got, step)
            queried = [n for n in ex.needles if n.key in ex.query_keys]
            assert [n.requested_depth for n in queried] == [depth, depth]
            assert p.ids[0] == tok.eos_id and tok.decode(p.ids[1:]) == ex.prompt
            assert 1080 <= p.haystack_tokens <= 1200


def test_needle_prompts_shrink_to_fit_the_context_or_fail_clearly(runs):
    tok = load_run(runs["baseline"]).tokenizer
    p = build_prompt(tok, SEQ, SEQ - 20, 1, 1, 0.5, 7)
    assert len(p.ids) + p.answer_tokens < SEQ  # the haystack was trimmed to leave room
    with pytest.raises(ConfigError, match="does not fit max_seq_len=60"):
        build_prompt(tok, 60, 50, 2, 1, 0.5, 7)


def test_needle_score_is_exact_match_of_values_in_query_order():
    assert score(" The magic number of Oslo is 1234567.", ["1234567"]) == [True]
    assert score(" The magic number of Oslo is 12345678.", ["1234567"]) == [False]
    assert score(" Oslo is 7654321. Lima is 1234567.", ["1234567", "7654321"]) == [False, False]
    assert score(" Lima is 1234567. Oslo is 7654321.", ["1234567", "7654321"]) == [True, True]
    assert score(" nothing", ["1234567"]) == [False]
    assert parse_needles("1x1, 4×2,6:2,3") == [(1, 1), (4, 2), (6, 2), (3, 1)]
    with pytest.raises(ConfigError, match="R \\(queried\\) must be in 1 … N=2"):
        parse_needles("2x3")


class Oracle(nn.Module):
    """A stand-in LM that answers each needle prompt from a table (through the real generate
    engine): right for prompts whose queried needle is at depth ≤ 0.5, one digit off beyond."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__()
        self.config = ModelConfig(vocab_size=vocab, d_model=8, n_layers=1, n_heads=2, max_seq_len=SEQ)
        self.lm_head = nn.Linear(1, 1)
        self.answers = answers

    def new_cache(self, batch_size, max_len=None, **_):
        return {"rows": None, "step": 0}

    def forward(self, ids, cache=None, key_padding_mask=None, **_):
        if cache["rows"] is None:
            mask = (
                key_padding_mask if key_padding_mask is not None else torch.ones_like(ids, dtype=torch.bool)
            )
            cache["rows"] = [self.answers[tuple(r[m].tolist())] for r, m in zip(ids, mask, strict=True)]
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.config.vocab_size)
        for i, ans in enumerate(cache["rows"]):
            logits[i, -1, ans[min(cache["step"], len(ans) - 1)]] = 1.0
        cache["step"] += 1
        return LMOutput(logits=logits)


def test_needle_accuracy_counts_exactly_the_retrieved_values_through_the_generate_engine(runs):
    tok = load_run(runs["baseline"]).tokenizer
    grid = NeedleGrid(lengths=[70, 90], depths=[0.0, 0.5, 1.0], needles=[(1, 1), (2, 1)], samples=2)
    answers = {}
    for p in grid_prompts(tok, SEQ, grid, seed=1):
        value = p.expected[0] if p.depth <= 0.5 else str(int(p.expected[0]) + 1)
        answers[tuple(p.ids)] = tok.encode(f" The magic number of {p.query_keys[0]} is {value}.\n")
    res = evaluate_grid(Oracle(answers, 448), tok, grid, seed=1, batch_size=3)
    for c in res["cells"]:
        assert c["accuracy"] == (1.0 if c["depth"] <= 0.5 else 0.0) and c["samples"] == 2
    assert res["accuracy"] == pytest.approx(2 / 3)
    assert [d["accuracy"] for d in res["by_depth"]] == [1.0, 1.0, 0.0]
    assert all(s["completion"].startswith(" The magic number of") for s in res["samples"])


def test_a_rerun_without_its_figure_removes_the_replaced_results_figure(runs, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["baseline"], run, ignore=shutil.ignore_patterns("eval"))
    drawn = evaluate(load_run(run), "needle", EvalOptions(**{**SMALL_NEEDLE.__dict__, "plot": None}))
    save_result(run, drawn)
    assert (run / "eval" / "needle.png").is_file()
    (run / "eval" / "mine.png").write_bytes(b"not ours")  # a file the user put there stays
    save_result(run, evaluate(load_run(run), "needle", SMALL_NEEDLE))  # plot=False: no figure
    assert not (run / "eval" / "needle.png").exists() and (run / "eval" / "mine.png").is_file()


def test_needle_completions_do_not_depend_on_their_batchmates(runs):
    # a batch generated up to its longest answer's budget: a shorter answer's prompt got extra
    # tokens (65 of 80 completions differed between --batch-size 1 and 8), which could finish a number
    run = load_run(runs["diff2"])
    grid = {"lengths": [70], "depths": [0.0, 0.5, 1.0], "needles": [(1, 1)], "samples": 3, "plot": False}
    alone = evaluate(run, "needle", EvalOptions(**grid, batch_size=1))["results"]["samples"]
    batched = evaluate(run, "needle", EvalOptions(**grid, batch_size=8))["results"]["samples"]
    assert [s["completion"] for s in alone] == [s["completion"] for s in batched]


def test_needle_suite_is_deterministic_for_a_seed_and_draws_new_prompts_for_another(runs):
    run = load_run(runs["diff2"])
    a = evaluate(run, "needle", SMALL_NEEDLE)
    b = evaluate(run, "needle", SMALL_NEEDLE)
    c = evaluate(run, "needle", EvalOptions(**{**SMALL_NEEDLE.__dict__, "seed": 1}))
    assert a["results"] == b["results"]
    assert [s["expected"] for s in a["results"]["samples"]] != [
        s["expected"] for s in c["results"]["samples"]
    ]
    assert a["settings"] == {
        "lengths": [70],
        "depths": [0.0, 0.5, 1.0],
        "needles": [[1, 1]],
        "samples": 1,
        "seed": 0,
    }
    assert len(a["results"]["cells"]) == 3 and len(a["results"]["samples"]) == 3


def test_needle_heat_map_is_a_png_in_the_eval_folder(runs):
    run = load_run(runs["baseline"])
    doc = evaluate(run, "needle", EvalOptions(**{**SMALL_NEEDLE.__dict__, "plot": None}))
    assert doc["plots"] == ["eval/needle.png"]  # relative to the run: it may be moved or copied
    png = runs["baseline"] / doc["plots"][0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shown_results_name_the_run_and_figures_as_named_now(runs, tmp_path, capsys, monkeypatch):
    import shutil

    opts = EvalOptions(**{**SMALL_NEEDLE.__dict__, "plot": None})
    copy = tmp_path / "copied"
    shutil.copytree(runs["baseline"], copy, ignore=shutil.ignore_patterns("eval"))
    save_result(copy, evaluate(load_run(copy), "needle", opts))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # another folder, and a copy of the run: both name it as now
    moved = tmp_path / "moved"
    shutil.copytree(copy, moved)
    assert main(["eval", "../moved", "--show", "--suite", "needle"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "needle · ../moved (baseline)" in out and "figure: ../moved/eval/needle.png" in out


# ----- attention -------------------------------------------------------------------------------
def test_attention_probe_spans_cover_the_needle_and_the_rows_that_predict_its_value(runs):
    run = load_run(runs["baseline"])
    tok = run.tokenizer
    p = build_prompt(tok, SEQ, 90, 2, 2, 0.5, 3)
    ids, per_query = spans(tok, p, SEQ)
    for (cols, rows), key, value in zip(per_query, p.query_keys, p.expected, strict=True):
        sentence = next(n.sentence for n in p.example.needles if n.key == key)
        assert sentence in tok.decode([ids[c] for c in cols])
        assert tok.decode([ids[r + 1] for r in rows]) == value  # row r predicts token r + 1


def test_attention_masses_of_softmax_maps_sum_to_one_and_differential_rows_to_one_minus_lambda(runs):
    opts = EvalOptions(lengths=[90], depths=[0.0, 1.0], needles=[(2, 1)], samples=2, plot=False)
    base = evaluate(load_run(runs["baseline"]), "attention", opts)["results"]
    assert base["map"] == "softmax"
    for d in base["by_depth"]:
        for layer in d["per_layer"]:
            assert layer["answer"] + layer["noise"] == pytest.approx(1.0, abs=1e-5)
            assert 0.0 <= layer["answer"] <= 1.0
    run = load_run(runs["diff"])
    diff = evaluate(run, "attention", opts)["results"]
    for li, layer in enumerate(diff["per_layer"]):
        lam = run.model.model.layers[li].self_attn.lam().item()
        assert layer["total"] == pytest.approx(1.0 - lam, abs=1e-5)
        assert layer["answer"] + layer["noise"] == pytest.approx(layer["total"], abs=1e-6)
        assert layer["noise_abs"] >= abs(layer["noise"]) - 1e-7
        # the shares are scale-free: a diff map whose rows sum to 1 − λ is compared as a softmax
        # map is (the headline), not by its smaller masses
        assert layer["answer_share"] + layer["noise_share"] == pytest.approx(1.0, abs=1e-6)
    for layer in base["per_layer"]:
        assert layer["answer_share"] == pytest.approx(layer["answer"], abs=1e-5)  # total 1: share = mass
    # scaling every differential row by c (as a different λ would) leaves the shares alone
    from difftrain.evals.attention import NAMES, probe

    class Scaled:
        def __init__(self, model, c):
            self.model, self.c, self.config = model, c, model.config

        def parameters(self):
            return self.model.parameters()

        def __call__(self, ids, output_attentions):
            out = self.model(ids, output_attentions=output_attentions)
            return type(out)(**{**vars(out), "attentions": [a * self.c for a in out.attentions]})

    from difftrain.evals.needle import default_grid, grid_prompts

    p = grid_prompts(
        run.tokenizer, run.config.max_seq_len, default_grid(run.tokenizer, run.config.max_seq_len, opts), 0
    )[0]
    with torch.no_grad():
        one, _ = probe(run.model, run.tokenizer, p)
        half, _ = probe(Scaled(run.model, 0.5), run.tokenizer, p)
    share = NAMES.index("answer_share")
    assert np.allclose(one[:, share], half[:, share]) and np.allclose(half[:, 0], one[:, 0] * 0.5, atol=1e-6)
    headlines = {h["name"] for h in evaluate(run, "attention", opts)["headline"]}
    assert headlines == {"answer share", "noise share"}


def test_attention_plot_draws_the_maps_of_every_layer_and_head(runs):
    run = load_run(runs["diff2"])
    opts = EvalOptions(lengths=[70], depths=[0.5], needles=[(1, 1)], samples=1, plot=True)
    doc = evaluate(run, "attention", opts)
    assert doc["plots"] == ["eval/attention.png"]
    assert (runs["diff2"] / doc["plots"][0]).stat().st_size > 10_000


# ----- outliers --------------------------------------------------------------------------------
def test_outliers_equal_a_direct_computation_over_the_same_tokens(runs):
    run = load_run(runs["diff"])
    doc = evaluate(run, "outliers", EvalOptions(tokens=2 * SEQ, batch_size=1))
    res = doc["results"]
    tw = eval_windows(run, data=None, count=2, full=False)
    with torch.no_grad():
        out = run.model(tw.windows[:, :-1], output_attentions=True, output_hidden_states=True)
    h = torch.cat([x.reshape(-1) for x in out.hidden_states]).double()
    s = torch.cat([x[torch.isfinite(x)] for x in out.attn_logits]).double()
    for got, x in ((res["hidden_states"], h), (res["attention_logits"], s)):
        top = x.abs().sort(descending=True).values
        assert got["count"] == x.numel()
        for k in (1, 2, 3, 10, 100):
            assert got[f"top{k}"] == pytest.approx(top[k - 1].item(), rel=1e-6)
        assert got["median"] == pytest.approx(x.abs().float().median().item(), rel=1e-6)
        kurt = ((x - x.mean()) ** 4).mean() / x.var(unbiased=False) ** 2
        assert got["kurtosis"] == pytest.approx(kurt.item(), rel=1e-6)
        assert len(got["per_layer"]) == 2
    assert {h["name"] for h in doc["headline"]} >= {"attn logit top-1", "hidden top-1", "hidden kurtosis"}


# ----- quant -----------------------------------------------------------------------------------
def test_fake_quantization_rounds_to_the_absmax_grid_and_keeps_the_mask():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 5, generator=g) * 4
    x = x.masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf"))
    assert fake_quantize(x, 16) is x
    finite = torch.isfinite(x)
    for bits in (8, 4):
        q = fake_quantize(x, bits)
        assert torch.equal(torch.isfinite(q), finite)
        amax = x.masked_fill(~finite, 0).abs().amax(dim=(-2, -1), keepdim=True)
        step = amax / (2 ** (bits - 1) - 1)
        err = (q - x).masked_fill(~finite, 0).abs()
        assert bool((err <= step / 2 + 1e-6).all())
        k = (q.masked_fill(~finite, 0) / step).expand_as(x)[finite]
        assert torch.allclose(k, k.round(), atol=1e-4)
    assert not torch.equal(fake_quantize(x, 4), fake_quantize(x, 8))


def test_quant_at_16_bits_equals_the_unquantized_model_and_4_bits_differs_from_8(runs):
    run = load_run(runs["diff2"])
    doc = evaluate(run, "quant", EvalOptions(bits=[8, 4], windows=3, plot=False))
    rows = {r["bits"]: r for r in doc["results"]["rows"]}
    assert list(rows) == [16, 8, 4]
    run.model.attn_impl = "eager"  # the quant rows all run the eager core
    ppl = evaluate(run, "ppl", EvalOptions(windows=3))["results"]
    assert rows[16]["loss"] == ppl["loss"] and rows[16]["delta_loss"] == 0.0
    assert rows[4]["loss"] != rows[8]["loss"]
    assert rows[4]["delta_loss"] == pytest.approx(rows[4]["loss"] - ppl["loss"])
    assert run.model._logit_transform is None  # the probe leaves the model as it found it


# ----- icl-order -------------------------------------------------------------------------------
def test_icl_scores_from_the_shared_prefix_cache_equal_full_forwards(runs):
    run = load_run(runs["diff"])
    tok, model = run.tokenizer, run.model
    prefix = [tok.eos_id, *tok.encode("The magic number of Oslo is 7000001.\nLabel: high\n\n")]
    suffixes = [
        tok.encode("The magic number of Lima is 2000002.\nLabel:"),
        tok.encode("The magic number of Rome is 9.\nLabel:"),
    ]
    cands = [tok.encode(" low"), tok.encode(" high"), tok.encode(" maybe not")]
    got = label_scores(model, prefix, suffixes, cands, batch_size=4)
    for i, s in enumerate(suffixes):
        for j, c in enumerate(cands):
            ids = torch.tensor([prefix + s + c])
            with torch.no_grad():
                logp = F.log_softmax(model(ids).logits.float(), dim=-1)[0]
            n = len(prefix) + len(s)
            ref = sum(logp[n - 1 + t, c[t]].item() for t in range(len(c)))
            assert got[i, j] == pytest.approx(ref, abs=1e-4)


def test_icl_order_reports_accuracy_per_order_deterministically(runs):
    run = load_run(runs["baseline"])
    opts = EvalOptions(demos=4, permutations=3, items=6)
    a = evaluate(run, "icl-order", opts)
    b = evaluate(run, "icl-order", opts)
    assert a["results"] == b["results"]
    res = a["results"]
    accs = [o["accuracy"] for o in res["per_order"]]
    assert len(accs) == 3 and len({tuple(o["order"]) for o in res["per_order"]}) == 3
    assert res["margin"] == pytest.approx(max(accs) - min(accs)) and res["mean"] == pytest.approx(
        np.mean(accs)
    )
    assert all(a * 6 == round(a * 6) for a in accs)
    assert a["settings"]["permutations"] == 3 and a["notes"] == []


def test_icl_order_reports_the_orders_it_scored_and_a_default_cut_to_fit(runs):
    """2 demonstrations have 2 orders: asked for 8, it scores (and reports) 2, and says why; the
    default 8 demonstrations cut to fit the context are noted."""
    from difftrain.evals.icl import prompts

    run = load_run(runs["baseline"])
    doc = evaluate(run, "icl-order", EvalOptions(demos=2, permutations=8, items=4))
    assert doc["settings"]["permutations"] == 2 and len(doc["results"]["per_order"]) == 2
    assert doc["notes"] == ["2 orders, not 8: 2 demonstrations have only 2, and every one is scored"]
    short = prompts(run.tokenizer, 10_000, EvalOptions(demos=8)).longest - 1  # no room for all 8
    run.config = run.config.replace(max_seq_len=short)
    doc = evaluate(run, "icl-order", EvalOptions(permutations=2, items=4))
    d = doc["settings"]["demos"]
    assert 2 <= d < 8
    assert doc["notes"] == [f"{d} demonstrations, not the default 8: more do not fit max_seq_len={short}"]


# ----- CLI -------------------------------------------------------------------------------------
def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_eval_refuses_a_run_without_weights_in_one_line(runs, tmp_path, capsys):
    run = make_run(tmp_path, "fresh", "diff", tokenizer=load_run(runs["diff"]).tokenizer)
    (run / "model.safetensors").unlink()
    assert main(["eval", str(run), "--suite", "ppl"]) == 2
    assert "has no model.safetensors" in _error(capsys)


def test_eval_unknown_suite_suggests_the_closest_name(runs, capsys):
    assert main(["eval", str(runs["diff"]), "--suite", "neelde"]) == 2
    assert "unknown suite `neelde`; did you mean `needle`?" in _error(capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--depths", "0,1.5"], "--depths 1.5 is outside [0, 1]"),
        (["--data", "no-such-file.txt"], "--data 'no-such-file.txt': "),  # before the model loads
        (["--data", "hf:"], "--data 'hf:': hf: source needs a dataset name"),
        (["--needles", "4x0"], "R (queried) must be in 1 … N=4"),
        (["--bits", "8,1"], "--bits 1 is out of range"),
        (["--samples", "0"], "--samples 0 must be ≥ 1"),
        (["--suite", "icl-order", "--demos", "0"], "--demos 0 must be ≥ 2"),  # not "the default"
        (["--suite", "icl-order", "--permutations", "0"], "--permutations 0 must be ≥ 2"),
        (["--lengths", "64,abc"], "--lengths 'abc' is not a number"),
        (
            ["--suite", "needle", "--lengths", "40", "--needles", "4x1"],
            "with 4 needles: a haystack of at least",
        ),
        (
            ["--suite", "needle", "--lengths", "10", "--needles", "1x1"],
            "--lengths 10 is too short for 1 needle:",
        ),
        # the default 4 needles do not fit: with 1, the length is what does not fit, and is named
        (["--suite", "attention", "--lengths", "1000"], "attention: --lengths 1000 does not fit"),
        (["--suite", "attention", "--needles", "1x1", "--lengths", "1000"], "--lengths 1000 does not fit"),
    ],
)
def test_eval_rejects_bad_options_with_one_line(runs, capsys, args, message):
    assert main(["eval", str(runs["baseline"]), *args]) == 2
    assert message in _error(capsys)


def test_eval_runs_several_suites_and_renders_tables(runs, capsys, monkeypatch):
    monkeypatch.chdir(runs["baseline"].parent)
    code = main(
        ["eval", str(runs["baseline"]), "--suite", "ppl,quant", "--bits", "6", "--windows", "2", "--no-plot"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "bits/byte" in out and "Δloss" in out and "16 = none (ref)" in out
    )  # the row the headline calls loss@16
    assert (runs["baseline"] / "eval" / "quant.json").is_file()
    assert not (runs["baseline"] / "eval" / "quant.png").exists()


def test_saved_results_round_trip(runs, tmp_path):
    run = load_run(runs["baseline"])
    doc = evaluate(run, "ppl", EvalOptions(windows=2))
    save_result(tmp_path, doc)
    assert load_result(tmp_path, "ppl") == doc and load_result(tmp_path, "needle") is None


def test_without_matplotlib_figures_are_skipped_with_a_note_and_plot_requests_fail(runs, capsys, monkeypatch):
    from difftrain.evals import plots

    monkeypatch.setattr(plots, "available", lambda: False)
    doc = evaluate(
        load_run(runs["baseline"]), "needle", EvalOptions(**{**SMALL_NEEDLE.__dict__, "plot": None})
    )
    assert doc["plots"] == [] and doc["notes"] == [plots.MISSING]
    assert main(["eval", str(runs["baseline"]), "--suite", "attention", "--plot"]) == 2
    assert "pip install 'difftrain[plot]'" in _error(capsys)
    assert main(["compare", str(runs["baseline"]), str(runs["diff"]), "--plot", "x.png"]) == 2
    assert "pip install 'difftrain[plot]'" in _error(capsys)


def test_a_context_too_short_for_a_suite_names_the_context_it_needs_or_an_option_that_fits(runs):
    """The advice of a refusal can be followed: the context named is the shortest that works,
    and fewer needles or demonstrations are offered only where they fit."""
    from difftrain.evals.icl import prompts
    from difftrain.evals.needle import default_grid, max_context, min_context

    tok = load_run(runs["baseline"]).tokenizer
    one = EvalOptions(needles=[(1, 1)])
    need = min(n for n in range(8, 400) if min_context(tok, 1) <= max_context(tok, n, 1, 1))
    default_grid(tok, need, one)
    # --lengths with the default needles: those too large for the context are left out, as without it
    fit = default_grid(tok, need, EvalOptions())
    grid = default_grid(tok, need, EvalOptions(lengths=[fit.lengths[-1]]))
    assert grid.needles == [(1, 1)] and grid.lengths == [fit.lengths[-1]]
    with pytest.raises(ConfigError, match=r"--lengths 5 is too short for 1 needle: .* use lengths ≥ \d+$"):
        default_grid(tok, need, EvalOptions(lengths=[5]))
    for opts in (one, EvalOptions(), EvalOptions(lengths=[8])):
        with pytest.raises(ConfigError, match=f"even with one needle: .* max_seq_len is at least {need}$"):
            default_grid(tok, need - 1, opts)
    with pytest.raises(ConfigError, match="too short for a needle test with 4 needles.*; use --needles 1x1$"):
        default_grid(tok, need, EvalOptions(needles=[(4, 1)]))
    least = prompts(tok, 10_000, EvalOptions(demos=2)).longest
    assert prompts(tok, least, EvalOptions()).demos == 2  # the default shrinks to what fits
    for opts in (EvalOptions(), EvalOptions(demos=2), EvalOptions(demos=8)):
        with pytest.raises(ConfigError, match=f"fewest demonstrations \\(2\\).* at least {least}$"):
            prompts(tok, least - 1, opts)
    six = prompts(tok, 10_000, EvalOptions(demos=6)).longest
    with pytest.raises(ConfigError, match="use --demos [3-6] or fewer$") as e:
        prompts(tok, six, EvalOptions(demos=8))
    fewer = int(str(e.value).split("--demos ")[-1].split()[0])
    assert prompts(tok, six, EvalOptions(demos=fewer)).demos == fewer


def test_suite_all_skips_the_suites_a_short_context_cannot_run_and_runs_the_others(runs, tmp_path, capsys):
    short = make_run(
        tmp_path, "short", "diff", tokenizer=load_run(runs["baseline"]).tokenizer, max_seq_len=48
    )
    assert main(["eval", str(short), "--suite", "all", "--windows", "2", "--no-plot"]) == 0
    err = capsys.readouterr().err
    for suite in ("needle", "attention", "icl-order"):
        assert f"skipped {suite}: " in err and f"skipped {suite}: {suite}: " not in err
        assert not (short / "eval" / f"{suite}.json").exists()
    assert sorted(p.name for p in (short / "eval").iterdir()) == ["outliers.json", "ppl.json", "quant.json"]
    assert main(["eval", str(short), "--suite", "all,needle"]) == 2  # named: it must run
    assert "even with one needle" in _error(capsys)


def test_suite_lists_accept_commas_repeats_and_all():
    from difftrain.cli.evaluate import parse_suites

    assert parse_suites(None) == ["ppl"]
    assert parse_suites(["ppl,needle", "ppl", "quant"]) == ["ppl", "needle", "quant"]
    assert parse_suites(["all"]) == ["ppl", "needle", "attention", "outliers", "quant", "icl-order", "recall"]


def test_an_eval_of_a_run_still_training_names_the_step_of_the_weights_it_scored(runs, tmp_path, capsys):
    import shutil

    from difftrain.io import RunLock

    run = tmp_path / "run"
    shutil.copytree(runs["baseline"], run, ignore=shutil.ignore_patterns("eval"))
    save_weights(run / "model.safetensors", load_run(run).model, {"step": "500"})
    doc = evaluate(load_run(run), "ppl", EvalOptions(windows=2))
    assert doc["weights"]["step"] == 500 and doc["notes"] == []
    lock = RunLock(run)  # as a training process holds it
    assert lock.acquire() is None
    try:
        doc = evaluate(load_run(run), "ppl", EvalOptions(windows=2))
    finally:
        lock.release()
    assert any(
        "is still training" in n and "weights at step 500, the last it saved" in n for n in doc["notes"]
    )
    save_result(run, doc)  # --show says which weights a stored result scored
    capsys.readouterr()
    assert main(["eval", str(run), "--show"]) == 0
    assert "weights of step 500" in " ".join(capsys.readouterr().out.split())


def test_eval_show_prints_stored_results_without_running_and_notes_stale_ones(runs, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["baseline"], run, ignore=shutil.ignore_patterns("eval"))
    assert main(["eval", str(run), "--show"]) == 2
    assert "holds no eval results yet; make one with `difftrain eval" in _error(capsys)
    doc = evaluate(load_run(run), "ppl", EvalOptions(windows=2))
    save_result(run, doc)
    assert main(["eval", str(run), "--show"]) == 0
    out, err = capsys.readouterr()
    assert f"{doc['results']['loss']:.4f}" in out and "computed " in out and err == ""
    assert main(["eval", str(run), "--show", "--suite", "ppl", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ppl": {**doc, "stale": False}}
    # a result older than the weights is shown with a note; one never made is an error with its command
    stored = run / "eval" / "ppl.json"
    stored.write_text(json.dumps({**doc, "weights": {**doc["weights"], "size": 1}}))
    assert main(["eval", str(run), "--show"]) == 0
    # the rerun measures what the stale result did: its windows, not the default 32
    assert (
        f"ppl predates the run's current weights; rerun `difftrain eval {run} --suite ppl --windows 2 --dtype float32`"
        in (capsys.readouterr().err.replace("\n", ""))
    )
    assert main(["eval", str(run), "--show", "--json"]) == 0  # a script is told too: a flag and the note
    out, err = capsys.readouterr()
    assert json.loads(out)["ppl"]["stale"] is True and "ppl predates the run's current weights" in err
    assert main(["eval", str(run), "--show", "--suite", "ppl@wiki"]) == 2
    assert "has no `ppl@wiki` result" in _error(capsys)
    assert main(["eval", str(run), "--show", "--windows", "3"]) == 2
    assert "--show prints the stored results and runs nothing, so --windows would do nothing" in _error(
        capsys
    )
    assert main(["eval", str(run), "--suite", "ppl@wiki"]) == 2
    assert "print it with --show --suite ppl@wiki" in _error(capsys)
    assert not (run / "eval" / "needle.json").exists() and len(list((run / "eval").iterdir())) == 1


def test_a_label_taken_from_the_source_name_never_replaces_another_sources_result(
    runs, tmp_path, capsys, monkeypatch
):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["diff"], run, ignore=shutil.ignore_patterns("eval"))
    monkeypatch.chdir(tmp_path)
    rng = random.Random(5)
    for folder in ("data", "data2", "data/folder/sub"):
        (tmp_path / folder).mkdir(parents=True)
        name = "a.txt" if "folder" not in folder else "f.md"
        (tmp_path / folder / name).write_text(" ".join(filler_sentence(rng) for _ in range(60)))
    stored = run / "eval" / "ppl@a.json"

    def ppl(*args: str) -> int:
        return main(["eval", str(run), "--suite", "ppl", "--windows", "2", *args])

    assert ppl("--data", "data/a.txt") == 0
    first = json.loads(stored.read_text())
    assert first["settings"]["sources"] == [str(tmp_path / "data" / "a.txt")]  # resolved, as typed elsewhere
    capsys.readouterr()
    # another a.txt: refused before the model loads, in one line naming the stored result's source
    assert ppl("--data", "data2/a.txt") == 2
    err = _error(capsys)
    assert f"{stored} holds the result on {tmp_path / 'data' / 'a.txt'}, not data2/a.txt" in err
    assert (
        "keep both with --data-label NAME (e.g. --data-label a-2), or replace that result with --data-label a"
        in err
    )
    assert json.loads(stored.read_text()) == first
    # the same source replaces its own result, as before
    assert ppl("--data", str(tmp_path / "data" / "a.txt")) == 0
    assert json.loads(stored.read_text())["created"] >= first["created"]
    # the suggested label keeps both; the stored label given on purpose replaces it, with a note
    assert ppl("--data", "data2/a.txt", "--data-label", "a-2") == 0
    assert json.loads((run / "eval" / "ppl@a-2.json").read_text())["settings"]["data"] == "data2/a.txt"
    capsys.readouterr()
    assert ppl("--data", "data2/a.txt", "--data-label", "a") == 0
    assert (
        f"--data-label a replaces {stored}, the result on {tmp_path / 'data' / 'a.txt'}"
        in capsys.readouterr().err
    )
    assert json.loads(stored.read_text())["settings"]["sources"] == [str(tmp_path / "data2" / "a.txt")]
    # a glob and its folder share the label `folder`, not the result
    assert ppl("--data", "data/folder/**/*.md") == 0
    capsys.readouterr()
    assert ppl("--data", "data/folder") == 2
    assert "ppl@folder.json holds the result on " + str(tmp_path / "data/folder/**/*.md") in _error(capsys)
    # a result written before the resolved source was recorded: the source as typed decides
    old = json.loads(stored.read_text())
    del old["settings"]["sources"]
    stored.write_text(json.dumps(old))
    assert ppl("--data", "data/a.txt") == 2
    assert "holds the result on data2/a.txt, not data/a.txt" in _error(capsys)
    assert ppl("--data", "data2/a.txt") == 0


# ----- windows the text holds, instruction records on --data, imported runs --------------------
def test_windows_beyond_the_split_are_capped_at_its_non_overlapping_windows_with_a_note(runs, capsys):
    run = load_run(runs["baseline"])
    every = eval_windows(run, data=None, count=None, full=True)  # all non-overlapping windows
    fit = every.split_tokens // (SEQ + 1)
    doc = evaluate(run, "ppl", EvalOptions(windows=fit * 40))
    res = doc["results"]
    assert res["windows"] == doc["settings"]["windows"] == fit  # the number actually used
    assert res["tokens"] <= res["split_tokens"]  # no token scored twice
    small = evaluate(run, "ppl", EvalOptions(windows=2))  # a split big enough: as before, no note
    assert small["results"]["windows"] == 2 and small["notes"] == []
    assert len(every.windows) == fit and not every.notes
    tw = eval_windows(run, data=None, count=fit * 40, full=False, asked=f"--windows {fit * 40}")
    assert torch.equal(tw.windows, every.windows) and tw.notes  # the --full windows, which never overlap
    [note] = doc["notes"]
    assert f"--windows {fit * 40:,} asks for" in note and f"the {fit:,} non-overlapping ones" in note

    assert main(["eval", str(runs["baseline"]), "--suite", "ppl", "--windows", str(fit * 40)]) == 0
    out = capsys.readouterr()
    assert f"{fit} × {SEQ} tokens" in out.out and "note: --windows" in out.err


def test_a_source_shorter_than_one_window_is_scored_as_one_window_of_all_its_tokens(runs, tmp_path):
    run = load_run(runs["baseline"])
    src = tmp_path / "short.txt"
    src.write_text("the quick brown fox jumps over the lazy dog")
    n = len(run.tokenizer.encode(src.read_text())) + 1  # + the document's eos
    assert n < SEQ + 1
    doc = evaluate(run, "ppl", EvalOptions(data=str(src)))
    assert doc["results"]["windows"] == 1 and doc["settings"]["seq_len"] == n - 1
    assert doc["results"]["loss_stderr"] is None
    assert doc["notes"][0].startswith(f"the --data source {src} holds {n} tokens")
    assert "scored as one window of all" in doc["notes"][0]
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(Exception, match="give another --data source"):
        evaluate(run, "ppl", EvalOptions(data=str(tmp_path / "empty.txt")))


def _run_error(capsys) -> str:
    """The one error line of an eval that failed after the model loaded (after its header line)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error:") and sum(x.startswith("error") for x in lines) == 1, lines
    return lines[-1]


def _instruction_run(runs, tmp_path: Path, val_fraction: float = 0.4) -> tuple[Path, Path]:
    """A copy of the baseline run whose recipe fine-tuned it on instruction records (pairs and
    chats): (run, records file)."""
    import shutil

    sft = tmp_path / "sft"
    shutil.copytree(runs["baseline"], sft, ignore=shutil.ignore_patterns("eval"))
    records = tmp_path / "sft.jsonl"
    rng = random.Random(3)
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    pairs = [{"prompt": filler_sentence(rng), "response": filler_sentence(rng)} for _ in range(40)]
    records.write_text("".join(json.dumps(r) + "\n" for r in pairs + chats * 4))
    recipe = yaml.safe_load((sft / "recipe.yaml").read_text())
    recipe["finetune"] = {"base": str(runs["baseline"]), "prompt_format": "Q> {prompt} A> "}
    recipe["data"].update(sources=[str(records)], val_fraction=val_fraction)
    (sft / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return sft, records


def test_an_instruction_fine_tune_reads_instruction_records_on_data_through_its_template(
    runs, tmp_path, capsys
):
    sft, _ = _instruction_run(runs, tmp_path)
    chats = tmp_path / "chats.jsonl"  # other records, the chat kind only
    turns = [{"role": "user", "content": filler_sentence(random.Random(i))} for i in range(30)]
    chats.write_text(
        "".join(json.dumps({"messages": [t, {"role": "assistant", "content": "yes"}]}) + "\n" for t in turns)
    )
    run = load_run(sft)
    tw = eval_windows(run, data=str(chats), count=None, full=True)
    text = run.tokenizer.decode(tw.windows.flatten().tolist())
    assert tw.records_as_text and text.count("<|user|>") >= 10  # rendered as the template renders chats
    assert main(["eval", str(sft), "--suite", "ppl", "--data", str(chats), "--windows", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["ppl"]
    assert doc["label"] == "chats" and "the --data records is scored" in doc["results"]["note"]
    # the same records on a run that is no instruction fine-tune: one line whose advice eval takes
    assert main(["eval", str(runs["baseline"]), "--suite", "ppl", "--data", str(chats)]) == 2
    err = _run_error(capsys)
    assert "a chat record (`messages`), and this run has no chat template: evaluate its chat fine-tune" in err
    assert "--text-field FIELD" in err
    assert "set text_field" not in err and "on_bad_record" not in err


def test_text_field_names_the_field_of_data_records_read_as_text(runs, tmp_path, capsys):
    notes = tmp_path / "notes.jsonl"
    rng = random.Random(8)
    bodies = [filler_sentence(rng) for _ in range(60)]
    notes.write_text("".join(json.dumps({"body": b, "n": i}) + "\n" for i, b in enumerate(bodies)))
    base = str(runs["baseline"])
    assert main(["eval", base, "--suite", "ppl", "--data", str(notes)]) == 2
    assert "name the field to read with --text-field FIELD" in _run_error(capsys)
    assert main(["eval", base, "--suite", "ppl", "--data", str(notes), "--text-field", "body", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["ppl"]
    assert doc["settings"]["text_field"] == "body"
    tok = load_run(runs["baseline"]).tokenizer  # every body is a document: its tokens and an eos
    assert doc["results"]["split_tokens"] == sum(len(tok.encode(b)) + 1 for b in bodies)
    assert main(["eval", base, "--suite", "ppl", "--text-field", "body"]) == 2
    assert "give --data SOURCE with it" in _error(capsys)


def test_an_instruction_split_shorter_than_one_window_is_scored_with_advice_eval_can_follow(runs, tmp_path):
    sft, _ = _instruction_run(runs, tmp_path, val_fraction=0.03)
    doc = evaluate(load_run(sft), "ppl", EvalOptions())
    n = doc["results"]["split_tokens"]
    assert 2 <= n < SEQ + 1 and doc["results"]["windows"] == 1 and doc["settings"]["seq_len"] == n - 1
    [note] = doc["notes"]
    assert "fewer than one window" in note and "--data FILE.jsonl" in note


def test_an_imported_run_has_no_validation_split_so_text_suites_ask_for_data(runs, tmp_path, capsys):
    import shutil

    imp = tmp_path / "imp"
    shutil.copytree(runs["baseline"], imp, ignore=shutil.ignore_patterns("eval"))
    model = load_run(imp).model
    save_weights(imp / "model.safetensors", model, metadata={"imported_from": "hf/tiny"})
    for suite in ("ppl", "outliers", "quant"):
        assert main(["eval", str(imp), "--suite", suite]) == 2
        err = _error(capsys)
        assert "was imported (from hf/tiny)" in err and "--data SOURCE" in err
    assert not (imp / "eval").exists()
    assert main(["compare", str(imp), str(runs["baseline"]), "--suite", "ppl"]) == 2
    assert "it was imported, so it has no validation split" in _error(capsys)  # and how to compare
    with pytest.raises(ConfigError, match="was imported"):
        eval_windows(load_run(imp), data=None, count=2, full=False)
    src = tmp_path / "other.txt"
    src.write_text(" ".join(filler_sentence(random.Random(2)) for _ in range(60)))
    assert main(["eval", str(imp), "--suite", "ppl", "--data", str(src), "--windows", "2"]) == 0
    capsys.readouterr()
    # the suites that read no split still run; `all` skips the text suites with the reason
    code = main(
        [
            "eval",
            str(imp),
            "--suite",
            "all",
            "--lengths",
            "70",
            "--depths",
            "0,1",
            "--needles",
            "1x1",
            "--samples",
            "1",
            "--demos",
            "2",
            "--permutations",
            "2",
            "--items",
            "4",
            "--no-plot",
        ]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert all(f"skipped {s}: " in err for s in ("ppl", "outliers", "quant"))
    assert {p.stem for p in (imp / "eval").glob("*.json")} >= {"needle", "attention", "icl-order"}


def test_results_that_cannot_be_saved_are_refused_first_or_shown_then_refused(
    runs, tmp_path, capsys, monkeypatch
):
    # a read-only run folder: eval computed the suite, then failed with a traceback and lost it
    import errno
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["baseline"], run, ignore=shutil.ignore_patterns("eval"))
    (run / "eval").write_text("not a folder")  # nothing can be saved there
    assert main(["eval", str(run), "--suite", "ppl", "--windows", "2"]) == 2
    err = capsys.readouterr().err
    assert f"cannot save results in {run / 'eval'}: {run / 'eval'} is not a folder" in " ".join(err.split())
    assert "parameters" not in err  # refused before the model was loaded
    (run / "eval").unlink()

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("difftrain.evals.save_result", full_disk)
    assert main(["eval", str(run), "--suite", "ppl", "--windows", "2"]) == 2
    out, err = capsys.readouterr()
    assert "bits/byte" in out  # what was measured is shown
    assert "cannot save the ppl result" in err and "No space left on device" in err and "Traceback" not in err


def test_attention_on_a_context_too_short_for_four_needles_probes_one_and_says_so(runs, tmp_path):
    from difftrain.evals.needle import max_context, min_context

    tok = load_run(runs["baseline"]).tokenizer
    need = min(n for n in range(8, 400) if min_context(tok, 1) <= max_context(tok, n, 1, 1))
    path = make_run(tmp_path, "short", "diff", tokenizer=tok, max_seq_len=need)
    short = load_run(path)
    doc = evaluate(short, "attention", EvalOptions(samples=1, depths=[0.5], plot=False))
    assert doc["settings"]["needles"] == [[1, 1]] or doc["settings"]["needles"] == [(1, 1)]
    assert doc["notes"] == [f"probed with 1 needle, not the default 4: they do not fit max_seq_len={need}"]
    # asked for 4: the refusal names the suite, not the needle test
    with pytest.raises(
        ConfigError, match=r"^attention: max_seq_len=\d+ is too short for a needle test with 4"
    ):
        evaluate(short, "attention", EvalOptions(needles=[(4, 1)], samples=1, plot=False))
    # and so does the command: its check before the model runs accepts the default
    assert (
        main(["eval", str(path), "--suite", "attention", "--samples", "1", "--depths", "0.5", "--no-plot"])
        == 0
    )
    assert main(["eval", str(path), "--suite", "attention", "--needles", "4x1", "--no-plot"]) == 2


def test_figure_titles_with_a_long_run_name_stay_inside_the_figure(tmp_path, monkeypatch):
    from difftrain.evals import plots

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or Path(path))
    name = "quickstart-baseline-with-a-long-name (baseline)"
    rows = [{"bits": 16, "loss": 4.0}, {"bits": 8, "loss": 4.01}, {"bits": 4, "loss": 4.3}]
    plots.quant_curve(rows, tmp_path / "q.png", title=name)
    settings = {"lengths": [64], "depths": [0.5], "needles": [[1, 1]], "samples": 4}
    results = {
        "cells": [{"context_tokens": 64, "depth": 0.5, "n_needles": 1, "n_queries": 1, "accuracy": 0.5}],
        "by_needles": [{"n_needles": 1, "n_queries": 1, "accuracy": 0.5}],
    }
    plots.needle_heatmap(results, settings, tmp_path / "n.png", title=name)
    for fig in drawn:
        fig.canvas.draw()  # (a Figure made without pyplot draws on its own Agg canvas)
        box, page = fig._suptitle.get_window_extent(), fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1, (fig._suptitle.get_text(), box, page)
        assert name.split()[0] in fig._suptitle.get_text().replace("\n", " ")  # wrapped, not cut


def test_bits_per_byte_counts_the_spaces_a_sentencepiece_piece_stands_for(metaspace_tokenizer):
    import numpy as np

    from difftrain.evals.windows import token_byte_lengths, window_target_bytes

    tok = metaspace_tokenizer
    windows = np.array([[2, 3, 4, 5], [3, 4, 5, 6], [5, 1, 3, 4]])
    # targets: "Hello world!", " world! again", and after </s> " Hello world": a new document's
    # first piece is decoded as a continuation here, one byte more per document boundary
    assert window_target_bytes(tok, windows).tolist() == [12, 13, 12]
    # (per token, each decoded alone, they lost their spaces: 11, 11, 10)
    assert token_byte_lengths(tok)[windows[:, 1:]].sum(axis=1).tolist() == [11, 11, 10]


def test_the_attention_note_describes_each_signed_arch_truly(runs, tmp_path, capsys):
    # diff2 has no subln and its rows sum to 1 − σ(λ): the diff note (subln, 1 − λ) was wrong for it
    import shutil

    opts = EvalOptions(lengths=[70], depths=[0.5], needles=[(1, 1)], samples=1, plot=False)
    shown = {}
    for arch in ("diff", "diff2"):
        run = tmp_path / arch
        shutil.copytree(runs[arch], run, ignore=shutil.ignore_patterns("eval"))
        save_result(run, evaluate(load_run(run), "attention", opts))
        assert main(["eval", str(run), "--show", "--suite", "attention"]) == 0
        shown[arch] = " ".join(capsys.readouterr().out.split())
    assert "rows sum to its 1 − λ" in shown["diff"] and "subln normalises each head" in shown["diff"]
    assert (
        "rows sum to 1 − σ(λ)" in shown["diff2"]
        and "with no subln that scale reaches the output" in shown["diff2"]
    )
    assert "subln normalises" not in shown["diff2"]


def test_the_quant_table_prints_a_delta_that_rounds_to_zero_without_a_minus(runs, capsys):
    # eval printed -0.0000 where compare printed +0.0000 for the same stored -1e-6
    from difftrain.cli.evaluate import render

    doc = evaluate(load_run(runs["baseline"]), "quant", EvalOptions(windows=2, bits=[8], plot=False))
    doc["results"]["rows"][1]["delta_loss"] = -1.2e-6
    render(doc, runs["baseline"])
    out = capsys.readouterr().out
    assert "+0.0000" in out and "-0.0000" not in out


def test_a_rerun_command_carries_quants_needle_grid_and_the_precision():
    # the hint dropped --with-needle and its grid (rerunning it lost the needle accuracy per bit
    # width) and --dtype (a bfloat16 result came back float32)
    from difftrain.evals.common import rerun_command

    doc = {
        "dtype": "bfloat16",
        "settings": {
            "bits": [16, 4],
            "windows": 2,
            "needle": {"lengths": [150], "depths": [0.5], "needles": [[1, 1]], "samples": 1, "seed": 9},
        },
    }
    assert rerun_command("runs/e2", "quant", doc) == (
        "difftrain eval runs/e2 --suite quant --windows 2 --bits 16,4 --with-needle --lengths 150 "
        "--depths 0.5 --needles 1x1 --samples 1 --seed 9 --dtype bfloat16"
    )
    assert rerun_command("runs/e2", "quant", doc, dtype=False).endswith("--seed 9")
