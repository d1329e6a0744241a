"""Training on several devices and machines through Lightning's DDP and FSDP strategies.

How the processes come to be (the launch story):

- one machine, `difftrain pretrain RECIPE train.devices=4`: the process you started is rank 0;
  before it writes anything it starts ranks 1..3 by running the same command line again with
  LOCAL_RANK=1..3 in their environment (Lightning's subprocess launcher, the one `Trainer.fit`
  would use — started early, so that every rank runs the whole command from the top);
- several machines: a launcher starts every process — `torchrun` (RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT), SLURM `srun` (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, ...), or
  one `difftrain` per machine with NODE_RANK, MASTER_ADDR and MASTER_PORT set — and Lightning's
  cluster environments read those variables. A launcher that started another number of processes
  than train.devices × train.num_nodes is refused (`start`).

Then every rank joins the process group (Lightning's own setup: gloo on CPU, NCCL on CUDA; the
Trainer later finds it initialised and reuses it), and the work that must happen once is run on
rank 0 while the others wait (`DistContext.on_rank_zero`, `DistContext.rank_zero_first`): the
run-directory decision, tokenizer training and sharding, the files of the run directory. Waits
use a separate gloo group with a long timeout (`PREPARE_TIMEOUT`), so a slow tokenizer build does
not trip the collectives' timeout, and an error on any rank is raised on every rank instead of
leaving the others waiting.

Semantics (see also `difftrain.train.lit`, `difftrain.data.modules`):
  global batch B = micro-batch m × accumulation a × devices × nodes; rank r of w reads the global
  sample indices c + k·w + r, so one optimizer step sees the same B samples for any w (1 process
  with a = 2 or 2 processes with a = 1); DDP averages gradients, which equals the accumulated
  mean; losses, token counts and validation sums are reduced over ranks before they are logged.

FSDP: the Transformer (not the LightningModule) is the FSDP root, wrapped in `LitLM.configure_model`
— Lightning wraps the whole LightningModule otherwise, and a manual backward inside
`training_step` then runs inside the root's forward, which FSDP cannot handle (Lightning issue
#19685). Each `Block` is its own unit when `train.fsdp.auto_wrap`. Lightning and torch refuse
FSDP on CPU, so `strategy: fsdp` needs CUDA (`difftrain.devicecheck.check_strategy`).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from difftrain.errors import DeviceError, DifftrainError, TrainingError

T = TypeVar("T")

PREPARE_TIMEOUT = timedelta(hours=6)
"""How long ranks wait for rank 0's one-time work (data preparation can take a while)."""

# --------------------------------------------------------------------------------------------
# strategy


def _dtype(precision: str) -> torch.dtype:
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def fsdp_mixed_precision(precision: str, fsdp: Any) -> Any:
    """torch FSDP MixedPrecision from train.precision and train.fsdp (buffers always fp32: the
    RoPE tables lose positions in bf16)."""
    from torch.distributed.fsdp import MixedPrecision

    compute = _dtype(precision)
    return MixedPrecision(
        param_dtype=compute if fsdp.param_dtype == "compute" else torch.float32,
        reduce_dtype=torch.float32 if fsdp.reduce_dtype == "float32" else compute,
        buffer_dtype=torch.float32,
    )


def build_strategy(recipe: Any, world_size: int) -> Any:
    """The Lightning strategy for `recipe.train.strategy` (a fresh object: Lightning binds it to
    one Trainer). auto is a single device, or DDP for several."""
    t = recipe.train
    if t.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from difftrain.model.transformer import Block

        f = t.fsdp
        return FSDPStrategy(
            sharding_strategy=f.sharding_strategy.upper(),
            auto_wrap_policy={Block} if f.auto_wrap else None,
            # no activation_checkpointing_policy: train.activation_checkpointing is the model's own
            # (set_activation_checkpointing, under every strategy); both would recompute each
            # block twice
            mixed_precision=fsdp_mixed_precision(t.precision, f),
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


def clean_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes (FSDP, activation checkpointing)."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def gather_full_weights(module: Any) -> dict[str, torch.Tensor] | None:
    """The full state dict of an FSDP-sharded `module` on rank 0 ({} on the other ranks); None
    when `module` is not sharded. A collective: every rank must call it at the same point.

    Gathered tensors go to CPU memory on GPUs (offloading from CPU to CPU crashes torch's FSDP).
    """
    if not is_fsdp(module):
        return None
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    offload = module.compute_device.type != "cpu"
    cfg = FullStateDictConfig(offload_to_cpu=offload, rank0_only=True)
    with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, cfg):
        sd = module.state_dict()
    return {clean_name(k): v for k, v in sd.items()}


# --------------------------------------------------------------------------------------------
# processes


def global_rank() -> int:
    """This process's rank (0 before the process group exists or without one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def is_global_zero() -> bool:
    return global_rank() == 0


@dataclass
class DistContext:
    """Who this process is, and the waits that run before the Trainer exists."""

    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    children: list[Any] = field(default_factory=list)
    _group: Any = None

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    def _gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj, group=self._group)
        return out

    def _raise_first(self, errors: list[Any], mine: BaseException | None) -> None:
        for rank, err in enumerate(errors):
            if err is None:
                continue
            if mine is not None:
                raise mine
            if isinstance(err, DifftrainError):
                raise err
            raise TrainingError(f"rank {rank} failed: {err}")

    @staticmethod
    def _portable(e: BaseException) -> Any:
        """An error as it travels to the other ranks: a DifftrainError as is, anything else as text."""
        return e if isinstance(e, DifftrainError) else f"{type(e).__name__}: {e}"

    def on_rank_zero(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 only; every rank returns its result (or raises its error)."""
        if self.world_size == 1:
            return fn()
        payload: list[Any] = [None]
        mine: BaseException | None = None
        if self.rank == 0:
            try:
                payload = [("ok", fn())]
            except Exception as e:
                mine = e
                payload = [("error", self._portable(e))]
        torch.distributed.broadcast_object_list(payload, src=0, group=self._group)
        kind, value = payload[0]
        if kind == "error":
            self._raise_first([value], mine)
        return value

    def rank_zero_first(self, fn: Callable[[], T]) -> T:
        """Run `fn` on every rank: first on rank 0, then on the first process of each other node
        (a node-local cache), then on the rest — each stage after the previous one finished.

        With a cache that `fn` fills (tokenizer, shards), the work is done once per filesystem and
        every later call is a cache hit. An error on any rank is raised on all of them.
        """
        if self.world_size == 1:
            return fn()
        stages = (self.rank == 0, self.rank != 0 and self.local_rank == 0, self.local_rank != 0)
        result: Any = None
        for mine in stages:
            error: BaseException | None = None
            if mine:
                try:
                    result = fn()
                except Exception as e:
                    error = e
            errors = self._gather(None if error is None else self._portable(error))
            self._raise_first(errors, error)
        return result

    def join(self, timeout: float = 120.0) -> None:
        """Wait for the ranks this process started (rank 0 on a single machine) to exit."""
        import subprocess

        for p in self.children:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()


def _interactive() -> bool:
    """Started from a notebook, `python -c`, or pytest: re-running the command line would not
    re-run this training."""
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
    """A run over several machines is started on each of them by a launcher (torchrun, srun)
    that says where rank 0 listens; without one, joining would wait for the other nodes forever
    (and ignore Ctrl-C there): refused instead."""
    if (
        num_nodes <= 1
        or _launched_processes() > 1
        or ("MASTER_ADDR" in os.environ and "NODE_RANK" in os.environ)
    ):
        return
    raise DeviceError(
        f"train.num_nodes={num_nodes} runs on {num_nodes} machines, but no launcher started this one "
        f"(no torchrun or SLURM environment, no MASTER_ADDR/NODE_RANK); start it on every node with "
        f"torchrun --nnodes {num_nodes} --node-rank N --master-addr HOST ... (or srun), or set "
        "train.num_nodes: 1 to train on this machine"
    )


def _set_threads(processes_per_node: int) -> None:
    """One machine's cores shared among its processes unless OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    n = max(1, (os.cpu_count() or 1) // processes_per_node)
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def start(recipe: Any, *, accelerator: str, devices: int, num_nodes: int) -> DistContext:
    """Start (or join) the processes of a run on `devices` × `num_nodes` devices.

    Single process: returns at once. Otherwise: rank 0 of a single-machine run starts the other
    ranks (they re-run the same command); every rank joins the process group; returns this rank.
    Call it before writing anything: every rank runs the code that follows.
    """
    world = devices * num_nodes
    require_node_launcher(num_nodes)
    if world == 1:
        launched = _launched_processes()
        if launched > 1:
            raise DeviceError(
                f"the launcher started {launched} processes but the recipe plans one device "
                f"(train.devices={devices}, train.num_nodes={num_nodes}); set train.devices to the "
                "processes per node and train.num_nodes to the nodes (under SLURM: srun with "
                "--ntasks-per-node = train.devices)"
            )
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
    _set_threads(devices)
    strategy.setup_environment()  # joins the process group exactly as the Trainer would
    if torch.distributed.get_world_size() != world:
        raise DeviceError(
            f"the launcher started {torch.distributed.get_world_size()} processes but the recipe plans "
            f"train.devices={devices} × train.num_nodes={num_nodes} = {world}; make them agree "
            "(torchrun --nproc-per-node = train.devices, --nnodes = train.num_nodes)"
        )
    group = torch.distributed.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    # tear the process group down before the interpreter does: gloo's threads otherwise abort a
    # process whose peer closed its connection first, turning a finished run into exit code 134
    atexit.register(_destroy_process_group)
    return DistContext(
        rank=strategy.global_rank,
        local_rank=strategy.local_rank,
        node_rank=strategy.node_rank,
        world_size=strategy.world_size,
        children=children,
        _group=group,
    )
