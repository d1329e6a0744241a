"""`icl-order`: in-context classification and its sensitivity to the order of demonstrations.

A small binary task from the needle generator's facts (paper §3.6): each item is a needle
sentence "The magic number of <city> is <7 digits>." labelled `high` when the number is at
least 5000000 and `low` otherwise. A prompt is D labelled demonstrations (half of each label),
each "<sentence>\nLabel: <label>\n\n", followed by an unlabelled "<sentence>\nLabel:".
The prediction is the label with the larger log-likelihood of its tokens. The same D
demonstrations are presented in P different orders (seeded permutations), each scored on the
same M test items (half of each label). Reported: accuracy per order, their mean, and the
best − worst margin (the order sensitivity); chance is 0.5.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from difftrain.data.builtin import make_needle_example
from difftrain.errors import ConfigError
from difftrain.evals.common import (
    EvalOptions,
    Progress,
    SuiteOutput,
    _no_progress,
    check_positive,
    headline,
    stable_seed,
)
from difftrain.rundir import Run

LABELS = ("low", "high")
QUICK = {"demos": 8, "permutations": 8, "items": 32}
FULL = {"demos": 16, "permutations": 24, "items": 100}


def items(seed: int, count: int, tag: str) -> list[tuple[str, int]]:
    """`count` facts (sentence, label index), half of each label, in a seeded order."""
    want = [i % 2 for i in range(count)]
    random.Random(stable_seed("icl-order", tag, seed)).shuffle(want)
    facts = (
        make_needle_example(context_chars=1, n_needles=1, seed=stable_seed("icl-fact", tag, seed, k)).needles
        for k in itertools.count()
    )
    labelled = ((nd.sentence, int(int(nd.value) >= 5_000_000)) for (nd,) in facts)
    return [next(f for f in labelled if f[1] == label) for label in want]


def demo_block(sentence: str, label: str | None) -> str:
    return f"{sentence}\nLabel:" + (f" {label}\n\n" if label is not None else "")


@torch.inference_mode()
def label_scores(
    model: Any, prefix: list[int], suffixes: list[list[int]], cands: list[list[int]], batch_size: int = 8
) -> np.ndarray:
    """Σ log p(candidate tokens | prefix + suffix) for every suffix × candidate: (suffixes, candidates).

    The shared `prefix` runs once into a KV cache copied to each row of a batch; each row reads
    only its test item and one candidate (right-padded: a causal row never attends to the
    padding after it)."""
    device = next(model.parameters()).device
    rows = [(i, j) for i in range(len(suffixes)) for j in range(len(cands))]
    longest = max(len(s) + len(c) for s in suffixes for c in cands)
    base = model.new_cache(1, max_len=len(prefix) + longest)
    model(torch.tensor([prefix], device=device), cache=base)
    P = len(prefix)
    out = np.zeros((len(suffixes), len(cands)))
    for a in range(0, len(rows), batch_size):
        chunk = rows[a : a + batch_size]
        ids = pad_sequence([torch.tensor(suffixes[i] + cands[j]) for i, j in chunk], batch_first=True)
        cache = model.new_cache(len(chunk), max_len=P + ids.shape[1])
        for layer in range(len(cache.keys)):
            cache.keys[layer][:, :, :P] = base.keys[layer][:, :, :P]
            cache.values[layer][:, :, :P] = base.values[layer][:, :, :P]
        cache.length = P
        cache.next_position.fill_(P)
        logp = F.log_softmax(model(ids.to(device), cache=cache).logits.float(), dim=-1).cpu()
        for r, (i, j) in enumerate(chunk):
            n, c = len(suffixes[i]), cands[j]
            pos = torch.arange(n - 1, n + len(c) - 1)
            out[i, j] = logp[r, pos, torch.tensor(c)].sum().item()
    return out


def fitting_demos(tokenizer: Any, max_len: int, want: int, seed: int) -> int:
    """The largest even number of demonstrations ≤ want whose prompts fit max_len (at least 2)."""
    blocks = [len(tokenizer.encode(demo_block(s, LABELS[lab]))) for s, lab in items(seed, want, "demos")]
    tail = max(len(tokenizer.encode(demo_block(s, None))) for s, _ in items(seed, 8, "tests")) + 4
    d = want
    while d > 2 and 1 + sum(sorted(blocks, reverse=True)[:d]) + tail > max_len:
        d -= 2
    return d


@dataclass
class Prompts:
    """The token ids the suite scores: one prefix (demonstrations) per order, one suffix per
    test item (its label index in `gold`), one candidate per label; `longest`: the longest
    prefix + suffix + candidate."""

    demos: int
    permutations: int
    items: int
    orders: list[list[int]]
    prefixes: list[list[int]]
    suffixes: list[list[int]]
    cands: list[list[int]]
    gold: list[int]
    longest: int


def _prompts(tok: Any, D: int, P: int, M: int, seed: int) -> Prompts:
    demos = items(seed, D, "demos")
    tests = items(seed, M, "tests")
    rng = random.Random(stable_seed("icl-order", "orders", seed))
    seen: dict[tuple[int, ...], None] = {}  # the distinct orders, in the order drawn
    for _ in range(100 * P):
        o = list(range(D))
        rng.shuffle(o)
        seen.setdefault(tuple(o))
        if len(seen) == P:
            break
    orders = [list(o) for o in seen]
    cands = [tok.encode(f" {lab}") for lab in LABELS]
    suffixes = [tok.encode(demo_block(sentence, None)) for sentence, _ in tests]
    prefixes = [
        [tok.document_start_id, *tok.encode("".join(demo_block(demos[i][0], LABELS[demos[i][1]]) for i in o))]
        for o in orders
    ]
    longest = max(len(p) for p in prefixes) + max(len(x) for x in suffixes) + max(len(c) for c in cands)
    # D demonstrations have D! orders: with fewer than P, every one of them is scored
    return Prompts(D, len(orders), M, orders, prefixes, suffixes, cands, [lab for _, lab in tests], longest)


def prompts(tok: Any, max_len: int, opts: EvalOptions) -> Prompts:
    """The prompts the options ask for, checked against the model's context (a ConfigError
    naming an option that fits, or the context the suite needs, when they do not fit)."""
    base = FULL if opts.full else QUICK
    # an option set to 0 is refused below, not taken for the default
    D, P, M = (base[k] if getattr(opts, k) is None else getattr(opts, k) for k in base)
    for k, v in zip(base, (D, P, M), strict=True):
        check_positive(f"--{k}", v, 2)
    if opts.demos is None:  # the default shrinks (in pairs) to what the model's context holds
        D = fitting_demos(tok, max_len, D, opts.seed)
    out = _prompts(tok, D, P, M, opts.seed)
    if out.longest <= max_len:
        return out
    step = 1 if opts.demos is not None else 2  # the default keeps half of each label
    tries = (_prompts(tok, d, P, M, opts.seed) for d in range(D - step, 1, -step))
    fewer = next((p for p in tries if p.longest <= max_len), None)
    if fewer is not None:
        if opts.demos is None:
            return fewer
        raise ConfigError(
            f"--demos {D}: the prompts are up to {out.longest} tokens but max_seq_len={max_len}; "
            f"use --demos {fewer.demos} or fewer"
        )
    least = out if D == 2 else _prompts(tok, 2, P, M, opts.seed)
    raise ConfigError(
        f"icl-order does not fit max_seq_len={max_len}: prompts with the fewest demonstrations (2) take up to "
        f"{least.longest} tokens; evaluate a model whose max_seq_len is at least {least.longest}"
    )


def run(run: Run, opts: EvalOptions, progress: Progress = _no_progress) -> SuiteOutput:
    pr = prompts(run.tokenizer, run.config.max_seq_len, opts)  # type: ignore[attr-defined]
    scores = np.zeros((len(pr.orders), pr.items, len(pr.cands)))
    for k, prefix in enumerate(pr.prefixes):
        scores[k] = label_scores(run.model, prefix, pr.suffixes, pr.cands, max(1, opts.batch_size))
        progress(k + 1, len(pr.prefixes))
    pred = scores.argmax(-1)
    acc = (pred == np.array(pr.gold)[None]).mean(axis=1)
    res = {
        "per_order": [{"order": o, "accuracy": float(a)} for o, a in zip(pr.orders, acc, strict=True)],
        "mean": float(acc.mean()),
        "std": float(acc.std()),
        "best": float(acc.max()),
        "worst": float(acc.min()),
        "margin": float(acc.max() - acc.min()),
        "chance": 0.5,
        "predicted_high": float(pred.mean()),
        "prompt_tokens": pr.longest,
    }
    settings = {"demos": pr.demos, "permutations": pr.permutations, "items": pr.items, "seed": opts.seed}
    notes = []
    base = FULL if opts.full else QUICK
    if opts.demos is None and pr.demos < base["demos"]:
        notes.append(
            f"{pr.demos} demonstrations, not the default {base['demos']}: more do not fit "
            f"max_seq_len={run.config.max_seq_len}"  # type: ignore[attr-defined]
        )
    asked = base["permutations"] if opts.permutations is None else opts.permutations
    if pr.permutations < asked:
        notes.append(
            f"{pr.permutations} orders, not {asked}: {pr.demos} demonstrations have only "
            f"{math.factorial(pr.demos)}, and every one is scored"
        )
    return SuiteOutput(
        notes=notes,
        settings={**settings, "labels": list(LABELS)},
        results=res,
        headline=[
            headline("icl accuracy", res["mean"], "higher", ".3f"),
            headline("order margin", res["margin"], "lower", ".3f"),
        ],
    )
