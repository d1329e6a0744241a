"""`difftrain plan`'s peak estimate against the measured peak of a training step.

    python benchmarks/memory.py [--shapes quickstart d512-seq512] [--json F]

Each (shape, arch, optimizer, checkpointing) runs 3 training steps in a fresh process
(`difftrain.bench.measure_training_peak`): on CUDA the growth of torch.cuda.max_memory_allocated;
on a CPU the tensors' own peak from the profiler's memory events, which is what the planner
estimates, and (Linux) the growth of the peak resident set, VmHWM, measured here: it adds
allocator slack and libraries loaded on first use, which the planner's CPU overheads cover.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from common import SHAPES, command, environment, write_result


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def measure_child(spec: dict[str, Any]) -> dict[str, Any]:
    """`measure_training_peak` in this fresh process; on a Linux CPU also the resident set's
    peak growth (glibc's free blocks handed back first, VmHWM reset to the resident set)."""
    from difftrain.bench import measure_training_peak

    before = None
    if spec["device"] == "cpu":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with contextlib.suppress(OSError, StopIteration):
            before = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
    out = measure_training_peak(spec)
    if before is not None:
        out["measured_peak"] = max(0, _status_bytes("VmHWM") - before)
    return out


def cases(shapes: list[str], cuda: bool) -> list[tuple[str, str, str, bool]]:
    """(shape, arch, optimizer, checkpointing) per measurement."""
    out = []
    for s in shapes:
        opt = "adamw8bit" if cuda else "adamw"
        out += [(s, "baseline", opt, False), (s, "diff", opt, False), (s, "diff", opt, True)]
    return out


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    from difftrain.plan import Settings, Target, plan_memory

    device = torch.device(args.device)
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    rows = []
    for shape_name, arch, optimizer, ckpt in cases(args.shapes, device.type == "cuda"):
        shape = SHAPES[shape_name]
        cfg = shape.config(arch)
        spec = {
            "device": str(device),
            "config": cfg.model_dump(mode="json"),
            "batch": shape.batch,
            "seq_len": shape.seq_len,
            "optimizer": optimizer,
            "checkpointing": ckpt,
            "precision": precision,
        }
        print(
            f"{shape_name} {arch} {optimizer}{' +ckpt' if ckpt else ''} in a fresh process", file=sys.stderr
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env
        )
        row: dict[str, Any] = {
            "shape": shape_name,
            "arch": arch,
            "optimizer": optimizer,
            "checkpointing": ckpt,
        }
        if proc.returncode != 0:
            rows.append({**row, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        settings = Settings(shape.batch, shape.seq_len, shape.batch, 1, precision, optimizer, ckpt)
        est = plan_memory(cfg, settings, Target(device.type, 0, str(device))).peak
        measured, tensor = child["measured_peak"], child.get("tensor_peak")
        rows.append(
            {
                **row,
                "precision": precision,
                "estimated_peak": round(est),
                "measured_peak": measured,
                "error": est / measured - 1.0 if measured else None,
                "tensor_peak": tensor,
                "tensor_error": est / tensor - 1.0 if tensor else None,
            }
        )
    return {
        "benchmark": "memory",
        "command": command("memory.py", argv),
        "device": environment(device),
        "measured_by": "torch.cuda.max_memory_allocated"
        if device.type == "cuda"
        else "VmHWM growth; profiler",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["quickstart", "d512-seq512"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one measurement, in this fresh process
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure_child(json.loads(args.child))))
        return 0
    r = run(args, argv)
    print(
        f"{'shape':12} {'arch':9} {'optimizer':10} {'ckpt':5} {'planned':>9} {'measured':>9} {'tensors':>9}"
    )
    mib = lambda b: f"{b / 2**20:8.1f}M" if b else "        —"  # noqa: E731
    for x in r["rows"]:
        if "estimated_peak" not in x:
            print(f"{x['shape']:12} {x['arch']:9} error: {x['error']}")
            continue
        print(
            f"{x['shape']:12} {x['arch']:9} {x['optimizer']:10} {'yes' if x['checkpointing'] else 'no':5}"
            f" {mib(x['estimated_peak'])} {mib(x['measured_peak'])} {mib(x['tensor_peak'])}"
        )
    write_result(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
