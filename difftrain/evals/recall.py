"""`recall` suite: exact-match accuracy on multi-query associative recall (`builtin:recall`).

Fresh held-out examples (the task's "eval" seeds, none equal to a training example of the run)
for each N (pairs in the context) and distractor rate of a grid, with the task settings of the
run's recipe (its first `builtin:recall` source). The model reads each example once,
teacher-forced, and a query counts as answered when the greedy prediction at every token of its
value is right (exact match); `exact_match` is the fraction of examples with every query right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from difftrain.data.config import RecallSpec
from difftrain.data.recall import RecallExample, held_out_examples, train_examples
from difftrain.data.tokenizer import record_start_id
from difftrain.errors import ConfigError, RunDirError
from difftrain.evals.common import EvalOptions, Progress, SuiteOutput, _no_progress, headline, mean
from difftrain.evals.windows import _run_recipe

PAIRS = [4, 8, 16, 32, 64]
SAMPLES_QUICK = 64
SAMPLES_FULL = 256


@dataclass(frozen=True)
class RecallGrid:
    pairs: list[int]
    distractors: list[float]
    samples: int
    task: RecallSpec
    """The run's task (vocabularies, queries, seed); each cell replaces n_pairs and the rate."""
    dropped: list[str]


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    answers: list[tuple[int, list[int]]]
    """Per query: (position of its first answer token in `ids`, its tokens)."""


def run_task(run: Any) -> RecallSpec:
    """The recall task of the run's recipe (its first builtin:recall source); a ConfigError for a
    run not trained on it (its tokenizer and model never saw the task: the suite would measure
    nothing)."""
    try:
        recipe = _run_recipe(run.path)
    except RunDirError as e:
        raise RunDirError(
            f"the recall suite reads the task from the run's recipe: {e}".split("; evaluate on")[0]
        ) from e
    for s in recipe.data.sources:
        if s.source == "builtin:recall":
            return s.recall or RecallSpec()
    raise ConfigError(
        f"{run.path} was not trained on builtin:recall, so the recall suite has nothing to measure; "
        "evaluate a run of a recall recipe (e.g. `difftrain pretrain recall-diff`)"
    )


def encode(tokenizer: Any, ex: RecallExample) -> Encoded:
    """The example's tokens as training saw them (segments encoded one by one, the record start
    token first where the tokenizer has one) and where each answer lies."""
    start = record_start_id(tokenizer)
    ids: list[int] = [] if start is None else [start]
    answers = []
    for text, trained in ex.segments():
        toks = tokenizer.encode(text)
        if trained:
            answers.append((len(ids), toks))
        ids += toks
    return Encoded(ids, answers)


def _cell_spec(task: RecallSpec, n: int, rate: float) -> RecallSpec:
    return task.model_copy(
        update={"n_pairs": n, "n_queries": min(task.n_queries, n), "distractor_rate": rate}
    )


def _longest(tokenizer: Any, spec: RecallSpec) -> int:
    """Tokens of the longest example the cell can have: every gap holding ⌈rate⌉ distractors."""
    full = spec.model_copy(update={"distractor_rate": float(-(-spec.distractor_rate // 1))})
    return len(encode(tokenizer, held_out_examples(full, 1, split="eval")[0]).ids)


def default_grid(tokenizer: Any, max_seq_len: int, opts: EvalOptions, task: RecallSpec) -> RecallGrid:
    """The grid `opts` asks for (see the module docstring), cells that cannot run left out."""
    samples = opts.samples or (SAMPLES_FULL if opts.full else SAMPLES_QUICK)
    if samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {samples}")
    asked = opts.pairs or sorted({*PAIRS, task.n_pairs})
    if any(n < 1 for n in asked):
        raise ConfigError(f"--pairs must be positive numbers of pairs, got {','.join(map(str, asked))}")
    rates = opts.distractors or sorted({0.0, task.distractor_rate})
    if any(not 0.0 <= r <= 16.0 for r in rates):
        raise ConfigError(f"--distractors must lie in [0, 16], got {','.join(f'{r:g}' for r in rates)}")
    pairs, dropped = [], []
    for n in sorted(set(asked)):
        if n > task.key_vocab:
            dropped.append(f"N={n} (more pairs than the {task.key_vocab} keys of the task)")
            continue
        need = max(_longest(tokenizer, _cell_spec(task, n, r)) for r in rates) - 1
        if need > max_seq_len:
            dropped.append(f"N={n} (up to {need} tokens, more than max_seq_len={max_seq_len})")
            continue
        pairs.append(n)
    if not pairs:
        raise ConfigError(
            f"no N of the recall grid can run: {'; '.join(dropped)}; choose others with --pairs"
        )
    return RecallGrid(pairs, sorted(set(rates)), samples, task, dropped)


@torch.inference_mode()
def score(model: Any, batch: list[Encoded], pad_id: int) -> list[list[bool]]:
    """Per example, per query: whether the greedy prediction of every answer token is right."""
    device = next(model.parameters()).device
    x = pad_sequence([torch.tensor(e.ids[:-1]) for e in batch], batch_first=True, padding_value=pad_id)
    pred = model(x.to(device)).logits.argmax(-1).cpu()
    return [
        [pred[b, pos - 1 : pos - 1 + len(t)].tolist() == t for pos, t in e.answers]
        for b, e in enumerate(batch)
    ]


def evaluate_grid(
    model: Any,
    tokenizer: Any,
    grid: RecallGrid,
    *,
    exclude: set[str] | frozenset[str] = frozenset(),
    batch_size: int = 8,
    progress: Progress = _no_progress,
) -> dict[str, Any]:
    """Accuracy per (N, distractor rate) cell, per N, per rate, and at the recipe's N; no example
    whose text is in `exclude` (the run's training examples) is asked."""
    cells = []
    total = len(grid.pairs) * len(grid.distractors) * grid.samples
    done = 0
    for n in grid.pairs:
        for rate in grid.distractors:
            spec = _cell_spec(grid.task, n, rate)
            exs = held_out_examples(spec, grid.samples, split="eval", exclude=exclude)
            encoded = [encode(tokenizer, ex) for ex in exs]
            ok: list[list[bool]] = []
            for i in range(0, len(encoded), batch_size):
                ok += score(model, encoded[i : i + batch_size], tokenizer.pad_id)
                done += len(encoded[i : i + batch_size])
                progress(done, total)
            cells.append(
                {
                    "n_pairs": n,
                    "distractor_rate": rate,
                    "accuracy": mean([float(q) for row in ok for q in row]),
                    "exact_match": mean([float(all(row)) for row in ok]),
                    "examples": len(ok),
                    "queries": sum(len(row) for row in ok),
                    "tokens": mean([float(len(e.ids)) for e in encoded]),
                }
            )

    def by(key: str, values: list[Any]) -> list[dict[str, Any]]:
        return [{key: v, "accuracy": mean([c["accuracy"] for c in cells if c[key] == v])} for v in values]

    recipe_cell = (grid.task.n_pairs, grid.task.distractor_rate)
    return {
        "accuracy": mean([c["accuracy"] for c in cells]),
        "at_recipe": next((c for c in cells if (c["n_pairs"], c["distractor_rate"]) == recipe_cell), None),
        "cells": cells,
        "by_pairs": by("n_pairs", grid.pairs),
        "by_rate": by("distractor_rate", grid.distractors),
    }


def grid_settings(grid: RecallGrid, seed: int, max_seq_len: int) -> dict[str, Any]:
    return {
        "pairs": grid.pairs,
        "distractors": grid.distractors,
        "samples": grid.samples,
        **{k: getattr(grid.task, k) for k in ("n_queries", "key_vocab", "value_vocab")},
        **{f"task_{k}": getattr(grid.task, k) for k in ("n_pairs", "distractor_rate", "seed")},
        "seed": seed,
        "seq_len": max_seq_len,
    }


def run(run: Any, opts: EvalOptions, progress: Progress = _no_progress) -> SuiteOutput:
    task = run_task(run)
    training = {ex.text for ex in train_examples(task)}
    # --seed draws other evaluation examples: it shifts the task's seed (the split stays "eval")
    task = task.model_copy(update={"seed": task.seed + opts.seed}) if opts.seed else task
    max_len = run.config.max_seq_len
    grid = default_grid(run.tokenizer, max_len, opts, task)
    res = evaluate_grid(
        run.model, run.tokenizer, grid, exclude=training, batch_size=opts.batch_size, progress=progress
    )
    notes = [f"left out: {'; '.join(grid.dropped)}"] if grid.dropped else []
    heads = [headline("accuracy", res["accuracy"], "higher", ".3f")]
    if (c := res["at_recipe"]) is not None:
        heads.append(headline(f"acc at recipe N={c['n_pairs']}", c["accuracy"], "higher", ".3f"))
    heads += [headline(f"acc N={b['n_pairs']}", b["accuracy"], "higher", ".3f") for b in res["by_pairs"]]
    out = SuiteOutput(
        settings=grid_settings(grid, opts.seed, max_len), results=res, headline=heads, notes=notes
    )
    import difftrain.evals.plots as plots

    plots.draw(out, opts.plot, run, "recall", lambda p, label: plots.recall_curves([(label, res)], p))
    return out
