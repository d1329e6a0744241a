"""Training-step and decode-step throughput of the model core, in one process, as ratios.

    python benchmarks/model_step.py [--d-model 512 --layers 4 --seq 512 --batch 4 --vocab 8192]
                                    [--reps 5] [--decode-tokens 64] [--json out.json]

Times an fp32 forward + backward of `baseline` and `diff` (and transformers' DiffLlama on the same
weights, when transformers is installed) at one shape, interleaved round by round so that the
machine's drift hits every variant alike, and reports tokens/s and the ratios. It also times
greedy decoding with the KV cache (one token per step, batch 1). Any extra `name=impl` argument
(e.g. `diff:eager`) adds a variant that runs the arch with that `attn_impl`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
from common import cpu_name, hf_model_for

from difftrain.model import ModelConfig, Transformer


def build(arch: str, args: argparse.Namespace, impl: str = "auto") -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=max(args.seq, args.decode_tokens + 8),
        attn_impl=impl,
    )
    return Transformer(cfg)


def step_fn(model: torch.nn.Module, ids: torch.Tensor, hf: bool):
    def step() -> None:
        model.zero_grad(set_to_none=True)
        if hf:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(ids[:, :-1], ids[:, 1:], return_logits=False).loss
        loss.backward()

    return step


@torch.no_grad()
def decode_fn(model: torch.nn.Module, tokens: int, hf: bool):
    prompt = torch.randint(0, 100, (1, 8))

    def run() -> None:
        if hf:
            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            return
        cache = model.new_cache(1, prompt.shape[1] + tokens)
        logits = model(prompt, cache=cache).logits[:, -1]
        for _ in range(tokens - 1):
            logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]

    return run


def timed(fn, reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--json", type=Path)
    p.add_argument("extra", nargs="*", help="more variants: arch:impl (e.g. diff:eager)")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    variants: dict[str, tuple[torch.nn.Module, bool]] = {}
    for arch in ("baseline", "diff"):
        variants[arch] = (build(arch, args), False)
    for spec in args.extra:
        arch, impl = spec.split(":")
        variants[spec] = (build(arch, args, impl), False)
    hf = hf_model_for(variants["diff"][0])
    if hf is not None:
        variants["DiffLlama (transformers)"] = (hf.train(), True)

    steps = {name: step_fn(m, ids, is_hf) for name, (m, is_hf) in variants.items()}
    decodes = {name: decode_fn(m, args.decode_tokens, is_hf) for name, (m, is_hf) in variants.items()}
    train_s: dict[str, list[float]] = {n: [] for n in steps}
    decode_s: dict[str, list[float]] = {n: [] for n in steps}
    for fn in steps.values():  # warm-up round
        fn()
    for _ in range(args.reps):  # interleaved: each round runs every variant once
        for name, fn in steps.items():
            train_s[name] += timed(fn, 1, warmup=0)
        for name, fn in decodes.items():
            decode_s[name] += timed(fn, 1, warmup=0)

    tokens = args.batch * args.seq
    result = {
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}",
        "torch": torch.__version__,
        "command": "python benchmarks/model_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": {k: getattr(args, k) for k in ("d_model", "layers", "heads", "seq", "batch", "vocab")},
        "train_tokens_per_s": {n: tokens / statistics.median(t) for n, t in train_s.items()},
        "decode_tokens_per_s": {n: args.decode_tokens / statistics.median(t) for n, t in decode_s.items()},
    }
    tr, de = result["train_tokens_per_s"], result["decode_tokens_per_s"]
    ratios = {"diff/baseline train": tr["diff"] / tr["baseline"]}
    if "DiffLlama (transformers)" in tr:
        ratios["diff/DiffLlama train"] = tr["diff"] / tr["DiffLlama (transformers)"]
        ratios["diff/DiffLlama decode"] = de["diff"] / de["DiffLlama (transformers)"]
    result["ratios"] = ratios
    print(f"{'variant':28s} {'train tok/s':>12s} {'decode tok/s':>13s}")
    for n in tr:
        print(f"{n:28s} {tr[n]:12.0f} {de[n]:13.1f}")
    for k, v in ratios.items():
        print(f"{k:28s} {v:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
