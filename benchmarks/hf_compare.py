"""Our training step and greedy decoding against transformers' Llama and DiffLlama on the same weights.

    python benchmarks/hf_compare.py [--shape quickstart] [--compile] [--reps 5] [--threads 1] [--json F]

For `baseline` (LlamaForCausalLM) and `diff` (DiffLlamaForCausalLM): the largest logit difference
(same weights, same function), a training step (forward, backward, clip, fused AdamW) of each in
turn, and greedy decoding of `--decode-tokens` tokens (ours: `generate_all` with the KV cache;
transformers: `generate`), with the agreeing prefix of the tokens. With `--compile` also ours
under torch.compile (`train.compile`, `generate --compile`) and transformers compiled (its static
cache and CompileConfig for decoding). Speed-ups are paired ratios: ours ÷ transformers' time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    SHAPES,
    autocast,
    batch,
    build,
    command,
    common_prefix,
    environment,
    hf_model_for,
    optimizer,
    paired_ratio,
    summary,
    time_round_robin,
    train_step_fn,
    write_result,
)


def variant_figures(t: dict[str, dict[str, list[float]]], tokens: int) -> dict[str, Any]:
    """Ours compiled against transformers eager (`compiled_`) and against transformers compiled
    (`both_compiled_`), when timed."""
    out: dict[str, Any] = {}
    for prefix, ours, ref in (
        ("compiled", "ours +compile", "hf"),
        ("both_compiled", "ours +compile", "hf +compile"),
    ):
        if ours in t and ref in t:
            c, h = t[ours], t[ref]
            out |= {
                f"{prefix}_tokens_per_s": tokens / statistics.median(c["wall"]),
                f"{prefix}_speedup": paired_ratio(h["wall"], c["wall"]),
                f"{prefix}_speedup_cpu": paired_ratio(h["cpu"], c["cpu"]),
            }
            if ref != "hf":
                out[f"{prefix}_hf_tokens_per_s"] = tokens / statistics.median(h["wall"])
    return out


def figures(t: dict[str, dict[str, list[float]]], tokens: int) -> dict[str, Any]:
    return {
        **variant_figures(t, tokens),
        "ours_tokens_per_s": tokens / statistics.median(t["ours"]["wall"]),
        "hf_tokens_per_s": tokens / statistics.median(t["hf"]["wall"]),
        "speedup": paired_ratio(t["hf"]["wall"], t["ours"]["wall"]),
        "speedup_cpu": paired_ratio(t["hf"]["cpu"], t["ours"]["cpu"]),
        "reps": {name: summary(v) for name, v in t.items()},
    }


def train_vs_hf(
    ours: Any, hf: Any, shape: Any, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    hf.train()
    x, y = batch(shape, device)
    with torch.no_grad():
        agree = (ours(x).logits.float() - hf(input_ids=x).logits.float()).abs().max().item()
    labels = torch.cat((x[:, :1], y[:, :-1]), dim=1)  # transformers shifts labels left by one

    def hf_step_fn(model: Any, forward: Any) -> Callable[[], None]:
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)  # transformers' Trainer default, as ours

        def step() -> None:
            with autocast(device, args.precision):
                loss = forward(input_ids=x, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    fns = {
        "ours": train_step_fn(ours, optimizer(ours, "adamw", device), (x, y), args.precision),
        "hf": hf_step_fn(hf, hf),
    }
    if args.compile:
        twin = build(ours.config, device)
        fns["ours +compile"] = train_step_fn(
            twin, optimizer(twin, "adamw", device), (x, y), args.precision, torch.compile(twin)
        )
        hf_twin = copy.deepcopy(hf)
        fns["hf +compile"] = hf_step_fn(hf_twin, torch.compile(hf_twin))
        for name in ("ours +compile", "hf +compile"):  # the compilations, untimed
            fns[name]()
            fns[name]()
    print(f"training step: {ours.config.arch} vs {type(hf).__name__}", file=sys.stderr)
    t = time_round_robin(fns, warmup=1, reps=args.reps, device=device)
    return {
        "arch": ours.config.arch,
        "hf_class": type(hf).__name__,
        "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "max_logit_diff": agree,
        **figures(t, shape.tokens),
    }


def decode_vs_hf(ours: Any, hf: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from difftrain.infer.generate import GenerationConfig, generate_all
    from difftrain.infer.sampling import SamplingConfig

    ours.eval()
    hf.eval()
    n = args.decode_tokens
    prompt = torch.randint(
        0, ours.config.vocab_size, (16,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    cfg = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(greedy=True), stop_at_eos=False)
    ids = torch.tensor([prompt], device=device)
    out: dict[str, list[int]] = {}

    def ours_fn(name: str, gen_cfg: Any) -> Callable[[], None]:
        def fn() -> None:
            out[name] = generate_all(ours, [prompt], gen_cfg)[0].token_ids

        return fn

    def hf_fn(name: str, **kwargs: Any) -> Callable[[], None]:
        def fn() -> None:
            with torch.inference_mode():
                r = hf.generate(
                    ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=2, **kwargs
                )
            out[name] = r[0, len(prompt) :].tolist()

        return fn

    fns = {"ours": ours_fn("ours", cfg), "hf": hf_fn("hf")}
    if args.compile:
        fns["ours +compile"] = ours_fn("ours +compile", dataclasses.replace(cfg, compile=True))
        fns["ours +compile"]()  # the compilation
        try:
            from transformers import CompileConfig

            config = CompileConfig(fullgraph=False, dynamic=False)
            config._compile_all_devices = True  # transformers compiles on GPUs only unless told
            fns["hf +compile"] = hf_fn("hf +compile", cache_implementation="static", compile_config=config)
            fns["hf +compile"]()
        except ImportError:  # a transformers without CompileConfig
            pass
    print(f"greedy decode: {ours.config.arch}, {n} tokens", file=sys.stderr)
    t = time_round_robin(fns, warmup=1, reps=max(3, args.reps), device=device)
    row = {
        "arch": ours.config.arch,
        "new_tokens": n,
        "agreeing_tokens": common_prefix(out["ours"], out["hf"]),
    }
    if "ours +compile" in out:
        row["compiled_equals_eager"] = out["ours +compile"] == out["ours"]
    if "hf +compile" in out:
        row["hf_compiled_equals_eager"] = out["hf +compile"] == out["hf"]
    return {**row, **figures(t, n)}


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    import transformers

    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    train, decode = [], []
    for arch in ("baseline", "diff"):
        ours = build(shape.config(arch), device)
        hf = hf_model_for(ours)
        if hf is None:
            continue
        train.append(train_vs_hf(ours, hf, shape, args, device))
        decode.append(decode_vs_hf(ours, hf, args, device))
    return {
        "benchmark": "hf_compare",
        "command": command("hf_compare.py", argv),
        "device": environment(device),
        "shape": dataclasses.asdict(shape),
        "transformers": transformers.__version__,
        "precision": args.precision,
        "reps": args.reps,
        "train": train,
        "decode": decode,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="32-true", help="32-true | bf16-mixed (autocast)")
    ap.add_argument("--compile", action="store_true", help="also both compiled")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed (pip install difftrain[hf])", file=sys.stderr)
        return 2
    result = run(args, argv)
    print(f"{'arch':9} {'what':14} {'ours tok/s':>11} {'hf tok/s':>10} {'speedup':>8} {'compiled':>9}")
    for what in ("train", "decode"):
        for r in result[what]:
            c = r.get("compiled_speedup")
            print(
                f"{r['arch']:9} {what:14} {r['ours_tokens_per_s']:11.1f} {r['hf_tokens_per_s']:10.1f}"
                f" {r['speedup']:8.2f} {'' if c is None else f'{c:9.2f}'}"
            )
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
