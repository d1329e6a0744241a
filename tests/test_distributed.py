"""Several processes on CPU (gloo): DDP and FSDP through Lightning, as a user starts them.

How the processes are started: each multi-process run is `difftrain pretrain RECIPE
train.devices=2` in a subprocess, through a small driver script (`DRIVER`) that runs the CLI in
its process; the first process starts rank 1 by running the same command line again (as in a
shell), so the whole path — launch, rank-0-first preparation, the Trainer, the run directory — is
the user's. The driver also records every file written, renamed or removed under the run and cache
folders, per rank (Python audit hooks), so "only rank 0 writes" is checked, not assumed.

FSDP: Lightning and torch refuse FSDP on CPU (difftrain says so: test_fsdp_on_cpu_is_refused...);
the driver's FSDP_ON_CPU=1 lifts only those refusals (FSDP's device_id=cpu, no CPU→CPU offload of
gathered tensors) so that difftrain's own FSDP code — the wrapped Transformer, the norm over
shards, decay groups by original shapes, full weights gathered for model.safetensors, sharded
checkpoints — runs here under gloo. benchmarks/gpu_check.sh runs the same on CUDA without patches.

References are single-process runs of the same recipe in this process: with global batch 8,
micro-batch 2 and 2 processes (accumulation 2), a step sees the same 8 samples as one process with
accumulation 4 (rank r of w reads samples c + k·w + r), so the loss curves agree to fp32 rounding.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_pretrain import make_corpus

from difftrain.data.modules import PretrainDataModule
from difftrain.devicecheck import check_strategy
from difftrain.errors import CheckpointError, DeviceError, RecipeError
from difftrain.recipe import load_recipe
from difftrain.rundir import load_run
from difftrain.spec import resolve
from difftrain.train.checkpoint import load_checkpoint_file
from difftrain.train.distributed import start
from difftrain.train.metrics import read_metrics
from difftrain.train.run import pretrain

RECIPE = """\
name: {name}
seed: 7
out_dir: runs
model:
  arch: diff
  d_model: 32
  n_layers: 2
  n_heads: 4
  max_seq_len: 32
data:
  sources: [{corpus}]
  val_fraction: 0.1
  val_windows: 4
  cache_dir: {cache}
tokenizer:
  train: {{vocab_size: 320}}
train:
  max_steps: 4
  micro_batch_size: 2
  global_batch_size: 8
  log_every: 1
  val_every: 2
  save_every: 2
optim:
  name: {optim}
  lr: 3.0e-3
  warmup_steps: 2
  schedule: constant
logging:
  progress: false
  tensorboard: false
"""

DRIVER = r"""
import os, sys

WATCH = [os.path.realpath(p) for p in os.environ["DT_WATCH"].split(os.pathsep)]
_fd, _busy = [None], [False]


def _record(event, path):
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    p = os.path.realpath(os.fsdecode(path))
    if not any(p == w or p.startswith(w + os.sep) for w in WATCH):
        return
    if _fd[0] is None:
        name = os.path.join(os.environ["DT_AUDIT"], "rank%s.log" % os.environ.get("LOCAL_RANK", "0"))
        _fd[0] = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(_fd[0], ("%s\t%s\n" % (event, p)).encode())


def _hook(event, args):
    if _busy[0]:
        return
    _busy[0] = True
    try:
        if event == "open":
            path, mode, flags = args
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            ):
                _record("write", path)
        elif event in ("os.rename", "os.link", "os.symlink"):
            _record(event, args[1])
        elif event in ("os.remove", "os.mkdir", "os.rmdir", "shutil.rmtree"):
            _record(event, args[0])
    finally:
        _busy[0] = False


sys.addaudithook(_hook)

if os.environ.get("FSDP_ON_CPU") == "1":
    import contextlib

    import lightning.pytorch.strategies as strategies
    import lightning.pytorch.strategies.fsdp as lfsdp
    import torch
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig
    from torch.distributed.fsdp.wrap import enable_wrap

    import difftrain.spec as spec

    class CPUFSDPStrategy(lfsdp.FSDPStrategy):
        @contextlib.contextmanager
        def model_sharded_context(self):
            with enable_wrap(
                wrapper_cls=FullyShardedDataParallel,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            ):
                yield

    def full_state_dict_context(module, world_size, rank0_only=True):
        return FullyShardedDataParallel.state_dict_type(
            module,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        )

    strategies.FSDPStrategy = CPUFSDPStrategy
    lfsdp._get_full_state_dict_context = full_state_dict_context
    check = spec.check_strategy
    spec.check_strategy = lambda recipe, accelerator, world: check(recipe, "cuda", world)

if os.environ.get("DT_SIGNAL_AT"):  # "RANK:STEP": that process alone gets SIGTERM at that step
    import signal

    import difftrain.train.callbacks as callbacks

    _rank, _step = os.environ["DT_SIGNAL_AT"].split(":")
    if os.environ.get("LOCAL_RANK", "0") == _rank:
        _end = callbacks.RunCallback.on_train_batch_end

        def _signalled(self, trainer, *args, **kwargs):
            if trainer.global_step == int(_step) and not getattr(self, "_sent", False):
                self._sent = True
                os.kill(os.getpid(), signal.SIGTERM)
            return _end(self, trainer, *args, **kwargs)

        callbacks.RunCallback.on_train_batch_end = _signalled

if os.environ.get("DT_DIE_AT"):  # "RANK:STEP": that process dies there (as the OOM killer kills)
    import difftrain.train.callbacks as callbacks

    _die_rank, _die_step = os.environ["DT_DIE_AT"].split(":")
    if os.environ.get("LOCAL_RANK", "0") == _die_rank:
        _end_die = callbacks.RunCallback.on_train_batch_end

        def _dies(self, trainer, *args, **kwargs):
            if trainer.global_step == int(_die_step):
                os._exit(137)
            return _end_die(self, trainer, *args, **kwargs)

        callbacks.RunCallback.on_train_batch_end = _dies

from difftrain.cli.app import main

sys.exit(main(sys.argv[1:]))
"""

# variables a surrounding launcher (torchrun, SLURM, Lightning) may have set: not ours to inherit
LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


class Workspace:
    """A folder with a corpus, a shared data cache and recipes with relative out_dir: runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.corpus = make_corpus(root)
        self.cache = root / "cache"
        (root / "drive.py").write_text(DRIVER)

    def recipe(self, folder: Path, name: str, optim: str = "adamw", cache: Path | None = None) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        p = folder / f"{name}.yaml"
        p.write_text(RECIPE.format(name=name, corpus=self.corpus, cache=cache or self.cache, optim=optim))
        return p

    def launch(
        self,
        folder: Path,
        args: list[str],
        *,
        fsdp: bool = False,
        watch: list[Path] = (),
        env_extra: dict[str, str] | None = None,
        code: int = 0,
    ) -> dict:
        """`difftrain ARGS train.devices=2` in `folder`; returns {rank: [(event, path)]} of writes
        under `folder`/runs and `watch` (and "stderr": its standard error). `code`: the exit code
        expected."""
        audit = folder / f"audit-{len(list(folder.glob('audit-*')))}"
        audit.mkdir()
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))
        }
        env.update(
            OMP_NUM_THREADS="1",
            DT_WATCH=os.pathsep.join(str(p) for p in [folder / "runs", *watch]),
            DT_AUDIT=str(audit),
            FSDP_ON_CPU="1" if fsdp else "0",
            **(env_extra or {}),
        )
        proc = subprocess.run(
            [sys.executable, str(self.root / "drive.py"), *args, "train.devices=2"],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
        writes: dict = {"stderr": proc.stderr, "stdout": proc.stdout}
        for log in audit.glob("rank*.log"):
            rank = int(log.stem.removeprefix("rank"))
            writes[rank] = [tuple(line.split("\t")) for line in log.read_text().splitlines()]
        return writes


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.csv") if "train/loss" in r]


def curve(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in train_rows(run_dir)}


def val_at(run_dir: Path, step: int) -> float:
    return [
        r["val/loss"] for r in read_metrics(run_dir / "metrics.csv") if r["step"] == step and "val/loss" in r
    ][0]


def assert_same_curve(got: dict[int, float], want: dict[int, float], steps, rtol: float = 1e-5) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=rtol), (s, got[s], want[s])


def single(folder: Path, recipe: Path, *overrides: str, resume: bool = False):
    """A single-process run in this process, from `folder` (relative out_dir)."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        result = pretrain(load_recipe(recipe, list(overrides)), resume=resume)
    finally:
        os.chdir(cwd)
    result.run_dir = folder / result.run_dir
    return result


# ----------------------------------------------------------------------------------------------
# the runs the tests share (module scope: each multi-process run costs ~10 s on 2 cores)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def ref(ws) -> Path:
    """One process, accumulation 4, six steps: the reference curve."""
    folder = ws.root / "ref"
    single(folder, ws.recipe(folder, "r"), "train.max_steps=6")
    return folder / "runs" / "r"


@pytest.fixture(scope="module")
def ddp(ws) -> tuple[Path, dict]:
    """Two processes, accumulation 2, four steps, with its own (cold) data cache."""
    folder = ws.root / "ddp"
    cache = ws.root / "cache-ddp"
    writes = ws.launch(folder, ["pretrain", str(ws.recipe(folder, "r", cache=cache))], watch=[cache])
    return folder / "runs" / "r", writes


@pytest.fixture(scope="module")
def fsdp_full(ws) -> Path:
    folder = ws.root / "fsdp"
    ws.launch(folder, ["pretrain", str(ws.recipe(folder, "r")), "train.strategy=fsdp"], fsdp=True)
    return folder / "runs" / "r"


# ----------------------------------------------------------------------------------------------
# DDP


def test_ranks_together_read_the_samples_of_one_process_with_accumulation(ws, ref):
    dm_args = dict(seq_len=32, micro_batch_size=2, seed=7, val_windows=0)
    shards = sorted((ws.cache / "shards").iterdir())[0]
    one = PretrainDataModule(shards, rank=0, world_size=1, **dm_args).train_dataset()
    ranks = [PretrainDataModule(shards, rank=r, world_size=2, **dm_args).train_dataset() for r in (0, 1)]
    for step in range(3):  # accumulation 4 on one process, 2 on each of two
        a = np.concatenate([one.batch_indices(4 * step + j) for j in range(4)])
        b = np.concatenate([ds.batch_indices(2 * step + j) for ds in ranks for j in range(2)])
        assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(8 * step, 8 * step + 8))


def test_two_ddp_processes_follow_the_loss_curve_of_one_process_with_accumulation(ddp, ref):
    run_dir, _ = ddp
    assert_same_curve(curve(run_dir), curve(ref), range(1, 5))
    assert_same_curve(curve(run_dir, "train/grad_norm"), curve(ref, "train/grad_norm"), range(1, 5))
    # the validation loss is reduced over both ranks' windows (2 each), not rank 0's alone
    assert val_at(run_dir, 4) == pytest.approx(val_at(ref, 4), rel=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 8 * 32  # tokens of both ranks
    assert summary["final_val_loss"] == pytest.approx(val_at(ref, 4), rel=1e-5)


def test_only_rank_zero_writes_the_run_directory_and_prepares_the_data_once(ddp):
    run_dir, writes = ddp
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert files == [
        ".lock",  # rank 0's lock on the folder while it trained
        "checkpoints",
        "checkpoints/index.json",
        "checkpoints/last.ckpt",
        "checkpoints/step-00000002.ckpt",
        "checkpoints/step-00000004.ckpt",
        "config.json",
        "metrics.csv",
        "model.safetensors",
        "recipe.yaml",
        "summary.json",
        "tokenizer.json",
    ]
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3, 4]  # one row per step, not per rank
    assert 1 not in writes, writes.get(1, [])[:5]  # rank 1 wrote, renamed, removed nothing
    cache = str(run_dir.parent.parent.parent / "cache-ddp")
    built = [p for e, p in writes[0] if e == "os.rename" and os.path.dirname(os.path.dirname(p)) == cache]
    assert len(built) == 2, built  # one tokenizer and one shard folder, renamed into the cache once
    assert load_run(run_dir).model.config.d_model == 32


def test_a_signal_to_one_process_stops_both_at_the_same_step(ws, ref):
    # `kill PID` (or a container's SIGTERM to its PID 1) reaches rank 0 or rank 1 alone: the one
    # that stopped left the other waiting in its next collective for ever (a hang, not a stop)
    for rank in ("1", "0"):
        folder = ws.root / f"signal-rank{rank}"
        recipe = ws.recipe(folder, "r")
        got = ws.launch(
            folder,
            ["pretrain", str(recipe), "train.max_steps=6", "train.save_every=6"],
            env_extra={"DT_SIGNAL_AT": f"{rank}:3"},
            code=143,  # SIGTERM's graceful stop, whichever process got it
        )
        run_dir = folder / "runs" / "r"
        index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
        assert [c["step"] for c in index["checkpoints"]] == [3], index
        assert got["stderr"].count("stopped at step 3; checkpoint saved.") == 1, got["stderr"][-2000:]
        said = got["stdout"] + got["stderr"]  # rank 0 says why the run stops, whichever got the signal
        told = "received SIGTERM: finishing this step" if rank == "0" else "SIGTERM reached another process"
        assert said.count(told) == 1, said[-2000:]
        assert json.loads((run_dir / "summary.json").read_text())["finished"] is False
    result = single(folder, recipe, "train.max_steps=6", resume=True)  # and it continues the curve
    assert result.resumed_from == 3
    assert_same_curve(curve(result.run_dir), curve(ref), range(1, 7))


def test_a_process_that_dies_leaves_the_other_one_line_and_its_checkpoints(ws):
    # the OOM killer (or kill -9) ends rank 1: rank 0's next collective fails on the lost
    # connection; that was a 115-line traceback with exit 1 and no word on resuming
    folder = ws.root / "dies"
    recipe = ws.recipe(folder, "r")
    got = ws.launch(
        folder,
        ["pretrain", str(recipe), "train.max_steps=8", "train.save_every=2"],
        env_extra={"DT_DIE_AT": "1:3"},
        code=2,
    )
    errors = [line for line in got["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another process of this run ended while this one waited for it" in errors[0]
    assert "Traceback" not in got["stderr"]
    assert "resume with `difftrain pretrain runs/r/recipe.yaml --resume`" in errors[0]
    from difftrain.cli.common import _PEER_LOST

    assert any(cause in errors[0] for cause in _PEER_LOST) and "/gloo/" not in errors[0], errors[0]
    index = json.loads((folder / "runs" / "r" / "checkpoints" / "index.json").read_text())
    assert [c["step"] for c in index["checkpoints"]] == [2]


def test_a_two_process_run_resumes_on_one_process_and_continues_the_curve(ws, ddp, ref):
    src, _ = ddp
    folder = ws.root / "ddp-then-1"
    shutil.copytree(src.parent.parent, folder, ignore=shutil.ignore_patterns("audit-*"))
    result = single(folder, folder / "r.yaml", "train.max_steps=6", resume=True)
    assert result.resumed_from == 4
    assert_same_curve(curve(result.run_dir), curve(ref), range(1, 7))


def test_a_one_process_run_resumes_on_two_processes_with_8bit_adamw(ws):
    """bitsandbytes' AdamW8bit under DDP: each rank steps its own 8-bit state on the averaged
    gradients. The curve follows one process within 8-bit rounding (the gradients' last bits differ
    between a sum over ranks and one over micro-batches)."""
    folder = ws.root / "8bit"
    recipe = ws.recipe(folder, "q", optim="adamw8bit")
    single(folder, recipe, "train.max_steps=3", "train.save_every=3")
    ws.launch(folder, ["pretrain", str(recipe), "train.max_steps=5", "--resume"])
    whole = ws.root / "8bit-ref"
    ref8 = single(whole, ws.recipe(whole, "q", optim="adamw8bit"), "train.max_steps=5").run_dir
    run_dir = folder / "runs" / "q"
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3, 4, 5]
    assert_same_curve(curve(run_dir), curve(ref8), range(1, 6), rtol=1e-3)
    ckpt = load_checkpoint_file(run_dir / "checkpoints" / "last.ckpt")
    # the optimizer really kept 8-bit state (bitsandbytes nests it under a key of its own)
    states = [
        s.get("__bnb_optimizer_quant_state__", s) for s in ckpt["optimizer_states"][0]["state"].values()
    ]
    assert any(v.dtype == torch.uint8 for s in states for v in s.values() if torch.is_tensor(v))


# ----------------------------------------------------------------------------------------------
# FSDP


def test_fsdp_on_two_cpu_processes_follows_the_curve_and_writes_full_weights(fsdp_full, ddp, ref):
    assert_same_curve(curve(fsdp_full), curve(ref), range(1, 5))
    # model.safetensors holds the full (gathered) weights: the DDP run's, and `generate` loads it
    full = load_file(str(fsdp_full / "model.safetensors"))
    replica = load_file(str(ddp[0] / "model.safetensors"))
    assert full.keys() == replica.keys()
    for k in full:
        torch.testing.assert_close(full[k], replica[k], rtol=1e-4, atol=1e-5)
    run = load_run(fsdp_full)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(run.model(ids).logits).all()
    assert (fsdp_full / "checkpoints" / "step-00000004.ckpt").is_file()  # full: one file


def test_a_full_fsdp_checkpoint_resumes_on_one_process_without_fsdp(ws, fsdp_full, ref):
    folder = ws.root / "fsdp-then-1"
    shutil.copytree(fsdp_full.parent.parent, folder, ignore=shutil.ignore_patterns("audit-*"))
    result = single(folder, folder / "r.yaml", "train.max_steps=6", resume=True)
    assert result.resumed_from == 4
    assert_same_curve(curve(result.run_dir), curve(ref), range(1, 7))


def test_sharded_fsdp_checkpoints_are_folders_that_only_fsdp_resumes(ws, ref):
    folder = ws.root / "sharded"
    recipe = ws.recipe(folder, "s")
    args = ["pretrain", str(recipe), "train.strategy=fsdp", "train.fsdp.checkpoint=sharded"]
    writes = ws.launch(folder, args, fsdp=True)
    run_dir = folder / "runs" / "s"
    ckpts = run_dir / "checkpoints"
    step = ckpts / "step-00000004.ckpt"
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert (ckpts / "last.ckpt").resolve() == step.resolve()
    index = json.loads((ckpts / "index.json").read_text())
    assert [e["file"] for e in index["checkpoints"]] == ["step-00000002.ckpt", "step-00000004.ckpt"]
    assert not list(ckpts.glob(".*"))  # the temporary folders were renamed into place
    # rank 1 wrote its shards (under the temporary names), and nothing else
    assert {os.path.basename(p) for e, p in writes[1] if e == "write"} == {"__1_0.distcp"}
    assert all(".partial" in p for _, p in writes[1])
    assert_same_curve(curve(run_dir), curve(ref), range(1, 5))
    assert (
        load_file(str(run_dir / "model.safetensors")).keys()
        == load_file(str(ref / "model.safetensors")).keys()
    )
    with pytest.raises(CheckpointError, match="sharded FSDP checkpoint.*train.strategy=fsdp"):
        single(folder, recipe, "train.max_steps=6", resume=True)


# ----------------------------------------------------------------------------------------------
# refusals and the process helpers


def test_fsdp_on_cpu_and_unsupported_combinations_are_refused_with_the_fix(ws, tmp_path):
    recipe = ws.recipe(tmp_path, "x")
    with pytest.raises(DeviceError, match="fsdp needs CUDA.*train.strategy=ddp"):
        resolve(load_recipe(recipe, ["train.strategy=fsdp"]))
    for overrides, pattern in (
        (["optim.name=adamw8bit"], "optim.name=adamw8bit with train.strategy=fsdp"),
        (["optim.name=lion8bit"], "optim.name=lion8bit with train.strategy=fsdp"),
        (["train.precision=16-mixed"], "16-mixed with train.strategy=fsdp"),
    ):
        r = load_recipe(recipe, ["train.strategy=fsdp", *overrides])
        with pytest.raises(DeviceError, match=pattern):
            check_strategy(r, "cuda", 2)
    with pytest.raises(RecipeError, match="data.val_windows=1 is fewer than the 2 processes"):
        resolve(load_recipe(recipe, ["train.devices=2", "data.val_windows=1"]))
    with pytest.raises(RecipeError, match="deepspeed_stage_2"):
        load_recipe(recipe, ["train.strategy=deepspeed_stage_2"])
    # a launcher (torchrun, srun) that started another number of processes than the recipe plans
    os.environ["WORLD_SIZE"] = "2"
    try:
        with pytest.raises(DeviceError, match="launcher started 2 processes but the recipe plans one device"):
            start(load_recipe(recipe), accelerator="cpu", devices=1, num_nodes=1)
    finally:
        del os.environ["WORLD_SIZE"]
    # several processes re-run the command line: impossible from inside pytest, and said so
    with pytest.raises(DeviceError, match="from a notebook, `python -c` or pytest"):
        single(tmp_path, recipe, "train.devices=2")
    assert not (tmp_path / "runs").exists()


CONTEXT_WORKER = r"""
import os, sys, time
from pathlib import Path

import torch

from difftrain.errors import DataError
from difftrain.train.distributed import DistContext

rank, port, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
ctx = DistContext(rank=rank, local_rank=rank, world_size=2, _group=torch.distributed.group.WORLD)
log = out / f"{rank}.txt"


def note(line):
    with open(log, "a") as f:
        f.write(line + "\n")


def work():
    note(f"start {time.monotonic()}")
    time.sleep(0.3)
    note(f"end {time.monotonic()}")
    return rank


assert ctx.rank_zero_first(work) == rank
note(ctx.on_rank_zero(lambda: f"decided by {rank}"))


def fails():
    raise DataError("data/x.txt: no documents; add some")


try:
    ctx.on_rank_zero(fails)
except DataError as e:
    note(f"raised {type(e).__name__}: {e}")
torch.distributed.barrier()
# leave without interpreter teardown: torch's gloo threads can abort a process that exits while its
# peer closes the connection ("terminate called without an active exception"); not what is tested
os._exit(0)
"""


def test_rank_zero_goes_first_and_its_errors_reach_every_rank(tmp_path):
    """The waits that run before the Trainer exists: rank 1 starts a rank-0-first task only after
    rank 0 finished it, takes rank 0's decision, and raises rank 0's error as its own."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(CONTEXT_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(port), str(tmp_path)], env=env)
        for r in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    logs = {r: (tmp_path / f"{r}.txt").read_text().splitlines() for r in (0, 1)}
    end0 = float(logs[0][1].split()[1])
    start1 = float(logs[1][0].split()[1])
    assert start1 >= end0  # the same monotonic clock: one machine
    for r in (0, 1):
        assert logs[r][2:] == ["decided by 0", "raised DataError: data/x.txt: no documents; add some"]


def test_several_nodes_without_a_launcher_are_refused_not_waited_for(monkeypatch, capsys, tmp_path):
    # train.num_nodes=2 on one machine waited in the rendezvous forever, deaf to Ctrl-C
    from difftrain.cli.app import main
    from difftrain.errors import DeviceError
    from difftrain.train.distributed import require_node_launcher

    for var in ("WORLD_SIZE", "SLURM_NTASKS", "MASTER_ADDR", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        DeviceError, match=r"train.num_nodes=2 runs on 2 machines, but no launcher started this one"
    ):
        require_node_launcher(2)
    require_node_launcher(1)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("NODE_RANK", "1")
    require_node_launcher(2)  # the environment says where rank 0 listens
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun
    require_node_launcher(2)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "quickstart", "train.num_nodes=2", "--dry-run"]) == 2
    assert "no launcher started this one" in capsys.readouterr().err
