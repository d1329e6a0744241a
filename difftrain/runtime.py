"""Process-wide helpers for the optional native library bitsandbytes (8-bit optimizers, QLoRA)."""

from __future__ import annotations

from typing import Any


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
