"""Per-step time of LitLM under the Lightning Trainer against a minimal hand-written loop.

    python benchmarks/lightning_overhead.py [--shape quickstart] [--steps 5] [--rounds 5] [--json F]

Both run the same `diff` model shape, batches and AdamW; they alternate in chunks of `--steps`
steps (a fresh Trainer each chunk), and a step is the time between two consecutive batch starts,
so the data loading and everything the loop does between steps count. The overhead is the median
of the per-round ratios minus 1 (the first step of each chunk is left out). Both loops compute the
gradient norm once for the finite check and the clipping.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import SHAPES, batch, build, command, environment, optimizer, sync, write_result


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    import lightning as L

    from difftrain.recipe import OptimConfig
    from difftrain.train.lit import LitLM
    from difftrain.train.optim import lr_multiplier
    from difftrain.train.run import _quiet_lightning

    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    cfg = shape.config("diff")
    optim = OptimConfig(name="adamw", lr=1e-4, warmup_steps=0)
    chunk = max(3, args.steps)
    batches = [
        dict(zip(("input_ids", "targets"), batch(shape, torch.device("cpu"), seed=i), strict=True))
        for i in range(chunk)
    ]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    hand_model = build(cfg, device)
    hand_opt = optimizer(hand_model, "adamw", device)
    sched = torch.optim.lr_scheduler.LambdaLR(hand_opt, lr_multiplier(optim, 10**6))
    params = list(hand_model.parameters())

    def hand_chunk() -> list[float]:
        starts = []
        for b in loader:
            starts.append(time.perf_counter())
            x, y = b["input_ids"].to(device), b["targets"].to(device)
            loss = hand_model(x, y, return_logits=False).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            if torch.isfinite(norm):
                hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)
            sched.step()
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            sync(device)
            self.starts.append(time.perf_counter())

    lit = LitLM(build(cfg, device), optim, total_steps=10**6, accumulate=1, grad_clip=1.0)
    _quiet_lightning()

    def lightning_chunk() -> list[float]:
        clock = StepClock()
        trainer = L.Trainer(
            accelerator=device.type,
            devices=1,
            precision="32-true",
            max_steps=chunk,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[clock],
            max_epochs=1,
        )
        trainer.fit(lit, train_dataloaders=loader)
        return [b - a for a, b in zip(clock.starts, clock.starts[1:-1], strict=False)]

    hand: list[float] = []
    light: list[float] = []
    ratios: list[float] = []
    hand_chunk()  # warm-up
    lightning_chunk()
    for _ in range(max(2, args.rounds)):  # short alternating rounds: a shared CPU drifts over a minute
        h_round, l_round = hand_chunk()[1:], lightning_chunk()[1:]
        hand += h_round
        light += l_round
        ratios.append(statistics.median(l_round) / statistics.median(h_round))
    return {
        "benchmark": "lightning_overhead",
        "command": command("lightning_overhead.py", argv),
        "device": environment(device),
        "shape": dataclasses.asdict(shape),
        "arch": "diff",
        "steps_timed": {"hand": len(hand), "lightning": len(light)},
        "hand_ms": 1e3 * statistics.median(hand),
        "lightning_ms": 1e3 * statistics.median(light),
        "overhead": statistics.median(ratios) - 1.0,
        "overhead_per_round": [r - 1.0 for r in ratios],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5, help="steps per chunk")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args, argv)
    print(
        f"hand loop {r['hand_ms']:.1f} ms/step, Lightning {r['lightning_ms']:.1f} ms/step: "
        f"overhead {r['overhead']:+.1%} (median of {len(r['overhead_per_round'])} rounds)"
    )
    write_result(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
