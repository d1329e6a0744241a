"""benchmarks/gpu_check.sh, the one short run that proves the GPU path, checked without a GPU.

A GPU is lent rarely and briefly, so the script must not have rotted when one is: its CPU dry run
runs every section at tiny sizes here, and its plumbing (the budget's split, the JSON a section
leaves when it is cut short or crashes, the summary, the refusals) is checked piece by piece.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
SECTIONS = ("kernels", "train", "qlora", "generate", "fsdp")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def gpu_check(*args: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_cuda_it_says_so_in_one_line_and_exits_3(tmp_path):
    done = gpu_check("--results", str(tmp_path / "results"), tmp_path=tmp_path)
    out = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 3 and len(out) == 1, done.stdout + done.stderr
    assert "no CUDA GPU" in out[0] and "Traceback" not in out[0]
    assert not (tmp_path / "results").exists()  # nothing was run, nothing written


def test_help_documents_the_budget_and_every_section(tmp_path):
    done = gpu_check("--help", tmp_path=tmp_path)
    assert done.returncode == 0
    assert "--budget SECONDS" in done.stdout and "(default 420)" in " ".join(done.stdout.split())
    assert all(f"\n  {s} " in done.stdout for s in SECTIONS), done.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["warp"], "unknown section 'warp'; the sections are kernels, train, qlora, generate, fsdp"),
        (["--budget", "0"], "--budget 0: give a positive number of seconds"),
        (["--budget", "soon"], "argument --budget: invalid float value: 'soon'"),
    ],
)
def test_a_mistake_on_the_command_line_is_one_line_and_exit_2(tmp_path, args, says):
    done = gpu_check(*args, tmp_path=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"gpu_check: {says} (see --help)"]


def test_each_section_gets_its_share_of_what_is_left():
    gc = load("gpu_check")
    order = list(gc.SHARES)
    assert order == list(SECTIONS)  # the priority order
    assert sum(gc.SHARES.values()) == pytest.approx(1.0)
    assert gc.timeout_for("kernels", order, 420) == pytest.approx(420 * gc.SHARES["kernels"])
    # a section that ended early leaves its time to the ones after it, in their proportions
    rest = order[1:]
    t = gc.timeout_for("train", rest, 400)
    assert t == pytest.approx(400 * gc.SHARES["train"] / sum(gc.SHARES[s] for s in rest))
    assert gc.timeout_for("fsdp", ["fsdp"], 37.5) == 37.5  # the last one gets all that is left
    assert gc.timeout_for("fsdp", ["fsdp"], -3) == 0.0


FAKE_SECTION = """
import json, sys, time
out = sys.argv[2]
open(out, "w").write(json.dumps({"section": sys.argv[1], "status": "running", "ok": False,
    "checks": {"first": {"ok": True, "detail": "done before the timeout"}}, "figures": {}}))
if sys.argv[1] == "kernels":
    time.sleep(60)  # past its timeout
sys.exit(7)  # the others crash
"""


def test_a_section_cut_short_or_crashed_leaves_its_json_saying_so(tmp_path, monkeypatch):
    gc = load("gpu_check")
    fake = tmp_path / "fake_sections.py"
    fake.write_text(FAKE_SECTION)
    monkeypatch.setattr(gc, "SECTIONS_PY", fake)
    ctx = {"python": sys.executable}
    res = gc.run_section("kernels", tmp_path / "kernels.json", 1.5, ctx, dict(os.environ))
    assert res["status"] == "cut_short" and res["ok"] is False and "cut short" in res["error"]
    assert res["checks"]["first"]["ok"] is True  # what it finished is kept
    assert 1.5 <= res["elapsed_s"] < 1.5 + gc.STOP_GRACE_S + 2 and res["timeout_s"] == 1.5
    assert json.loads((tmp_path / "kernels.json").read_text()) == res  # and on disk
    res = gc.run_section("train", tmp_path / "train.json", 30, ctx, dict(os.environ))
    assert res["status"] == "crashed" and "exited with code 7" in res["error"]
    table = gc.summary_markdown(
        [res], {"device": "d", "date": "t", "machine": "m", "command": "c", "budget": 30, "elapsed": 1}
    )
    assert "| train | first | done before the timeout | | pass |" in table
    assert "| train | error | the section's process exited with code 7" in table


def test_a_whole_run_cut_short_by_its_budget_still_writes_every_json_and_the_summary(tmp_path):
    results = tmp_path / "results"
    done = gpu_check("--dry-run", "--budget", "1", "--results", str(results), "train", tmp_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    folder = results / "cpu-dry-run"
    res = json.loads((folder / "train.json").read_text())
    assert res["status"] == "cut_short" and res["ok"] is False
    assert "| train | cut_short |" in (folder / "summary.md").read_text()
    assert not list(tmp_path.glob("difftrain-gpu-check.*"))  # its work folder is removed


@pytest.mark.parametrize("n_kv", [4, 2])
def test_the_candidate_diff_cores_equal_eager(n_kv):
    cores = load("diff_cores")
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 4, 16, 8
    inputs = [
        torch.randn(B, H, T, d, generator=g),
        torch.randn(B, n_kv, T, d, generator=g),
        torch.randn(B, n_kv // 2, T, 2 * d, generator=g),
        torch.tensor(0.37),
    ]
    grad = torch.randn(B, H // 2, T, 2 * d, generator=g)

    def run(fn):
        xs = [x.clone().requires_grad_() for x in inputs]
        out = fn(*xs)
        return [out, *torch.autograd.grad(out, xs, grad)]

    ref = run(cores.eager)
    for name, fn in cores.CANDIDATES.items():
        for a, b in zip(run(fn), ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # the reference itself, written out for differential head 1: (A1 − λ·A2)·V, its maps from
    # query heads 2 and 3 and key heads 2g and 2g+1, its values from head g (g = 1 // n_rep)
    q, k, v, lam = inputs
    g = 1 // (H // n_kv)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    a1 = (q[0, 2] @ k[0, 2 * g].T / d**0.5).masked_fill(~mask, -torch.inf).softmax(-1)
    a2 = (q[0, 3] @ k[0, 2 * g + 1].T / d**0.5).masked_fill(~mask, -torch.inf).softmax(-1)
    torch.testing.assert_close(ref[0][0, 1], (a1 - lam * a2) @ v[0, g], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_dry_run_runs_every_section_on_the_cpu(tmp_path):
    results = tmp_path / "results"
    done = gpu_check(
        "--dry-run", "--budget", "600", "--results", str(results), tmp_path=tmp_path, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = results / "cpu-dry-run"
    for section in SECTIONS:
        res = json.loads((folder / f"{section}.json").read_text())
        assert res["section"] == section and res["date"] and res["command"] and res["device"]
        if section == "fsdp":
            assert res["status"] == "skipped" and "no GPUs" in res["skipped"]
            continue
        assert res["status"] == "ok" and "error" not in res, res
        assert res["checks"] and all(c["ok"] or c.get("judged") is False for c in res["checks"].values())
    train = json.loads((folder / "train.json").read_text())
    assert {"diff_tokens_per_s", "baseline_tokens_per_s", "diff_vs_baseline_tokens_per_s"} <= set(
        train["figures"]
    )
    assert {"diff_core_padded_sdpa_ms", "diff_core_split_v_sdpa_ms", "auto_choice_measured"} <= set(
        train["figures"]
    )
    assert train["checks"]["diff_vs_baseline_95_percent"]["judged"] is False  # a GPU target, not judged here
    qlora = json.loads((folder / "qlora.json").read_text())
    assert {"4bit_layers_on_device_during_the_step", "merged_equals_trained_on_the_device"} <= set(
        qlora["checks"]
    )
    summary = (folder / "summary.md").read_text()
    assert "- command: `bash benchmarks/gpu_check.sh --dry-run --budget 600" in summary
    assert "| train | diff_tokens_per_s |" in summary and "| fsdp | skipped |" in summary
    assert not list(tmp_path.glob("difftrain-gpu-check.*"))
