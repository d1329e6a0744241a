"""Decode speed: tokens/s of greedy generation with the KV cache vs recomputing the prefix.

    .venv/bin/python benchmarks/decode.py                       # quickstart-shaped, all archs
    .venv/bin/python benchmarks/decode.py --run runs/quickstart --json decode.json

Default model: the quickstart shape (d_model 256, 4 layers, 8 heads, vocab 4096, tied
embeddings) with max_seq_len 1024 and random weights, one per arch; `--run` loads a trained
run instead. Each arch generates `--new-tokens` tokens greedily from a `--prompt-tokens` random
prompt (no eos stop, so every run produces exactly that many tokens), once through the cached
engine and once through the no-cache reference (`use_cache=False`, the whole sequence
recomputed every step), after a short warm-up. Both paths are timed in the same process, one
after the other, so their ratio is meaningful on a noisy machine even when absolute figures are
not. The tokens of the two paths are compared too (they should agree: same math, different
shapes; with random weights near-ties can flip late tokens, so the agreeing prefix is reported).

With `--hf`, and when `difftrain.interop.hf` provides an exporter, the same weights are
also run through Hugging Face transformers' `generate` (greedy, its own cache).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from common import common_prefix, hf_model_for

from difftrain.infer.generate import GenerationConfig, generate_all
from difftrain.infer.sampling import SamplingConfig
from difftrain.model import ModelConfig, Transformer

QUICKSTART = dict(d_model=256, n_layers=4, n_heads=8, vocab_size=4096, max_seq_len=1024, tie_embeddings=True)


def time_decode(
    model: torch.nn.Module, prompt: list[int], new_tokens: int, use_cache: bool, compile: bool = False
) -> tuple[float, list[int], float]:
    """Seconds to generate `new_tokens` greedily (prefill included), the tokens, and the seconds
    of the warm-up (a full-length run when compiled: that is the compilation; else 4 tokens)."""
    greedy = SamplingConfig(greedy=True)
    kw = dict(sampling=greedy, stop_at_eos=False, use_cache=use_cache, compile=compile)
    cfg = GenerationConfig(max_new_tokens=new_tokens, **kw)
    t0 = time.perf_counter()
    generate_all(model, [prompt], cfg if compile else GenerationConfig(max_new_tokens=4, **kw))
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    (c,) = generate_all(model, [prompt], cfg)
    seconds = time.perf_counter() - t0
    assert len(c.token_ids) == new_tokens, (len(c.token_ids), c.finish_reason)
    return seconds, c.token_ids, warmup


def hf_model(model: Transformer) -> torch.nn.Module | None:
    """The same weights as a transformers model in eval mode (see `common.hf_model_for`)."""
    hf = hf_model_for(model)
    return None if hf is None else hf.eval()


def time_hf(model: Transformer, prompt: list[int], new_tokens: int) -> tuple[float, list[int]] | None:
    """transformers' greedy `generate` (its own KV cache) on the same weights and prompt."""
    hf = hf_model(model)
    if hf is None:
        return None
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, max_new_tokens=new_tokens, pad_token_id=2)
    with torch.inference_mode():
        hf.generate(ids, **{**kw, "max_new_tokens": 4})
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        seconds = time.perf_counter() - t0
    return seconds, out[0, len(prompt) :].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--arch", nargs="+", default=["baseline", "diff", "diff2"], choices=["baseline", "diff", "diff2"]
    )
    ap.add_argument("--run", type=Path, help="Benchmark a trained run directory instead of random weights.")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--no-uncached", action="store_true", help="Skip the (slow) no-cache reference.")
    ap.add_argument(
        "--compile", action="store_true", help="Also time the compiled decode step (generate --compile)."
    )
    ap.add_argument(
        "--hf", action="store_true", help="Also time transformers' generate (needs the HF exporter)."
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)."
    )
    ap.add_argument("--json", type=Path, help="Write the results as JSON to this file.")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    models: list[tuple[str, Transformer]] = []
    if args.run is not None:
        from difftrain.rundir import load_run

        run = load_run(args.run)
        models.append((run.config.arch, run.model))
    else:
        for arch in args.arch:
            torch.manual_seed(0)
            models.append((arch, Transformer(ModelConfig(arch=arch, **QUICKSTART)).eval()))

    rows = []
    for arch, model in models:
        c = model.config
        if args.prompt_tokens + args.new_tokens - 1 > c.max_seq_len:
            sys.exit(
                f"prompt {args.prompt_tokens} + {args.new_tokens} new tokens exceed max_seq_len={c.max_seq_len}"
            )
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, c.vocab_size, (args.prompt_tokens,), generator=g).tolist()
        cached_s, cached_ids, _ = time_decode(model, prompt, args.new_tokens, use_cache=True)
        row = {
            "arch": arch,
            "params": sum(p.numel() for p in model.parameters()),
            "cached_tokens_per_s": args.new_tokens / cached_s,
            "cached_s": cached_s,
        }
        if not args.no_uncached:
            uncached_s, uncached_ids, _ = time_decode(model, prompt, args.new_tokens, use_cache=False)
            row.update(
                uncached_tokens_per_s=args.new_tokens / uncached_s,
                uncached_s=uncached_s,
                speedup=uncached_s / cached_s,
                agreeing_tokens=common_prefix(cached_ids, uncached_ids),
            )
        if args.compile:  # `difftrain generate --compile`: the static-shape decode step, compiled
            compiled_s, compiled_ids, compile_s = time_decode(
                model, prompt, args.new_tokens, use_cache=True, compile=True
            )
            row.update(
                compiled_tokens_per_s=args.new_tokens / compiled_s,
                compiled_s=compiled_s,
                compile_s=compile_s,
                compile_speedup=cached_s / compiled_s,
                compiled_agreeing_tokens=common_prefix(cached_ids, compiled_ids),
            )
        if args.hf:
            hf = time_hf(model, prompt, args.new_tokens)
            if hf is not None:
                row.update(
                    hf_tokens_per_s=args.new_tokens / hf[0],
                    hf_s=hf[0],
                    vs_hf=hf[0] / cached_s,
                    hf_agreeing_tokens=common_prefix(cached_ids, hf[1]),
                )
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    from rich.table import Table

    from difftrain.cli.common import WideWhenPiped  # piped or to a file: no cell cropped

    table = Table(
        title=f"greedy decode, {args.new_tokens} new tokens after {args.prompt_tokens} prompt tokens"
    )
    cols = ["arch", "cached tok/s", "no-cache tok/s", "cache speedup", "agreeing tokens"]
    if args.compile:
        cols += ["compiled tok/s", "compile s"]
    for col in [*cols, "HF tok/s", "ours vs HF", "HF agreeing"]:
        table.add_column(col, justify="right")
    for r in rows:
        cells = [
            r["arch"],
            f"{r['cached_tokens_per_s']:.1f}",
            f"{r['uncached_tokens_per_s']:.1f}" if "uncached_s" in r else "—",
            f"{r['speedup']:.1f}×" if "speedup" in r else "—",
            f"{r['agreeing_tokens']}/{args.new_tokens}" if "agreeing_tokens" in r else "—",
        ]
        if args.compile:
            cells += [f"{r['compiled_tokens_per_s']:.1f}", f"{r['compile_s']:.0f}"]
        cells += [
            f"{r['hf_tokens_per_s']:.1f}" if "hf_s" in r else "—",
            f"{r['vs_hf']:.2f}×" if "vs_hf" in r else "—",
            f"{r['hf_agreeing_tokens']}/{args.new_tokens}" if "vs_hf" in r else "—",
        ]
        table.add_row(*cells)
    WideWhenPiped().print(table)
    if args.hf and any("hf_s" not in r for r in rows):
        print(
            "transformers comparison skipped where transformers has no class for the arch (diff2)",
            file=sys.stderr,
        )

    if args.json:
        from difftrain.io import atomic_write_json

        shape = {k: v for k, v in models[0][1].config.model_dump().items() if k != "arch"}
        atomic_write_json(
            args.json,
            {
                "benchmark": "decode",
                "command": " ".join(["benchmarks/decode.py", *(argv if argv is not None else sys.argv[1:])]),
                "device": "cpu",
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "new_tokens": args.new_tokens,
                "prompt_tokens": args.prompt_tokens,
                "model": shape,
                "run": str(args.run) if args.run else None,
                "results": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
