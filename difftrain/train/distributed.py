"""Training on several devices and machines through Lightning's DDP and FSDP strategies.

One machine (`train.devices=4`): the process you started is rank 0 and, before it writes
anything, starts ranks 1..3 by running the same command line with LOCAL_RANK=1..3. Several
machines: a launcher (torchrun, SLURM `srun`, or NODE_RANK with MASTER_ADDR/MASTER_PORT) starts
every process. The work that must happen once runs on rank 0 while the others wait (`DistContext`,
over a gloo group); an error on any rank is raised on every rank.

Global batch B = micro-batch × accumulation × devices × nodes; rank r of w reads the global
sample indices c + k·w + r, so a step sees the same B samples for any w. Under FSDP (CUDA only)
the Transformer is the root (`LitLM.configure_model`), each `Block` a unit with `train.fsdp.auto_wrap`.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from difftrain.errors import DeviceError, DifftrainError, TrainingError

T = TypeVar("T")

PREPARE_TIMEOUT = timedelta(hours=6)  # how long ranks wait for rank 0's data preparation


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a Lightning `precision` computes in."""
    return {"bf": torch.bfloat16, "16": torch.float16}.get(precision[:2], torch.float32)


def build_strategy(recipe: Any, world_size: int) -> Any:
    """The Lightning strategy for `recipe.train.strategy` (a fresh object: Lightning binds it to
    one Trainer). auto is a single device, or DDP for several."""
    t = recipe.train
    if t.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp import MixedPrecision

        from difftrain.model.transformer import Block

        f, compute = t.fsdp, compute_dtype(t.precision)
        return FSDPStrategy(
            sharding_strategy=f.sharding_strategy.upper(),
            auto_wrap_policy={Block} if f.auto_wrap else None,
            # no activation_checkpointing_policy: the model's own would recompute each block twice
            mixed_precision=MixedPrecision(  # buffers in fp32: the RoPE tables lose positions in bf16
                param_dtype=compute if f.param_dtype == "compute" else torch.float32,
                reduce_dtype=torch.float32 if f.reduce_dtype == "float32" else compute,
                buffer_dtype=torch.float32,
            ),
            cpu_offload=f.cpu_offload,
            state_dict_type=f.checkpoint,
            use_orig_params=True,
        )
    if t.strategy == "ddp" or world_size > 1:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    return "auto"


def is_fsdp(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FullyShardedDataParallel)


def full_params(module: Any) -> AbstractContextManager:
    """Where an FSDP unit `module` holds its full parameters (a collective); else a no-op."""
    if not is_fsdp(module):
        return nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.summon_full_params(module, writeback=False)


def clean_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes (FSDP, activation checkpointing)."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def gather_full_weights(module: Any) -> dict[str, torch.Tensor] | None:
    """The full state dict of an FSDP-sharded `module` on rank 0 ({} on the other ranks), in CPU
    memory; None when `module` is not sharded. A collective."""
    if not is_fsdp(module):
        return None
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # (offloading from CPU to CPU crashes torch's FSDP)
    cfg = FullStateDictConfig(offload_to_cpu=module.compute_device.type != "cpu", rank0_only=True)
    with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, cfg):
        sd = module.state_dict()
    return {clean_name(k): v for k, v in sd.items()}


def is_global_zero() -> bool:
    """Whether this process is rank 0 (so is one before the process group exists, or without one)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@dataclass
class DistContext:
    """Who this process is, and the waits that run before the Trainer exists."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    children: list[Any] = field(default_factory=list)
    _group: Any = None

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    def _raise_first(self, errors: list[Any], mine: BaseException | None) -> None:
        """Where any rank failed: this rank's own error, else the first one another rank sent."""
        for rank, err in enumerate(errors):
            if err is not None:
                raise mine or (
                    err if isinstance(err, DifftrainError) else TrainingError(f"rank {rank} failed: {err}")
                )

    @staticmethod
    def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
        try:
            return fn(), None
        except Exception as e:
            return None, e

    @staticmethod
    def _portable(e: BaseException | None) -> Any:
        """An error as it travels to the other ranks: a DifftrainError as is, anything else as text."""
        return e if e is None or isinstance(e, DifftrainError) else f"{type(e).__name__}: {e}"

    def on_rank_zero(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 only; every rank returns its result (or raises its error)."""
        if self.world_size == 1:
            return fn()
        result, mine = self._attempt(fn) if self.rank == 0 else (None, None)
        payload = [(result, self._portable(mine))]
        torch.distributed.broadcast_object_list(payload, src=0, group=self._group)
        result, error = payload[0]
        self._raise_first([error], mine)
        return result  # type: ignore[return-value]

    def rank_zero_first(self, fn: Callable[[], T]) -> T:
        """Run `fn` on every rank: first on rank 0, then on the first process of each other node,
        then on the rest, each stage after the previous one finished (so a cache that `fn` fills
        is filled once per filesystem). An error on any rank is raised on all of them."""
        if self.world_size == 1:
            return fn()
        stages = (self.rank == 0, self.rank != 0 and self.local_rank == 0, self.local_rank != 0)
        result: Any = None
        for mine in stages:
            error = None
            if mine:
                result, error = self._attempt(fn)
            errors: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(errors, self._portable(error), group=self._group)
            self._raise_first(errors, error)
        return result

    def join(self, timeout: float = 120.0) -> None:
        """Wait for the ranks this process started (rank 0 on a single machine) to exit."""
        for p in self.children:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()


def _interactive() -> bool:
    """Started from a notebook, `python -c`, or pytest (re-running the command line would not
    re-run this training)."""
    import __main__

    argv0 = sys.argv[0] if sys.argv else ""
    return (
        not hasattr(__main__, "__file__")
        or argv0 in ("", "-c")
        or Path(argv0).name in ("pytest", "py.test")
        or argv0.endswith(("pytest/__main__.py", "ipykernel_launcher.py"))
    )


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _launched_processes() -> int:
    """Processes a launcher (torchrun, srun, a Lightning parent) says this job has; 1 if none.
    SLURM as Lightning detects it: SLURM_NTASKS set, job name not bash/interactive."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return int(os.environ["SLURM_NTASKS"])
    return 1


def require_node_launcher(num_nodes: int) -> None:
    """DeviceError for a run over several machines that no launcher (torchrun, srun) started:
    joining would wait for the other nodes forever."""
    if num_nodes <= 1 or _launched_processes() > 1 or {"MASTER_ADDR", "NODE_RANK"} <= os.environ.keys():
        return
    raise DeviceError(
        f"train.num_nodes={num_nodes} runs on {num_nodes} machines, but no launcher started this one "
        f"(no torchrun or SLURM environment, no MASTER_ADDR/NODE_RANK); start it on every node with "
        f"torchrun --nnodes {num_nodes} --node-rank N --master-addr HOST ... (or srun), or set "
        "train.num_nodes: 1 to train on this machine"
    )


def _launch_mismatch(launched: int, devices: int, num_nodes: int) -> DeviceError:
    plans = "one device" if devices * num_nodes == 1 else f"{devices * num_nodes} devices"
    return DeviceError(
        f"the launcher started {launched} processes but the recipe plans {plans} (train.devices={devices} "
        f"× train.num_nodes={num_nodes}); set train.devices to the processes per node and train.num_nodes "
        "to the nodes (torchrun --nproc-per-node, --nnodes; srun --ntasks-per-node)"
    )


def start(recipe: Any, *, accelerator: str, devices: int, num_nodes: int) -> DistContext:
    """Start (or join) the processes of a run on `devices` × `num_nodes` devices and join the
    process group; returns this rank. Call it before writing anything: every rank runs the code
    that follows."""
    world = devices * num_nodes
    require_node_launcher(num_nodes)
    if world == 1:
        if _launched_processes() > 1:
            raise _launch_mismatch(_launched_processes(), devices, num_nodes)
        return DistContext()
    import lightning as L

    probe = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=build_strategy(recipe, world),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    strategy = probe.strategy
    env = strategy.cluster_environment
    try:  # torchrun / SLURM started a number of processes: it must be the recipe's
        env.validate_settings(num_devices=devices, num_nodes=num_nodes)
    except ValueError as e:
        raise DeviceError(
            f"train.devices={devices} × train.num_nodes={num_nodes} does not match the launcher "
            f"({type(env).__name__}): {e}"
        ) from e
    children: list[Any] = []
    launcher = strategy.launcher
    if launcher is not None and not env.creates_processes_externally:
        if _interactive():
            raise DeviceError(
                f"train.devices={devices} starts one process per device by running this command again, "
                "which is not possible from a notebook, `python -c` or pytest; run "
                "`difftrain pretrain RECIPE` from a shell (or launch with torchrun)"
            )
        launcher.launch(lambda: None)  # LOCAL_RANK=1.. children run the same command line
        children = list(getattr(launcher, "procs", []))
    if "OMP_NUM_THREADS" not in os.environ:  # the machine's cores shared among its processes
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // devices))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    strategy.setup_environment()  # joins the process group exactly as the Trainer would
    if torch.distributed.get_world_size() != world:
        raise _launch_mismatch(torch.distributed.get_world_size(), devices, num_nodes)
    group = torch.distributed.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    # tear the process group down before the interpreter does: gloo's threads would otherwise
    # abort a finished run whose peer closed first (exit code 134)
    atexit.register(_destroy_process_group)
    return DistContext(strategy.global_rank, strategy.local_rank, strategy.world_size, children, group)
