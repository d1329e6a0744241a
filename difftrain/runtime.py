"""Process-wide settings that make CPU training faster without changing any result.

glibc's malloc serves every block above its mmap threshold (128 KiB, rising to at most 32 MiB)
with a fresh `mmap` and returns it to the kernel on free. A training step allocates and frees the
same large activations, logits and gradients every step, so every step page-faults through all of
them again: at the bench's quickstart shape on one CPU thread that is ~49,000 faults (baseline)
and ~95,000 (diff) per step, 5-9 % of the step (`python benchmarks/run_all.py` measures steps
with the setting applied; `DIFFTRAIN_MALLOC=default` turns it off to compare). `tune_allocator`
raises the mmap and trim thresholds so freed blocks stay in the heap and are reused: 0 faults per
step. Peak memory is unchanged (the heap keeps what the peak needed); memory freed after the peak
is not returned to the kernel until the process ends, as with jemalloc or tcmalloc in their usual
settings. CUDA memory is not affected (PyTorch's caching allocator already reuses it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1

_state: dict[str, str] = {}


CPU_GEMM_ENV = "DIFFTRAIN_CPU_GEMM"
CPU_GEMM_CHOICES = ("auto", "onednn", "torch")


def cpu_gemm_setting() -> str:
    """DIFFTRAIN_CPU_GEMM as asked (auto, onednn or torch; unset is auto), or a ConfigError for any
    other value: checked here, without torch, by every command before it does any work
    (`model.gemm` resolves the choice against the machine)."""
    from difftrain.errors import ConfigError

    raw = os.environ.get(CPU_GEMM_ENV, "")
    want = raw.strip().lower() or "auto"
    if want not in CPU_GEMM_CHOICES:
        raise ConfigError(
            f"{CPU_GEMM_ENV}={raw!r} is not a CPU matrix-product backend; "
            f"set it to one of {', '.join(CPU_GEMM_CHOICES)} (or unset it for auto)"
        )
    return want


CPU_KERNELS_ENV = "DIFFTRAIN_CPU_KERNELS"
SWITCH_OFF = ("off", "0", "no", "false")
SWITCH_ON = ("", "on", "1", "yes", "true")


def _switch(env: str, on: tuple[str, ...], off: tuple[str, ...], fix: str) -> str:
    """An on/off environment variable as asked: "on" or "off" (its words compared case- and
    space-insensitively; unset is on), or a ConfigError naming the value and `fix`."""
    from difftrain.errors import ConfigError

    raw = os.environ.get(env, "")
    want = raw.strip().lower()
    if want in off:
        return "off"
    if want in on:
        return "on"
    raise ConfigError(f"{env}={raw!r} is not a setting; {fix}")


def cpu_kernels_setting() -> str:
    """DIFFTRAIN_CPU_KERNELS as asked: auto (unset, auto, on, 1, yes, true) or off (off, 0, no,
    false); a ConfigError for any other value, checked without torch by every command before it
    does any work (`model.ckernels` compiles and loads the kernels)."""
    fix = (
        "set it to off to train with torch's operations instead of the fused CPU kernels, or to auto "
        "(or unset it) to use them"
    )
    return "auto" if _switch(CPU_KERNELS_ENV, (*SWITCH_ON, "auto"), SWITCH_OFF, fix) == "on" else "off"


def tune_allocator() -> str:
    """Keep large freed blocks in glibc's heap (see the module docstring); idempotent.

    Returns what was done: "tuned", "off" (DIFFTRAIN_MALLOC=default), "user" (the user set
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES themselves), or
    "unavailable" (not Linux/glibc, e.g. macOS or musl).
    """
    if "allocator" in _state:
        return _state["allocator"]
    _state["allocator"] = result = _tune()
    return result


def allocator_state() -> str:
    """What `tune_allocator` did in this process ("not tried" before it ran)."""
    return _state.get("allocator", "not tried")


def malloc_setting() -> str:
    """DIFFTRAIN_MALLOC as asked: "off" (glibc's default allocator: default, off, 0, no, false) or
    "on" (unset, on, 1, yes, true, tuned); a ConfigError for any other value, which every command
    checks before it does any work."""
    fix = "set it to default to turn off the allocator tuning (or unset it to keep it on)"
    return _switch("DIFFTRAIN_MALLOC", (*SWITCH_ON, "tuned"), ("default", *SWITCH_OFF), fix)


def _tune() -> str:
    if malloc_setting() == "off":
        return "off"
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return "user"
    mallopt = glibc_mallopt()
    if mallopt is None:
        return "unavailable"
    if mallopt(_M_MMAP_THRESHOLD, _INT_MAX) != 1 or mallopt(_M_TRIM_THRESHOLD, _INT_MAX) != 1:
        return "unavailable"
    return "tuned"


def glibc_mallopt() -> Any:
    """glibc's `mallopt(param, value)` through ctypes, or None where there is none (not Linux,
    or a libc other than glibc: macOS, musl, whose mallopt does nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 — glibc only (musl has a mallopt that does nothing)
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


class _NoKernelsHint:
    """A logging filter that drops bitsandbytes' hint about the optional `kernels` package."""

    def filter(self, record: Any) -> bool:
        return "kernels-community" not in record.getMessage()


def import_bitsandbytes(need: str, instead: str) -> Any:
    """bitsandbytes (with its `kernels` hint quieted), or a DeviceError naming what needs it
    (`need`, e.g. "optim.name=adamw8bit") and the way around it (`instead`)."""
    from difftrain.errors import DeviceError

    quiet_bitsandbytes_hint()
    try:
        import bitsandbytes as bnb
        import bitsandbytes.optim  # noqa: F401  (the 8-bit optimizers; a broken build fails here)
    except Exception as e:  # ImportError, or a broken native library
        raise DeviceError(
            f"{need} needs bitsandbytes, which cannot be used here ({type(e).__name__}: {e}); "
            f"{instead}, or install a bitsandbytes build for this machine (`pip install -U bitsandbytes`)"
        ) from e
    return bnb


def quiet_bitsandbytes_hint() -> None:
    """Drop the warning bitsandbytes logs when it is imported on a CPU with AVX-512 BF16 and the
    optional `kernels` package is missing ("Failed to load CPU gemm_4bit_forward from
    kernels-community ... pip install kernels"): a faster 4-bit CPU product it does without,
    printed into every command that imports it (8-bit optimizers, QLoRA). Idempotent; call it
    before importing bitsandbytes."""
    import logging

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _NoKernelsHint) for f in log.filters):
        log.addFilter(_NoKernelsHint())
