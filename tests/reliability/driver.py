"""Subprocess driver of the reliability tests (not a test module).

    python driver.py killchain PLAN.json    run a chain of training processes, each SIGKILLed at
                                            a planned point, snapshotting the run after each kill
    python driver.py slowsave SECONDS ARGS  `difftrain ARGS` whose checkpoint writes stall half-way
                                            for SECONDS (a second Ctrl-C must not wait for them)

killchain imports torch, Lightning and difftrain once, then forks one child per planned run, so a
kill point costs a fork rather than a fresh interpreter (importing torch takes seconds on a small
CPU). The parent runs no torch code, so the children start from clean thread pools.

A kill point is either
- an event: the `nth` call of `os.replace` / `os.rename` / `os.unlink` whose destination matches
  `pattern` (fnmatch on the file name), at a `phase`: "torn" (the temporary source is cut to half
  its size, as if the process died in the middle of writing it, then SIGKILL), "before" (SIGKILL
  just before the rename), "after" (SIGKILL just after it); or the `nth` shard write ("shard");
- a delay: SIGKILL from the parent `delay` seconds after the child's training loop starts.

Each child runs `difftrain.cli.app.main(args)` in-process and records, at the start of training,
the step it resumed from (`started.json`). The parent writes `log.json`: one entry per child with
its label, exit status and resumed step, and copies the run directory (and cache) into
`snapshots/<i>-<label>` after each kill, for the test to verify.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

_real = {"replace": os.replace, "rename": os.rename, "unlink": os.unlink}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_event(point: dict[str, Any]) -> None:
    """Patch os.replace / os.rename / os.unlink (or the shard writer) to SIGKILL at `point`."""
    op, pattern, phase, nth = point["op"], point["pattern"], point["phase"], point["nth"]
    hits = [0]

    if op == "shard":
        from difftrain.data import shards

        real_write = shards._ShardWriter.write

        def write(self, ids, copies=1):  # type: ignore[no-untyped-def]
            real_write(self, ids, copies)
            hits[0] += 1
            if hits[0] == nth:
                self.f.flush()
                os.fsync(self.f.fileno())
                _die()

        shards._ShardWriter.write = write  # type: ignore[method-assign]
        return

    real = _real[op]

    def patched(*args: Any, **kwargs: Any) -> Any:
        dst = args[-1] if op != "unlink" else args[0]
        if fnmatch.fnmatch(os.path.basename(os.fspath(dst)), pattern):
            hits[0] += 1
            if hits[0] == nth:
                if phase == "torn":
                    src = os.fspath(args[0])
                    if os.path.isfile(src):
                        size = os.path.getsize(src)
                        with open(src, "r+b") as f:
                            f.truncate(size // 2)
                            os.fsync(f.fileno())
                    _die()
                if phase == "before":
                    _die()
                result = real(*args, **kwargs)
                _die()
                return result
        return real(*args, **kwargs)

    setattr(os, op, patched)


def _record_start(path: Path, batch_sleep: float = 0.0) -> None:
    """Wrap pretrain so that the child writes the step it starts from, as training begins.

    batch_sleep: seconds to pause after each micro-batch, so that a kill after a given delay
    lands within a bounded number of steps however fast the machine is.
    """
    import lightning as L

    import difftrain.train.run as run

    class Started(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            tmp = path.with_suffix(".part")
            tmp.write_text(json.dumps({"step": trainer.global_step, "time": time.time()}))
            _real["replace"](tmp, path)

        def on_train_batch_end(self, *args: Any) -> None:
            if batch_sleep:
                time.sleep(batch_sleep)

    real_pretrain = run.pretrain

    def pretrain(*args: Any, **kwargs: Any) -> Any:
        kwargs["extra_callbacks"] = [*(kwargs.get("extra_callbacks") or []), Started()]
        return real_pretrain(*args, **kwargs)

    run.pretrain = pretrain


def _child(entry: dict[str, Any], started: Path, log_file: Path) -> None:
    """Body of a forked child: set up the kill point, run the command, exit with its code."""
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        import torch

        torch.set_num_threads(1)
        _record_start(started, entry.get("batch_sleep", 0.0))
        if entry.get("op"):
            _install_event(entry)
        from difftrain.cli.app import main

        code = main(entry["args"])
    except BaseException:  # noqa: BLE001 - a child must never return into the parent's loop
        import traceback

        traceback.print_exc()
        code = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def killchain(plan_path: Path) -> None:
    plan = json.loads(plan_path.read_text())
    work = Path(plan["work"])
    snaps = work / "snapshots"
    snaps.mkdir(parents=True, exist_ok=True)
    # Warm imports (no torch ops): every child inherits them.
    import lightning  # noqa: F401

    import difftrain.cli.app  # noqa: F401
    import difftrain.cli.prepare  # noqa: F401
    import difftrain.cli.pretrain  # noqa: F401
    import difftrain.data.modules  # noqa: F401
    import difftrain.data.shards  # noqa: F401
    import difftrain.model  # noqa: F401
    import difftrain.train.callbacks  # noqa: F401
    import difftrain.train.lit  # noqa: F401
    import difftrain.train.metrics  # noqa: F401
    import difftrain.train.run  # noqa: F401

    log: list[dict[str, Any]] = []
    for i, entry in enumerate(plan["runs"]):
        label = f"{i:02d}-{entry['label']}"
        started = work / f"started-{i:02d}.json"
        child_log = work / f"child-{i:02d}.log"
        started.unlink(missing_ok=True)
        if entry.get("resume_if_checkpoint"):  # `--resume` once the run has a checkpoint file
            ckpts = Path(entry["resume_if_checkpoint"]) / "checkpoints"
            if ckpts.is_dir() and any(ckpts.glob("step-*.ckpt")):
                entry = {**entry, "args": [*entry["args"], "--resume"]}
        t0 = time.time()
        pid = os.fork()
        if pid == 0:
            _child(entry, started, child_log)
        status = None
        delay = entry.get("delay")
        if delay is not None:  # kill from outside, `delay` s after training starts
            deadline = time.time() + 120
            while not started.exists() and time.time() < deadline:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = st
                    break
                time.sleep(0.01)
            if status is None:
                time.sleep(delay)
                os.kill(pid, signal.SIGKILL)  # still our unreaped child: the pid cannot be reused
        if status is None:
            _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        resumed = json.loads(started.read_text())["step"] if started.exists() else None
        rec = {
            "label": label,
            "rc": rc,
            "args": entry["args"],
            "resumed_from": resumed,
            "seconds": round(time.time() - t0, 2),
            "log": str(child_log),
        }
        if entry.get("snapshot"):
            dest = snaps / label
            for what in entry["snapshot"]:
                src = Path(what)
                if src.exists():
                    shutil.copytree(src, dest / src.name, symlinks=True)
            rec["snapshot"] = str(dest)
        log.append(rec)
        (work / "log.json").write_text(json.dumps(log, indent=1))


def slowsave(seconds: float, args: list[str]) -> int:
    """Run `difftrain ARGS`; once a graceful stop begins, checkpoint writes write half the file,
    then stall for `seconds` (a large model on a slow disk)."""
    import torch

    from difftrain.train import checkpoint

    real_save = torch.save

    def slow_save(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
        import io

        buf = io.BytesIO()
        real_save(obj, buf, *a, **kw)
        data = buf.getvalue()
        with open(f, "wb") as out:  # f: the temporary file of AtomicCheckpointIO
            out.write(data[: len(data) // 2])
            out.flush()
            print(f"slowsave: writing {os.path.basename(os.fspath(f))}", file=sys.stderr, flush=True)
            time.sleep(seconds)
            out.write(data[len(data) // 2 :])

    from difftrain.train.callbacks import RunCallback

    real_stop = RunCallback._stop

    def stop(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        checkpoint.torch.save = slow_save  # only the save of a graceful stop stalls
        if self.state.saved_step == trainer.global_step:  # it always saves, even right after a periodic save
            self.save(trainer, pl_module)
        return real_stop(self, trainer, pl_module)

    RunCallback._stop = stop  # type: ignore[method-assign]
    from difftrain.cli.app import main

    return main(args)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "killchain":
        killchain(Path(sys.argv[2]))
    elif mode == "slowsave":
        sys.exit(slowsave(float(sys.argv[2]), sys.argv[3:]))
    else:
        sys.exit(f"unknown mode {mode}")
