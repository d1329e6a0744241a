"""Optimizer step time and state bytes per parameter, checked against `difftrain.plan`.

    python benchmarks/optimizer_state.py [--shape quickstart] [--reps 10] [--json F]

adamw, adamw8bit, paged_adamw8bit (CUDA only) and lion8bit on the same `diff` model, each after a
first step that allocates its state; the steps are timed round-robin. `planned_state_bytes` is
what `difftrain plan` counts for that optimizer: the two must agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    SHAPES,
    build,
    command,
    environment,
    optimizer,
    paired_ratio,
    summary,
    time_round_robin,
    write_result,
)

NAMES = ("adamw", "adamw8bit", "paged_adamw8bit", "lion8bit")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    from difftrain.errors import DeviceError
    from difftrain.plan import model_params, optimizer_bytes
    from difftrain.train.optim import optimizer_state_bytes

    device = torch.device(args.device)
    cfg = SHAPES[args.shape].config("diff")
    rows: list[dict[str, Any]] = []
    fns, opts = {}, {}
    for name in NAMES:
        model = build(cfg, device)
        try:
            opt = optimizer(model, name, device)
        except DeviceError as e:
            rows.append({"optimizer": name, "available": False, "reason": str(e)})
            continue
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()  # allocates the state
        opts[name] = (opt, model)
        fns[name] = opt.step
    times = time_round_robin(fns, warmup=1, reps=args.reps, device=device)
    planned = model_params(cfg)
    n = sum(p.numel for p in planned)
    for name, (opt, _model) in opts.items():
        state = optimizer_state_bytes(opt)
        rows.append(
            {
                "optimizer": name,
                "available": True,
                **summary(times[name]),
                "state_bytes": state,
                "bytes_per_param": state / n,
                "planned_state_bytes": optimizer_bytes(planned, name),
                "vs_adamw": paired_ratio(times["adamw"]["wall"], times[name]["wall"]),
            }
        )
    rows.sort(key=lambda r: NAMES.index(r["optimizer"]))
    return {
        "benchmark": "optimizer_state",
        "command": command("optimizer_state.py", argv),
        "device": environment(device),
        "shape": args.shape,
        "arch": "diff",
        "params": n,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args, argv)
    print(f"{'optimizer':16} {'ms/step':>8} {'bytes/param':>12} {'= plan':>7}")
    for row in r["rows"]:
        if not row["available"]:
            print(f"{row['optimizer']:16} {row['reason']}")
            continue
        same = "yes" if row["state_bytes"] == row["planned_state_bytes"] else "NO"
        print(f"{row['optimizer']:16} {row['ms']:8.2f} {row['bytes_per_param']:12.2f} {same:>7}")
    write_result(args.json, r)
    return 0 if all(x["state_bytes"] == x["planned_state_bytes"] for x in r["rows"] if x["available"]) else 1


if __name__ == "__main__":
    sys.exit(main())
