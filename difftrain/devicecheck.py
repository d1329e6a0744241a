"""Recipes a machine's devices cannot run, refused with the fix (torch-free: called by
`difftrain.spec.resolve` on the recipe resolved for a machine).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from difftrain.errors import DeviceError, RecipeError

BNB_NAMES = ("adamw8bit", "paged_adamw8bit", "lion8bit")


def no_cuda_here() -> bool:
    """True where torch cannot see a CUDA (or ROCm) GPU: macOS, or Linux without the NVIDIA, AMD
    (ROCm) and WSL GPU device files. False where it may (then only torch can tell)."""
    if sys.platform == "darwin":
        return True
    if sys.platform.startswith("linux"):
        return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))
    return False


def has_tensorboard() -> bool:
    """Whether tensorboard or tensorboardX is installed (imports neither)."""
    import importlib.util

    return any(importlib.util.find_spec(n) is not None for n in ("tensorboard", "tensorboardX"))


def check_loggers(recipe: Any) -> None:
    """Refuse a logger the recipe asks for whose package is not installed."""
    import importlib.util

    log = recipe.logging
    if log.tensorboard is True and not has_tensorboard():
        raise DeviceError(
            "logging.tensorboard=true but tensorboard is not installed; `pip install tensorboard`, or set "
            "logging.tensorboard: auto (logs when it is installed)"
        )
    if log.wandb_project and importlib.util.find_spec("wandb") is None:
        raise DeviceError(
            "logging.wandb_project is set but wandb is not installed; `pip install wandb`, or remove "
            "logging.wandb_project"
        )


def check_strategy(recipe: Any, accelerator: str, world_size: int) -> None:
    """Refuse strategy/device/optimizer combinations that cannot work (`auto` values resolved)."""
    t, strategy = recipe.train, recipe.train.strategy
    if strategy == "fsdp":
        if accelerator != "cuda":
            raise DeviceError(
                f"train.strategy=fsdp needs CUDA GPUs (Lightning's FSDPStrategy and torch's FSDP refuse "
                f"{accelerator} devices); on this machine use train.strategy=ddp — train.devices=N then "
                "runs N processes"
            )
        if recipe.optim.name in BNB_NAMES:
            raise DeviceError(
                f"optim.name={recipe.optim.name} with train.strategy=fsdp: FSDP cannot shard or gather "
                "bitsandbytes' quantized optimizer states into checkpoints; use optim.name=adamw (FSDP "
                "already shards its state over the devices) or train.strategy=ddp"
            )
        if t.precision == "16-mixed":
            raise DeviceError(
                "train.precision=16-mixed with train.strategy=fsdp is not supported (fp16 loss scaling "
                "over shards); use train.precision=bf16-mixed, or train.strategy=ddp on GPUs without bf16"
            )
        ft = getattr(recipe, "finetune", None)
        if ft is not None and ft.method != "full":
            raise DeviceError(
                f"finetune.method={ft.method} with train.strategy=fsdp: adapters train a few tensors "
                "(nothing worth sharding, and the frozen base is saved separately); use "
                "train.strategy=ddp, or finetune.method=full"
            )
    val_windows = recipe.data.val_windows
    if world_size > 1 and 0 < val_windows < world_size and getattr(recipe, "finetune", None) is None:
        raise RecipeError(
            f"data.val_windows={val_windows} is fewer than the {world_size} processes, and every "
            f"process validates at least one window; set data.val_windows to {world_size} or more (or 0)"
        )


NO_CUDA = "train.accelerator=cuda but no CUDA GPU is visible here; use train.accelerator=auto or cpu"


def check_off_cuda(resolved: Any, accelerator: str) -> None:
    """Refuse the options that need a CUDA GPU when training runs on `accelerator` (cpu, mps)."""
    if accelerator == "cuda":
        return
    t = resolved.train
    if t.precision == "16-mixed":
        raise DeviceError("train.precision=16-mixed needs a CUDA GPU; on CPU use 32-true (or bf16-mixed)")
    if resolved.optim.name == "paged_adamw8bit":
        raise DeviceError(
            "optim.name=paged_adamw8bit needs CUDA; on this machine use optim.name=adamw or adamw8bit"
        )


def check_flex(model: Any, accelerator: str) -> None:
    if model.attn_impl == "flex" and accelerator != "cuda":
        raise DeviceError(
            "model.attn_impl=flex has no backward pass on CPU in this torch; train on CPU with "
            "model.attn_impl=sdpa (or auto), or use flex on a CUDA GPU"
        )
