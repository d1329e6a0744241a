"""`ppl`: loss, perplexity and bits per byte on fixed windows of held-out text.

For windows w of max_seq_len + 1 tokens (inputs w[:-1], targets w[1:]):

    loss = Σ −log p(w_{t+1} | w_≤t) / N_tokens            (nats per token)
    ppl  = exp(loss)
    bits per token = loss / ln 2
    bits per byte  = Σ −log₂ p(...) / N_bytes             (N_bytes = UTF-8 bytes of the targets)

By default the windows are training's validation windows (`eval_windows`), so `loss` reproduces
its final validation loss.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from difftrain.evals.common import EvalOptions, Progress, SuiteOutput, _no_progress, batches, headline
from difftrain.evals.windows import TokenWindows, data_settings, option_windows
from difftrain.rundir import Run


@torch.inference_mode()
def window_nll(
    model: torch.nn.Module, windows: torch.Tensor, *, batch_size: int = 8, progress: Progress = _no_progress
) -> np.ndarray:
    """Summed next-token NLL (nats, fp32 logits) of each window: (n,) float64."""
    device = next(model.parameters()).device
    out = np.zeros(len(windows), dtype=np.float64)
    spans = batches(len(windows), batch_size)
    for j, (a, b) in enumerate(spans):
        w = windows[a:b].to(device)
        logits = model(w[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="none").sum(dim=1)
        out[a:b] = nll.double().cpu().numpy()
        progress(j + 1, len(spans))
    return out


def summarize(nll: np.ndarray, tw: TokenWindows) -> dict[str, Any]:
    """Loss, perplexity, bits per token/byte and the standard error of the loss over windows."""
    tokens_per_window = tw.windows.shape[1] - 1
    n_tokens = int(len(nll) * tokens_per_window)
    n_bytes = int(tw.target_bytes.sum())
    loss = float(nll.sum() / n_tokens)
    stderr = float((nll / tokens_per_window).std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else None
    return {
        "loss": loss,
        "ppl": math.exp(min(loss, 700.0)),
        "bits_per_token": loss / math.log(2),
        "bits_per_byte": float(nll.sum() / math.log(2) / n_bytes) if n_bytes else None,
        "loss_stderr": stderr,
        "tokens": n_tokens,
        "bytes": n_bytes,
        "windows": len(nll),
    }


def run(run: Run, opts: EvalOptions, progress: Progress = _no_progress) -> SuiteOutput:
    tw = option_windows(run, opts)
    nll = window_nll(run.model, tw.windows, batch_size=opts.batch_size, progress=progress)
    res = {**summarize(nll, tw), "source": tw.source, "split_tokens": tw.split_tokens}
    if tw.records_as_text:
        records = "its validation records" if tw.split == "val" else "the --data records"
        res["note"] = (
            f"an instruction fine-tune: every token of {records} is scored, as plain text "
            "through its template (prompts too); its training val loss scored the responses only"
        )
    return SuiteOutput(
        notes=list(tw.notes),
        settings={**data_settings(opts, tw), "windows": len(tw.windows), "full": opts.full},
        results=res,
        headline=[
            headline("loss", res["loss"], "lower", ".4f"),
            headline("ppl", res["ppl"], "lower", ".2f"),
            headline("bits/byte", res["bits_per_byte"], "lower", ".4f"),
        ],
    )
