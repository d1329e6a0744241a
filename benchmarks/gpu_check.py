"""The GPU path in one short run: `bash benchmarks/gpu_check.sh [--budget SECONDS] [SECTION ...]`.

The sections run in priority order, each in a process of its own (so only one model is ever on
the device, and a section that hangs can be stopped), each with a timeout carved from what is left
of the budget in proportion to its share (a section that ends early leaves its time to the next).
A section writes benchmarks/results/gpu/<device>/<section>.json as it goes; one cut short still
leaves its JSON, saying so. summary.md then holds one table of every figure and check.

Exit codes: 0 every section ran and passed (or was skipped), 1 a check failed or a section was
cut short or crashed, 2 a mistake on the command line, 3 no CUDA GPU (nothing run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECTIONS_PY = HERE / "gpu_sections.py"

# Priority order, and each section's share of the budget (of what is left when it starts).
SHARES = {"kernels": 0.17, "train": 0.46, "qlora": 0.20, "generate": 0.12, "fsdp": 0.05}
DEFAULT_BUDGET = 420.0
ABOUT = {
    "kernels": "every attention core of every arch (sdpa, flex, flex under torch.compile) against eager: "
    "logits and gradients, fp32 and bf16, MHA and GQA",
    "train": "diff-124m and baseline-124m at seq 2048, bf16 + torch.compile + adamw8bit for about a minute "
    "each: tokens/s, MFU, diff/baseline ratio, peak memory vs `difftrain plan`, 8-bit bytes/param; "
    "the candidate diff cores timed at that shape",
    "qlora": "a pretrain on the device with the CUDA defaults, then a QLoRA fine-tune: 4-bit layers on the "
    "device checked during the step; the merged run's logits equal the trained model's, on the device",
    "generate": "decoding tokens/s with the KV cache, eager and compiled (generate --compile)",
    "fsdp": "FSDP on every GPU against DDP (needs 2+ GPUs; otherwise recorded as skipped)",
}
STOP_GRACE_S = 5.0  # between SIGTERM and SIGKILL of a section cut short

DEVICE_PROBE = """
import json, torch
if not torch.cuda.is_available():
    print(json.dumps(None))
else:
    p = torch.cuda.get_device_properties(0)
    print(json.dumps({"name": p.name, "count": torch.cuda.device_count(), "memory": p.total_memory,
                      "capability": f"{p.major}.{p.minor}", "torch": torch.__version__}))
"""


class UsageError(Exception):
    """A mistake on the command line: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    sections = "\n".join(
        textwrap.fill(ABOUT[name], 96, initial_indent=f"  {name:<9} ", subsequent_indent=" " * 12)
        for name in SHARES
    )
    p = Parser(
        prog="bash benchmarks/gpu_check.sh",
        description="Prove the GPU path in one short run (or show exactly what breaks).",
        epilog=f"sections, in the order they run (default: all):\n{sections}\n\n"
        "Results: RESULTS/<device>/<section>.json, written as each section goes, and summary.md.\n"
        "Exit: 0 all passed, 1 a check failed or a section was cut short, 2 usage, 3 no CUDA GPU.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="SECONDS",
        help=f"wall-clock seconds for all sections together (default {DEFAULT_BUDGET:g}); each "
        "section's timeout is its share of what is left when it starts",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=HERE / "results" / "gpu",
        metavar="DIR",
        help="where the <device>/ folder of results goes (default benchmarks/results/gpu)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every section on the CPU at tiny sizes: tests the script, not the GPU (figures "
        "are not judged against the GPU targets)",
    )
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of: {', '.join(SHARES)}")
    args = p.parse_args(argv)
    unknown = [s for s in args.sections if s not in SHARES]
    if unknown:
        raise UsageError(f"unknown section {unknown[0]!r}; the sections are {', '.join(SHARES)}")
    if not args.budget > 0:
        raise UsageError(f"--budget {args.budget:g}: give a positive number of seconds")
    args.sections = [s for s in SHARES if s in args.sections] if args.sections else list(SHARES)
    return args


def timeout_for(section: str, remaining: list[str], seconds_left: float) -> float:
    """`section`'s timeout: its share of the seconds left among the sections still to run."""
    total = sum(SHARES[s] for s in remaining)
    return max(0.0, seconds_left * SHARES[section] / total)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def probe_device(python: str, env: dict[str, str]) -> dict | None:
    out = subprocess.run([python, "-c", DEVICE_PROBE], capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"could not import torch: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_section(name: str, out: Path, timeout: float, ctx: dict, env: dict[str, str]) -> dict:
    """Run one section in its own process group; stop it at `timeout`. Returns its JSON as left."""
    cmd = [ctx["python"], str(SECTIONS_PY), name, str(out), f"{timeout:.1f}", json.dumps(ctx)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    cut = False
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        cut = True
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        code = proc.wait()
    elapsed = time.monotonic() - t0
    try:
        res = json.loads(out.read_text())
    except (OSError, ValueError):
        res = {"section": name, "checks": {}, "figures": {}}
    res.update(timeout_s=round(timeout, 1), elapsed_s=round(elapsed, 1))
    if cut:
        res.update(status="cut_short", ok=False)
        res["error"] = f"cut short at its timeout of {timeout:.0f} s (what it finished is above)"
    elif res.get("status") in (None, "running"):
        res.update(status="crashed", ok=False)
        res.setdefault("error", f"the section's process exited with code {code} before it finished")
    write_json(out, res)
    return res


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_markdown(results: list[dict], header: dict) -> str:
    """One table of every figure and every check, with the run's date, machine and command."""
    lines = [
        f"# gpu_check on {header['device']}",
        "",
        f"- date: {header['date']}",
        f"- machine: {header['machine']}",
        f"- command: `{header['command']}`",
        f"- budget: {header['budget']:g} s; ran {header['elapsed']:.0f} s",
        "",
        "| section | status | time (s) |",
        "| --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['section']} | {r.get('status')} | {r.get('elapsed_s', 0)} of {r.get('timeout_s', 0)} |"
        )
    lines += [
        "",
        "| section | figure or check | value | target | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for name, f in r.get("figures", {}).items():
            value = f"{_fmt(f.get('value'))} {f.get('unit', '')}".strip()
            lines.append(f"| {r['section']} | {name} | {value} | {f.get('target', '')} | |")
        for name, c in r.get("checks", {}).items():
            verdict = ("pass" if c["ok"] else "FAIL") if c.get("judged", True) else "not judged"
            lines.append(f"| {r['section']} | {name} | {c.get('detail', '')} | | {verdict} |")
        if r.get("skipped"):
            lines.append(f"| {r['section']} | skipped | {r['skipped']} | | skipped |")
        if r.get("error"):
            lines.append(f"| {r['section']} | error | {r['error'].splitlines()[0][:300]} | | FAIL |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"gpu_check: {e} (see --help)", file=sys.stderr)
        return 2
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    python = os.environ.get("PYTHON") or sys.executable
    start = time.monotonic()
    if args.dry_run:
        device = {"name": "cpu dry run", "count": 0, "memory": 0, "capability": "", "torch": ""}
    else:
        try:
            device = probe_device(python, env)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"gpu_check: cannot look for a CUDA GPU: {e}; nothing was run")
            return 3
        if device is None:
            print("gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False); nothing was run")
            return 3
    folder = args.results / slug(device["name"])
    folder.mkdir(parents=True, exist_ok=True)
    command = " ".join(["bash benchmarks/gpu_check.sh", *argv])
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = []
    with tempfile.TemporaryDirectory(prefix="difftrain-gpu-check.") as work:
        # the sections' corpora, runs and data cache: nothing of theirs outlives the script
        ctx = {"python": python, "dry_run": args.dry_run, "device": device, "command": command}
        ctx.update(date=date, work=work)
        for i, name in enumerate(args.sections):
            left = args.budget - (time.monotonic() - start)
            timeout = timeout_for(name, args.sections[i:], left)
            print(f"gpu_check: {name} (timeout {timeout:.0f} s)", flush=True)
            res = run_section(name, folder / f"{name}.json", timeout, ctx, env)
            print(
                f"gpu_check: {name} {res.get('status')} in {res['elapsed_s']:.0f} s -> {folder / f'{name}.json'}"
            )
            results.append(res)
    header = {
        "device": device["name"],
        "date": date,
        "machine": f"{device['name']} × {device['count']}, capability {device['capability']}, "
        f"{device['memory'] / 2**30:.0f} GiB, torch {device['torch']}"
        if not args.dry_run
        else "CPU (dry run: figures mean nothing)",
        "command": command,
        "budget": args.budget,
        "elapsed": time.monotonic() - start,
    }
    (folder / "summary.md").write_text(summary_markdown(results, header))
    print(f"gpu_check: summary -> {folder / 'summary.md'}")
    return 0 if all(r.get("status") in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
