"""Atomic file writes: a file difftrain writes is either the old version or the complete new one
(a temporary file in the same folder, fsynced, renamed over the destination, the folder fsynced).
Disk-full and permission errors become DifftrainErrors that name the file. A killed write leaves
its temporary file behind: `remove_stale_temps` deletes it. Also the run directory's creation
checks and its lock.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from difftrain.errors import DifftrainError

_UMASK = os.umask(0)  # read once at import: os.umask can only be read by setting it
os.umask(_UMASK)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames inside it are durable (no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _os_error_message(path: Path, e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return f"disk full while writing {path}; free some space and retry (the previous version of the file is intact)"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {path}: {e.strerror}; choose a writable location"
    return f"could not write {path}: {e.strerror or e}"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path`, fsynced and renamed onto `path` on success (for
    writers that want a file name); on any exception it is removed and `path` is untouched."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent)
    # mkstemp creates 0600; give the file the permissions a plain open() would (0666 & ~umask)
    os.fchmod(fd, 0o666 & ~_UMASK)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # again after the writer: one that replaces the file (safetensors' save_file) makes it 0600
        os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DifftrainError(_os_error_message(dest, e)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """`atomic_path` for a folder: yield an empty temporary folder next to `path`; on success it
    takes `path`'s place, and what `path` held is removed only then. On any exception the
    temporary folder is removed and `path` is untouched."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent))
    os.chmod(tmp, 0o777 & ~_UMASK)
    old = tmp.with_suffix(".old")
    try:
        yield tmp
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
    except BaseException:
        if old.exists() and not dest.exists():
            os.replace(old, dest)  # (the swap failed halfway: put the old folder back)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


TEMP_GLOB = ".*.tmp"  # `atomic_path`'s temporary files: .NAME.PID.<random>.tmp


def remove_stale_temps(folder: str | os.PathLike[str]) -> list[str]:
    """Delete the temporary files of atomic writes in `folder` whose writer process is gone;
    return their names."""
    removed: list[str] = []
    for p in Path(folder).glob(TEMP_GLOB):
        try:
            pid = int(p.name.rsplit(".", 3)[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid) and p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # (this module's `open`: tests inject a full disk)
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_save_safetensors(
    path: str | os.PathLike[str], tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """Save a dict of torch tensors as safetensors, atomically (tensors made contiguous first)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


LOCK_FILE = ".lock"  # in a run directory: flocked by the process that trains into it


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (a dangling link included)."""
    p = path.absolute()
    while p != p.parent:
        with contextlib.suppress(OSError):  # ENAMETOOLONG: no such file can exist either
            if p.exists() or p.is_symlink():
                break
        p = p.parent
    return p


def _uncreatable(run_dir: Path, why: str) -> DifftrainError:
    return DifftrainError(
        f"cannot create the run directory {run_dir}: {why}; set out_dir (or name) to a folder you can write"
    )


def check_run_dir_creatable(run_dir: str | os.PathLike[str]) -> None:
    """Refuse, writing nothing, a run directory that cannot be created or written."""
    why = uncreatable_reason(Path(run_dir))
    if why is not None:
        raise _uncreatable(Path(run_dir), why)


def uncreatable_reason(folder: Path) -> str | None:
    """Why `folder` (and its missing parents) cannot be created and written, judged without
    writing anything; None when it can."""
    long = next((part for part in Path(folder).absolute().parts if len(part.encode("utf-8")) > 255), None)
    if long is not None:
        return f"the folder name {long[:20]}… is {len(long.encode('utf-8'))} bytes long, more than a folder name may be (255)"
    base = _nearest_existing(folder)
    if base.is_symlink() and not base.exists():
        return f"{base} is a symbolic link that leads nowhere (a loop, or its target is missing)"
    if not base.is_dir():
        return f"{base} is not a folder"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable"
    kind = pseudo_filesystem(base)
    if kind is not None:  # os.access says yes to root there, and mkdir then fails
        return f"{base} is on a kernel filesystem ({kind}) where no folder can be made"
    return None


def unwritable_file_reason(path: Path) -> str | None:
    """Why a file at `path` cannot be written, judged without writing anything; None when it can."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder"
    why = uncreatable_reason(path.parent)
    if why is None and path.exists() and not os.access(path, os.W_OK):
        why = f"{path} is not writable"
    return why


# Linux filesystems of the kernel's own objects: nothing can be created there, whatever
# `os.access` says to root
PSEUDO_FILESYSTEMS = frozenset(
    "proc sysfs cgroup cgroup2 devpts debugfs tracefs securityfs pstore bpf configfs fusectl "
    "mqueue binfmt_misc efivarfs autofs".split()
)


def pseudo_filesystem(path: Path) -> str | None:
    """The type of the kernel filesystem `path` lies on (proc, sysfs, ...), else None, from
    /proc/self/mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
        target = str(Path(path).resolve())
    except (OSError, UnicodeDecodeError):
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split(" ")
        try:
            point = fields[4].replace("\\040", " ")
            fstype = fields[fields.index("-", 6) + 1]
        except (IndexError, ValueError):
            continue
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind if kind in PSEUDO_FILESYSTEMS else None


def make_run_dir(run_dir: str | os.PathLike[str]) -> None:
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DifftrainError(_os_error_message(run_dir, e)) from e
        raise _uncreatable(run_dir, e.strerror or str(e)) from e


class RunLock:
    """An exclusive, advisory lock on a run directory (flock on `<run_dir>/.lock`), held by the
    process that trains into it, so that a second run into it is refused. The OS drops it when
    the process ends, however it ends. Where flock is missing (Windows) runs are not locked."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def holder(self) -> int | None:
        """The pid that holds the lock now (0 if unknown), or None; writes nothing."""
        if self._fd is not None or not self.path.is_file():
            return None
        fd, holder = self._lock(create=False)
        if fd is not None:
            os.close(fd)  # it was free: closing drops the lock just taken
        return holder

    def acquire(self) -> int | None:
        """Take the lock, creating the run directory if need be; None when taken, else the
        holder's pid (0 if unknown)."""
        fd, holder = self._lock(create=True)
        if fd is not None:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
        return holder

    def _lock(self, *, create: bool) -> tuple[int | None, int | None]:
        """(descriptor holding the lock, None), or (None, the holder's pid) when another open
        file holds it; (None, None) where flock is missing."""
        try:
            import fcntl
        except ImportError:
            return None, None
        if create:
            make_run_dir(self.path.parent)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT if create else os.O_RDONLY, 0o644)
        except OSError as e:
            raise DifftrainError(_os_error_message(self.path, e)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            try:
                return None, int(self.path.read_text().strip() or 0)
            except (OSError, ValueError):
                return None, 0
        return fd, None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def json_error_reason(e: json.JSONDecodeError) -> str:
    """json's message with the column it leaves out of e.msg; the caller names the line."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def lazy_getattr(package: str, table: dict[str, str]) -> Any:
    """A module `__getattr__` that imports `package.<table[name]>` on the first use of `name`."""
    import importlib

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def sha256_file(path: Path) -> str:
    """SHA-256 of a file; of a folder (an FSDP sharded checkpoint) over its files' relative names
    and contents."""
    h = hashlib.sha256()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
