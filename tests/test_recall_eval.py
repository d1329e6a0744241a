"""The recall suite scores exact matches: a model that looks each key up in its context scores
1, one that guesses a constant scores the share of answers equal to it; the result is saved in
the form of the other suites, for every N of the grid and every distractor rate."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from difftrain.data.config import RecallSpec, TokenizerTrainConfig
from difftrain.data.recall import held_out_examples, recall_documents, value_symbol
from difftrain.data.tokenizer import train_tokenizer
from difftrain.errors import ConfigError, RunDirError
from difftrain.evals import evaluate, save_result
from difftrain.evals.common import EvalOptions
from difftrain.evals.recall import default_grid, encode

TASK = RecallSpec(
    n_pairs=8, n_queries=3, distractor_rate=1.0, key_vocab=40, value_vocab=12, num_documents=300
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(recall_documents(TASK), TokenizerTrainConfig(vocab_size=400))


class LookUp(torch.nn.Module):
    """An exact solver of the task: at each position, the token that followed the latest earlier
    occurrence of the current token (an induction head written out)."""

    def __init__(self, vocab: int, max_seq_len: int = 128) -> None:
        super().__init__()
        self.vocab = vocab
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_seq_len=max_seq_len, arch="lookup")

    def forward(self, x: torch.Tensor) -> SimpleNamespace:
        B, T = x.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            for t in range(T):
                earlier = [s for s in range(t) if x[b, s] == x[b, t]]
                if earlier:
                    logits[b, t, x[b, earlier[-1] + 1]] = 1.0
        return SimpleNamespace(logits=logits)


class Constant(LookUp):
    """Always predicts one token."""

    def __init__(self, vocab: int, token: int) -> None:
        super().__init__(vocab)
        self.token = token

    def forward(self, x: torch.Tensor) -> SimpleNamespace:
        logits = torch.zeros(*x.shape, self.vocab)
        logits[..., self.token] = 1.0
        return SimpleNamespace(logits=logits)


@dataclass
class FakeRun:
    path: Path
    model: torch.nn.Module
    config: object
    tokenizer: object


def _run(tmp_path: Path, model: LookUp, tokenizer) -> FakeRun:
    recipe = {
        "name": "r",
        "model": {"arch": "diff", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 128},
        "data": {"sources": [{"source": "builtin:recall", "recall": TASK.model_dump()}], "val_fraction": 0.0},
        "train": {"max_steps": 10},
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    return FakeRun(tmp_path, model, model.config, tokenizer)


def test_a_model_that_looks_keys_up_answers_every_query(tmp_path, tokenizer) -> None:
    run = _run(tmp_path, LookUp(tokenizer.vocab_size), tokenizer)
    opts = EvalOptions(pairs=[2, 8, 16], distractors=[0.0, 1.0], samples=6, batch_size=4, plot=False)
    doc = evaluate(run, "recall", opts)
    res = doc["results"]
    assert doc["suite"] == "recall" and doc["settings"]["pairs"] == [2, 8, 16]
    assert [(c["n_pairs"], c["distractor_rate"]) for c in res["cells"]] == [
        (n, r) for n in (2, 8, 16) for r in (0.0, 1.0)
    ]
    assert all(c["accuracy"] == 1.0 and c["exact_match"] == 1.0 for c in res["cells"])
    assert [c["queries"] for c in res["cells"]] == [12, 12, 18, 18, 18, 18]  # min(3, N) per example
    assert res["at_recipe"]["n_pairs"] == 8 and res["at_recipe"]["distractor_rate"] == 1.0
    names = [h["name"] for h in doc["headline"]]
    assert names == ["accuracy", "acc at recipe N=8", "acc N=2", "acc N=8", "acc N=16"]
    path = save_result(tmp_path, doc)
    assert path == tmp_path / "eval" / "recall.json"
    assert json.loads(path.read_text())["results"]["accuracy"] == 1.0


def test_a_constant_guess_scores_the_share_of_answers_it_names(tmp_path, tokenizer) -> None:
    aa = tokenizer.encode(" " + value_symbol(0))
    assert len(aa) == 1
    run = _run(tmp_path, Constant(tokenizer.vocab_size, aa[0]), tokenizer)
    doc = evaluate(run, "recall", EvalOptions(pairs=[8], distractors=[1.0], samples=20, plot=False))
    cell = doc["results"]["cells"][0]
    exs = held_out_examples(TASK, 20, split="eval")
    expected = [a == value_symbol(0) for ex in exs for a in ex.answers]
    assert cell["accuracy"] == pytest.approx(sum(expected) / len(expected))
    assert cell["exact_match"] == pytest.approx(sum(all(a == "aa" for a in ex.answers) for ex in exs) / 20)


def test_the_answer_positions_are_those_of_the_values(tokenizer) -> None:
    ex = held_out_examples(TASK, 1, split="eval")[0]
    enc = encode(tokenizer, ex)
    assert [tokenizer.decode(enc.ids[p : p + len(t)]).strip() for p, t in enc.answers] == ex.answers
    assert [tokenizer.decode([enc.ids[p - 1]]).strip() for p, _ in enc.answers] == ex.query_keys


def test_a_grid_that_cannot_run_is_refused_or_trimmed_with_a_note(tokenizer) -> None:
    grid = default_grid(tokenizer, 28, EvalOptions(pairs=[4, 8, 64]), TASK)
    assert (
        grid.pairs == [4] and any("N=8" in d for d in grid.dropped) and any("N=64" in d for d in grid.dropped)
    )
    with pytest.raises(ConfigError, match="no N of the recall grid can run"):
        default_grid(tokenizer, 8, EvalOptions(pairs=[8]), TASK)
    with pytest.raises(ConfigError, match="--distractors"):
        default_grid(tokenizer, 96, EvalOptions(distractors=[-1.0]), TASK)


def test_compare_shows_recall_side_by_side_and_plots_accuracy_against_n(tmp_path, tokenizer) -> None:
    from difftrain.evals.compare import compare_runs, plot_curves

    dirs = []
    for name, model in (("a", LookUp(tokenizer.vocab_size)), ("b", Constant(tokenizer.vocab_size, 9))):
        d = tmp_path / name
        d.mkdir()
        run = _run(d, model, tokenizer)
        save_result(
            d, evaluate(run, "recall", EvalOptions(pairs=[2, 8], distractors=[0.0], samples=4, plot=False))
        )
        (d / "summary.json").write_text(json.dumps({"steps": 10, "finished": True}))
        (d / "metrics.csv").write_text(
            "step,train/loss,train/tokens,train/time_s\n1,4.0,100,1.0\n10,3.0,1000,2.0\n"
        )
        dirs.append(d)
    cmp = compare_runs(dirs, ["recall"])
    rows = {r.name: r.values for r in cmp.suites["recall"]}
    assert rows["acc N=2"][0] == 1.0 and rows["acc N=8"][0] == 1.0 and rows["acc N=8"][1] < 1.0
    path = plot_curves(cmp, tmp_path / "compare.png")
    assert path.is_file() and path.stat().st_size > 10_000


def test_a_run_not_trained_on_the_task_is_refused_with_the_reason(tmp_path, tokenizer) -> None:
    run = _run(tmp_path, LookUp(tokenizer.vocab_size), tokenizer)
    recipe = json.loads((tmp_path / "recipe.yaml").read_text())
    recipe["data"] = {"sources": ["builtin:needles"]}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    with pytest.raises(ConfigError, match="was not trained on builtin:recall"):
        evaluate(run, "recall", EvalOptions(plot=False))
    (tmp_path / "recipe.yaml").unlink()
    with pytest.raises(RunDirError, match="reads the task from the run's recipe: .* has no recipe.yaml"):
        evaluate(run, "recall", EvalOptions(plot=False))
