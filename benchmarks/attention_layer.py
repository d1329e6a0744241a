"""Forward+backward time of one decoder block (input norm + attention + residual + MLP) per arch
and attention implementation, and the diff/baseline (and diff2/baseline) ratios from one run.

    .venv/bin/python benchmarks/attention_layer.py                     # d_model=512, H=8, T=512, B=8
    .venv/bin/python benchmarks/attention_layer.py --impls sdpa --reps 3 --json bench.json
    .venv/bin/python benchmarks/attention_layer.py --cores             # the attention cores alone
    .venv/bin/python benchmarks/attention_layer.py --variants          # diff: the candidate cores

`--cores` times `difftrain.model.kernels.attention_core` alone (no projections) per arch × impl at
the (B, T, H, d) of the arguments; `--variants` times the candidate `diff` cores of
`diff_cores.py` (zero-padded SDPA, SDPA with V split) against the package's sdpa core.

Each measurement: `--warmup` untimed iterations, then the median of `--reps` timed ones, the
archs of one implementation timed round-robin so their ratio survives a change of machine load. flex
attention has no backward on CPU, so on CPU its rows time the forward pass only (marked `fwd`)
and its ratio compares like with like (flex forward vs flex forward). Machines are noisy: read
the ratios, which come from one run, rather than the absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import diff_cores
import torch
from common import ROOT  # noqa: F401  (puts the checkout on sys.path)

from difftrain.model import AttnMask, ModelConfig
from difftrain.model.attention import AttnOptions
from difftrain.model.kernels import attention_core
from difftrain.model.rope import RotaryEmbedding
from difftrain.model.transformer import Block


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_interleaved(steps: dict[str, object], warmup: int, reps: int, device: torch.device) -> dict:
    """Warm every step up, then time them round-robin (A B C A B C ...) so that a change of load
    on the machine during the run hits all of them alike. Returns, per step, the wall-clock and
    the process CPU times (ms) of each rep: on a CPU shared with other jobs the CPU time (work
    done by all our threads) is far steadier than the wall clock."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            _sync(device)
            times[name]["wall"].append((time.perf_counter() - t0) * 1e3)
            times[name]["cpu"].append((time.process_time() - c0) * 1e3)
    return times


def _summary(t: dict[str, list[float]]) -> dict:
    return {
        "ms": statistics.median(t["wall"]),
        "cpu_ms": statistics.median(t["cpu"]),
        "ms_all": [round(x, 1) for x in t["wall"]],
        "cpu_ms_all": [round(x, 1) for x in t["cpu"]],
    }


def block_step(args: argparse.Namespace, arch: str, impl: str, device: torch.device):
    """A closure running one block forward+backward (forward only for flex on CPU), and its mode."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=256,
        d_model=args.d_model,
        n_layers=1,
        n_heads=args.n_heads,
        max_seq_len=args.seq,
    )
    block = Block(cfg, layer_idx=0).to(device)
    B, T = args.batch, args.seq
    x = torch.randn(B, T, cfg.d_model, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    assert cfg.head_dim is not None
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)(
        torch.arange(T, device=device)[None].expand(B, T)
    )
    mask, opts = AttnMask(T, T), AttnOptions(impl)
    backward = not (impl == "flex" and device.type == "cpu")

    def step() -> None:
        if backward:
            block.zero_grad(set_to_none=True)
            x.grad = None
            out = block(x, *rope, mask, None, opts)[0]
            out.backward(grad)
        else:
            with torch.no_grad():
                block(x, *rope, mask, None, opts)

    return step, "fwd+bwd" if backward else "fwd"


def bench_blocks(args: argparse.Namespace, impl: str, device: torch.device) -> list[dict]:
    steps, modes = {}, {}
    for arch in args.archs:
        steps[arch], modes[arch] = block_step(args, arch, impl, device)
    times = _time_interleaved(steps, args.warmup, args.reps, device)
    return [{"arch": arch, "impl": impl, "mode": modes[arch], **_summary(times[arch])} for arch in args.archs]


def bench_diff_variants(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The diff core alone (fwd+bwd): the package's sdpa core, then each candidate of diff_cores.py."""
    torch.manual_seed(0)
    B, T, H, d = args.batch, args.seq, args.n_heads, args.d_model // args.n_heads
    q = torch.randn(B, H, T, d, device=device, requires_grad=True)
    k = torch.randn(B, H, T, d, device=device, requires_grad=True)
    v = torch.randn(B, H // 2, T, 2 * d, device=device, requires_grad=True)
    lam = torch.tensor(0.3, device=device, requires_grad=True)
    mask = AttnMask(T, T)
    cores = {"package_sdpa": lambda: attention_core("diff", q, k, v, lam, mask, "sdpa").out}
    cores |= {name: lambda fn=fn: fn(q, k, v, lam) for name, fn in diff_cores.CANDIDATES.items()}
    steps = {}
    for name, core in cores.items():

        def step(core=core) -> None:
            torch.autograd.grad(core().sum(), (q, k, v, lam))

        steps[name] = step
    times = _time_interleaved(steps, args.warmup, args.reps, device)
    return [{"variant": name, **_summary(t)} for name, t in times.items()]


def bench_cores(args: argparse.Namespace, impl: str, device: torch.device) -> list[dict]:
    """Each arch's attention core alone, forward+backward (forward only for flex on CPU)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, d = args.batch, args.seq, args.n_heads, args.d_model // args.n_heads

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device).requires_grad_()

    mask = AttnMask(T, T)
    q, k, q2 = leaf(B, H, T, d), leaf(B, H, T, d), leaf(B, 2 * H, T, d)
    v_base, v_diff = leaf(B, H, T, d), leaf(B, H // 2, T, 2 * d)
    lam, lam2 = torch.tensor(0.3, device=device, requires_grad=True), leaf(B, H, T)
    cores = {
        "baseline": lambda: attention_core("baseline", q, k, v_base, None, mask, impl).out,
        "diff": lambda: attention_core("diff", q, k, v_diff, lam, mask, impl).out,
        "diff2": lambda: attention_core("diff2", q2, k, v_base, lam2, mask, impl).out,
    }
    backward = not (impl == "flex" and device.type == "cpu")
    steps = {}
    for arch in args.archs:

        def step(core=cores[arch]) -> None:
            if backward:
                core().sum().backward()
            else:
                with torch.no_grad():
                    core()

        steps[arch] = step
    times = _time_interleaved(steps, args.warmup, args.reps, device)
    mode = "fwd+bwd" if backward else "fwd"
    return [{"arch": a, "impl": impl, "mode": mode, **_summary(times[a])} for a in args.archs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--archs", nargs="+", default=["baseline", "diff", "diff2"])
    p.add_argument("--impls", nargs="+", default=["eager", "sdpa", "flex"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", action="store_true", help="only compare the candidate diff cores")
    p.add_argument("--cores", action="store_true", help="the attention cores alone, not whole blocks")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    setup = {
        "d_model": args.d_model,
        "n_heads": args.n_heads,
        "seq": args.seq,
        "batch": args.batch,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "warmup": args.warmup,
        "reps": args.reps,
    }
    what = (
        "the candidate diff cores"
        if args.variants
        else "the attention core"
        if args.cores
        else "one decoder block"
    )
    print(
        f"{what}, d_model={args.d_model} H={args.n_heads} T={args.seq} B={args.batch} "
        f"on {device} ({torch.get_num_threads()} threads), median of {args.reps}"
    )
    if args.variants:
        rows = bench_diff_variants(args, device)
        print(f"  {'variant':<22} {'wall ms':>9} {'ratio':>6} {'cpu ms':>9} {'ratio':>6}")
        for r in rows:
            print(
                f"  {r['variant']:<22} {r['ms']:9.1f} {r['ms'] / rows[0]['ms']:6.2f}"
                f" {r['cpu_ms']:9.1f} {r['cpu_ms'] / rows[0]['cpu_ms']:6.2f}"
            )
        result: dict = {"setup": setup, "diff_sdpa_variants": rows}
    else:
        bench = bench_cores if args.cores else bench_blocks
        results = [r for impl in args.impls for r in bench(args, impl, device)]
        by = {(r["arch"], r["impl"]): r for r in results}
        others = [a for a in args.archs if a != "baseline"] if "baseline" in args.archs else []
        ratios = {}
        for clock, key in (("wall", "ms"), ("cpu", "cpu_ms")):
            print(f"  {clock + ' ms':<8} {'mode':<8}" + "".join(f"{a:>10}" for a in args.archs), end="")
            print("".join(f"{a + '/base':>12}" for a in others))
            for impl in args.impls:
                line = f"  {impl:<8} {by[(args.archs[0], impl)]['mode']:<8}"
                line += "".join(f"{by[(a, impl)][key]:10.1f}" for a in args.archs)
                for a in others:
                    r = by[(a, impl)][key] / by[("baseline", impl)][key]
                    ratios[f"{a}/baseline[{impl},{clock}]"] = round(r, 3)
                    line += f"{r:12.2f}"
                print(line)
        result = {"setup": setup, "cores_only": args.cores, "results": results, "ratios": ratios}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
