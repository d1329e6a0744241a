"""fp32 CPU matrix products: torch's default BLAS (MKL on x86 wheels) against oneDNN.

    .venv/bin/python benchmarks/cpu_gemm.py                 # the bench's quickstart shape, 1 thread
    .venv/bin/python benchmarks/cpu_gemm.py --tokens 8192 --d-model 768 --ffn 2048 --vocab 32768

Times each product of one training step of a decoder layer and of the LM head (forward y = x Wᵀ,
backward ∂x = g W and ∂W = gᵀ x) both ways, interleaved in one process, and prints ms and
GFLOP/s per product and the total ratio: the figures behind `difftrain/model/gemm.py`'s choice.
Which backend a run uses: `DIFFTRAIN_CPU_GEMM` (auto picks oneDNN on x86-64 CPUs not made by
Intel, where MKL runs a generic path). The CPU vendor is printed with the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from rich.table import Table

from difftrain.cli.common import WideWhenPiped
from difftrain.model import gemm


def _time(fn, reps: int) -> float:
    fn()
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def products(
    tokens: int, d_model: int, ffn: int, vocab: int, head_rows: int
) -> list[tuple[str, int, int, int]]:
    """(name, rows, in, out) of each linear of a decoder layer and the LM head (one loss chunk)."""
    return [
        ("q/k/v/o", tokens, d_model, d_model),
        ("gate/up", tokens, d_model, ffn),
        ("down", tokens, ffn, d_model),
        ("lm head (chunk)", head_rows, d_model, vocab),
    ]


def _passes(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, tuple[Callable, Callable, str]]:
    """Each pass of one linear layer: (torch's product, oneDNN's as model/gemm.py runs it, shape)."""
    (n, k), m = x.shape, w.shape[0]
    return {
        "forward": (lambda: x @ w.t(), lambda: gemm._dnn(x, w), f"{n}×{k} · {k}×{m}"),
        "∂x": (lambda: dy @ w, lambda: gemm._dnn(dy, w.t()), f"{n}×{m} · {m}×{k}"),
        "∂W": (lambda: dy.t() @ x, lambda: gemm.weight_grad(dy, x), f"{m}×{n} · {n}×{k}"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="rows: micro-batch × sequence (16 × 256)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=704, help="SwiGLU hidden width")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    if gemm._onednn_op() is None:
        print("this torch has no oneDNN linear on this CPU: nothing to compare", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from difftrain.model.loss import chunk_rows

    table = Table(title=f"fp32 products, {args.threads} thread(s), CPU vendor {gemm.cpu_vendor() or '?'}")
    for col in (
        "product",
        "pass",
        "shape",
        "torch ms",
        "oneDNN ms",
        "torch GFLOP/s",
        "oneDNN GFLOP/s",
        "speedup",
    ):
        table.add_column(col, justify="left" if col in ("product", "pass", "shape") else "right")
    totals = {"torch": 0.0, "onednn": 0.0}
    g = torch.Generator().manual_seed(0)
    for name, n, k, m in products(args.tokens, args.d_model, args.ffn, args.vocab, chunk_rows(args.vocab)):
        x, w, dy = (
            torch.randn(n, k, generator=g),
            torch.randn(m, k, generator=g),
            torch.randn(n, m, generator=g),
        )
        flops = 2 * n * k * m
        for pass_name, (ref, dnn, shape) in _passes(x, w, dy).items():
            torch.testing.assert_close(dnn(), ref(), rtol=1e-4, atol=1e-3)  # the same product
            t_ref, t_dnn = _time(ref, args.reps), _time(dnn, args.reps)
            totals["torch"] += t_ref
            totals["onednn"] += t_dnn
            table.add_row(
                name,
                pass_name,
                shape,
                f"{t_ref * 1e3:.2f}",
                f"{t_dnn * 1e3:.2f}",
                f"{flops / t_ref / 1e9:.0f}",
                f"{flops / t_dnn / 1e9:.0f}",
                f"{t_ref / t_dnn:.2f}×",
            )
    console = WideWhenPiped()  # piped or to a file: no cell cropped
    console.print(table)
    console.print(
        f"all products: torch {totals['torch'] * 1e3:.1f} ms, oneDNN {totals['onednn'] * 1e3:.1f} ms, "
        f"oneDNN {totals['torch'] / totals['onednn']:.2f}× as fast; this machine's choice: {gemm.backend()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
