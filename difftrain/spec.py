"""From a recipe to a run: `resolve(recipe, machine) -> RunSpec`.

A `RunSpec` is everything a run will do on one machine: the recipe with its `auto` values fixed
(and the reason for each), the processes, the batch arithmetic, the number of steps and the run
folder. `difftrain plan`, `--dry-run`, the start table and the run itself all read one spec, and
`resolve` makes every check that the recipe and the machine alone decide (the run folder's come
after it, in `train.preflight`). With a `Machine` given `resolve` is torch-free: that is how a
recipe is checked before torch loads (`Machine()`: no GPU) and how `plan --gpu-mem` plans for a
GPU that is not here.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field, replace
from pathlib import Path

from difftrain.devicecheck import NO_CUDA, check_flex, check_loggers, check_off_cuda, check_strategy
from difftrain.errors import DeviceError, RecipeError
from difftrain.model.config import ModelConfig
from difftrain.recipe import Recipe, global_batch, resolve_auto, train_seq_len

Batch = tuple[int, int, int, int]
"""(global batch, micro-batch, devices×nodes, accumulation): what a resume compares."""


@dataclass(frozen=True)
class Machine:
    """The devices a run can use. `here`: this machine, whose toolchain (a compiler for
    train.compile, the loggers' packages) `resolve` checks too; a machine described for
    planning has none to check."""

    cuda_devices: int = 0
    bf16: bool = False
    capability: tuple[int, int] | None = None  # of the first CUDA GPU
    mps: bool = False
    name: str = field(default_factory=lambda: platform.processor() or platform.machine())
    threads: int = 1
    here: bool = False

    @classmethod
    def detect(cls) -> Machine:
        """This machine, as torch sees it."""
        import torch

        cuda = torch.cuda.is_available()
        return cls(
            cuda_devices=torch.cuda.device_count() if cuda else 0,
            bf16=cuda and torch.cuda.is_bf16_supported(),
            capability=torch.cuda.get_device_capability(0) if cuda else None,
            mps=hasattr(torch.backends, "mps") and torch.backends.mps.is_available(),
            name=torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
            threads=torch.get_num_threads(),
            here=True,
        )

    @classmethod
    def gpu(cls, name: str) -> Machine:
        """One CUDA GPU with bf16, Ampere or newer: what `plan --gpu-mem` plans for."""
        return cls(cuda_devices=1, bf16=True, capability=(8, 0), name=name)

    def cpu_only(self) -> Machine:
        """This machine with its GPUs left out (`plan --device cpu`)."""
        name = platform.processor() or platform.machine()
        return replace(self, cuda_devices=0, bf16=False, capability=None, name=name)


def device_name(accelerator: str, machine: Machine, world: int = 1) -> str:
    """What trains: the GPU's name, or the CPU with its threads (per process); × the processes of
    a run on several (all of them, on every node)."""
    times = f" × {world}" if world > 1 else ""
    if accelerator == "cuda":
        return machine.name + times
    if accelerator != "cpu":
        return accelerator + times
    n, each = machine.threads, " each" if world > 1 else ""
    return f"cpu{times} ({machine.name}, {n} thread{'s' if n != 1 else ''}{each})"


@dataclass(frozen=True)
class RunSpec:
    """A recipe resolved for a machine (see the module docstring). `recipe.train.global_batch_size`
    is filled in: the global batch is the run's, so a resume may change the micro-batch or the
    devices and keep it."""

    recipe: Recipe
    machine: Machine
    accelerator: str
    devices: int  # per node
    world_size: int  # devices × nodes
    seq_len: int
    accumulate: int
    global_batch_size: int
    max_steps: int
    run_dir: Path
    reasons: dict[str, str]  # setting → why `auto` chose its value

    @property
    def model(self) -> ModelConfig:
        assert self.recipe.model is not None  # `resolve` refuses a recipe without one
        return self.recipe.model

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def batch(self) -> Batch:
        return (self.global_batch_size, self.recipe.train.micro_batch_size, self.world_size, self.accumulate)

    @property
    def core(self) -> str:
        """The attention core training runs (`model.kernels.pick_core`)."""
        from difftrain.model.kernels import pick_core  # (torch: only once a core is asked for)

        return pick_core(self.model.attn_impl, self.accelerator, self.machine.capability)

    @property
    def attention(self) -> str:
        """The core, with the `model.attn_impl` that chose it where they differ: `sdpa (auto)`."""
        impl = self.model.attn_impl
        return self.core if impl == self.core else f"{self.core} ({impl})"

    @property
    def device(self) -> str:
        return device_name(self.accelerator, self.machine, self.world_size)

    def auto_choices(self) -> list[tuple[str, str, str]]:
        """(setting, value, why) for each setting the recipe left `auto`."""
        t = self.recipe.train
        values = {
            "accelerator": self.accelerator,
            "devices": str(self.devices),
            "precision": t.precision,
            "compile": "on" if t.compile else "off",
            "optimizer": self.recipe.optim.name,
            "attention": self.core,
        }
        return [(k, values[k], why) for k, why in self.reasons.items()]

    def with_model(self, model: ModelConfig) -> RunSpec:
        """The spec with the recipe's model replaced (a vocabulary sized to the tokenizer)."""
        return replace(self, recipe=self.recipe.model_copy(update={"model": model}))


def _accelerator(recipe: Recipe, machine: Machine, reasons: dict[str, str]) -> str:
    acc = recipe.train.accelerator
    if acc == "auto":
        acc = "cuda" if machine.cuda_devices else "cpu"
        reasons["accelerator"] = "a CUDA GPU is visible" if machine.cuda_devices else "no CUDA GPU is visible"
    if acc == "cuda" and not machine.cuda_devices:
        raise DeviceError(NO_CUDA)
    if acc == "mps" and not machine.mps:
        raise DeviceError(
            "train.accelerator=mps but Apple MPS is not available here; use train.accelerator=auto"
        )
    return acc


def _auto_reasons(recipe: Recipe, accelerator: str, machine: Machine, reasons: dict[str, str]) -> None:
    """Why `resolve_auto` and `pick_core` choose what they do, for each value the recipe left `auto`."""
    t, cuda = recipe.train, accelerator == "cuda"
    if t.precision == "auto":
        reasons["precision"] = (
            ("a CUDA GPU with" if machine.bf16 else "a CUDA GPU without") + " bf16" if cuda else "not CUDA"
        )
    if t.compile == "auto":
        reasons["compile"] = "CUDA" if cuda else "not CUDA"
    if recipe.optim.name == "auto":
        reasons["optimizer"] = (
            ("FSDP shards AdamW's state" if t.strategy == "fsdp" else "8-bit states save GPU memory")
            if cuda
            else "8-bit AdamW is for CUDA"
        )
    if recipe.model is not None and recipe.model.attn_impl == "auto":
        reasons["attention"] = (
            "flex where the GPU has compute capability 8.0+, else sdpa"
            if cuda
            else "flex has no backward on CPU"
            if accelerator == "cpu"
            else "the portable core"
        )


def resolve(recipe: Recipe, machine: Machine | None = None) -> RunSpec:
    """The recipe as it runs on `machine` (default: this one), checked against it: the devices,
    precision, strategy and attention core it can run, the compiler train.compile needs, the batch
    arithmetic and the sequence length. DeviceError / RecipeError say what to change."""
    machine = machine or Machine.detect()
    reasons: dict[str, str] = {}
    acc = _accelerator(recipe, machine, reasons)
    cuda = acc == "cuda"
    r = resolve_auto(recipe, cuda=cuda, bf16=cuda and machine.bf16)
    _auto_reasons(recipe, acc, machine, reasons)
    t = r.train
    if machine.here:
        check_loggers(r)
    check_off_cuda(r, acc)
    if cuda and t.precision in ("bf16-mixed", "bf16-true") and not machine.bf16:
        raise DeviceError(f"train.precision={t.precision} but this GPU has no bf16 support; use 16-mixed")
    if t.devices == "auto":
        devices = machine.cuda_devices if cuda else 1
        reasons["devices"] = "every visible GPU" if cuda else "one process off CUDA"
    else:
        devices = int(t.devices)
        if devices < 1:
            raise RecipeError(f"train.devices={devices}: need at least 1 (or auto)")
        if cuda and devices > machine.cuda_devices:
            raise DeviceError(
                f"train.devices={devices} but only {machine.cuda_devices} CUDA GPU(s) are visible; lower train.devices"
            )
    if t.compile and acc in ("cpu", "cuda") and machine.here:
        import torch

        from difftrain.infer.device import require_compiler

        require_compiler(torch.device(acc), "train.compile=true")
    world = devices * t.num_nodes
    check_strategy(r, acc, world)
    if r.model is None:
        raise RecipeError(
            f"{recipe.source or recipe.name}: no model: section; a pretraining recipe needs one "
            "(a fine-tune fills it from finetune.base)"
        )
    check_flex(r.model, acc)
    seq_len = train_seq_len(t, r.model.max_seq_len)
    global_bs, accumulate = global_batch(t, devices)
    r.train.global_batch_size = global_bs
    max_steps = t.max_steps or -(-t.max_tokens // (global_bs * seq_len))  # type: ignore[operator]  # ceil
    run_dir = r.run_dir  # (refuses an out_dir that climbs out of the current folder)
    return RunSpec(
        r, machine, acc, devices, world, seq_len, accumulate, global_bs, max_steps, run_dir, reasons
    )
