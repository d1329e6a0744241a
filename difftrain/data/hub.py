"""hf: sources: a Hugging Face `datasets` dataset — a Hub name, a local folder (written by
save_to_disk, or data files), or a packaged builder (hf:json, hf:parquet, ...) over data_files.

Loading fails as one DataError naming the source and the fix. Where the Hub's host does not
resolve, the load runs in offline mode (the local cache only) instead of `datasets`' retries.
"""

from __future__ import annotations

import glob
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from difftrain.data.config import resolve_path
from difftrain.errors import DataError

CHAT_RECORD_AS_TEXT = (
    "a chat record (`messages`), in data read as plain text documents: chat turns are read through a "
    "chat template by `difftrain finetune` (finetune.base: the pretrained run); pretrain on text documents"
)
SAVED_MARKERS = ("state.json", "dataset_dict.json", "dataset_info.json")  # a save_to_disk folder's files
_SAVE_FOR_OFFLINE = "save it with dataset.save_to_disk(DIR) and use source 'hf:DIR'"
_LOCAL_FILES = "; for local files use e.g. source 'hf:json' with data_files"


def columns_read(columns: list[str], names: list[str], chat: bool, what: str, where: str) -> list[str]:
    """The columns to read of a table whose columns are `names`: `columns`, or, for instruction
    records (`chat`), ["messages"] where the table holds chat records; else a DataError."""
    missing = [c for c in columns if c not in names]
    if not missing:
        return columns
    if chat and "messages" in names:
        return ["messages"]
    if "messages" in names:  # text_field: messages would name a list, not text
        raise DataError(f"{what} holds {CHAT_RECORD_AS_TEXT}")
    fix = (
        f"set prompt_field/response_field on {where}, or give chat records a 'messages' column"
        if chat
        else f"set text_field on {where}"
    )
    wanted = ", ".join(map(repr, missing))
    raise DataError(f"{what} has no column {wanted} (columns: {', '.join(names)}); {fix}")


def missing_split(label: str, local: Path, split: str, splits: list[str]) -> str:
    return f"{label}: no split '{split}' in {local} (splits: {', '.join(splits)}); choose one with hf:<path>@<split>"


class HubDataset:
    """The `datasets` side of an hf: source (`source`: its `Source`); its data_files and dataset
    are resolved and loaded once."""

    def __init__(self, source: Any) -> None:
        self.source, self.spec = source, source.spec
        self._ds: Any = None
        self._files: list[Path] | None = None

    @property
    def label(self) -> str:
        return self.source.label

    def local_dir(self) -> Path | None:
        """The local folder the source names (DataError where it is missing); None for a Hub name."""
        p = self.spec.hf_local_dir(self.source.base_dir)
        if p is not None and not p.exists():
            raise DataError(f"{self.label}: local dataset folder {p} does not exist; fix the path")
        return p

    def data_files(self) -> list[Path] | None:
        """The files data_files name, globs expanded (None without data_files); a file that exists
        as written is that file (its name may hold [ ] * ?)."""
        if not self.spec.data_files or self._files is not None:
            return self._files
        files: list[Path] = []
        for raw in self.spec.data_files:
            p = resolve_path(raw, self.source.base_dir)
            matches = (
                sorted(Path(m) for m in glob.glob(str(p), recursive=True) if os.path.isfile(m))
                if glob.has_magic(raw) and not p.exists()
                else [p]
            )
            for m in matches:
                if m.is_dir():
                    raise DataError(
                        f"{self.label}: data_files entry {m} is a folder; name its files, e.g. "
                        f"{Path(raw.rstrip('/')) / '*.jsonl'}"
                    )
                if not m.is_file():
                    raise DataError(f"{self.label}: data_files entry {m} does not exist; fix data_files")
            if not matches:
                raise DataError(f"{self.label}: data_files pattern {p} matches no files; fix data_files")
            files.extend(matches)
        self._files = files
        return files

    def check_saved_split(self, local: Path) -> None:
        """DataError for a split a save_to_disk folder does not hold, read from its metadata (so a
        source whose shards are cached is refused as a loaded one is)."""
        _, _, split = self.spec.hf_parts()
        try:
            if (local / "dataset_dict.json").is_file():
                splits = [str(x) for x in json.loads((local / "dataset_dict.json").read_text())["splits"]]
                if split not in splits:
                    raise DataError(missing_split(self.label, local, split, splits))
            elif (local / "state.json").is_file() and "@" in self.spec.source[3:]:
                saved = json.loads((local / "state.json").read_text()).get("_split")
                if str(saved or "") != split:
                    note = f" (saved from split '{saved}')" if saved else ""
                    raise DataError(
                        f"{self.label}: {local} holds one dataset{note}, not a DatasetDict of splits; leave out "
                        f"@{split} to read all of it"
                    )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # unreadable metadata: loading the folder names the problem

    def dataset(self) -> Any:
        if self._ds is None:
            self._ds = self._load()
        return self._ds

    def rows(self, columns: list[str], chat: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, row) of the dataset's `columns` (`chat`: see `columns_read`)."""
        ds = self.dataset()
        names = getattr(ds, "column_names", None)
        if names is not None:
            columns = columns_read(columns, names, chat, f"{self.label}: dataset", "this source")
            ds = ds.select_columns(columns)
        row = 0
        for batch in ds.iter(batch_size=1000):
            n = len(next(iter(batch.values())))
            for values in zip(*(batch.get(c, [None] * n) for c in columns), strict=True):
                yield f"{self.label}, row {row}", dict(zip(columns, values, strict=True))
                row += 1

    def _load(self) -> Any:
        try:
            import datasets
        except ImportError as e:
            raise DataError(
                f"{self.label}: hf: sources need the `datasets` library; install it with "
                "pip install 'difftrain[hf]'"
            ) from e
        name, config, split = self.spec.hf_parts()
        local = self.local_dir()
        builder = local is None and _packaged_builder(name)  # hf:json etc.: local files, no Hub
        saved = local is not None and any((local / f).exists() for f in SAVED_MARKERS)
        if builder and not self.spec.data_files:
            raise DataError(
                f"{self.label}: hf:{name} reads local files and needs data_files; add data_files: [FILE, ...] "
                "to this source (or name the files as sources themselves)"
            )
        if saved and config:
            raise DataError(
                f"{self.label}: {local} was saved with save_to_disk and has no configs; leave out :{config}"
            )
        if saved and self.spec.data_files:
            raise DataError(
                f"{self.label}: {local} was saved with save_to_disk, which data_files do not apply to; drop "
                "data_files (or read the files with source 'hf:json' / 'hf:parquet' / 'hf:csv' and data_files)"
            )
        unreachable = _unreachable_hub() if local is None and not builder else None
        try:
            if saved:
                assert local is not None
                self.check_saved_split(local)
                ds = datasets.load_from_disk(str(local))
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise DataError(missing_split(self.label, local, split, list(ds)))
                    ds = ds[split]
                return ds
            files = self.data_files()
            with _datasets_mode(unreachable is not None, local is not None or builder):
                return datasets.load_dataset(
                    str(local) if local is not None else name,
                    config,
                    split=split,
                    # each resolved file as itself: datasets globs what it is given (a[1].jsonl)
                    data_files=[glob.escape(str(f)) for f in files] if files else None,
                    streaming=self.spec.streaming,
                )
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{self.label}: {self._failure(e, name, local, builder, unreachable)}") from e

    def _failure(
        self, e: Exception, name: str, local: Path | None, builder: bool, unreachable: str | None
    ) -> str:
        """What a failed load means, and the fix."""
        text = f"{type(e).__name__}: {_first_line(e)}"
        if "split" in str(e).lower() and isinstance(e, (ValueError, KeyError)):
            hint = "choose an existing split with hf:<dataset>[:<config>]@<split>"
        elif builder and all(f.stat().st_size == 0 for f in self.data_files() or []):
            return "its data_files are empty; point data_files at files that hold records"
        elif builder:  # the files are at fault: datasets hides the reason in the exception's cause
            why = e.__cause__ or e.__context__
            if why is not None and str(why):
                text = f"{text}; {type(why).__name__}: {_first_line(why)}"
            return (
                f"datasets' {name} builder could not read data_files ({text}); fix the file, or name it as "
                "a source itself (data.sources: [FILE]) to get the line of each bad record"
            )
        elif unreachable is not None and (self.source.base_dir / name).is_dir():
            return (
                f"'{name}' is read as a Hugging Face Hub dataset name, which cannot be reached from this "
                f"machine; for the folder {self.source.base_dir / name} write source 'hf:./{name}'"
            )
        elif unreachable is not None:  # the cache was read already: HF_DATASETS_OFFLINE adds nothing
            text = (
                f"{unreachable} cannot be reached from this machine and the dataset is not in the local cache"
            )
            hint = f"download it where there is network, {_SAVE_FOR_OFFLINE}{_LOCAL_FILES}"
        elif local is not None:  # nothing to download: the folder is at fault
            hint = (
                f"check the folder {local}: a dataset written by save_to_disk (an empty one cannot be "
                "read), or data files datasets can read, with hf:PATH:CONFIG naming a config it has"
            )
        else:
            import datasets

            offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))  # (datasets read the env)
            env = "" if offline else " (or set HF_DATASETS_OFFLINE=1 to use the local Hugging Face cache)"
            hint = f"if this machine is offline, download the dataset where there is network, {_SAVE_FOR_OFFLINE}{env}{_LOCAL_FILES}"
        return f"could not load Hugging Face dataset '{name}' ({text}); {hint}"


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _unreachable_hub() -> str | None:
    """The Hub's host when its name does not resolve (an offline machine); None where it does or
    HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set."""
    if any(
        os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    ):
        return None
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):  # UnicodeError: a name no lookup takes (HF_ENDPOINT=http://a..b)
        return host
    return None


def _packaged_builder(name: str) -> bool:
    """Whether `name` is one of `datasets`' own builders (json, csv, parquet, ...)."""
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    except ImportError:  # a layout of a future datasets: ask the Hub, as for any name
        return False
    return name in _PACKAGED_DATASETS_MODULES


@contextmanager
def _datasets_mode(offline: bool, quiet: bool) -> Iterator[None]:
    """`datasets` in offline mode (it reads its local cache only) while `offline`, without its
    progress bars and log lines while `quiet`."""
    import datasets.config
    import datasets.utils as ds_utils
    import huggingface_hub.constants as hub
    from datasets.utils import logging as ds_logging

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    bars_off, level = ds_utils.are_progress_bars_disabled(), ds_logging.get_verbosity()
    if offline:
        datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    if quiet:
        ds_utils.disable_progress_bars()
        ds_logging.set_verbosity(ds_logging.CRITICAL)  # a bad file is logged as an error, then raised
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved
        ds_logging.set_verbosity(level)
        if quiet and not bars_off:
            ds_utils.enable_progress_bars()
