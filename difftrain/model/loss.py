"""Next-token cross-entropy fused with the LM head, in chunks of rows.

`linear_cross_entropy` never holds more than one chunk of the logits (N × V): per chunk it
computes the logits, the loss, and at once the gradient of the summed loss with respect to them
(softmax − one-hot), which it multiplies into ∂h and accumulates into ∂W; backward only scales
those. It equals `F.cross_entropy(h @ Wᵀ, targets, reduction="sum")` and its gradients up to
float rounding, and saves memory, not time.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 22
"""Logits per chunk (16 MiB in fp32); rows per chunk = max(CHUNK_MIN_ROWS, this // V)."""
CHUNK_MIN_ROWS = 256


def chunk_rows(vocab_size: int) -> int:
    """Rows of logits computed at a time for a vocabulary of `vocab_size`."""
    return max(CHUNK_MIN_ROWS, CHUNK_ELEMENTS // max(1, vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ_rows CE(h Wᵀ, t) over rows with t != −100, gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, rows: int) -> Tensor:  # type: ignore[override]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a in range(0, N, rows):
            hc, tc = h[a : a + rows], targets[a : a + rows]
            valid = tc != IGNORE_INDEX
            safe = torch.where(valid, tc, 0)[:, None]
            # one log_softmax kernel serves the loss and, exponentiated in place, the gradient
            logp = torch.log_softmax((hc @ weight.t()).float(), dim=-1)  # (n, V), fp32 statistics
            total -= (logp.gather(1, safe).squeeze(1) * valid).sum()
            if not (need_h or need_w):
                continue
            # ∂(Σ CE)/∂z = softmax(z) − onehot(t) on valid rows, 0 on ignored ones; in place
            g = logp.exp_()
            g.scatter_add_(1, safe, torch.full(safe.shape, -1.0, dtype=g.dtype, device=g.device))
            g = g.mul_(valid[:, None]).to(h.dtype)
            if dh is not None:
                torch.mm(g, weight, out=dh[a : a + rows])
            if dw is not None and dw.dtype == g.dtype:
                dw.addmm_(g.t(), hc)
            elif dw is not None:  # half-precision matmul, fp32 accumulation across chunks
                dw.add_(g.t() @ hc)
        ctx.save_for_backward(
            dh if dh is not None else h.new_empty(0),
            (dw.to(weight.dtype) if dw is not None else weight.new_empty(0)),
        )
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        dh, dw = ctx.saved_tensors
        gh = dh * grad.to(dh.dtype) if ctx.needs_input_grad[0] else None
        gw = dw * grad.to(dw.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, rows: int | None = None) -> Tensor:
    """Mean cross-entropy of logits h·Wᵀ (fp32 softmax) over targets != −100, never holding all
    the logits; 0 when every target is ignored.

    h (…, D), weight (V, D), targets (…) with the same leading shape as h. Under autocast the
    matmuls run in the autocast dtype, as the LM head's linear layer would.
    """
    D = h.shape[-1]
    flat_h, flat_t = h.reshape(-1, D), targets.reshape(-1)
    device = flat_h.device.type
    autocast = device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
    flat_h, weight = flat_h.to(dtype), weight.to(dtype)
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        total = _LinearCrossEntropy.apply(flat_h, weight, flat_t, rows or chunk_rows(weight.shape[0]))
    return total / (flat_t != IGNORE_INDEX).sum().clamp(min=1)
