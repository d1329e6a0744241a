"""Run the benchmark scripts one after another (`make bench`), each writing results/<name>.json.

    .venv/bin/python benchmarks/run_all.py              # every script at its default shapes
    .venv/bin/python benchmarks/run_all.py --quick      # tiny shapes, 1-2 repetitions: a smoke test
    .venv/bin/python benchmarks/run_all.py --only memory optimizer_state --threads 1

Each script runs in its own process (a failure is reported and the next one runs); the exit code
is 1 when any failed. On a CPU that other jobs share, `--threads 1` avoids intra-op threads
waiting for each other, which otherwise dominates both wall and CPU time. `--out-dir` puts the
JSON elsewhere (default: benchmarks/results/; `--quick` results get a `-quick` suffix, so they
never replace a full run's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# result → (the script's arguments, its arguments under --quick)
SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    "attention_layer": (
        [],
        ["--d-model", "64", "--n-heads", "4", "--seq", "64", "--batch", "2", "--reps", "1"],
    ),
    "attention_cores": (
        ["--cores"],
        ["--cores", "--d-model", "64", "--n-heads", "4", "--seq", "64", "--reps", "1"],
    ),
    "model_step": (
        ["--reps", "5"],
        ["--d-model", "64", "--layers", "2", "--seq", "64", "--reps", "1", "--decode-tokens", "8"],
    ),
    "hf_compare": (["--compile"], ["--shape", "tiny", "--reps", "1", "--decode-tokens", "8"]),
    "lightning_overhead": ([], ["--shape", "tiny", "--steps", "3", "--rounds", "2"]),
    "optimizer_state": ([], ["--shape", "tiny", "--reps", "2"]),
    "decode": (["--compile", "--hf"], ["--new-tokens", "8", "--no-uncached", "--arch", "diff"]),
    "memory": ([], ["--shapes", "tiny"]),
    "data_pipeline": ([], ["--vocab", "512", "--batches", "20", "--no-model"]),
}
FILES = {"attention_cores": "attention_layer"}  # result name → script, where they differ


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS of each script (torch's threads)"
    )
    ap.add_argument("--only", nargs="+", choices=list(SCRIPTS), default=None, help="these results only")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    failed = []
    for name in args.only or SCRIPTS:
        script_args, quick_args = SCRIPTS[name]
        out = args.out_dir / f"{name}{'-quick' if args.quick else ''}.json"
        cmd = [sys.executable, str(HERE / f"{FILES.get(name, name)}.py")]
        cmd += [*(quick_args if args.quick else script_args), "--json", str(out)]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
        code = subprocess.run(cmd, env=env).returncode
        print(f"== {name}: exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
