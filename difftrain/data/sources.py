"""Data sources: turn `data.sources` entries into streams of documents (or SFT records).

A source is a local path (file, folder read recursively, or glob), `builtin:NAME` or
`hf:<dataset>[:<config>][@<split>]`, read lazily in a deterministic order (sorted paths). Its
*fingerprint* (a hash of its spec and its files' paths, sizes and mtimes) keys the shard cache.

`.jsonl` / `.json` / `.parquet` files hold one document per record (its `text_field`); any other
file is one UTF-8 document; `.gz` files are decompressed. A `.json` file found in a folder may be
one document of text instead (`files.json_document`); one named itself is always records.

Malformed input raises a DataError naming the file (and line or row) and the fix; with
`data.on_bad_record: skip` a malformed record is dropped and counted in `SourceStats`.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import difftrain.data.builtin as builtin
import difftrain.data.recall as recall
from difftrain.data.config import DataConfig, RecallSpec, SourceSpec, resolve_path
from difftrain.data.files import (
    MAX_BAD_EXAMPLES,
    RECORD_SUFFIXES,
    TEXT_SUFFIXES,
    BadRecordPolicy,
    SourceStats,
    json_document,
    json_objects,
    parquet_rows,
    read_bytes,
    suffix,
    text_document,
)
from difftrain.data.hub import CHAT_RECORD_AS_TEXT, HubDataset
from difftrain.errors import DataError


@dataclass(frozen=True)
class RecordText:
    """How a source of instruction records is read as text: each record becomes the document
    `render(record)` (a fine-tune's template, as training saw it); `key` names the rendering in
    the fingerprint."""

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
        """Set: instruction records are read as text through it; plain-text sources ignore it."""
        self.base_dir = base_dir
        self.hub = HubDataset(self) if spec.kind == "hf" else None
        self.walked: set[Path] = set()
        """The files found by walking a folder (not named by the source itself)."""
        stdlib = spec.source in ("builtin:python-stdlib", "builtin:python-docstrings")
        self.files = self._expand_paths() if spec.kind == "path" else builtin.stdlib_files() if stdlib else []

    @property
    def label(self) -> str:
        return self.name or f"data.sources[{self.index}] ('{self.spec.source}')"

    def _resolve(self, raw: str) -> Path:
        return resolve_path(raw, self.base_dir)

    def _walk(self, root: Path) -> list[Path]:
        """The readable files under `root` (hidden ones left out), sorted; noted as walked."""
        found = sorted(
            p
            for p in root.rglob("*")
            if not any(part.startswith(".") for part in p.relative_to(root).parts)
            and p.is_file()
            and (suffix(p) in TEXT_SUFFIXES or suffix(p) in RECORD_SUFFIXES)
        )
        self.walked.update(found)
        return found

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
            # 'corpus/**' matches the folders and the files in them: each file is read once
            return list(dict.fromkeys(f for m in matches for f in (self._walk(m) if m.is_dir() else [m])))
        if path.is_file():
            return [path]
        if not path.is_dir():
            raise DataError(f"{self.label}: {path} does not exist; fix the path{self._start_note(raw)}")
        if files := self._walk(path):
            return files
        raise DataError(
            f"{self.label}: folder {path} holds no text files (.txt, .md, code, .jsonl, .json, "
            ".parquet); put documents there or point the source at them"
        )

    def _start_note(self, raw: str) -> str:
        """For a message: where a relative path started; for a Windows-style path, to use /."""
        note = "" if Path(raw).expanduser().is_absolute() else f" (relative paths start at {self.base_dir})"
        if os.sep == "/" and any(c in raw for c in "\\\t\n\r"):
            note += (
                "; separate folders with / (a \\ is part of a file name here, and in double quotes YAML "
                "reads \\t as a tab)"
            )
        return note

    def check_local_files(self) -> None:
        """DataError where an hf: source's local folder, data_files or split is missing (path
        sources are checked when they resolve)."""
        if self.hub is not None:
            local = self.hub.local_dir()
            self.hub.data_files()
            if local is not None:
                self.hub.check_saved_split(local)

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
        """The spec with its local paths as real paths, so the same files find the same shards
        however they are spelled (relative, absolute, through a link)."""
        # recall: absent from the keys of the sources that have none
        spec = self.spec.model_dump(mode="json", exclude={"recall"} if self.spec.recall is None else None)
        if self.spec.kind == "path":
            spec["source"] = os.path.realpath(self._resolve(self.spec.source))
        elif self.spec.kind == "hf":
            local = self.spec.hf_local_dir(self.base_dir)
            if local is not None:
                _, config, split = self.spec.hf_parts()
                spec["source"] = f"hf:{os.path.realpath(local)}{f':{config}' if config else ''}@{split}"
            if spec.get("data_files"):
                spec["data_files"] = [os.path.realpath(self._resolve(f)) for f in self.spec.data_files or []]
        return spec

    def fingerprint(self) -> str:
        """Hash of everything the documents depend on, computed without reading them."""
        ident: dict[str, Any] = {
            "spec": self._identity_spec(),
            "files": self._file_stats(self.files),
        }
        if any(suffix(f) == ".json" for f in self.walked):
            ident["folder_json"] = 2  # how a folder's .json files are read (2: configs as text)
        if self.spells_special_tokens:
            ident["records_as_text"] = self.records_as_text.key  # type: ignore[union-attr]
            ident["template_tokens"] = 1  # its template's markers encode as special tokens, as in training
        if self.spec.kind == "builtin":
            ident["python"] = sys.version
            ident["generator"] = 1  # bump when a builtin corpus generator changes its output
        if self.hub is not None:
            ident["data_files"] = self._file_stats(self.hub.data_files() or [])
            local = self.hub.local_dir()
            if local is not None:
                ident["local"] = self._file_stats(sorted(p for p in local.rglob("*") if p.is_file()))
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode("utf-8")).hexdigest()

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
            with contextlib.suppress(OSError):
                total += f.stat().st_size * (4 if f.suffix.lower() == ".gz" else 1)
        return total

    def _bad(self, stats: SourceStats, policy: BadRecordPolicy, message: str) -> None:
        if policy == "error":
            raise DataError(f"{message}, or set data.on_bad_record: skip to drop such records")
        stats.bad_records += 1
        if len(stats.bad_examples) < MAX_BAD_EXAMPLES:
            stats.bad_examples.append(message)

    def _rows(
        self, path: Path, columns: list[str], stats: SourceStats, policy: BadRecordPolicy, chat: bool = False
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, record) of a .jsonl / .json / .parquet file (`chat`: see `parquet_rows`)."""
        if suffix(path) == ".parquet":
            return parquet_rows(path, columns, self.label, chat)
        return json_objects(path, self.label, self.spec.text_field, lambda m: self._bad(stats, policy, m))

    def _texts(
        self, rows: Iterator[tuple[str, dict[str, Any]]], stats: SourceStats, policy: BadRecordPolicy
    ) -> Iterator[str]:
        texts = (
            self._field(where, rec, self.spec.text_field, "text_field", stats, policy) for where, rec in rows
        )
        yield from (t for t in texts if t is not None)

    def record_fields(self) -> set[str] | None:
        """The field names of the source's records as its first record shows them (a dataset's
        columns, a Parquet schema, a .jsonl/.json file's first object); an empty set for other
        sources; None where they cannot be told without reading (then reading names the problem)."""
        if self.hub is not None:
            names = getattr(self.hub.dataset(), "column_names", None)
            return None if names is None else set(names)
        if not self.files or suffix(self.files[0]) not in RECORD_SUFFIXES:
            return set()
        first = self.files[0]
        if suffix(first) == ".parquet":
            try:
                import pyarrow.parquet as pq

                return set(pq.ParquetFile(first).schema_arrow.names)
            except Exception:
                return None
        record = next(self._rows(first, [], SourceStats(self.spec.source), "skip"), None)
        return set(record[1]) if record else set()

    def _field(
        self,
        where: str,
        rec: dict[str, Any],
        name: str,
        key: str,
        stats: SourceStats,
        policy: BadRecordPolicy,
    ) -> str | None:
        """Field `name` of a record (`key`: the setting that names it), or None for a bad record."""
        value = rec.get(name)
        if isinstance(value, str):
            return value
        if name in rec:
            what = "null" if value is None else type(value).__name__
            problem = f"field '{name}' is {what}, not a string; fix the record"
        elif key == "text_field" and isinstance(rec.get("messages"), list):
            problem = CHAT_RECORD_AS_TEXT
        else:
            have = ", ".join(sorted(map(str, rec))) or "none"
            problem = f"record has no field '{name}' (fields: {have}); set {key}: <field> on {self.label}"
        self._bad(stats, policy, f"{where}: {problem}")
        return None

    def documents(self, stats: SourceStats, policy: BadRecordPolicy = "error") -> Iterator[str]:
        """The documents of this source, in a deterministic order; updates `stats`."""
        for text in self._raw_documents(stats, policy):
            if not text:
                continue
            stats.documents += 1
            stats.bytes += len(text.encode("utf-8"))
            yield text
            if stats.documents == self.spec.max_documents:
                return

    @property
    def spells_special_tokens(self) -> bool:
        """Whether the documents are records rendered through a fine-tune's template, whose
        markers (<|user|>, ...) encode as special tokens, as in training (other text that spells
        one encodes it as plain text)."""
        plain = self.spec.kind == "builtin" and self.spec.source != "builtin:python-docstrings"
        return self.records_as_text is not None and not plain

    def _raw_documents(self, stats: SourceStats, policy: BadRecordPolicy) -> Iterator[str]:
        if self.spells_special_tokens:
            render = self.records_as_text.render  # type: ignore[union-attr]
            yield from map(render, self._record_stream(stats, policy, lambda m: render({"messages": m})))
        elif self.spec.kind == "builtin":
            stats.files = len(self.files)
            yield from _BUILTIN_DOCUMENTS[self.spec.source](self)
        elif self.hub is not None:
            yield from self._texts(self.hub.rows([self.spec.text_field]), stats, policy)
        else:
            for path in self.files:
                stats.files += 1
                kind = suffix(path)
                data = read_bytes(self.label, path) if kind == ".json" and path in self.walked else None
                if data is not None and json_document(data, self.spec.text_field):
                    stats.json_documents += 1
                elif kind in RECORD_SUFFIXES:
                    rows = self._rows(path, [self.spec.text_field], stats, policy)
                    yield from self._texts(rows, stats, policy)
                    continue
                data = read_bytes(self.label, path) if data is None else data
                yield from text_document(path, data, lambda m: self._bad(stats, policy, m))

    def records(
        self,
        stats: SourceStats,
        policy: BadRecordPolicy = "error",
        check_messages: Callable[[list[Any]], object] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Instruction records {"prompt", "response", ...} of this source (fine-tuning data).

        `prompt_field` / `response_field` are renamed to "prompt" / "response"; other fields are
        kept (a template may use them). A record with `messages` and no prompt/response pair is
        passed on as it is once `check_messages` (the chat template's rendering) accepts it: a
        DataError it raises makes it a bad record.
        """
        for count, rec in enumerate(self._record_stream(stats, policy, check_messages), 1):
            stats.documents += 1
            if "messages" in rec and "prompt" not in rec:
                stats.bytes += sum(len(str(m.get("content", "")).encode("utf-8")) for m in rec["messages"])
            else:
                stats.bytes += len(rec["prompt"].encode("utf-8")) + len(rec["response"].encode("utf-8"))
            yield rec
            if count == self.spec.max_documents:
                return

    def _record_stream(
        self,
        stats: SourceStats,
        policy: BadRecordPolicy,
        check_messages: Callable[[list[Any]], object] | None,
    ) -> Iterator[dict[str, Any]]:
        """The source's instruction records, uncounted and without max_documents applied."""
        src = self.spec.source
        if src == "builtin:python-docstrings":
            stats.files = len(self.files)
            yield from builtin.python_docstring_records(self.spec.docstrings, self.files)
            return
        if self.spec.kind == "builtin":
            raise DataError(
                f"{self.label}: '{src}' holds plain documents, not prompt/response records; fine-tune on "
                "builtin:python-docstrings or on a .jsonl of records"
            )
        pf, rf = self.spec.prompt_field, self.spec.response_field
        for where, rec in self._record_rows([pf, rf], stats, policy):
            # a chat record: `messages` without a whole prompt/response pair (chat datasets often
            # keep the first user turn as `prompt` too, e.g. UltraChat), as `columns_read` chooses
            if "messages" in rec and not (pf in rec and rf in rec):
                rec = {k: v for k, v in rec.items() if k not in ("prompt", "response")}
                try:
                    if not (
                        isinstance(rec["messages"], list)
                        and all(isinstance(m, dict) for m in rec["messages"])
                    ):
                        raise DataError("'messages' must be a list of {role, content} objects")
                    if check_messages is not None:
                        check_messages(rec["messages"])
                except DataError as e:
                    self._bad(stats, policy, f"{where}: {e}")
                    continue
                yield rec
                continue
            prompt = self._field(where, rec, pf, "prompt_field", stats, policy)
            response = (
                None if prompt is None else self._field(where, rec, rf, "response_field", stats, policy)
            )
            if response is not None:
                # the record's own names stay usable in prompt_format (e.g. {instruction})
                yield {**rec, "prompt": prompt, "response": response}

    def _record_rows(
        self, columns: list[str], stats: SourceStats, policy: BadRecordPolicy
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, record) of instruction records: prompt/response `columns` or chat `messages`."""
        if self.hub is not None:
            yield from self.hub.rows(columns, chat=True)
        for path in self.files:  # (none for an hf: source)
            stats.files += 1
            if suffix(path) not in RECORD_SUFFIXES:
                raise DataError(
                    f"{path}: plain text files hold documents, not prompt/response records; use a .jsonl, "
                    ".json or .parquet file for fine-tuning data"
                )
            yield from self._rows(path, columns, stats, policy, chat=True)


_BUILTIN_DOCUMENTS: dict[str, Callable[[Source], Iterator[str]]] = {
    "builtin:python-stdlib": lambda s: (t for t in map(builtin.read_python_source, s.files) if t.strip()),
    "builtin:python-docstrings": lambda s: (
        r["prompt"] + r["response"] for r in builtin.python_docstring_records(s.spec.docstrings, s.files)
    ),
    "builtin:needles": lambda s: builtin.needle_documents(s.spec.needles),
    "builtin:recall": lambda s: recall.recall_documents(s.spec.recall or RecallSpec()),
}


def resolve_sources(
    data_cfg: DataConfig, base_dir: str | os.PathLike[str], records_as_text: RecordText | None = None
) -> list[Source]:
    """Resolve every entry of `data.sources` (paths checked now, text read later)."""
    base = Path(base_dir).expanduser().resolve()
    return [Source(spec, i, base, records_as_text=records_as_text) for i, spec in enumerate(data_cfg.sources)]


def check_local_sources(data_cfg: DataConfig, base_dir: str | os.PathLike[str]) -> None:
    """DataError for a local file or folder of `data.sources` that is missing, or read by two
    sources (`check_distinct`), reading none of the data (the dry runs)."""
    sources = resolve_sources(data_cfg, base_dir)  # path sources are checked as they resolve
    for source in sources:
        source.check_local_files()
    check_distinct(sources)


_WHAT_AND_HOW_MUCH = {"source", "weight", "data_files", "max_documents", "streaming"}


def check_distinct(sources: list[Source]) -> None:
    """DataError where two sources read the same documents (the same file however named, or the
    same dataset) the same way: each source is split into training and validation on its own,
    so a document held out of one copy would be trained on through the other."""
    seen: dict[tuple[Any, ...], Source] = {}
    for src in sources:
        # how the source reads its documents (fields, a builtin's settings)
        how = json.dumps(src.spec.model_dump(mode="json", exclude=_WHAT_AND_HOW_MUCH), sort_keys=True)
        keys: list[tuple[Any, ...]]
        if src.spec.kind == "path":
            keys = [("file", f.resolve(), how) for f in src.files]
        elif src.hub is not None:  # its local files and folder, however spelled (a link, ./x)
            files = [f.resolve() for f in src.hub.data_files() or []]
            twice = next((f for i, f in enumerate(files) if f in files[:i]), None)
            if twice is not None:
                raise DataError(
                    f"{src.label}: data_files name {twice} more than once (two entries or patterns match "
                    "it), so its documents would be read twice and validation documents trained on; "
                    "name each file once"
                )
            keys = [("file", f, how) for f in files]
            local = src.hub.local_dir()
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


def iter_documents(data_cfg: DataConfig, base_dir: str | os.PathLike[str]) -> Iterator[str]:
    """All documents of all sources, in order (weights not applied). For quick inspection."""
    for src in resolve_sources(data_cfg, base_dir):
        stats = SourceStats(src.spec.source)
        yield from src.documents(stats, data_cfg.on_bad_record)
        require_documents(src, stats)


def require_documents(src: Source, stats: SourceStats) -> None:
    """DataError for a source that yielded no documents."""
    if stats.documents == 0 and stats.bad_records:
        raise DataError(
            f"{src.label}: every record is malformed ({stats.bad_records} skipped by data.on_bad_record: "
            "skip); set data.on_bad_record: error to see the first with its line (a wrong text_field?)"
        )
    if stats.documents == 0:
        raise DataError(
            f"{src.label}: the source yielded no documents; point it at text, or remove it from data.sources"
        )
