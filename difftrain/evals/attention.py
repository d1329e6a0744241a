"""`attention`: where attention goes during retrieval — the paper's Table 3 probe.

For a needle prompt followed by its (teacher-forced) answer, take the query positions that
predict the digits of the j-th queried value and, in each layer's effective attention map A,
split each of their rows into the mass on the j-th queried needle's sentence (the answer span)
and the mass on every other position (the noise: filler, distractor needles, question):

    answer_l = mean_{heads, query rows} Σ_{s ∈ span} A_l[h, t, s]
    noise_l  = mean_{heads, query rows} Σ_{s ∉ span} A_l[h, t, s]

The probed map is the softmax map for `baseline`, A1 − λ·A2 for `diff` (entries may be
negative: `noise_abs` sums |A| over the noise) and A_2i − σ(λ)·A_2i+1 for `diff2`. Their rows
sum to different totals, so the headlines are the shares of each row's total (rows whose total
is not positive are left out), per layer and averaged over layers, for each depth:

    answer_share_l = mean_{heads, query rows} answer_row / total_row,  noise_share = 1 − answer_share
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from difftrain.errors import ConfigError
from difftrain.evals.common import EvalOptions, Progress, SuiteOutput, _no_progress, headline, mean
from difftrain.evals.needle import NeedlePrompt, default_grid, grid_prompts, grid_settings
from difftrain.rundir import Run

NEEDLES_DEFAULT = [(4, 1)]
NAMES = ("answer", "noise", "noise_abs", "total", "answer_share", "noise_share")
MAPS = {"baseline": "softmax", "diff": "A1 - lambda*A2", "diff2": "A_2i - sigmoid(lambda)*A_2i+1"}


def spans(
    tokenizer: Any, p: NeedlePrompt, max_len: int
) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """Token ids of [eos] + prompt + answer, and per queried needle (answer-span key columns,
    query rows), in sequence coordinates (the leading eos is position 0)."""
    ex = p.example
    text = ex.text
    enc = tokenizer.tk.encode(text, add_special_tokens=False)
    ids = [tokenizer.document_start_id, *enc.ids][:max_len]
    offs = enc.offsets
    out = []
    start = len(ex.prompt)
    for key, value in zip(p.query_keys, p.expected, strict=True):
        nd = next(n for n in ex.needles if n.key == key)
        a, b = nd.char_offset, nd.char_offset + len(nd.sentence)
        cols = [i + 1 for i, (s, e) in enumerate(offs) if s < b and e > a]
        stem = f"{key} is "
        vs = text.index(stem + value, start) + len(stem)
        start = ve = vs + len(value)
        # token i of the text sits at sequence position i + 1 and is predicted at position i
        rows = [i for i, (s, e) in enumerate(offs) if s < ve and e > vs and i + 1 < len(ids)]
        out.append((cols, rows))
    return ids, out


@torch.inference_mode()
def probe(model: Any, tokenizer: Any, p: NeedlePrompt) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per layer (answer, noise, noise_abs, total, answer_share, noise_share), shape (layers, 6),
    and the maps."""
    device = next(model.parameters()).device
    ids, per_query = spans(tokenizer, p, model.config.max_seq_len)
    out = model(torch.tensor([ids], device=device), output_attentions=True)
    stats = np.zeros((len(out.attentions), len(NAMES)))
    for li, A in enumerate(out.attentions):
        M = A[0].float()  # (heads, T, S)
        acc = []
        for cols, rows in per_query:
            R = M[:, rows, :]  # (heads, q, S)
            in_span = torch.zeros(R.shape[-1], dtype=torch.bool, device=R.device)
            in_span[cols] = True
            ans = R[..., in_span].sum(-1)
            total = R.sum(-1)
            noise_abs = R[..., ~in_span].abs().sum(-1)
            ok = total > 1e-6  # a row's shares need a positive total (λ < 1)
            share = (ans[ok] / total[ok]).mean().item() if bool(ok.any()) else float("nan")
            acc.append([t.mean().item() for t in (ans, total - ans, noise_abs, total)] + [share, 1.0 - share])
        stats[li] = np.mean(acc, axis=0)
    return stats, [a[0].float().cpu().numpy() for a in out.attentions]


def attention_grid(tok: Any, max_len: int, opts: EvalOptions) -> tuple[Any, list[str]]:
    """The needle grid the suite probes, with its notes: the options' needles, or the default 4;
    where 4 do not fit the context, 1 with a note. A ConfigError names the suite."""
    try:
        return default_grid(
            tok, max_len, replace(opts, needles=opts.needles or NEEDLES_DEFAULT), quick_lengths=1
        ), []
    except ConfigError as e:
        if opts.needles is not None:
            raise ConfigError(f"attention: {e}") from e
    try:  # the default 4 needles do not fit this context: one needle
        grid = default_grid(tok, max_len, replace(opts, needles=[(1, 1)]), quick_lengths=1)
    except ConfigError as e:
        raise ConfigError(f"attention: {e}") from e
    note = f"probed with 1 needle, not the default {NEEDLES_DEFAULT[0][0]}: they do not fit max_seq_len={max_len}"
    return grid, [note]


def run(run: Run, opts: EvalOptions, progress: Progress = _no_progress) -> SuiteOutput:
    model, tok = run.model, run.tokenizer
    grid, notes = attention_grid(tok, run.config.max_seq_len, opts)  # type: ignore[attr-defined]
    prompts = grid_prompts(tok, run.config.max_seq_len, grid, opts.seed)  # type: ignore[attr-defined]
    all_stats = []
    for i, p in enumerate(prompts):
        all_stats.append(probe(model, tok, p)[0])
        progress(i + 1, len(prompts))
    stats = np.stack(all_stats)  # (prompts, layers, 6)

    def named(row: np.ndarray) -> dict[str, float | None]:  # a share no row could give: null
        return {n: float(x) if np.isfinite(x) else None for n, x in zip(NAMES, row, strict=True)}

    def summary(sel: list[int]) -> dict[str, Any]:
        per_layer = stats[sel].mean(axis=0)  # (layers, 6)
        return {
            **named(per_layer.mean(axis=0)),
            "per_layer": [{"layer": li, **named(row)} for li, row in enumerate(per_layer)],
        }

    by_depth = [
        {"depth": d, **summary([i for i, p in enumerate(prompts) if p.depth == d])} for d in grid.depths
    ]
    res = {
        "map": MAPS[run.config.arch],  # type: ignore[attr-defined]
        **summary(list(range(len(prompts)))),
        "by_depth": by_depth,
        "prompts": len(prompts),
        "measured_depths": [mean(p.measured_depths) for p in prompts],
    }
    out = SuiteOutput(
        notes=notes,
        settings=grid_settings(grid, opts.seed),
        results=res,
        headline=[  # shares: the masses of the archs' maps are on different scales (module doc)
            headline("answer share", res["answer_share"], "higher", ".3f"),
            headline("noise share", res["noise_share"], "lower", ".3f"),
        ],
    )
    if opts.plot:
        import difftrain.evals.plots as plots

        plots.require()
        mid = grid.depths[len(grid.depths) // 2]
        p = next(q for q in prompts if q.depth == mid)
        _, maps = probe(model, tok, p)
        _, per_query = spans(tok, p, run.config.max_seq_len)  # type: ignore[attr-defined]
        cols, rows = per_query[0]
        path = run.path / "eval" / "attention.png"
        plots.attention_maps(
            maps,
            path,
            arch=run.config.arch,  # type: ignore[attr-defined]
            answer_span=(min(cols), max(cols) + 1) if cols else None,
            query_rows=rows,
            title=f"{run.path.name}, needle at {mid:.0%} of {p.haystack_tokens} tokens",
        )
        out.plots.append(str(path))
    return out
