"""`quant`: how much the model suffers when its attention logits are quantized (paper Fig. 8).

Every layer's scaled scores S = QKᵀ/√d are fake-quantized before the softmax with dynamic
absmax quantization to b bits (symmetric, round to nearest):

    s_max = max |S|  over the unmasked entries of one (sequence, head) map
    Δ     = s_max / (2^(b−1) − 1)
    Ŝ     = clamp(round(S / Δ), −(2^(b−1) − 1), 2^(b−1) − 1) · Δ

16 bits is the reference: the unquantized model through the same eager attention path.
Reported: the `ppl` figures and Δloss = loss_b − loss_16 at each width (--with-needle: needle accuracy).
"""

from __future__ import annotations

from typing import Any

import torch

from difftrain.evals.common import (
    REFERENCE_BITS,
    EvalOptions,
    Progress,
    SuiteOutput,
    _no_progress,
    check_bits,
    headline,
)
from difftrain.evals.ppl import summarize, window_nll
from difftrain.evals.windows import data_settings, option_windows
from difftrain.rundir import Run


def fake_quantize(scores: torch.Tensor, bits: int) -> torch.Tensor:
    """Dynamic symmetric absmax fake quantization of attention scores (B, H, T, S) to `bits`;
    −inf (masked) entries stay −inf and do not count towards the scale. bits ≥ 16: unchanged."""
    if bits >= REFERENCE_BITS:
        return scores
    finite = torch.isfinite(scores)
    x = scores.masked_fill(~finite, 0.0)
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12) / qmax
    q = torch.clamp(torch.round(x / scale), -qmax, qmax) * scale
    return q.masked_fill(~finite, float("-inf"))


def run(run: Run, opts: EvalOptions, progress: Progress = _no_progress) -> SuiteOutput:
    import difftrain.evals.needle as needle

    widths = check_bits(opts.bits)
    model, tok = run.model, run.tokenizer
    tw = option_windows(run, opts)
    grid = None
    if opts.with_needle:
        grid = needle.default_grid(tok, run.config.max_seq_len, opts, quick_lengths=1)  # type: ignore[attr-defined]
    n_ppl = -(-len(tw.windows) // opts.batch_size)
    n_needle = 0 if grid is None else len(grid.lengths) * len(grid.needles) * len(grid.depths) * grid.samples
    total = len(widths) * (n_ppl + n_needle)
    rows: list[dict[str, Any]] = []
    done = 0

    def step(base: int) -> Progress:
        return lambda d, t: progress(base + d, total)

    try:
        for b in widths:
            # 16: identity, but through the same eager path
            model.set_attn_logit_transform(lambda scores, layer, b=b: fake_quantize(scores, b))
            nll = window_nll(model, tw.windows, batch_size=opts.batch_size, progress=step(done))
            done += n_ppl
            row: dict[str, Any] = {"bits": b, **summarize(nll, tw)}
            if grid is not None:
                row["needle_accuracy"] = needle.evaluate_grid(
                    model, tok, grid, seed=opts.seed, batch_size=opts.batch_size, progress=step(done)
                )["accuracy"]
                done += n_needle
            rows.append(row)
    finally:
        model.set_attn_logit_transform(None)
    ref = rows[0]
    for r in rows:
        r["delta_loss"] = r["loss"] - ref["loss"]
        r["ppl_ratio"] = r["ppl"] / ref["ppl"]
        if grid is not None:
            r["delta_accuracy"] = r["needle_accuracy"] - ref["needle_accuracy"]
    settings: dict[str, Any] = {
        "bits": widths,
        **data_settings(opts, tw),
        "windows": len(tw.windows),
        "granularity": "per (sequence, head)",
    }
    if grid is not None:
        settings["needle"] = needle.grid_settings(grid, opts.seed)
    heads = [headline("loss@16", ref["loss"], "lower", ".4f")]
    for r in rows[1:]:
        heads.append(headline(f"Δloss@{r['bits']}", r["delta_loss"], "lower", "+.4f"))
        if grid is not None:
            heads.append(headline(f"Δacc@{r['bits']}", r["delta_accuracy"], "higher", "+.3f"))
    out = SuiteOutput(
        settings=settings, results={"source": tw.source, "rows": rows}, headline=heads, notes=list(tw.notes)
    )
    import difftrain.evals.plots as plots

    plots.draw(out, opts.plot, run, "quant", lambda p, title: plots.quant_curve(rows, p, title))
    return out
