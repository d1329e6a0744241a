"""Data sources: turn `data.sources` entries into streams of documents (or SFT records).

A source is a local path (file, directory read recursively, or glob), `builtin:NAME`
(see builtin.py) or `hf:<dataset>[:<config>][@<split>]` (Hugging Face `datasets`). Reading is
lazy and in a deterministic order (sorted paths). Each source has a *fingerprint* — a hash of
its spec and of its files' paths, sizes and mtimes — that keys the token-shard cache, so a
second `prepare` with unchanged data never re-reads the text.

File formats: `.jsonl` / `.json` / `.parquet` hold one document per record (the `text_field`
of each record); any other file is one document (UTF-8 text). `.gz` files are decompressed.
In a folder (or a glob matching folders) read for pretraining, a `.json` file is records only
when it holds a list, JSON lines, or one object with the `text_field`: any other `.json` there
(package.json, a tsconfig.json with comments: the configs of a code corpus) is one document of
text, counted in `SourceStats.json_documents`. A `.json` file named itself is always records.

Malformed input raises a DataError naming the file (and line or row) and the fix; with
`data.on_bad_record: skip` a malformed record is dropped instead and counted in `SourceStats`.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import socket
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from difftrain.data import builtin, recall
from difftrain.data.config import DataConfig, RecallSpec, SourceSpec, resolve_path
from difftrain.errors import DataError
from difftrain.io import json_error_reason as _json_reason

RECORD_SUFFIXES = frozenset({".jsonl", ".json", ".parquet"})
TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .org .py .pyi .c .h .cc .cpp .cxx .hpp .cu .cuh .rs .go "
    ".java .kt .scala .js .mjs .ts .jsx .tsx .rb .php .sh .bash .zsh .fish .lua .pl .r .jl .swift .m "
    ".mm .sql .html .htm .css .scss .xml .yaml .yml .toml .ini .cfg .csv .tsv .hs .ml .mli .ex .exs "
    ".el .clj .vim .cs .fs .dart .zig .nim .f90 .v .sv .proto .cmake .mk".split()
)
"""File types read when walking a directory (an explicitly named file is read whatever its type)."""

BadRecordPolicy = Literal["error", "skip"]
_MAX_BAD_EXAMPLES = 5
# a chat record (`messages`) in a source read as plain text: only a fine-tune renders chat turns
CHAT_RECORD_AS_TEXT = (
    "a chat record (`messages`), in data read as plain text documents: chat turns are read through a "
    "chat template by `difftrain finetune` (finetune.base: the pretrained run); pretrain on text documents"
)


@dataclass
class SourceStats:
    """What was read from one source."""

    source: str
    documents: int = 0
    bytes: int = 0
    files: int = 0
    bad_records: int = 0
    bad_examples: list[str] = field(default_factory=list)
    json_documents: int = 0
    """`.json` files of a folder read as text (configs, not records): see the module docstring."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _suffix(path: Path) -> str:
    """The format suffix of a file, looking through a trailing .gz."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")


# What reading a file can raise: OSError (gzip.BadGzipFile among them), and from a .gz cut short
# EOFError, which the CLI would otherwise take for Ctrl-D, and zlib.error for corrupt data.
_READ_ERRORS = (OSError, EOFError, zlib.error)
# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): as a pair it is one character (an emoji),
# alone (text cut in the middle of a pair) it is no text UTF-8 can hold
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _encodes(obj: Any) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(obj: Any) -> str | None:
    """Where a parsed JSON value holds a lone surrogate (which no tokenizer can encode): "field
    'meta' " for a record's top-level field, "" for the value itself; None where it holds none.
    The whole record is refused: a template may read any of its fields."""
    if _encodes(obj):
        return None
    if isinstance(obj, dict):
        bad = next((k for k, v in obj.items() if not _encodes(v)), None)
        if bad is not None:
            return f"field '{bad}' "
    return ""


LONE_SURROGATE = (
    "holds a lone UTF-16 surrogate escape (e.g. \\ud83d without its pair: text cut in the middle of "
    "an emoji), which is no UTF-8 text; fix or delete the record"
)


def _unreadable(label: str, path: Path, e: BaseException) -> DataError:
    if isinstance(e, EOFError):
        why = "the gzip file is truncated: it ends before its end-of-stream marker"
    elif isinstance(e, (gzip.BadGzipFile, zlib.error)):
        why = f"not a valid gzip file: {e}"
    else:
        why = getattr(e, "strerror", None) or str(e)
    return DataError(
        f"{label}: cannot read {path} ({why}); fix or replace the file, or remove it from the source"
    )


@dataclass(frozen=True)
class RecordText:
    """How a source of instruction records is read as text: each record becomes the document
    `render(record)` (an instruction fine-tune's template: its prompt and response, or its chat
    messages, as training saw them). `key` names the rendering in the shard cache's fingerprint."""

    key: str
    render: Callable[[dict[str, Any]], str]


class Source:
    """One resolved entry of `data.sources`."""

    def __init__(
        self,
        spec: SourceSpec,
        index: int,
        base_dir: Path,
        *,
        name: str | None = None,
        records_as_text: RecordText | None = None,
    ) -> None:
        self.spec = spec
        self.index = index
        self.name = name
        """How messages name the source (default: its place in data.sources), e.g. "--data 'x.txt'"."""
        self.records_as_text = records_as_text
        """Set: the source holds instruction records, read as text documents through it (the
        evaluations of an instruction fine-tune); plain-text sources ignore it."""
        self.base_dir = base_dir
        self._hf: Any = None  # the loaded dataset of an hf: source (`_hf_dataset`)
        self._data_files: list[Path] | None = None  # its data_files, resolved (`_hf_data_files`)
        self.files: list[Path] = []
        self.walked: set[Path] = set()
        """The files found by walking a folder (not named by the source itself)."""
        if spec.kind == "path":
            self.files = self._expand_paths()
        elif spec.source in ("builtin:python-stdlib", "builtin:python-docstrings"):
            self.files = builtin.stdlib_files()

    # -- naming ------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.name or f"data.sources[{self.index}] ('{self.spec.source}')"

    def _resolve(self, raw: str) -> Path:
        return resolve_path(raw, self.base_dir)

    # -- local files -------------------------------------------------------------------------
    def _walk(self, root: Path) -> list[Path]:
        found = []
        for p in root.rglob("*"):
            rel = p.relative_to(root)
            if any(part.startswith(".") for part in rel.parts) or not p.is_file():
                continue
            if _suffix(p) in TEXT_SUFFIXES or _suffix(p) in RECORD_SUFFIXES:
                found.append(p)
        return sorted(found)

    def _expand_paths(self) -> list[Path]:
        raw = self.spec.source
        path = self._resolve(raw)
        # a file or folder that exists as written is that file (its name may hold [ ] * ?)
        if glob.has_magic(raw) and not path.exists():
            matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
            if not matches:
                raise DataError(
                    f"{self.label}: the pattern matches no files (looked for {path}); fix the pattern{self._start_note(raw)}"
                )
            files: list[Path] = []
            for m in matches:
                if m.is_dir():
                    found = self._walk(m)
                    self.walked.update(found)
                else:
                    found = [m]
                files.extend(found)
            # 'corpus/**' matches the folders and the files in them: each file is read once
            files = list(dict.fromkeys(files))
        elif path.is_dir():
            files = self._walk(path)
            self.walked.update(files)
            if not files:
                raise DataError(
                    f"{self.label}: folder {path} holds no text files (.txt, .md, code, .jsonl, .json, "
                    ".parquet); put documents there or point the source at them"
                )
        elif path.is_file():
            files = [path]
        else:
            raise DataError(f"{self.label}: {path} does not exist; fix the path{self._start_note(raw)}")
        return files

    def _start_note(self, raw: str) -> str:
        """Where a relative path in the recipe started, for a message (nothing for an absolute
        one: overrides arrive absolute, made so against the folder they were typed in); and for
        a Windows-style path, that folders are separated by /."""
        note = "" if Path(raw).expanduser().is_absolute() else f" (relative paths start at {self.base_dir})"
        if os.sep == "/" and any(c in raw for c in "\\\t\n\r"):
            note += (
                "; separate folders with / (a \\ is part of a file name here, and in double quotes YAML "
                "reads \\t as a tab)"
            )
        return note

    def check_local_files(self) -> None:
        """Raise DataError if a local file or folder this source names is missing (path sources
        are checked when they resolve; this adds an hf: source's local folder and data_files)."""
        if self.spec.kind == "hf":
            local = self._hf_local_dir()
            self._hf_data_files()
            if local is not None:
                self._check_saved_split(local)

    def _check_saved_split(self, local: Path) -> None:
        """DataError for a split a folder saved with save_to_disk does not hold, read from its
        metadata files: the load checks the same, but a cached source is not loaded, so `@train`
        on one saved Dataset was refused once and accepted once its shards were cached."""
        _, _, split = self.spec.hf_parts()
        try:
            if (local / "dataset_dict.json").is_file():
                splits = [str(x) for x in json.loads((local / "dataset_dict.json").read_text())["splits"]]
                if split not in splits:
                    raise DataError(_missing_split(self.label, local, split, splits))
            elif (local / "state.json").is_file() and "@" in self.spec.source[3:]:
                saved = json.loads((local / "state.json").read_text()).get("_split")
                if str(saved or "") != split:
                    raise DataError(_one_dataset(self.label, local, split, saved))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # unreadable metadata: loading the folder names the problem

    # -- identity ----------------------------------------------------------------------------
    def _file_stats(self, files: list[Path]) -> list[tuple[str, int, int]]:
        out = []
        for f in files:
            try:
                st = f.stat()
            except OSError as e:
                raise DataError(f"{self.label}: cannot read {f} ({e.strerror})") from e
            out.append((os.path.realpath(f), st.st_size, st.st_mtime_ns))
        return out

    def _identity_spec(self) -> dict[str, Any]:
        """The spec as the cache key sees it: local paths however spelled ('c.txt', '../x/c.txt',
        an absolute path, a symbolic link: a run's recipe.yaml records them absolute) as the one
        real path, so the same files find the same shards."""
        spec = self.spec.model_dump(mode="json")
        if spec.get("recall") is None:  # (absent from the keys of the sources that have none)
            spec.pop("recall", None)
        if self.spec.kind == "path":
            spec["source"] = os.path.realpath(self._resolve(self.spec.source))
        elif self.spec.kind == "hf":
            local = self.spec.hf_local_dir(self.base_dir)
            if local is not None:
                _, config, split = self.spec.hf_parts()
                spec["source"] = (
                    f"hf:{os.path.realpath(local)}" + (f":{config}" if config else "") + f"@{split}"
                )
            if spec.get("data_files"):
                spec["data_files"] = [os.path.realpath(self._resolve(f)) for f in self.spec.data_files or []]
        return spec

    def fingerprint(self) -> str:
        """Hash of everything the documents depend on, computed without reading them."""
        ident: dict[str, Any] = {
            "spec": self._identity_spec(),
            "files": self._file_stats(self.files),
        }
        if any(_suffix(f) == ".json" for f in self.walked):
            ident["folder_json"] = 2  # how a folder's .json files are read (2: configs as text)
        if self._reads_records_as_text:
            ident["records_as_text"] = self.records_as_text.key  # type: ignore[union-attr]
            ident["template_tokens"] = 1  # its template's markers encode as special tokens, as in training
        if self.spec.kind == "builtin":
            ident["python"] = sys.version
            ident["generator"] = 1  # bump when a builtin corpus generator changes its output
        if self.spec.kind == "hf":
            ident["data_files"] = self._file_stats(self._hf_data_files() or [])
            local = self._hf_local_dir()
            if local is not None:
                ident["local"] = self._file_stats(sorted(p for p in local.rglob("*") if p.is_file()))
        blob = json.dumps(ident, sort_keys=True).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()

    def estimated_bytes(self) -> int | None:
        """Rough size of the text, for progress bars (None when unknown)."""
        if self.spec.source == "builtin:needles":
            return builtin.needles_estimated_bytes(self.spec.needles)
        if self.spec.source == "builtin:recall":
            return recall.estimated_bytes(self.spec.recall or RecallSpec())
        if self.spec.kind == "hf":
            return None
        total = 0
        for f in self.files:
            try:
                total += f.stat().st_size * (4 if f.suffix.lower() == ".gz" else 1)
            except OSError:
                pass
        return total

    # -- bad records -------------------------------------------------------------------------
    def _bad(self, stats: SourceStats, policy: BadRecordPolicy, message: str) -> None:
        if policy == "error":
            raise DataError(f"{message}, or set data.on_bad_record: skip to drop such records")
        stats.bad_records += 1
        if len(stats.bad_examples) < _MAX_BAD_EXAMPLES:
            stats.bad_examples.append(message)

    # -- reading -----------------------------------------------------------------------------
    def _read(self, path: Path) -> bytes:
        try:
            with _open(path) as f:
                return f.read()
        except _READ_ERRORS as e:
            raise _unreadable(self.label, path, e) from e

    def _text_file(
        self, path: Path, stats: SourceStats, policy: BadRecordPolicy, data: bytes | None = None
    ) -> Iterator[str]:
        """The file (`data`, when already read) as one document."""
        data = self._read(path) if data is None else data
        try:
            yield data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            self._bad(
                stats,
                policy,
                f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert the file to UTF-8 or remove it",
            )

    def _json_document(self, path: Path) -> bytes | None:
        """The bytes of a `.json` file found in a folder when it is a document rather than
        records: not a list, not JSON lines, not an object with the text field (a config such as
        package.json, or not JSON at all, such as a tsconfig.json with comments); else None."""
        data = self._read(path)
        if data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
            return None  # a list of records: not parsed twice
        try:
            obj = json.loads(data)
        except json.JSONDecodeError as e:
            return None if e.msg == "Extra data" else data  # JSON lines are records
        except UnicodeDecodeError:
            return None  # neither: the record reader names the file
        return data if isinstance(obj, dict) and self.spec.text_field not in obj else None

    def _json_objects(
        self, path: Path, stats: SourceStats, policy: BadRecordPolicy
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, record) for each JSON object of a .jsonl / .json file."""
        if _suffix(path) == ".json":
            try:
                with _open(path) as f:
                    content = f.read()
                obj = json.loads(content)
                escapes = _SURROGATE_ESCAPE.search(content)  # (bytes: `_open` reads binary)
            except json.JSONDecodeError as e:
                if e.msg != "Extra data":
                    raise DataError(
                        f"{path}, line {e.lineno}: not valid JSON ({_json_reason(e)}); fix the file "
                        "(a .json source holds a list of records or JSON lines)"
                    ) from e
                obj = None  # JSON lines in a .json file
            except UnicodeDecodeError as e:
                raise DataError(f"{self.label}: cannot read {path} ({e})") from e
            except _READ_ERRORS as e:
                raise _unreadable(self.label, path, e) from e
            if obj is not None:
                items = obj if isinstance(obj, list) else [obj]
                for i, item in enumerate(items):
                    where = f"{path}, record {i}"
                    if escapes and (bad := _lone_surrogate(item)) is not None:
                        self._bad(stats, policy, f"{where}: {bad}{LONE_SURROGATE}")
                        continue
                    if isinstance(item, dict):
                        yield where, item
                    elif isinstance(item, str):
                        yield where, {self.spec.text_field: item}
                    else:
                        self._bad(
                            stats,
                            policy,
                            f"{where}: a JSON {type(item).__name__}, not an object; fix the record",
                        )
                return
        try:
            with _open(path) as f:
                for n, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    where = f"{path}, line {n}"
                    try:
                        obj = json.loads(raw.rstrip(b"\r\n"))
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        reason = _json_reason(e) if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                        self._bad(
                            stats, policy, f"{where}: not valid JSON ({reason}); fix or delete the line"
                        )
                        continue
                    if not isinstance(obj, dict):
                        self._bad(
                            stats,
                            policy,
                            f"{where}: a JSON {type(obj).__name__}, not an object; fix the line",
                        )
                        continue
                    if _SURROGATE_ESCAPE.search(raw) and (bad := _lone_surrogate(obj)) is not None:
                        self._bad(stats, policy, f"{where}: {bad}{LONE_SURROGATE}")
                        continue
                    yield where, obj
        except _READ_ERRORS as e:
            raise _unreadable(self.label, path, e) from e

    def _parquet_rows(
        self, path: Path, columns: list[str], chat: bool = False
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, row) of the Parquet file's `columns`; `chat`: instruction records, whose rows
        may instead hold a `messages` column (chat records)."""
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(
                f"{path}: reading Parquet needs pyarrow; install it with pip install 'difftrain[parquet]'"
            ) from e
        if path.name.lower().endswith(".gz"):
            raise DataError(
                f"{path}: a gzip-compressed Parquet file cannot be read in place (Parquet compresses its own "
                "columns); decompress it with gunzip and name the .parquet file"
            )
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise DataError(f"{path}: not a readable Parquet file ({e}); check the file") from e
        names = pf.schema_arrow.names
        columns = _columns_read(columns, names, chat, f"{path}: Parquet file", self.label)
        row = 0
        for batch in pf.iter_batches(columns=columns, batch_size=1024):
            cols = [batch.column(i).to_pylist() for i in range(len(columns))]
            for values in zip(*cols, strict=True):
                yield f"{path}, row {row}", dict(zip(columns, values, strict=True))
                row += 1

    def _hf_data_files(self) -> list[Path] | None:
        """The files an hf: source's data_files name, globs expanded (None without data_files);
        resolved once per Source: the checks, the cache key and the load each ask for them."""
        if not self.spec.data_files:
            return None
        if self._data_files is None:
            self._data_files = self._expand_data_files(self.spec.data_files)
        return self._data_files

    def _expand_data_files(self, entries: list[str]) -> list[Path]:
        files: list[Path] = []
        for raw in entries:
            p = self._resolve(raw)
            # a file that exists as written is that file (its name may hold [ ] * ?), as for a path source
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
        return files

    def _hf_local_dir(self) -> Path | None:
        p = self.spec.hf_local_dir(self.base_dir)
        if p is None:
            return None
        if not p.exists():
            raise DataError(f"{self.label}: local dataset folder {p} does not exist; fix the path")
        return p

    def record_fields(self) -> set[str] | None:
        """The field names of the source's records as its first record shows them: a dataset's
        columns, a Parquet file's schema, the first JSON object of a .jsonl/.json file (empty when
        it holds none); None where they cannot be told without reading the records (a streaming
        dataset without column names, a Parquet file pyarrow cannot open: reading names the
        problem). Sources of other files have no record fields: an empty set."""
        if self.spec.kind == "hf":
            names = getattr(self._hf_dataset(), "column_names", None)
            return None if names is None else set(names)
        if not self.files or _suffix(self.files[0]) not in RECORD_SUFFIXES:
            return set()
        first = self.files[0]
        if _suffix(first) == ".parquet":
            try:
                import pyarrow.parquet as pq

                return set(pq.ParquetFile(first).schema_arrow.names)
            except Exception:
                return None
        record = next(self._json_objects(first, SourceStats(self.spec.source), "skip"), None)
        return set(record[1]) if record else set()

    def _hf_dataset(self) -> Any:
        """The dataset of an hf: source, loaded once per Source (a reader asks for it again)."""
        if self._hf is None:
            self._hf = self._load_hf_dataset()
        return self._hf

    def _load_hf_dataset(self) -> Any:
        try:
            import datasets
        except ImportError as e:
            raise DataError(
                f"{self.label}: hf: sources need the `datasets` library; install it with "
                "pip install 'difftrain[hf]'"
            ) from e
        name, config, split = self.spec.hf_parts()
        local = self._hf_local_dir()
        builder = local is None and _packaged_builder(name)  # hf:json etc.: local files, no Hub
        if builder and not self.spec.data_files:
            raise DataError(
                f"{self.label}: hf:{name} reads local files and needs data_files; add data_files: [FILE, ...] "
                "to this source (or name the files as sources themselves)"
            )
        unreachable = _unreachable_hub() if local is None and not builder else None
        saved = local is not None and any(
            (local / f).exists() for f in ("state.json", "dataset_dict.json", "dataset_info.json")
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
        try:
            if saved:
                ds = datasets.load_from_disk(str(local))
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise DataError(_missing_split(self.label, local, split, list(ds)))
                    ds = ds[split]
                elif "@" in self.spec.source[3:] and str(getattr(ds, "split", None) or "") != split:
                    # one saved Dataset holds no splits: reading all of it as "@split" would hide
                    # that the split asked for is not there
                    raise DataError(_one_dataset(self.label, local, split, getattr(ds, "split", None)))
                return ds
            files = self._hf_data_files()
            with _hub_offline(unreachable is not None), _quiet_datasets(local is not None or builder):
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
            text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if "split" in str(e).lower() and isinstance(e, (ValueError, KeyError)):
                hint = "choose an existing split with hf:<dataset>[:<config>]@<split>"
            elif builder and all(f.stat().st_size == 0 for f in self._hf_data_files() or []):
                raise DataError(
                    f"{self.label}: its data_files are empty; point data_files at files that hold records"
                ) from e
            elif builder:  # the files are at fault: datasets hides the reason in the exception's cause
                why = e.__cause__ or e.__context__
                if why is not None and str(why):
                    text = f"{text}; {type(why).__name__}: {str(why).splitlines()[0]}"
                raise DataError(
                    f"{self.label}: datasets' {name} builder could not read data_files ({text}); fix the "
                    "file, or name it as a source itself (data.sources: [FILE]) to get the line of each "
                    "bad record"
                ) from e
            elif unreachable is not None and (self.base_dir / name).is_dir():  # a local folder, unmarked
                raise DataError(
                    f"{self.label}: '{name}' is read as a Hugging Face Hub dataset name, which cannot be reached "
                    f"from this machine; for the folder {self.base_dir / name} write source 'hf:./{name}'"
                ) from e
            elif unreachable is not None:  # the cache was read already: HF_DATASETS_OFFLINE adds nothing
                text = f"{unreachable} cannot be reached from this machine and the dataset is not in the local cache"
                hint = (
                    "download it where there is network, save it with dataset.save_to_disk(DIR) and use "
                    "source 'hf:DIR'; for local files use e.g. source 'hf:json' with data_files"
                )
            elif local is not None:  # nothing to download: the folder is at fault
                hint = (
                    f"check the folder {local}: a dataset written by save_to_disk (an empty one cannot be "
                    "read), or data files datasets can read, with hf:PATH:CONFIG naming a config it has"
                )
            else:
                offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))  # (datasets read the env)
                hint = (
                    "if this machine is offline, download the dataset where there is network, "
                    "save it with dataset.save_to_disk(DIR) and use source 'hf:DIR'"
                    + (
                        ""
                        if offline
                        else " (or set HF_DATASETS_OFFLINE=1 to use the local Hugging Face cache)"
                    )
                    + "; for local files use e.g. source 'hf:json' with data_files"
                )
            raise DataError(
                f"{self.label}: could not load Hugging Face dataset '{name}' ({text}); {hint}"
            ) from e

    def _hf_rows(self, columns: list[str], chat: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, row) of the dataset's `columns`; `chat` as for `_parquet_rows`."""
        ds = self._hf_dataset()
        names = getattr(ds, "column_names", None)
        if names is not None:
            columns = _columns_read(columns, names, chat, f"{self.label}: dataset", "this source")
            ds = ds.select_columns(columns)
        row = 0
        for batch in ds.iter(batch_size=1000):
            for values in zip(
                *(batch.get(c, [None] * len(next(iter(batch.values())))) for c in columns), strict=True
            ):
                yield f"{self.label}, row {row}", dict(zip(columns, values, strict=True))
                row += 1

    def _records(
        self, columns: list[str], stats: SourceStats, policy: BadRecordPolicy
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, record) from record-shaped inputs (jsonl/json/parquet/hf): instruction records,
        prompt/response `columns` or chat records' `messages`."""
        if self.spec.kind == "hf":
            yield from self._hf_rows(columns, chat=True)
            return
        for path in self.files:
            stats.files += 1
            suffix = _suffix(path)
            if suffix == ".parquet":
                yield from self._parquet_rows(path, columns, chat=True)
            elif suffix in (".jsonl", ".json"):
                yield from self._json_objects(path, stats, policy)
            else:
                raise DataError(
                    f"{path}: plain text files hold documents, not prompt/response records; use a .jsonl, "
                    ".json or .parquet file for fine-tuning data"
                )

    def _field(
        self,
        where: str,
        rec: dict[str, Any],
        name: str,
        key: str,
        stats: SourceStats,
        policy: BadRecordPolicy,
    ) -> str | None:
        if name not in rec:
            have = ", ".join(sorted(map(str, rec))) or "none"
            if key == "text_field" and isinstance(rec.get("messages"), list):
                self._bad(stats, policy, f"{where}: {CHAT_RECORD_AS_TEXT}")
                return None
            self._bad(
                stats,
                policy,
                f"{where}: record has no field '{name}' (fields: {have}); set {key}: <field> on {self.label}",
            )
            return None
        value = rec[name]
        if not isinstance(value, str):
            self._bad(
                stats,
                policy,
                f"{where}: field '{name}' is {'null' if value is None else type(value).__name__}, not a string; "
                "fix the record",
            )
            return None
        return value

    def documents(self, stats: SourceStats, policy: BadRecordPolicy = "error") -> Iterator[str]:
        """The documents of this source, in a deterministic order; updates `stats`."""
        limit = self.spec.max_documents
        for text in self._raw_documents(stats, policy):
            if not text:
                continue
            stats.documents += 1
            stats.bytes += len(text.encode("utf-8"))
            yield text
            if limit is not None and stats.documents >= limit:
                return

    @property
    def spells_special_tokens(self) -> bool:
        """Whether the documents are records rendered through a fine-tune's template, whose
        markers (<|user|>, <|end|>, ...) are special tokens: they encode as those tokens, as the
        fine-tune's training encoded them; other text that spells one encodes it as plain text."""
        return self._reads_records_as_text

    @property
    def _reads_records_as_text(self) -> bool:
        plain = self.spec.kind == "builtin" and self.spec.source != "builtin:python-docstrings"
        return self.records_as_text is not None and not plain

    def _raw_documents(self, stats: SourceStats, policy: BadRecordPolicy) -> Iterator[str]:
        src = self.spec.source
        if self._reads_records_as_text:
            render = self.records_as_text.render  # type: ignore[union-attr]
            for rec in self._record_stream(stats, policy, lambda m: render({"messages": m})):
                yield render(rec)
            return
        if src == "builtin:python-stdlib":
            stats.files = len(self.files)
            yield from builtin.python_stdlib_documents(self.files)
        elif src == "builtin:python-docstrings":
            stats.files = len(self.files)
            for rec in builtin.python_docstring_records(self.spec.docstrings, self.files):
                yield rec["prompt"] + rec["response"]
        elif src == "builtin:needles":
            yield from builtin.needle_documents(self.spec.needles)
        elif src == "builtin:recall":
            yield from recall.recall_documents(self.spec.recall or RecallSpec())
        elif self.spec.kind == "hf":
            f = self.spec.text_field
            for where, rec in self._hf_rows([f]):
                text = self._field(where, rec, f, "text_field", stats, policy)
                if text is not None:
                    yield text
        else:
            f = self.spec.text_field
            for path in self.files:
                suffix = _suffix(path)
                text = self._json_document(path) if suffix == ".json" and path in self.walked else None
                if text is not None:
                    stats.files += 1
                    stats.json_documents += 1
                    yield from self._text_file(path, stats, policy, text)
                elif suffix in RECORD_SUFFIXES:
                    stats.files += 1
                    rows = (
                        self._parquet_rows(path, [f])
                        if suffix == ".parquet"
                        else self._json_objects(path, stats, policy)
                    )
                    for where, rec in rows:
                        text = self._field(where, rec, f, "text_field", stats, policy)
                        if text is not None:
                            yield text
                else:
                    stats.files += 1
                    yield from self._text_file(path, stats, policy)

    def records(
        self,
        stats: SourceStats,
        policy: BadRecordPolicy = "error",
        check_messages: Callable[[list[Any]], object] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Instruction records {"prompt", "response", ...} of this source (fine-tuning data).

        `prompt_field` / `response_field` are renamed to "prompt" / "response"; other fields of
        jsonl/json records are kept (a chat template may use them). A .jsonl/.json record with
        `messages` (a list of {role, content}) and no prompt field is passed on as it is, once
        `check_messages` (the chat template's rendering) accepts it: a DataError it raises makes
        the record a bad one, named with its file and line (and skipped under `skip`).
        """
        limit = self.spec.max_documents
        count = 0
        for rec in self._record_stream(stats, policy, check_messages):
            stats.documents += 1
            if "messages" in rec and "prompt" not in rec:
                stats.bytes += sum(len(str(m.get("content", "")).encode("utf-8")) for m in rec["messages"])
            else:
                stats.bytes += len(rec["prompt"].encode("utf-8")) + len(rec["response"].encode("utf-8"))
            yield rec
            count += 1
            if limit is not None and count >= limit:
                return

    def _record_stream(
        self,
        stats: SourceStats,
        policy: BadRecordPolicy,
        check_messages: Callable[[list[Any]], object] | None,
    ) -> Iterator[dict[str, Any]]:
        """The source's instruction records, uncounted (`records` counts them and applies
        max_documents; `documents` does, for records read as text)."""
        src = self.spec.source
        if src == "builtin:python-docstrings":
            stats.files = len(self.files)
            return builtin.python_docstring_records(self.spec.docstrings, self.files)
        if self.spec.kind == "builtin":
            raise DataError(
                f"{self.label}: '{src}' holds plain documents, not prompt/response records; fine-tune on "
                "builtin:python-docstrings or on a .jsonl of records"
            )
        return self._checked_records(stats, policy, check_messages)

    def _checked_records(
        self,
        stats: SourceStats,
        policy: BadRecordPolicy,
        check_messages: Callable[[list[Any]], object] | None,
    ) -> Iterator[dict[str, Any]]:
        pf, rf = self.spec.prompt_field, self.spec.response_field
        for where, rec in self._records([pf, rf], stats, policy):
            # a chat record, rendered by the chat template: `messages` without a whole prompt/response
            # pair (chat datasets often keep the first user turn as `prompt` too, e.g. UltraChat), as
            # a table source's columns are chosen (`_columns_read`)
            if "messages" in rec and not (pf in rec and rf in rec):
                rec = {k: v for k, v in rec.items() if k not in ("prompt", "response")}
                if not (
                    isinstance(rec["messages"], list) and all(isinstance(m, dict) for m in rec["messages"])
                ):
                    self._bad(
                        stats, policy, f"{where}: 'messages' must be a list of {{role, content}} objects"
                    )
                    continue
                if check_messages is not None:
                    try:
                        check_messages(rec["messages"])
                    except DataError as e:
                        self._bad(stats, policy, f"{where}: {e}")
                        continue
                yield rec
                continue
            prompt = self._field(where, rec, pf, "prompt_field", stats, policy)
            if prompt is None:
                continue
            response = self._field(where, rec, rf, "response_field", stats, policy)
            if response is None:
                continue
            out = dict(rec)  # the record's own names stay usable in prompt_format (e.g. {instruction})
            out["prompt"], out["response"] = prompt, response
            yield out


def _columns_read(columns: list[str], names: list[str], chat: bool, what: str, where: str) -> list[str]:
    """The columns to read of a table whose columns are `names`: `columns`, or, for instruction
    records (`chat`), ["messages"] where the table holds chat records instead; else a DataError
    saying which option names the right ones."""
    missing = [c for c in columns if c not in names]
    if not missing:
        return columns
    if chat and "messages" in names:
        return ["messages"]
    wanted = ", ".join(repr(c) for c in missing)
    if not chat and "messages" in names:  # text_field: messages would name a list, not text
        raise DataError(f"{what} holds {CHAT_RECORD_AS_TEXT}")
    fix = (
        f"set prompt_field/response_field on {where}, or give chat records a 'messages' column"
        if chat
        else f"set text_field on {where}"
    )
    raise DataError(f"{what} has no column {wanted} (columns: {', '.join(names)}); {fix}")


def resolve_sources(
    data_cfg: DataConfig, base_dir: str | os.PathLike[str], records_as_text: RecordText | None = None
) -> list[Source]:
    """Resolve every entry of `data.sources` (paths checked now, text read later)."""
    base = Path(base_dir).expanduser().resolve()
    return [Source(spec, i, base, records_as_text=records_as_text) for i, spec in enumerate(data_cfg.sources)]


def check_local_sources(data_cfg: DataConfig, base_dir: str | os.PathLike[str]) -> None:
    """Raise DataError for a local file or folder of `data.sources` that is missing, or read by
    two sources (`check_distinct`), reading none of the data (the dry runs of pretrain and
    finetune)."""
    sources = resolve_sources(data_cfg, base_dir)  # path sources are checked as they resolve
    for source in sources:
        source.check_local_files()
    check_distinct(sources)


def _missing_split(label: str, local: Path, split: str, splits: list[str]) -> str:
    return f"{label}: no split '{split}' in {local} (splits: {', '.join(splits)}); choose one with hf:<path>@<split>"


def _one_dataset(label: str, local: Path, split: str, saved_split: Any) -> str:
    saved = f" (saved from split '{saved_split}')" if saved_split else ""
    return f"{label}: {local} holds one dataset{saved}, not a DatasetDict of splits; leave out @{split} to read all of it"


def check_distinct(sources: list[Source]) -> None:
    """Raise DataError where two sources read the same documents: the same file (a folder and a
    file in it, a file and a glob that matches it) or the same dataset, read the same way. Each
    source is split into training and validation documents on its own (by its place in the
    list), so a document held out of one copy would be trained on through the other, and the
    validation loss would read low; a source's weight is how to count it more than once."""
    seen: dict[tuple[Any, ...], Source] = {}
    for src in sources:
        # how the source reads its documents (fields, a builtin's settings: nested sections too)
        how = json.dumps(
            src.spec.model_dump(
                mode="json", exclude={"source", "weight", "data_files", "max_documents", "streaming"}
            ),
            sort_keys=True,
        )
        keys: list[tuple[Any, ...]]
        if src.spec.kind == "path":
            keys = [("file", f.resolve(), how) for f in src.files]
        elif src.spec.kind == "hf":  # its local files and folder, however spelled (a link, ./x)
            files = [f.resolve() for f in src._hf_data_files() or []]
            twice = next((f for i, f in enumerate(files) if f in files[:i]), None)
            if twice is not None:
                raise DataError(
                    f"{src.label}: data_files name {twice} more than once (two entries or patterns match "
                    "it), so its documents would be read twice and validation documents trained on; "
                    "name each file once"
                )
            keys = [("file", f, how) for f in files]
            local = src._hf_local_dir()
            if local is not None:
                _, config, split = src.spec.hf_parts()
                keys.append(("folder", Path(os.path.realpath(local)), config, split, how))
            if not keys:  # a hub dataset: its name as written
                keys = [("spec", src.spec.source, how)]
        else:
            keys = [("spec", src.spec.source, tuple(src.spec.data_files or ()), how)]
        for key in keys:
            other = seen.setdefault(key, src)
            if other is not src:
                what = f"both read {key[1]}" if key[0] in ("file", "folder") else "are the same source"
                raise DataError(
                    f"{other.label} and {src.label} {what}: each would be split into training and "
                    "validation on its own, so validation documents would be trained on; read it "
                    "through one source (to count a source more, give it a weight, e.g. weight: 2)"
                )


def sources_fingerprint(sources: list[Source]) -> str:
    """One hash over all sources, in order."""
    h = hashlib.sha256()
    for s in sources:
        h.update(s.fingerprint().encode())
    return h.hexdigest()


def iter_documents(data_cfg: DataConfig, base_dir: str | os.PathLike[str]) -> Iterator[str]:
    """All documents of all sources, in order (weights not applied). For quick inspection."""
    for src in resolve_sources(data_cfg, base_dir):
        stats = SourceStats(src.spec.source)
        yield from src.documents(stats, data_cfg.on_bad_record)
        require_documents(src, stats)


def require_documents(src: Source, stats: SourceStats) -> None:
    if stats.documents == 0 and stats.bad_records:
        n = stats.bad_records
        raise DataError(
            f"{src.label}: every record is malformed ({n} skipped by data.on_bad_record: skip), so the "
            "source yielded no documents; with data.on_bad_record=error the first one is named with "
            "its line (a wrong text_field?) — fix the records, or remove the source from data.sources"
        )
    if stats.documents == 0:
        raise DataError(
            f"{src.label}: the source yielded no documents; it is empty — point it at text, or "
            "remove it from data.sources"
        )


def _unreachable_hub() -> str | None:
    """The Hugging Face Hub's host when its name does not resolve (an offline machine), else None.

    Offline, `datasets` retries each request five times over ~25 s, printing every retry, before
    it falls back to its cache; one name lookup finds out at once. Already-offline settings
    (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) skip the lookup.
    """
    if any(
        os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    ):
        return None
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):  # UnicodeError: a name no lookup takes (HF_ENDPOINT=http://a..b)
        return host
    return None


def _packaged_builder(name: str) -> bool:
    """Whether `name` is one of `datasets`' own builders (json, csv, parquet, text, ...), which read
    local data_files and need no Hub."""
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    except ImportError:  # a layout of a future datasets: ask the Hub, as for any name
        return False
    return name in _PACKAGED_DATASETS_MODULES


@contextmanager
def _quiet_datasets(quiet: bool) -> Iterator[None]:
    """Without `datasets`' progress bars and log lines while `quiet` (reading local files: the
    library never prints, and errors come back as one DataError); a Hub download keeps its bars."""
    if not quiet:
        yield
        return
    import datasets.utils as ds_utils
    from datasets.utils import logging as ds_logging

    bars_off, level = ds_utils.are_progress_bars_disabled(), ds_logging.get_verbosity()
    ds_utils.disable_progress_bars()
    ds_logging.set_verbosity(ds_logging.CRITICAL)  # a bad file is logged as an error, then raised
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if not bars_off:
            ds_utils.enable_progress_bars()


@contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """Run `datasets` in offline mode (it reads its local cache only) while `offline`."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved
