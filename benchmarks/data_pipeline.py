"""Data pipeline figures: tokenizer training, shard building, cache size, loader throughput.

    .venv/bin/python benchmarks/data_pipeline.py                  # builtin:python-stdlib, 8192 BPE
    .venv/bin/python benchmarks/data_pipeline.py --vocab 4096 --json data.json
    .venv/bin/python benchmarks/data_pipeline.py --no-model        # skip the model comparison

Steps, each timed once in a fresh cache folder (a temporary one unless --cache is given):
1. train the byte-level BPE on the sources (`prepare_tokenizer`), MB of text per second;
2. tokenize the corpus into shards (`prepare_data`, tokenizer already cached), MB/s;
3. call `prepare_data` again: the cache hit (no text read);
4. the PretrainDataModule train loader: tokens/s over --batches batches (after 5 warm-up
   batches), in the main process (num_workers=0, the default);
5. unless --no-model: forward + backward + AdamW step of the quickstart-shaped model (diff,
   d_model 256, 4 layers, 8 heads, fp32) on the same batches, tokens/s, and the ratio of the
   loader's throughput to it (the loader must never be the bottleneck).

The tokenizers library trains and encodes on all cores (rayon); on a shared machine the
figures depend on the load — note the core count and load printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from difftrain.data.config import DataConfig, TokenizerConfig, TokenizerTrainConfig
from difftrain.data.modules import PretrainDataModule
from difftrain.data.shards import prepare_data, prepare_tokenizer
from difftrain.data.sources import resolve_sources


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="builtin:python-stdlib")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--model-steps", type=int, default=5)
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--cache", type=Path, default=None, help="cache folder (default: a fresh temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    cache = args.cache or Path(tempfile.mkdtemp(prefix="difftrain-bench-"))
    data = DataConfig(sources=[args.source], cache_dir=str(cache))
    tok_cfg = TokenizerConfig(train=TokenizerTrainConfig(vocab_size=args.vocab))
    base = Path.cwd()
    fig: dict[str, object] = {
        "source": args.source,
        "vocab_size": args.vocab,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
    }

    t = time.perf_counter()
    sources = resolve_sources(data, base)
    _, _, _ = prepare_tokenizer(data, tok_cfg, base_dir=base, sources=sources)
    tok_s = time.perf_counter() - t

    t = time.perf_counter()
    prepared = prepare_data(data, tok_cfg, seed=0, base_dir=base)
    shard_s = time.perf_counter() - t
    assert prepared.tokenizer_from_cache and not prepared.from_cache
    st = prepared.stats
    mb = st.bytes / 1e6

    t = time.perf_counter()
    again = prepare_data(data, tok_cfg, seed=0, base_dir=base)
    hit_s = time.perf_counter() - t
    assert again.from_cache

    fig.update(
        documents=st.documents,
        text_mb=round(mb, 2),
        tokens=st.tokens,
        tokens_per_byte=round(st.tokens_per_byte, 4),
        tokenizer_train_s=round(tok_s, 2),
        tokenizer_train_mb_per_s=round(mb / tok_s, 2),
        shard_build_s=round(shard_s, 2),
        shard_build_mb_per_s=round(mb / shard_s, 2),
        cache_hit_s=round(hit_s, 3),
        cache_mb=round(_dir_size(cache) / 1e6, 2),
    )

    dm = PretrainDataModule(
        prepared, seq_len=args.seq_len, micro_batch_size=args.micro_batch, seed=0, val_windows=0
    )
    it = iter(dm.train_dataloader())
    for _ in range(5):
        next(it)
    t = time.perf_counter()
    for _ in range(args.batches):
        batch = next(it)
    load_s = time.perf_counter() - t
    loader_tps = args.batches * args.micro_batch * args.seq_len / load_s
    fig.update(loader_tokens_per_s=round(loader_tps), loader_batch_ms=round(1000 * load_s / args.batches, 3))

    if not args.no_model:
        import torch

        from difftrain.model import ModelConfig, Transformer

        torch.manual_seed(0)
        cfg = ModelConfig(
            arch="diff",
            vocab_size=args.vocab,
            d_model=256,
            n_layers=4,
            n_heads=8,
            max_seq_len=args.seq_len,
            tie_embeddings=True,
        )
        model = Transformer(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            out = model(batch["input_ids"], batch["targets"])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        t = time.perf_counter()
        for _ in range(args.model_steps):
            batch = next(it)
            step()
        model_s = time.perf_counter() - t
        model_tps = args.model_steps * args.micro_batch * args.seq_len / model_s
        fig.update(model_tokens_per_s=round(model_tps), loader_over_model=round(loader_tps / model_tps, 1))

    if args.cache is None:
        shutil.rmtree(cache, ignore_errors=True)
    for k, v in fig.items():
        print(f"{k:26s} {v}")
    if args.json:
        args.json.write_text(json.dumps(fig, indent=2) + "\n")


if __name__ == "__main__":
    main()
