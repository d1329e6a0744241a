"""`outliers`: activation outliers in attention logits and hidden states — the paper's Table 5.

Over a fixed number of validation tokens, collect

- attention logits: every layer's scaled pre-softmax scores q·k/√d at unmasked (causal)
  positions, for every query head (both maps of each differential head for `diff`);
- hidden states: every layer's block output (after its residual), all features;

and report for the magnitudes |x| the top-1, -2, -3, -10 and -100 values and the median (over
a strided subsample beyond `MEDIAN_SAMPLE` values: `median_over`), plus the kurtosis of x,
κ = E[(x − μ)⁴] / σ⁴ (3 for a Gaussian), pooled over layers and per layer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from difftrain.evals.common import (
    EvalOptions,
    Progress,
    SuiteOutput,
    _no_progress,
    batches,
    check_positive,
    headline,
)
from difftrain.evals.windows import data_settings, eval_windows
from difftrain.rundir import Run

TOPS = (1, 2, 3, 10, 100)
MEDIAN_SAMPLE = 4_000_000
TOKENS_QUICK = 8192
TOKENS_FULL = 131_072


class Stats:
    """Streaming top-k of |x|, moments of x, and a strided sample of |x| for the median."""

    def __init__(self, stride: int) -> None:
        self.top = torch.empty(0, dtype=torch.float32)
        self.n = 0
        self.sums = np.zeros(4, dtype=np.float64)  # Σx, Σx², Σx³, Σx⁴ about `shift`
        self.shift: float | None = None
        self.stride = stride
        self.sample: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1).float().cpu()
        if x.numel() == 0:
            return
        a = x.abs()
        k = min(max(TOPS), a.numel())
        self.top = torch.cat((self.top, a.topk(k).values)).topk(min(max(TOPS), self.top.numel() + k)).values
        if self.shift is None:  # centre the moments near the mean for accuracy in float64
            self.shift = float(x.double().mean())
        d = x.double() - self.shift
        d2 = d * d
        self.sums += np.array(
            [d.sum().item(), d2.sum().item(), (d2 * d).sum().item(), (d2 * d2).sum().item()]
        )
        self.n += x.numel()
        self.sample.append(a[:: self.stride].clone())

    def result(self) -> dict[str, Any]:
        top = self.top.tolist()
        out: dict[str, Any] = {f"top{k}": (top[k - 1] if len(top) >= k else None) for k in TOPS}
        sample = torch.cat(self.sample) if self.sample else torch.empty(0)
        out["median"] = float(sample.median()) if sample.numel() else None
        out["median_over"] = int(sample.numel())
        out["count"] = self.n
        if self.n:
            m1, m2, m3, m4 = (self.sums / self.n).tolist()
            var = m2 - m1 * m1
            c4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
            out["mean"] = (self.shift or 0.0) + m1
            out["std"] = math.sqrt(max(var, 0.0))
            out["kurtosis"] = c4 / (var * var) if var > 0 else None
        return out


def collect(
    model: Any, windows: torch.Tensor, *, batch_size: int = 8, progress: Progress = _no_progress
) -> dict[str, Any]:
    """Outlier statistics of attention logits and hidden states over `windows` (n, T+1)."""
    device = next(model.parameters()).device
    cfg = model.config
    n, T = windows.shape[0], windows.shape[1] - 1
    heads = 2 * cfg.n_heads if cfg.arch == "diff2" else cfg.n_heads
    L = cfg.n_layers
    # per layer: n·heads·T(T+1)/2 unmasked logits, n·T·d_model hidden values
    stride_l = max(1, math.ceil(n * heads * T * (T + 1) // 2 * L / MEDIAN_SAMPLE))
    stride_h = max(1, math.ceil(n * T * cfg.d_model * L / MEDIAN_SAMPLE))
    logits = [Stats(stride_l) for _ in range(L)]
    hidden = [Stats(stride_h) for _ in range(L)]
    spans = batches(n, batch_size)
    with torch.inference_mode():
        for j, (a, b) in enumerate(spans):
            out = model(windows[a:b, :-1].to(device), output_attentions=True, output_hidden_states=True)
            for li in range(L):
                s = out.attn_logits[li]
                logits[li].add(s[torch.isfinite(s)])
                hidden[li].add(out.hidden_states[li])
            progress(j + 1, len(spans))
    return {"logits": logits, "hidden": hidden}


def _pool(stats: list[Stats]) -> dict[str, Any]:
    """Pool per-layer statistics into one (exact for tops, moments and the sample)."""
    pooled = Stats(1)
    pooled.top = (
        torch.cat([s.top for s in stats]).topk(min(max(TOPS), sum(s.top.numel() for s in stats))).values
    )
    pooled.n = sum(s.n for s in stats)
    # re-centre every layer's moments on a common shift before adding them
    shift = sum((s.shift or 0.0) * s.n for s in stats) / max(pooled.n, 1)
    total = np.zeros(4)
    for s in stats:
        if not s.n:
            continue
        m = s.sums / s.n
        c = (s.shift or 0.0) - shift  # x − shift = d + c
        total += s.n * np.array(
            [
                m[0] + c,
                m[1] + 2 * c * m[0] + c * c,
                m[2] + 3 * c * m[1] + 3 * c * c * m[0] + c**3,
                m[3] + 4 * c * m[2] + 6 * c * c * m[1] + 4 * c**3 * m[0] + c**4,
            ]
        )
    pooled.sums, pooled.shift = total, shift
    pooled.sample = [t for s in stats for t in s.sample]
    return pooled.result()


def run(run: Run, opts: EvalOptions, progress: Progress = _no_progress) -> SuiteOutput:
    check_positive("--tokens", opts.tokens)
    tokens = opts.tokens or (TOKENS_FULL if opts.full else TOKENS_QUICK)
    tw = eval_windows(
        run,
        data=opts.data,
        count=max(1, tokens // run.config.max_seq_len),  # type: ignore[attr-defined]
        full=False,
        text_field=opts.text_field,
        asked=f"--tokens {tokens:,}" if opts.tokens is not None else f"the default --tokens {tokens:,}",
        error_bar=False,
    )
    got = collect(run.model, tw.windows, batch_size=opts.batch_size, progress=progress)
    res: dict[str, Any] = {"source": tw.source, "tokens": tw.windows[:, 1:].numel()}
    for kind, name in (("logits", "attention_logits"), ("hidden", "hidden_states")):
        res[name] = {
            **_pool(got[kind]),
            "per_layer": [{"layer": i, **s.result()} for i, s in enumerate(got[kind])],
        }
    al, hs = res["attention_logits"], res["hidden_states"]
    return SuiteOutput(
        settings={**data_settings(opts, tw), "tokens": res["tokens"]},
        notes=list(tw.notes),
        results=res,
        headline=[
            headline("attn logit top-1", al["top1"], "lower", ".2f"),
            headline("attn logit median", al["median"], None, ".3f"),
            headline("attn logit kurtosis", al.get("kurtosis"), "lower", ".2f"),
            headline("hidden top-1", hs["top1"], "lower", ".2f"),
            headline("hidden median", hs["median"], None, ".3f"),
            headline("hidden kurtosis", hs.get("kurtosis"), "lower", ".2f"),
        ],
    )
