"""Device and dtype for inference: `auto` picks the fastest sensible choice on this machine."""

from __future__ import annotations

import os

import torch

from difftrain.errors import DeviceError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


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
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"--device {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name} but no CUDA GPU is visible here; use --device auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"--device {name} but only {torch.cuda.device_count()} CUDA GPU(s) are visible; "
                f"use cuda:0 … cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type == "mps" and not _mps_available():
        raise DeviceError(f"--device {name} but Apple MPS is not available here; use --device auto or cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"--device {name} is not supported; use auto, cpu, cuda, cuda:N or mps")
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
    """DeviceError unless torch.compile can build kernels for `device`: on CPU inductor compiles
    C++ (it needs a compiler: $CXX, g++, clang++ or c++ on PATH), on CUDA it needs Triton.
    Checked before anything loads, so a missing toolchain is one line, not a traceback from
    the first compiled call."""
    import shutil

    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise DeviceError(
                f"{option} on CUDA needs Triton, which is not installed here; "
                "pip install triton (it ships with Linux CUDA builds of torch) or leave out the option"
            )
    elif device.type == "cpu":
        import logging

        # torch's C++ build helpers warn "No CUDA runtime is found, using CUDA_HOME=..." where a CUDA
        # toolkit is installed without a GPU: nothing to do with CPU kernels, and it lands in the
        # middle of streamed text
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
        if not any(shutil.which(n) for n in names):
            raise DeviceError(
                f"{option} on CPU needs a C++ compiler ({' or '.join(names)} on PATH), and none was found; "
                "install one (e.g. apt install g++) or leave out the option"
            )
