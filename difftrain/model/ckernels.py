"""Fused fp32 CPU kernels for training (`cpu_kernels.c`), compiled here at first use.

In a CPU training step the elementwise steps around the matrix products are bound by memory, not
arithmetic: their (tokens × F) and (tokens × D) tensors come out of a product and do not fit in
the cache, so each of torch's eager passes (RMSNorm's pow, mean, two products; SwiGLU's silu and
product, and backward's three) is a trip to DRAM. `cpu_kernels.c` makes one pass for each
forward and backward: RMSNorm from x to y (keeping x and the row statistics; backward recomputes
x̂), SwiGLU from gate and up to h (keeping gate and up, not silu(gate): one (tokens × F) tensor
less per layer), and each backward in one pass; and the chunked loss (`model/loss.py`) turns each
chunk of logits into its loss and, in place, its gradient (softmax − one-hot) in one kernel, where
torch ran log_softmax, exp, gather and scatter. At the bench's quickstart shape (Intel Xeon, two
threads) they take the diff training step from ≈ 520 to ≈ 485 ms (`benchmarks/README.md`).

The source is compiled by the machine's C compiler ($CC, else cc) with `-O3 -march=native
-fopenmp` into the cache folder ($DIFFTRAIN_CACHE/kernels, named by a hash of the source, the
compiler and the CPU), once per cache folder, compiler and CPU, in about a second, and loaded
with ctypes; its OpenMP
binds to torch's libgomp, so the kernels run on torch's own threads. Without a compiler (or
OpenMP), or with DIFFTRAIN_CPU_KERNELS=off, training runs the same steps as torch operations (the
same results within fp32 rounding: the kernels sum in another order and compute exp themselves,
within 2 ulp). Only contiguous fp32 CPU tensors outside torch.compile take these kernels;
everything else, CUDA included, is unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from difftrain.errors import ConfigError
from difftrain.runtime import CPU_KERNELS_ENV as ENV
from difftrain.runtime import cpu_kernels_setting as setting

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ("-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-fopenmp")

_state: dict[str, Any] = {}


def library() -> Any:
    """The loaded kernels (a ctypes library), or None: turned off, or no compiler (`status` says
    which). Compiled once per cache folder, compiler and CPU; loaded once per process."""
    if "lib" not in _state:
        try:
            _state["lib"], _state["status"] = _load()
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - anything else: training runs torch's operations
            _state["lib"], _state["status"] = None, f"unavailable ({type(e).__name__}: {e})"
    return _state["lib"]


def status() -> str:
    """What `library` found: "compiled", "off (DIFFTRAIN_CPU_KERNELS)", or "unavailable (why)"."""
    library()
    return _state["status"]


def forget() -> None:
    """Load again at the next use (tests change the setting)."""
    _state.clear()


def _cache_dir() -> Path:
    from difftrain.data.config import default_cache_dir

    return Path(default_cache_dir()) / "kernels"


def _compiler() -> list[str] | None:
    """$CC (it may carry arguments: `ccache gcc`, `gcc -m64`), else cc, as a command line; None
    when its program is not found."""
    words = shlex.split(os.environ.get("CC", "").strip() or "cc")
    program = shutil.which(words[0]) if words else None
    return None if program is None else [program, *words[1:]]


def _machine_key() -> str:
    """What the compiled code depends on besides source and compiler: the CPU (-march=native)."""
    parts = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name", "CPU part")):
                    parts.append(line.strip())
                    if len(parts) > 6:
                        break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def library_path(cc: list[str]) -> Path:
    """Where the library compiled by the command `cc` for this source and CPU is cached."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, errors="replace", timeout=30)
    parts = [SOURCE.read_bytes(), " ".join(cc).encode(), version.stdout.encode(), " ".join(_FLAGS).encode()]
    suffix = ".dll" if platform.system() == "Windows" else ".so"
    key = hashlib.sha256(b"\0".join([*parts, _machine_key().encode()])).hexdigest()[:16]
    return _cache_dir() / f"cpu_kernels-{key}{suffix}"


def _load() -> tuple[Any, str]:
    if setting() == "off":
        return None, f"off ({ENV})"
    cc = _compiler()
    if cc is None:
        given = os.environ.get("CC", "").strip()
        if given:
            return None, f"unavailable ($CC={given} is not a program found here; set $CC to a C compiler)"
        return None, "unavailable (no C compiler: install gcc or set $CC)"
    try:
        path = library_path(cc)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"unavailable (cannot run {cc[0]} --version or read {SOURCE.name}: {e})"
    try:
        if not path.exists():
            why = _compile(cc, path)
            if why:
                return None, f"unavailable ({why})"
        return _open(path), "compiled"
    except (OSError, AttributeError):  # a damaged or foreign file in the cache: compile it anew
        pass
    why = _compile(cc, path)
    if why:
        return None, f"unavailable ({why})"
    # loaded from a copy under another name: dlopen hands back the library it already opened
    # from `path` when that path is named again, even when the file there is a new one
    fresh = path.with_name(f"{path.stem}.{os.getpid()}{path.suffix}")
    try:
        shutil.copyfile(path, fresh)
        return _open(fresh), "compiled"
    except (OSError, AttributeError) as e:
        return None, f"unavailable (cannot load {path}: {e})"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(fresh)


def _open(path: Path) -> Any:
    """The library at `path` with its functions declared: an OSError if it is no library, an
    AttributeError if it is another one."""
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    return lib


def _compile(cc: list[str], path: Path) -> str | None:
    """Compile the source to `path` (atomically: concurrent processes each write their own file
    and rename it); the reason on failure, else None."""
    name = Path(cc[0]).name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=path.suffix + ".tmp")
        os.close(fd)
    except OSError as e:
        return f"cannot write the cache folder {path.parent}: {e.strerror or e}"
    try:
        done = subprocess.run(
            [*cc, *_FLAGS, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=300,
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no message"]
            return f"{name} failed: {next((x for x in lines if 'error' in x.lower()), lines[-1]).strip()}"
        if os.path.getsize(tmp) == 0:
            return f"{name} wrote nothing"
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # loadable by whoever shares the cache, as a compiler writes it
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"{name} failed: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: Any) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.difftrain_swiglu_fwd.argtypes = [p, p, p, i64, i32]
    lib.difftrain_swiglu_fwd.restype = None
    lib.difftrain_swiglu_bwd.argtypes = [p, p, p, p, p, i64, i32]
    lib.difftrain_swiglu_bwd.restype = None
    lib.difftrain_rmsnorm_fwd.argtypes = [p, p, p, p, i64, i64, f32, i32]
    lib.difftrain_rmsnorm_fwd.restype = None
    lib.difftrain_rmsnorm_bwd.argtypes = [p, p, p, p, p, p, i64, i64, i32]
    lib.difftrain_rmsnorm_bwd.restype = i32
    lib.difftrain_xent.argtypes = [p, p, p, i64, i64, i64, i32, i32]
    lib.difftrain_xent.restype = i32


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Inside the block, training takes torch's operations as with DIFFTRAIN_CPU_KERNELS=off (the
    bench times both in one process)."""
    _paused.append(True)
    try:
        yield
    finally:
        _paused.pop()


_paused: list[bool] = []


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels may run on these tensors: contiguous fp32 CPU tensors, not under
    torch.compile, not `paused`, and the library loaded."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
        and not torch.compiler.is_compiling()
        and not _paused
        and library() is not None
    )


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) ⊙ up (contiguous fp32 CPU tensors of one shape)."""
    h = torch.empty_like(gate)
    library().difftrain_swiglu_fwd(_ptr(gate), _ptr(up), _ptr(h), gate.numel(), torch.get_num_threads())
    return h


def _plain(*tensors: Tensor) -> list[Tensor]:
    """Tensors as the kernels read them, contiguous fp32: what forward saved normally is already
    (free), but a saved-tensor hook (offloading, compression) may give back another layout."""
    return [t.to(torch.float32).contiguous() for t in tensors]


def swiglu_backward(gh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(∂gate, ∂up) of h = silu(gate) ⊙ up for ∂h = gh."""
    gh, gate, up = _plain(gh, gate, up)
    if not gh.shape == gate.shape == up.shape:
        raise ValueError(f"swiglu_backward: shapes {gh.shape}, {gate.shape}, {up.shape} differ")
    gg, gu = torch.empty_like(gate), torch.empty_like(up)
    library().difftrain_swiglu_bwd(
        _ptr(gh), _ptr(gate), _ptr(up), _ptr(gg), _ptr(gu), gate.numel(), torch.get_num_threads()
    )
    return gg, gu


class SwiGLU(torch.autograd.Function):
    """silu(gate) ⊙ up by the kernels, keeping gate and up for backward (not silu(gate) too);
    for `usable` tensors (`gemm.gated_up` runs it when the products are plain layer calls)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return swiglu(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, gh: Tensor):  # type: ignore[override]
        return swiglu_backward(gh, *ctx.saved_tensors)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(w ⊙ x·r, r) with r = 1/√(mean(x²) + ε) over x's last dimension, one r per row."""
    D = x.shape[-1]
    rows = x.numel() // max(D, 1)
    y = torch.empty_like(x)
    r = torch.empty(x.shape[:-1], dtype=torch.float32)
    library().difftrain_rmsnorm_fwd(_ptr(x), _ptr(w), _ptr(y), _ptr(r), rows, D, eps, torch.get_num_threads())
    return y, r


def rms_norm_backward(
    g: Tensor, x: Tensor, w: Tensor, r: Tensor, need_x: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None]:
    """(∂x, ∂w) of `rms_norm` for ∂y = g, each None when not needed."""
    g, x, w, r = _plain(g, x, w, r)
    D = x.shape[-1]
    if g.shape != x.shape or w.shape != (D,) or r.numel() * D != x.numel():
        raise ValueError(f"rms_norm_backward: shapes {g.shape}, {x.shape}, {w.shape}, {r.shape} do not fit")
    gx = torch.empty_like(x) if need_x else None
    gw = torch.empty(D, dtype=torch.float32) if need_w else None
    rc = library().difftrain_rmsnorm_bwd(
        _ptr(g),
        _ptr(x),
        _ptr(w),
        _ptr(r),
        _ptr(gx),
        _ptr(gw),
        x.numel() // max(D, 1),
        D,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("out of memory for RMSNorm's weight gradient")
    return gx, gw


def cross_entropy_rows(z: Tensor, targets: Tensor, ignore_index: int, grad: bool) -> Tensor:
    """Each row's −log softmax(z)[target] (0 where the target is `ignore_index`), for contiguous
    fp32 logits z (rows × V) and int64 targets; with `grad`, z is overwritten by the gradient of
    the rows' summed loss, softmax(z) − onehot(target) (0 on ignored rows). A target outside
    [0, V) is an IndexError, as torch's gather makes it."""
    rows, V = z.shape
    targets = targets.contiguous()
    loss = torch.empty(rows, dtype=torch.float32)
    rc = library().difftrain_xent(
        _ptr(z), _ptr(targets), _ptr(loss), rows, V, ignore_index, int(grad), torch.get_num_threads()
    )
    if rc != 0:
        raise IndexError(
            f"a target is outside the vocabulary of {V} tokens (0 … {V - 1}) and not {ignore_index}"
        )
    return loss
