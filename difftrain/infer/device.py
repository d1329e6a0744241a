"""Device and dtype for inference: `auto` picks the fastest sensible choice on this machine."""

from __future__ import annotations

import logging
import os
import shutil

import torch

from difftrain.errors import DeviceError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES |= {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` → cuda if a GPU is visible, else mps, else cpu; otherwise the named device, checked."""
    name = name.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        device: torch.device | None = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"--device {name!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {name} but no CUDA GPU is visible here; use --device auto or cpu")
    if device.type == "mps" and not _mps_available():
        raise DeviceError(f"--device {name} but Apple MPS is not available here; use --device auto or cpu")
    n = torch.cuda.device_count()
    if device.type == "cuda" and device.index is not None and device.index >= n:
        raise DeviceError(f"--device {name} but only {n} CUDA GPU(s) are visible; use cuda:0 … cuda:{n - 1}")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` → bfloat16 on a GPU that supports it, float16 on mps, float32 otherwise (CPUs are
    fastest and exact in fp32 at these sizes); otherwise the named dtype."""
    name = name.strip().lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    if name not in DTYPES:
        raise DeviceError(f"--dtype {name!r} is unknown; use auto, float32, bfloat16 or float16")
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("--dtype bfloat16 but this GPU has no bf16 support; use --dtype float16")
    return dtype


def require_compiler(device: torch.device, option: str = "--compile") -> None:
    """DeviceError unless torch.compile can build kernels for `device` (C++ on CPU, Triton on
    CUDA), checked before anything loads."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise DeviceError(
                f"{option} on CUDA needs Triton, which is not installed here; "
                "pip install triton (it ships with Linux CUDA builds of torch) or leave out the option"
            )
    elif device.type == "cpu":
        # torch's C++ build helpers warn "No CUDA runtime is found" where a CUDA toolkit is
        # installed without a GPU: irrelevant to CPU kernels, and it lands in streamed text
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
        if not any(shutil.which(n) for n in names):
            raise DeviceError(
                f"{option} on CPU needs a C++ compiler ({' or '.join(names)} on PATH), and none was found; "
                "install one (e.g. apt install g++) or leave out the option"
            )
