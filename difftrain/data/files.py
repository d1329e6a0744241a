"""Reading local files: formats by suffix (through a trailing .gz), JSON records, Parquet rows.

A reader reports a malformed record to its `bad(message)` callback (which raises, or counts and
skips it: `data.on_bad_record`) and raises a DataError naming the file for one it cannot read.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from difftrain.data.hub import columns_read
from difftrain.errors import DataError
from difftrain.io import json_error_reason as _json_reason

Bad = Callable[[str], None]
RECORD_SUFFIXES = frozenset({".jsonl", ".json", ".parquet"})
TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .org .py .pyi .c .h .cc .cpp .cxx .hpp .cu .cuh .rs .go "
    ".java .kt .scala .js .mjs .ts .jsx .tsx .rb .php .sh .bash .zsh .fish .lua .pl .r .jl .swift .m "
    ".mm .sql .html .htm .css .scss .xml .yaml .yml .toml .ini .cfg .csv .tsv .hs .ml .mli .ex .exs "
    ".el .clj .vim .cs .fs .dart .zig .nim .f90 .v .sv .proto .cmake .mk".split()
)
"""File types read when walking a directory (an explicitly named file is read whatever its type)."""

BadRecordPolicy = Literal["error", "skip"]
MAX_BAD_EXAMPLES = 5


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
    """`.json` files of a folder read as text (configs, not records: `json_document`)."""


def suffix(path: Path) -> str:
    """The format suffix of a file, looking through a trailing .gz."""
    return Path(path.name.lower().removesuffix(".gz")).suffix


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
    'meta' " for a record's top-level field, "" for the value itself; None where it holds none
    (the whole record is refused: a template may read any of its fields)."""
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


def read_bytes(label: str, path: Path) -> bytes:
    try:
        with _open(path) as f:
            return f.read()
    except _READ_ERRORS as e:
        raise _unreadable(label, path, e) from e


def text_document(path: Path, data: bytes, bad: Bad) -> Iterator[str]:
    """`data` (the bytes of `path`) as one document."""
    try:
        yield data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        bad(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert the file to UTF-8 or remove it")


def json_document(data: bytes, text_field: str) -> bool:
    """Whether a `.json` file found in a folder is a document rather than records: not a list,
    not JSON lines, not an object with the text field (package.json, a tsconfig.json with
    comments)."""
    if data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return False  # a list of records: not parsed twice
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        return e.msg != "Extra data"  # JSON lines are records
    except UnicodeDecodeError:
        return False  # neither: the record reader names the file
    return isinstance(obj, dict) and text_field not in obj


def json_objects(path: Path, label: str, text_field: str, bad: Bad) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for each JSON object of a .jsonl / .json file (a .json file: a list of
    records or of strings, one record, or JSON lines)."""
    if suffix(path) == ".json":
        try:
            content = read_bytes(label, path)
            obj = json.loads(content)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":
                raise DataError(
                    f"{path}, line {e.lineno}: not valid JSON ({_json_reason(e)}); fix the file "
                    "(a .json source holds a list of records or JSON lines)"
                ) from e
            obj = None  # JSON lines in a .json file
        except UnicodeDecodeError as e:
            raise DataError(f"{label}: cannot read {path} ({e})") from e
        if obj is not None:
            escapes = _SURROGATE_ESCAPE.search(content)
            for i, item in enumerate(obj if isinstance(obj, list) else [obj]):
                where = f"{path}, record {i}"
                if escapes and (at := _lone_surrogate(item)) is not None:
                    bad(f"{where}: {at}{LONE_SURROGATE}")
                elif isinstance(item, dict):
                    yield where, item
                elif isinstance(item, str):
                    yield where, {text_field: item}
                else:
                    bad(f"{where}: a JSON {type(item).__name__}, not an object; fix the record")
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
                    bad(f"{where}: not valid JSON ({reason}); fix or delete the line")
                    continue
                if not isinstance(obj, dict):
                    bad(f"{where}: a JSON {type(obj).__name__}, not an object; fix the line")
                elif _SURROGATE_ESCAPE.search(raw) and (at := _lone_surrogate(obj)) is not None:
                    bad(f"{where}: {at}{LONE_SURROGATE}")
                else:
                    yield where, obj
    except _READ_ERRORS as e:
        raise _unreadable(label, path, e) from e


def parquet_rows(
    path: Path, columns: list[str], label: str, chat: bool = False
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of the Parquet file's `columns` (`chat`: see `columns_read`)."""
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
    columns = columns_read(columns, pf.schema_arrow.names, chat, f"{path}: Parquet file", label)
    row, batches = 0, pf.iter_batches(columns=columns, batch_size=1024)
    while True:
        try:  # a damaged page fails where it is read
            batch = next(batches, None)
        except Exception as e:
            raise DataError(
                f"{path}: not a readable Parquet file after row {row} ({e}); check the file"
            ) from e
        if batch is None:
            return
        for values in zip(*(batch.column(i).to_pylist() for i in range(len(columns))), strict=True):
            yield f"{path}, row {row}", dict(zip(columns, values, strict=True))
            row += 1
