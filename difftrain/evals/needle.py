"""`needle`: multi-needle retrieval in the protocol of the Differential Transformer paper (§3.4).

A haystack of filler sentences of L tokens hides N needles "The magic number of <city> is
<7 digits>."; the prompt ends with a question for R of them. The queried needles sit at the
requested depth d (0 = first sentence, 1 = last), the N − R others (distractors) at random
depths. The model continues the prompt greedily through the shared generation engine, and a
query counts as retrieved when the j-th number in the completion is exactly the j-th queried
value:

    accuracy(L, d, N, R) = 1/(K·R) · Σ_samples Σ_j [numbers_j(completion) = value_j]

over K samples per cell, each a fresh haystack from `make_needle_example` seeded by
("needle-eval", seed, cell, sample). The grid is drawn as a heat map per (N, R) (paper Fig. 5).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from difftrain.data.builtin import make_needle_example
from difftrain.errors import ConfigError
from difftrain.evals.common import (
    EvalOptions,
    Progress,
    SuiteOutput,
    _no_progress,
    check_depths,
    check_positive,
    headline,
    mean,
    stable_seed,
)
from difftrain.rundir import Run

DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
NEEDLES_QUICK = [(1, 1), (4, 1)]
NEEDLES_FULL = [(1, 1), (2, 2), (4, 2), (6, 2), (8, 1)]
SAMPLES_QUICK = 4
SAMPLES_FULL = 20
MIN_CONTEXT = 32


@dataclass(frozen=True)
class NeedleGrid:
    """Context lengths (haystack tokens) × depths × (N needles, R queried), K samples per cell."""

    lengths: list[int]
    depths: list[float]
    needles: list[tuple[int, int]]
    samples: int


@dataclass
class NeedlePrompt:
    """One retrieval example, tokenized: `ids` = [eos] + prompt tokens."""

    context_tokens: int
    depth: float
    n_needles: int
    n_queries: int
    sample: int
    ids: list[int]
    haystack_tokens: int
    answer_tokens: int
    expected: list[str]
    query_keys: list[str]
    measured_depths: list[float]
    example: Any


def check_needles(needles: Sequence[tuple[int, int]] | None) -> None:
    if needles is not None and not needles:
        raise ConfigError("--needles is empty; give N×R pairs, e.g. 1x1,4x2")
    for n, r in needles or []:
        if not 1 <= n <= 64:
            raise ConfigError(f"--needles {n}x{r}: N (needles) must be in 1 … 64")
        if not 1 <= r <= n:
            raise ConfigError(f"--needles {n}x{r}: R (queried) must be in 1 … N={n}")


def parse_needles(text: str) -> list[tuple[int, int]]:
    """'1x1,4x2' → [(1, 1), (4, 2)] (N needles × R queried; 'N' alone means R = 1)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:\s*[x×:/]\s*(\d+))?", part)
        if m is None:
            raise ConfigError(f"--needles {part!r} is not N×R; write e.g. 4x1 (4 needles, 1 queried)")
        out.append((int(m.group(1)), int(m.group(2) or 1)))
    check_needles(out)
    return out


def _example(tokenizer: Any, context_tokens: int, n: int, r: int, depth: float, seed: int) -> Any:
    """A needle example whose queried needles sit at `depth` and the others at random depths."""
    # The generator draws keys, values and the queried needles from `seed` before it reads the
    # depths, so a tiny probe tells which needles will be queried.
    probe = make_needle_example(context_chars=1, n_needles=n, n_queries=r, depths=[0.0] * n, seed=seed)
    rng = random.Random(stable_seed("distractors", seed))
    depths = [depth if nd.key in probe.query_keys else rng.random() for nd in probe.needles]
    ex = make_needle_example(
        context_tokens=context_tokens, n_needles=n, n_queries=r, depths=depths, seed=seed, tokenizer=tokenizer
    )
    assert ex.query_keys == probe.query_keys  # the generator's draw order is what we rely on
    return ex


def build_prompt(
    tokenizer: Any,
    max_seq_len: int,
    context_tokens: int,
    n: int,
    r: int,
    depth: float,
    seed: int,
    sample: int = 0,
) -> NeedlePrompt:
    """Tokenize one example; shrink its haystack if prompt + answer would overflow the context."""
    budget = context_tokens
    for _ in range(8):
        ex = _example(tokenizer, budget, n, r, depth, seed)
        ids = [tokenizer.document_start_id, *tokenizer.encode(ex.prompt)]
        answer_tokens = len(tokenizer.encode(ex.answer))
        overflow = len(ids) + answer_tokens + 1 - max_seq_len
        if overflow <= 0 or budget - overflow < MIN_CONTEXT:
            break
        budget -= overflow
    if overflow > 0:
        raise ConfigError(
            f"a needle prompt of {context_tokens} context tokens with {n} needles and {r} queried does not fit "
            f"max_seq_len={max_seq_len}; use shorter --lengths (at most "
            f"{max_context(tokenizer, max_seq_len, n, r)})"
        )
    return NeedlePrompt(
        context_tokens=context_tokens,
        depth=depth,
        n_needles=n,
        n_queries=r,
        sample=sample,
        ids=ids,
        haystack_tokens=ex.n_tokens if ex.n_tokens is not None else len(tokenizer.encode(ex.haystack)),
        answer_tokens=answer_tokens,
        expected=list(ex.expected),
        query_keys=list(ex.query_keys),
        measured_depths=[filler_depth(ex, nd) for nd in ex.needles if nd.key in ex.query_keys],
        example=ex,
    )


def filler_depth(ex: Any, needle: Any) -> float:
    """The fraction of the haystack's filler text that precedes a needle (what depth asks for)."""
    needle_chars = sum(len(nd.sentence) + 1 for nd in ex.needles)
    before = sum(len(nd.sentence) + 1 for nd in ex.needles if nd.char_offset < needle.char_offset)
    filler = len(ex.haystack) + 1 - needle_chars
    return (needle.char_offset - before) / filler if filler > 0 else 0.0


def min_context(tokenizer: Any, n: int) -> int:
    """The shortest haystack worth testing with N needles: at least half of it filler (probed)."""
    probes = (
        make_needle_example(context_chars=1, n_needles=n, seed=stable_seed("probe", s)) for s in range(6)
    )
    return max(MIN_CONTEXT, 2 * max(len(tokenizer.encode(ex.haystack)) for ex in probes))


def max_context(tokenizer: Any, max_seq_len: int, n: int, r: int) -> int:
    """The longest haystack (tokens) whose prompt + answer fit `max_seq_len`, with a margin for
    longer city names than the probes happen to draw."""
    probes = [
        make_needle_example(context_chars=200, n_needles=n, n_queries=r, seed=stable_seed("probe", s))
        for s in range(6)
    ]
    sizes = [[len(tokenizer.encode(t)) for t in (ex.prompt, ex.haystack, ex.answer)] for ex in probes]
    return max_seq_len - max(2 + p - h + a for p, h, a in sizes) - 2 * r - 2


def default_grid(
    tokenizer: Any, max_seq_len: int, opts: EvalOptions, *, quick_lengths: int = 2
) -> NeedleGrid:
    """The grid the options ask for; unset parts take the quick (or, with --full, paper) defaults."""
    needles = opts.needles or (NEEDLES_FULL if opts.full else NEEDLES_QUICK)
    check_needles(needles)
    if opts.needles is None:
        # default configurations that cannot fit this model's context are left out (see `dropped`)
        fits = [
            (n, r)
            for n, r in needles
            if min_context(tokenizer, n) <= max_context(tokenizer, max_seq_len, n, r)
        ]
        needles = fits or needles[:1]
    depths = opts.depths if opts.depths is not None else list(DEPTHS)
    check_depths(depths)
    samples = opts.samples or (SAMPLES_FULL if opts.full else SAMPLES_QUICK)
    check_positive("--samples", samples)
    low = max(min_context(tokenizer, n) for n, _ in needles)
    most = max(needles)
    top = min(max_context(tokenizer, max_seq_len, n, r) for n, r in needles)
    if top < low:
        raise ConfigError(_too_short(tokenizer, max_seq_len, most[0], low))
    if opts.lengths:
        lengths = sorted(set(opts.lengths))
        if lengths[-1] > top:
            raise ConfigError(
                f"--lengths {lengths[-1]} does not fit: with the question and answer the prompt would exceed the "
                f"model's max_seq_len={max_seq_len}; use lengths ≤ {top}"
            )
        if lengths[0] < low:
            raise ConfigError(
                f"--lengths {lengths[0]} is too short for {most[0]} needle{'s' if most[0] > 1 else ''}: the needles alone take about {low // 2} tokens "
                f"and at least half of a haystack should be filler; use lengths ≥ {low}"
            )
    else:
        # top·i/k for i = 1 … k (the paper's evenly spaced lengths), those long enough for the
        # needles; the shortest usable and the longest length when fewer than two remain
        k = 8 if opts.full else quick_lengths
        lengths = sorted({x for i in range(k) if (x := round(top * (i + 1) / k)) >= low})
        if len(lengths) < min(k, 2):
            lengths = sorted({low, top})
    return NeedleGrid(
        lengths=lengths, depths=[float(d) for d in depths], needles=list(needles), samples=samples
    )


def _too_short(tokenizer: Any, max_seq_len: int, n: int, low: int) -> str:
    """Why no haystack fits: what to ask for instead (fewer needles, or a longer context)."""
    one = max_context(tokenizer, max_seq_len, 1, 1)
    if n > 1 and min_context(tokenizer, 1) <= one:
        return (
            f"max_seq_len={max_seq_len} is too short for a needle test with {n} needles: a haystack of at least "
            f"{low} tokens plus the question and answer does not fit; use --needles 1x1"
        )
    need = max_seq_len + min_context(tokenizer, 1) - one
    return (
        f"max_seq_len={max_seq_len} is too short for a needle test, even with one needle: it needs a context of "
        f"at least {need} tokens; evaluate a model whose max_seq_len is at least {need}"
    )


def grid_prompts(tokenizer: Any, max_seq_len: int, grid: NeedleGrid, seed: int) -> list[NeedlePrompt]:
    """Every prompt of the grid, in cell order (length, N×R, depth, sample)."""
    return [
        build_prompt(
            tokenizer, max_seq_len, L, n, r, d, stable_seed("needle-eval", seed, L, n, r, f"{d:.6f}", k), k
        )
        for L in grid.lengths
        for n, r in grid.needles
        for d in grid.depths
        for k in range(grid.samples)
    ]


def score(completion: str, expected: Sequence[str]) -> list[bool]:
    """Per queried value: is the j-th number in the completion exactly the j-th expected value?"""
    numbers = re.findall(r"\d+", completion)
    return [j < len(numbers) and numbers[j] == v for j, v in enumerate(expected)]


def _within_budget(tokenizer: Any, prompt: NeedlePrompt, completion: Any) -> str:
    """A completion as the prompt's own budget (its answer's tokens + 2) leaves it: a batch
    generates up to its longest prompt's budget, and a shorter prompt's extra tokens could finish a
    number it would not have — the score would depend on its batchmates and --batch-size."""
    own = prompt.answer_tokens + 2
    if len(completion.token_ids) <= own:
        return completion.text
    decoder = tokenizer.stream_decoder(context=prompt.ids)
    return (decoder.push_many(completion.token_ids[:own]) + decoder.flush()).split("\n", 1)[0]


def retrieve(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[NeedlePrompt],
    *,
    batch_size: int = 8,
    progress: Progress = _no_progress,
) -> list[tuple[str, list[bool]]]:
    """Greedy completions (through `difftrain.infer.generate`) and their per-query scores."""
    from difftrain.infer.generate import greedy

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))  # less padding per batch
    out: list[tuple[str, list[bool]] | None] = [None] * len(prompts)
    for j in range(0, len(order), batch_size):
        idx = order[j : j + batch_size]
        new = max(prompts[i].answer_tokens for i in idx) + 2
        comps = greedy(model, [prompts[i].ids for i in idx], new, tokenizer=tokenizer, stop=("\n",))
        for i, c in zip(idx, comps, strict=True):
            text = _within_budget(tokenizer, prompts[i], c)
            out[i] = (text, score(text, prompts[i].expected))
        progress(min(j + batch_size, len(order)), len(order))
    return [o for o in out if o is not None]


def aggregate(
    grid: NeedleGrid, prompts: Sequence[NeedlePrompt], scored: Sequence[tuple[str, list[bool]]]
) -> dict:
    """Cell, per-(N, R), per-depth, per-length and overall accuracies, plus every sample."""

    def group(**key: Any) -> dict[str, Any]:
        """The prompts whose fields equal `key`: `key`, their accuracy and their count."""
        sel = [
            ok
            for p, (_, ok) in zip(prompts, scored, strict=True)
            if all(getattr(p, k) == v for k, v in key.items())
        ]
        return {**key, "accuracy": mean([sum(ok) / len(ok) for ok in sel]), "samples": len(sel)}

    def acc(**key: Any) -> dict[str, Any]:
        return {k: v for k, v in group(**key).items() if k != "samples"}

    cells = [
        group(context_tokens=L, depth=d, n_needles=n, n_queries=r)
        for L in grid.lengths
        for n, r in grid.needles
        for d in grid.depths
    ]
    samples = [
        {
            **{k: getattr(p, k) for k in ("context_tokens", "depth", "n_needles", "n_queries", "sample")},
            "haystack_tokens": p.haystack_tokens,
            "prompt_tokens": len(p.ids),
            "measured_depths": [round(x, 4) for x in p.measured_depths],
            "query_keys": p.query_keys,
            "expected": p.expected,
            "completion": text,
            "correct": ok,
        }
        for p, (text, ok) in zip(prompts, scored, strict=True)
    ]
    return {
        "accuracy": group()["accuracy"],
        "exact_match": mean([float(all(ok)) for _, ok in scored]),
        "cells": cells,
        "by_needles": [acc(n_needles=n, n_queries=r) for n, r in grid.needles],
        "by_depth": [acc(depth=d) for d in grid.depths],
        "by_length": [acc(context_tokens=L) for L in grid.lengths],
        "samples": samples,
    }


def evaluate_grid(
    model: Any,
    tokenizer: Any,
    grid: NeedleGrid,
    *,
    seed: int,
    batch_size: int = 8,
    progress: Progress = _no_progress,
) -> dict[str, Any]:
    """Run the whole grid; the `results` part of needle.json."""
    prompts = grid_prompts(tokenizer, model.config.max_seq_len, grid, seed)
    scored = retrieve(model, tokenizer, prompts, batch_size=batch_size, progress=progress)
    return aggregate(grid, prompts, scored)


def grid_settings(grid: NeedleGrid, seed: int) -> dict[str, Any]:
    return {**asdict(grid), "needles": [list(x) for x in grid.needles], "seed": seed}


def run(run: Run, opts: EvalOptions, progress: Progress = _no_progress) -> SuiteOutput:
    max_len = run.config.max_seq_len  # type: ignore[attr-defined]
    grid = default_grid(run.tokenizer, max_len, opts)
    default = [] if opts.needles is not None else NEEDLES_FULL if opts.full else NEEDLES_QUICK
    gone = [f"{n}x{r}" for n, r in default if (n, r) not in grid.needles]  # too large for the context
    res = evaluate_grid(
        run.model, run.tokenizer, grid, seed=opts.seed, batch_size=opts.batch_size, progress=progress
    )
    out = SuiteOutput(
        settings=grid_settings(grid, opts.seed),
        results=res,
        notes=[f"needle configurations {', '.join(gone)} do not fit max_seq_len={max_len} and were left out"]
        if gone
        else [],
        headline=[headline("accuracy", res["accuracy"], "higher", ".3f")]
        + [
            headline(f"acc N={b['n_needles']} R={b['n_queries']}", b["accuracy"], "higher", ".3f")
            for b in res["by_needles"]
        ],
    )
    import difftrain.evals.plots as plots

    plots.draw(
        out, opts.plot, run, "needle", lambda p, title: plots.needle_heatmap(res, out.settings, p, title)
    )
    return out
