"""Ctrl-C and SIGTERM stop a run cleanly; a second Ctrl-C stops it at once without damage.

Three real processes train at the same time (long runs that would not finish on their own):
`python -m difftrain pretrain` receiving SIGINT, the same receiving SIGTERM, and the driver's
`slowsave` (checkpoint writes of a graceful stop stall half-way, as a big model on a slow disk
would) receiving SIGINT and then, while that save is stalled, a second SIGINT.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    assert_checkpoints_verify,
    driver_command,
    driver_env,
    flat,
    make_corpus,
    resume_point,
    safetensors_step,
    tmp_leftovers,
    write_recipe,
)

from difftrain.cli.app import main
from difftrain.train.checkpoint import load_checkpoint_file, read_index
from difftrain.train.metrics import read_metrics

ACCUMULATE = 2  # global_batch_size 4 / micro_batch_size 2
STALL = 30.0  # seconds a stalled save would take


class Proc:
    def __init__(self, name: str, cmd: list[str], root: Path, first: int, second: int | None = None) -> None:
        self.name, self.root, self.first, self.second = name, root, first, second
        self.out, self.err = root / f"{name}.out", root / f"{name}.err"
        env = driver_env()
        env["COLUMNS"] = "60"  # a narrow terminal: the resume command must still be one line
        self.p = subprocess.Popen(
            cmd, stdout=open(self.out, "w"), stderr=open(self.err, "w"), env=env, cwd=root
        )
        self.sent: list[tuple[int, float]] = []
        self.rc: int | None = None
        self.exited_at: float | None = None

    @property
    def run_dir(self) -> Path:
        return self.root / "runs" / self.name

    def poll(self) -> bool:
        """Send the planned signals when their moment comes; True once the process has exited."""
        if self.rc is None and self.p.poll() is not None:
            self.rc, self.exited_at = self.p.returncode, time.monotonic()
        if self.rc is not None:
            return True
        if not self.sent and (self.run_dir / "checkpoints" / "index.json").is_file():
            self._send(self.first)  # training is under way and has saved once
        elif self.second and len(self.sent) == 1 and "slowsave: writing" in self.err.read_text():
            self._send(self.second)  # the graceful stop is in the middle of writing its checkpoint
        return False

    def _send(self, sig: int) -> None:
        self.p.send_signal(sig)
        self.sent.append((sig, time.monotonic()))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    make_corpus(root)
    big = dict(steps=100_000, save_every=3, keep=2)
    difftrain = [sys.executable, "-m", "difftrain", "pretrain"]
    procs = {
        "sigint": Proc(
            "sigint",
            [*difftrain, str(write_recipe(root, "sigint", **big)), "--no-progress"],
            root,
            signal.SIGINT,
        ),
        "sigterm": Proc(
            "sigterm",
            [*difftrain, str(write_recipe(root, "sigterm", **big)), "--no-progress"],
            root,
            signal.SIGTERM,
        ),
        "double": Proc(
            "double",
            driver_command(
                "slowsave", str(STALL), "pretrain", str(write_recipe(root, "double", **big)), "--no-progress"
            ),
            root,
            signal.SIGINT,
            signal.SIGINT,
        ),
    }
    deadline = time.monotonic() + 120
    try:
        while not all(p.poll() for p in procs.values()):
            assert time.monotonic() < deadline, {n: p.err.read_text()[-2000:] for n, p in procs.items()}
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.p.poll() is None:
                p.p.kill()
    return procs


def _last_checkpoint_step(run_dir: Path) -> int:
    return read_index(run_dir / "checkpoints")[-1]["step"]


@pytest.mark.parametrize("name, code", [("sigint", 130), ("sigterm", 143)])
def test_a_signal_finishes_the_step_saves_and_prints_the_resume_command(stopped, name, code):
    p = stopped[name]
    err = p.err.read_text()
    assert p.rc == code, err[-2000:]
    m = re.search(r"stopped at step (\d+); checkpoint saved\. Resume with: (.+)$", err, re.M)
    assert m, err[-2000:]
    step = int(m.group(1))
    assert m.group(2).strip() == f"difftrain pretrain {shlex.quote(str(p.run_dir / 'recipe.yaml'))} --resume"
    assert "Traceback" not in err
    # the checkpoint of the stop step is the newest one, complete, and ends on a step boundary
    assert_checkpoints_verify(p.run_dir)
    assert _last_checkpoint_step(p.run_dir) == step == resume_point(p.run_dir).step
    ckpt = load_checkpoint_file(p.run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == step
    assert ckpt["difftrain"]["micro_batches_seen"] == step * ACCUMULATE  # no half-accumulated step
    assert safetensors_step(p.run_dir / "model.safetensors") == step
    assert max(r["step"] for r in read_metrics(p.run_dir / "metrics.csv")) == step


def test_the_printed_resume_command_continues_the_run(stopped, capsys, monkeypatch):
    p = stopped["sigint"]
    line = re.search(r"Resume with: (.+)$", p.err.read_text(), re.M).group(1)
    argv = shlex.split(line)
    assert argv[:2] == ["difftrain", "pretrain"]
    step = _last_checkpoint_step(p.run_dir)
    monkeypatch.chdir(p.root)
    assert main([*argv[1:], f"train.max_steps={step + 2}", "--no-progress"]) == 0, capsys.readouterr().err
    assert f"resuming from step {step}" in flat(capsys.readouterr().out)
    assert safetensors_step(p.run_dir / "model.safetensors") == step + 2


def test_a_second_ctrl_c_exits_at_once_without_corrupting_anything(stopped, capsys, monkeypatch):
    p = stopped["double"]
    out, err = flat(p.out.read_text()), p.err.read_text()  # rich wraps at 60 columns
    assert p.rc == 130, err[-2000:]
    assert [s for s, _ in p.sent] == [signal.SIGINT, signal.SIGINT]
    assert "received SIGINT" in out and "press Ctrl-C again" in out
    assert p.exited_at - p.sent[1][1] < STALL / 3  # did not wait for the stalled save
    assert "Traceback" not in err
    # the stop's checkpoint was cut off mid-write: only its temporary file is torn, nothing else
    assert_checkpoints_verify(p.run_dir)
    assert any(".ckpt." in t for t in tmp_leftovers(p.run_dir))
    point = resume_point(p.run_dir)
    assert point is not None and point.warnings == []
    assert safetensors_step(p.run_dir / "model.safetensors") == point.step
    # the last line says where the run stands, not the first signal's "saving…"
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"quit at once (SIGINT again): resume from its last checkpoint (step {point.step}) with: "
    )
    assert last.endswith(" --resume") and "difftrain pretrain " in last
    monkeypatch.chdir(p.root)
    recipe = p.run_dir / "recipe.yaml"
    assert (
        main(["pretrain", str(recipe), "--resume", f"train.max_steps={point.step + 1}", "--no-progress"]) == 0
    )
    assert f"resuming from step {point.step}" in flat(capsys.readouterr().out)
    assert tmp_leftovers(p.run_dir) == []  # the torn temporary file was cleaned up
