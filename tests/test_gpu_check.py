"""benchmarks/gpu_check.sh, the only place the GPU-only paths are checked, in its CPU dry run.

A GPU is lent rarely and briefly, so the script must not have rotted when one is: every section
runs here on the CPU at tiny sizes (GPU_CHECK_DEVICE=cpu) and must finish with its checks
passing and its JSON complete. The GPU-scale targets (plan within 15 %, 2.1 bytes/param) are
recorded but not judged at these sizes; that they are recorded is checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("kernels", "bench", "converge", "qlora", "fsdp")


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path: Path) -> None:
    results = tmp_path / "results"
    env = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "RESULTS_DIR": str(results),
        "PYTHON": sys.executable,
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for section in SECTIONS:
        res = json.loads((results / f"{section}.json").read_text())
        assert res["section"] == section
        assert res["ok"] is True and "error" not in res and "skipped" not in res, res
        assert res["device"], f"{section}: no device recorded"
        assert res["checks"], f"{section}: no checks ran"
        for name, c in res["checks"].items():
            assert c["ok"] or c.get("judged") is False, (section, name, c)
    bench = json.loads((results / "bench.json").read_text())
    unjudged = {n for n, c in bench["checks"].items() if c.get("judged") is False}
    gpu_scale = {"plan_within_15_percent", "adamw8bit_bytes_per_param", "paged_adamw8bit_bytes_per_param"}
    assert {"plan_within_15_percent", "adamw8bit_bytes_per_param"} <= unjudged <= gpu_scale
    assert {"adamw_state_as_planned", "adamw8bit_state_as_planned"} <= set(bench["checks"])
    assert (results / "bench-full.json").is_file() and (results / "bench-full.md").is_file()
    # the script's temporary folder (and the data cache in it) is removed at exit
    assert not list(tmp_path.glob("difftrain-gpu-check.*"))
