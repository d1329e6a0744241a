"""Every failure a user can cause is a DifftrainError.

The CLI turns a DifftrainError into one red line (what is wrong, where, how to fix it) and exit
code 2; it never shows a traceback for one unless `--debug` is given. Library code raises the most
specific subclass so callers (and tests) can tell the causes apart.
"""

from __future__ import annotations


class DifftrainError(Exception):
    """A user-facing error: the message names the cause and the fix."""

    exit_code = 2


class ConfigError(DifftrainError):
    """A model or recipe setting is invalid (bad value, impossible shape, unknown key)."""


class RecipeError(ConfigError):
    """A recipe file could not be read, parsed or validated."""


class DataError(DifftrainError):
    """A data source is missing, empty or malformed."""


class TokenizerError(DataError):
    """A tokenizer could not be trained, loaded or does not fit the model."""


class RunDirError(DifftrainError):
    """A run directory is missing, incomplete, or holds a different run."""


class CheckpointError(DifftrainError):
    """A checkpoint or weights file is missing, damaged or does not match its config."""


class DeviceError(DifftrainError):
    """The requested device, precision or kernel is not available on this machine."""


class InteropError(DifftrainError):
    """An import or export to another format is not possible."""


class TrainingError(DifftrainError):
    """Training stopped on a fault the user can act on (non-finite loss, out of memory, disk full)."""


class StopRequested(Exception):
    """Raised after a graceful stop (signal) once the checkpoint is written (not a mistake: the
    CLI prints the resume command and exits 130 / 143)."""

    def __init__(self, signum: int, step: int, is_global_zero: bool = True) -> None:
        super().__init__(f"stopped by signal {signum} at step {step}")
        self.signum = signum
        self.step = step
        self.is_global_zero = is_global_zero  # (the other processes of a run say nothing)
