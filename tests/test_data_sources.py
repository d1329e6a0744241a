"""Sources: local files / folders / globs / jsonl / parquet / hf, the stdlib, and bad input."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
from pathlib import Path

import pytest

from difftrain.data import builtin
from difftrain.data.config import DataConfig, TokenizerConfig
from difftrain.data.sources import SourceStats, iter_documents, resolve_sources
from difftrain.errors import DataError


def docs(sources, base: Path, **kw) -> list[str]:
    return list(iter_documents(DataConfig(sources=sources, **kw), base))


def read_one(source, base: Path, policy: str = "error") -> tuple[list[str], SourceStats]:
    (src,) = resolve_sources(DataConfig(sources=[source], on_bad_record=policy), base)
    stats = SourceStats(src.spec.source)
    return list(src.documents(stats, policy)), stats


def test_folder_is_read_recursively_in_sorted_order_skipping_hidden_and_binary(tmp_path: Path) -> None:
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "b.txt").write_text("bee")
    (tmp_path / "c" / "a.md").write_text("ay")
    (tmp_path / "c" / "sub" / "z.py").write_text("print('z')")
    (tmp_path / "c" / "image.png").write_bytes(b"\x89PNG\x00")
    (tmp_path / "c" / ".git").mkdir()
    (tmp_path / "c" / ".git" / "HEAD.txt").write_text("secret")
    (tmp_path / "c" / "empty.txt").write_text("")
    assert docs(["c"], tmp_path) == ["ay", "bee", "print('z')"]
    assert docs(["c/**/*.py", "c/b.txt"], tmp_path) == ["print('z')", "bee"]


def test_jsonl_json_and_gzip_read_the_configured_text_field(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"body": "one"}\n\n{"body": "two", "x": 1}\n')
    (tmp_path / "b.json").write_text(json.dumps([{"body": "three"}, "four"]))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write('{"body": "five"}\n')
    spec = lambda p: {"source": p, "text_field": "body"}  # noqa: E731
    assert docs([spec("a.jsonl"), spec("b.json"), spec("c.jsonl.gz")], tmp_path) == [
        "one",
        "two",
        "three",
        "four",
        "five",
    ]
    (tmp_path / "lines.json").write_text('{"text": "l1"}\n{"text": "l2"}\n')  # JSON lines named .json
    assert docs(["lines.json"], tmp_path) == ["l1", "l2"]


def test_a_folders_config_json_is_text_while_its_record_files_stay_records(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "a.js").write_text("let a = 1;")
    pkg = '{"name": "pkg", "version": "1.0.0"}'
    (repo / "package.json").write_text(pkg)
    tsconfig = '{\n  // comments: not JSON\n  "strict": true\n}\n'
    (repo / "tsconfig.json").write_text(tsconfig)
    (repo / "records.json").write_text(json.dumps([{"text": "r1"}, {"text": "r2"}]))
    (repo / "one.json").write_text(json.dumps({"text": "r3", "id": 1}))
    (repo / "lines.json").write_text('{"text": "l1"}\n{"text": "l2"}\n')
    got, stats = read_one("repo", tmp_path)
    assert got == ["l1", "l2", "r3", pkg, "r1", "r2", "let a = 1;", tsconfig]
    assert stats.json_documents == 2 and stats.files == 6 and stats.bad_records == 0
    for named in ("repo/package.json", "repo/*.json"):  # a .json named itself or by a glob: records
        with pytest.raises(DataError, match="package.json, record 0: record has no field 'text'"):
            read_one(named, tmp_path)
    got, stats = read_one("repo/s*", tmp_path)  # a glob matching a folder walks it
    assert got == ["let a = 1;"]
    # a broken record in a list is still an error, not text
    (repo / "records.json").write_text('[{"text": "r1"}, {"text": 2}]')
    with pytest.raises(DataError, match="records.json, record 1: field 'text' is int"):
        read_one("repo", tmp_path)


def test_bad_jsonl_line_names_file_and_line_unless_skipped_then_counted(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(
        '{"text": "ok"}\n{"text": broken\n{"txt": "wrong field"}\n{"text": null}\n[1, 2]\n{"text": "fine"}\n'
    )
    with pytest.raises(DataError, match=r"d\.jsonl, line 2: not valid JSON .*on_bad_record: skip"):
        read_one("d.jsonl", tmp_path)
    out, stats = read_one("d.jsonl", tmp_path, policy="skip")
    assert out == ["ok", "fine"]
    assert stats.bad_records == 4 and stats.documents == 2
    assert "line 3: record has no field 'text' (fields: txt); set text_field" in stats.bad_examples[1]
    assert "line 4: field 'text' is null" in stats.bad_examples[2]
    # chat records in pretraining data: the message says who reads `messages` (a fine-tune)
    f.write_text('{"text": "ok"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(
        DataError, match=r"line 2: a chat record \(`messages`\), in data read as plain text.*finetune"
    ):
        read_one("d.jsonl", tmp_path)
    f.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"line 2: record has no field 'text' \(fields: body\)"):
        read_one("d.jsonl", tmp_path)


def test_non_utf8_text_file_is_a_bad_record(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "c" / "ok.txt").write_text("fine")
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 text"):
        read_one("c", tmp_path)
    out, stats = read_one("c", tmp_path, policy="skip")
    assert out == ["fine"] and stats.bad_records == 1


def test_parquet_reads_a_column_and_names_the_columns_when_it_is_missing(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["p1", "p2", None], "id": [1, 2, 3]}), tmp_path / "t.parquet")
    with pytest.raises(
        DataError, match=r"t\.parquet: Parquet file has no column 'text' \(columns: content, id\)"
    ):
        read_one("t.parquet", tmp_path)
    with pytest.raises(DataError, match=r"t\.parquet, row 2: field 'content' is null"):
        read_one({"source": "t.parquet", "text_field": "content"}, tmp_path)
    out, stats = read_one({"source": "t.parquet", "text_field": "content"}, tmp_path, policy="skip")
    assert out == ["p1", "p2"] and stats.bad_records == 1
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress((tmp_path / "t.parquet").read_bytes()))
    with pytest.raises(
        DataError, match=r"t\.parquet\.gz: a gzip-compressed Parquet file .* decompress it with gunzip"
    ):
        read_one({"source": "t.parquet.gz", "text_field": "content"}, tmp_path)


def test_a_parquet_file_damaged_past_its_first_pages_is_one_data_error(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 50 for i in range(5000)]}), path, row_group_size=500)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4000] = bytes(4000)  # the footer stays readable
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"d\.parquet: not a readable Parquet file after row \d+"):
        read_one("d.parquet", tmp_path)


def test_parquet_without_pyarrow_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs pyarrow.*difftrain\[parquet\]"):
        read_one("t.parquet", tmp_path)


def test_missing_path_and_empty_glob_say_where_they_looked(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"data\.sources\[0\] \('nope/'\): .*nope does not exist; fix the path"
    ):
        docs(["nope/"], tmp_path)
    with pytest.raises(DataError, match="matches no files"):
        docs(["*.txt"], tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.png").write_bytes(b"\x00")
    with pytest.raises(DataError, match="holds no text files"):
        docs(["bin"], tmp_path)


def test_empty_corpus_is_an_error_naming_the_source(tmp_path: Path) -> None:
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match=r"data\.sources\[0\] \('e\.txt'\): the source yielded no documents"):
        docs(["e.txt"], tmp_path)
    (tmp_path / "all_bad.jsonl").write_text("nope\n")
    with pytest.raises(
        DataError, match=r"every record is malformed \(1 skipped by data.on_bad_record: skip\)"
    ) as e:
        docs(["all_bad.jsonl"], tmp_path, on_bad_record="skip")
    assert "it is empty" not in str(e.value)  # it is not: its records are bad


def test_max_documents_caps_a_source(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(10)))
    assert docs([{"source": "a.jsonl", "max_documents": 3}], tmp_path) == ["d0", "d1", "d2"]


def test_fingerprint_changes_with_content_and_settings_but_not_with_reading(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("one")

    def fp(**kw):
        return resolve_sources(DataConfig(sources=[{"source": "a.txt", **kw}]), tmp_path)[0].fingerprint()

    first = fp()
    assert fp() == first
    f.write_text("one, longer")
    assert fp() != first
    assert fp(text_field="body") != fp()


def test_stdlib_files_are_sorted_real_sources_without_test_suites() -> None:
    files = builtin.stdlib_files()
    root = builtin.stdlib_dir()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 300
    assert "ast.py" in rel and "json/decoder.py" in rel
    for r in rel:
        parts = r.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), r
    assert not any(r.startswith(("lib2to3/tests", "idlelib/idle_test", "unittest/test")) for r in rel)


def test_missing_stdlib_sources_are_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "os.pyc").write_bytes(b"\x00")
    monkeypatch.setattr(builtin, "stdlib_dir", lambda: tmp_path)
    with pytest.raises(DataError, match="builtin:python-stdlib: no Python standard library sources under"):
        docs(["builtin:python-stdlib"], tmp_path)


def test_record_fields_show_the_first_record_and_an_hf_dataset_loads_once(
    tmp_path: Path, monkeypatch
) -> None:
    """eval asks a --data source for its record fields before reading it: a dataset is loaded
    once for both (it was loaded twice), and each kind of file shows its first record's fields."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text('\n{"prompt": "p", "response": "r"}\n{"text": "t"}\n')
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "a.txt").write_text("plain")
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]]}), tmp_path / "m.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    fields = {}
    for name in ("d.jsonl", "e.jsonl", "a.txt", "m.parquet", "bad.parquet"):
        (src,) = resolve_sources(DataConfig(sources=[name]), tmp_path)
        fields[name] = src.record_fields()
    assert fields == {
        "d.jsonl": {"prompt", "response"},
        "e.jsonl": set(),
        "a.txt": set(),
        "m.parquet": {"messages"},
        "bad.parquet": None,  # unreadable here: reading it names the problem
    }
    loads = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: loads.append(a) or real(*a, **k))
    (src,) = resolve_sources(DataConfig(sources=[{"source": "hf:json", "data_files": ["d.jsonl"]}]), tmp_path)
    assert src.record_fields() == {"prompt", "response", "text"}
    assert list(src.documents(SourceStats(src.spec.source), "skip")) == ["t"]
    assert len(loads) == 1


def test_a_glob_over_a_folder_reads_each_file_once(tmp_path: Path) -> None:
    # 'c/**' matches the folder, its subfolder and their files: each file was read 2-3 times
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("ay")
    (tmp_path / "c" / "sub" / "b.txt").write_text("bee")
    assert docs(["c/**"], tmp_path) == ["ay", "bee"]
    assert docs(["c/**/*"], tmp_path) == ["ay", "bee"]


def test_two_sources_reading_the_same_documents_are_refused(tmp_path: Path) -> None:
    """Each source is split into train and validation on its own: a file read by two sources
    (a folder and a file in it, a file and a glob) would put its validation documents in
    training through the other copy."""
    from difftrain.data.modules import load_sft_records
    from difftrain.data.shards import prepare_data
    from difftrain.data.sources import check_local_sources

    (tmp_path / "corp").mkdir()
    (tmp_path / "corp" / "a.jsonl").write_text('{"text": "a", "prompt": "p", "response": "r"}\n')
    (tmp_path / "corp" / "b.txt").write_text("bee")
    (tmp_path / "copy.jsonl").write_text((tmp_path / "corp" / "a.jsonl").read_text())
    same = re.escape(str((tmp_path / "corp" / "a.jsonl").resolve()))
    for sources in (["corp", "corp/a.jsonl"], ["corp/*.jsonl", {"source": "corp", "weight": 2}]):
        cfg = DataConfig(sources=sources)
        for check in (
            lambda cfg=cfg: check_local_sources(cfg, tmp_path),
            lambda cfg=cfg: prepare_data(cfg, TokenizerConfig(), seed=0, base_dir=tmp_path),
            lambda cfg=cfg: load_sft_records(cfg, seed=0, base_dir=tmp_path),
        ):
            with pytest.raises(
                DataError,
                match=rf"data.sources\[0\] .* and data.sources\[1\] .* both read {same}: .*weight: 2",
            ):
                check()
    with pytest.raises(DataError, match=r"\('builtin:needles'\) are the same source"):
        check_local_sources(DataConfig(sources=["builtin:needles", "builtin:needles"]), tmp_path)
    # builtin sources with settings of their own (sections in the spec): the same settings twice
    # are the same source, other settings another
    needles = {"source": "builtin:needles", "needles": {"num_documents": 8}}
    with pytest.raises(DataError, match="are the same source"):
        check_local_sources(DataConfig(sources=[needles, needles]), tmp_path)
    other = {"source": "builtin:needles", "needles": {"num_documents": 9}}
    check_local_sources(DataConfig(sources=[needles, other]), tmp_path)
    # other files, or the same file read through another field, are other documents
    check_local_sources(DataConfig(sources=["corp/a.jsonl", "copy.jsonl", "corp/b.txt"]), tmp_path)
    check_local_sources(
        DataConfig(sources=["corp/a.jsonl", {"source": "corp/a.jsonl", "text_field": "prompt"}]), tmp_path
    )
    # through hf: too — its data_files against a plain source or within one list, and a saved
    # dataset's folder under two spellings (a link) — where nothing was refused and every
    # validation document was trained on
    hf_json = {"source": "hf:json", "data_files": ["corp/a.jsonl"]}
    with pytest.raises(DataError, match=rf"data.sources\[0\] .* and data.sources\[1\] .* both read {same}"):
        check_local_sources(DataConfig(sources=["corp/a.jsonl", hf_json]), tmp_path)
    with pytest.raises(DataError, match=rf"data_files name {same} more than once"):
        check_local_sources(
            DataConfig(sources=[{"source": "hf:json", "data_files": ["corp/a.jsonl", "corp/*.jsonl"]}]),
            tmp_path,
        )
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{}")
    (tmp_path / "saved_link").symlink_to(tmp_path / "saved")
    with pytest.raises(DataError, match="both read .*saved"):
        check_local_sources(DataConfig(sources=["hf:./saved", "hf:./saved_link"]), tmp_path)
    check_local_sources(DataConfig(sources=["hf:./saved@train", "hf:./saved_link@validation"]), tmp_path)
    # a data_files entry that is a folder is named so; a file whose name holds [ ] is that file
    with pytest.raises(
        DataError, match=r"data_files entry .*corp is a folder; name its files, e.g. corp/\*.jsonl"
    ):
        check_local_sources(DataConfig(sources=[{"source": "hf:json", "data_files": ["corp"]}]), tmp_path)
    (tmp_path / "data[1].jsonl").write_text('{"text": "x"}\n')
    check_local_sources(
        DataConfig(sources=[{"source": "hf:json", "data_files": ["data[1].jsonl"]}]), tmp_path
    )
    # and read as itself: datasets globs what it is given ([1] matched nothing: "StopIteration")
    assert docs([{"source": "hf:json", "data_files": ["data[1].jsonl"]}], tmp_path) == ["x"]


def test_hf_source_loads_local_json_through_datasets(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "h1"}\n{"text": "h2"}\n')
    assert docs([{"source": "hf:json", "data_files": ["d.jsonl"]}], tmp_path) == ["h1", "h2"]
    with pytest.raises(DataError, match=r"dataset has no column 'body' \(columns: text\)"):
        docs([{"source": "hf:json", "data_files": ["d.jsonl"], "text_field": "body"}], tmp_path)


def test_hf_source_loads_a_dataset_saved_to_disk_with_its_split(tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
            "test": datasets.Dataset.from_dict({"text": ["t"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "saved"))
    assert docs(["hf:./saved"], tmp_path) == ["a", "b"]
    assert docs(["hf:./saved@test"], tmp_path) == ["t"]
    with pytest.raises(DataError, match="no split 'dev'.*splits: train, test"):
        docs(["hf:./saved@dev"], tmp_path)


def test_chat_records_are_read_from_parquet_and_hf_datasets_as_from_jsonl(tmp_path: Path) -> None:
    """Hub chat datasets are Parquet with a `messages` column: fine-tuning reads them as it reads
    a .jsonl of chat records."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [  # as UltraChat has them: the first user turn repeated as `prompt`, and no `response`
        {
            "prompt": f"q{i}",
            "prompt_id": f"{i}",
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "c.parquet")
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    for source in ("c.jsonl", "c.parquet", "hf:./saved", {"source": "hf:json", "data_files": ["c.jsonl"]}):
        (src,) = resolve_sources(DataConfig(sources=[source]), tmp_path)
        records = list(src.records(SourceStats(src.spec.source)))
        assert [r["messages"] for r in records] == [c["messages"] for c in chats], source
        assert not any("prompt" in r for r in records), source  # a chat record: not a half prompt/response
    # neither prompt/response nor messages: the message names both ways to fix it
    pq.write_table(pa.table({"q": ["x"]}), tmp_path / "n.parquet")
    (src,) = resolve_sources(DataConfig(sources=["n.parquet"]), tmp_path)
    with pytest.raises(
        DataError,
        match=r"no column 'prompt', 'response' \(columns: q\); set prompt_field/response_field on .*"
        r"or give chat records a 'messages' column$",
    ):
        list(src.records(SourceStats(src.spec.source)))


def test_a_split_asked_of_a_saved_dataset_without_splits_is_refused(tmp_path: Path, monkeypatch) -> None:
    import datasets

    from difftrain.data import hub as sources_mod

    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "one"))
    assert docs(["hf:./one"], tmp_path) == ["a", "b"]
    with pytest.raises(
        DataError, match=r"holds one dataset, not a DatasetDict of splits; leave out @validation"
    ):
        docs(["hf:./one@validation"], tmp_path)
    # refused before anything is loaded, so a cached source is refused too (it was accepted once
    # its shards were cached), and a DatasetDict's missing split likewise
    from difftrain.data.config import DataConfig
    from difftrain.data.sources import check_local_sources

    with pytest.raises(DataError, match=r"holds one dataset, not a DatasetDict of splits; leave out @train"):
        check_local_sources(DataConfig(sources=["hf:./one@train"]), tmp_path)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(DataError, match=r"no split 'test' in .*dd \(splits: train\)"):
        check_local_sources(DataConfig(sources=["hf:./dd@test"]), tmp_path)
    check_local_sources(DataConfig(sources=["hf:./dd@train", "hf:./one"]), tmp_path)
    from difftrain.data.config import TokenizerConfig, TokenizerTrainConfig
    from difftrain.data.shards import prepare_data

    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    text = [" ".join(words[(i + j) % 8] for j in range(40)) for i in range(60)]
    datasets.Dataset.from_dict({"text": text}).save_to_disk(str(tmp_path / "many"))
    tok = TokenizerConfig(train=TokenizerTrainConfig(vocab_size=300))
    cfg = {"cache_dir": str(tmp_path / "cache"), "val_fraction": 0.1}
    prepare_data(DataConfig(sources=["hf:./many"], **cfg), tok, seed=0, base_dir=tmp_path)
    with pytest.raises(DataError, match="holds one dataset"):  # its shards are cached under the same key
        prepare_data(DataConfig(sources=["hf:./many@train"], **cfg), tok, seed=0, base_dir=tmp_path)
    # a local folder named without ./ is a Hub name: offline, the error says how to name the folder
    monkeypatch.setattr(sources_mod, "_unreachable_hub", lambda: "huggingface.co")
    with pytest.raises(
        DataError, match=r"'one' is read as a Hugging Face Hub dataset name.*write source 'hf:\./one'$"
    ):
        docs(["hf:one"], tmp_path)


def test_hf_source_offline_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])  # the hub's name resolves
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # (whatever another test's env set)
    with pytest.raises(
        DataError,
        match=r"could not load Hugging Face dataset 'someone/corpus' \(ConnectionError.*save_to_disk",
    ) as e:
        docs(["hf:someone/corpus:default@train"], tmp_path)
    assert "or set HF_DATASETS_OFFLINE=1" in str(e.value)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # set already: not advised again
    with pytest.raises(DataError, match="save_to_disk") as e:
        docs(["hf:someone/corpus:default@train"], tmp_path)
    assert "HF_DATASETS_OFFLINE" not in str(e.value)


def test_an_unreachable_hub_reads_the_cache_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Offline, datasets retries each request for ~25 s before it falls back to its cache: when the
    # hub's name does not resolve, the load runs in offline mode (cache only), and a dataset that
    # is not cached is a one-line error without the retries.
    import datasets
    import huggingface_hub.constants as hub

    def no_dns(host, *a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    seen = []

    def load_dataset(name, *args, **kwargs):
        seen.append((name, datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE))
        raise FileNotFoundError(f"Dataset {name} is not cached")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.org")
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    before = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(
        DataError,
        match=r"'someone/corpus' \(hub.example.org cannot be reached from this machine and the dataset is not "
        r"in the local cache\); download it where there is network",
    ):
        docs(["hf:someone/corpus"], tmp_path)
    assert seen == [("someone/corpus", True, True)]
    assert (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE) == before  # restored
    monkeypatch.undo()
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)  # local files still load through a builder
    (tmp_path / "d.jsonl").write_text('{"text": "h1"}\n')
    assert docs([{"source": "hf:json", "data_files": ["d.jsonl"]}], tmp_path) == ["h1"]
    monkeypatch.undo()  # an HF_ENDPOINT no lookup takes is unreachable too, not a traceback
    monkeypatch.setenv("HF_ENDPOINT", "http://a..b")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DataError, match=r"a\.\.b cannot be reached from this machine"):
        docs(["hf:someone/corpus"], tmp_path)


def test_hf_json_with_a_bad_file_names_the_file_not_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def no_dns(host, *a, **k):
        raise AssertionError("a packaged builder reading local files must not look up the Hub")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b\n')
    with pytest.raises(
        DataError,
        match=r"datasets' json builder could not read data_files \(.*JSON parse error.*\); fix the file, "
        r"or name it as a source itself",
    ):
        docs([{"source": "hf:json", "data_files": ["bad.jsonl"]}], tmp_path)
    captured = capsys.readouterr()
    assert "Failed to load JSON" not in captured.err + captured.out  # datasets' own log line
    assert "Generating train split" not in captured.err + captured.out  # and its progress bar
    with pytest.raises(DataError, match=r"hf:json reads local files and needs data_files; add data_files"):
        docs(["hf:json"], tmp_path)


@pytest.mark.parametrize("suffix", [".txt.gz", ".jsonl.gz", ".json.gz"])
def test_a_truncated_or_corrupt_gzip_is_a_data_error_naming_the_file(tmp_path: Path, suffix: str) -> None:
    # gzip raises EOFError for a file cut short: uncaught, the CLI took it for Ctrl-D ("aborted", 130)
    import random

    rng = random.Random(0)
    if suffix == ".txt.gz":
        body = " ".join(str(rng.random()) for _ in range(5000))
    else:
        body = "".join(json.dumps({"text": str(rng.random())}) + "\n" for _ in range(2000))
    whole = gzip.compress(body.encode())
    (tmp_path / f"cut{suffix}").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=rf"cannot read .*cut{suffix} \(the gzip file is truncated"):
        docs([f"cut{suffix}"], tmp_path)
    (tmp_path / f"junk{suffix}").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=rf"cannot read .*junk{suffix} \(not a valid gzip file"):
        docs([f"junk{suffix}"], tmp_path)


def test_a_json_error_keeps_its_position(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b\n')
    with pytest.raises(
        DataError, match=r"d.jsonl, line 2: not valid JSON \(Unterminated string starting at column 10\)"
    ):
        docs(["d.jsonl"], tmp_path)


def test_a_lone_surrogate_escape_is_a_bad_record_named_by_file_and_line(tmp_path: Path) -> None:
    # scraped text cut inside an emoji leaves "\ud83d" without its pair: json reads it, and no
    # tokenizer can encode it; a pair is one character and is kept
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "cut \\ud83d here"}\n{"text": "fine"}\n')
    with pytest.raises(
        DataError, match=r"d\.jsonl, line 2: field 'text' holds a lone UTF-16 surrogate escape"
    ):
        read_one("d.jsonl", tmp_path)
    out, stats = read_one("d.jsonl", tmp_path, policy="skip")
    assert out == ["ok \U0001f600", "fine"] and stats.bad_records == 1
    g = tmp_path / "d.json"
    g.write_text('[{"text": "a"}, {"text": "b \\udc00"}]')
    with pytest.raises(
        DataError, match=r"d\.json, record 1: field 'text' holds a lone UTF-16 surrogate escape"
    ):
        read_one("d.json", tmp_path)
    f.write_text('{"text": "fine", "meta": "\\udc00"}\n')  # a field no one reads: named, still refused
    with pytest.raises(DataError, match=r"line 1: field 'meta' holds a lone UTF-16 surrogate"):
        read_one("d.jsonl", tmp_path)


def test_a_file_whose_name_holds_glob_characters_is_read_as_named(tmp_path: Path) -> None:
    (tmp_path / "notes[1].txt").write_text("bracketed")
    (tmp_path / "notes1.txt").write_text("matched by the pattern")
    got, _ = read_one("notes[1].txt", tmp_path)  # it exists as written: that file, not a pattern
    assert got == ["bracketed"]
    got, _ = read_one("note?[1].txt", tmp_path)  # no such file: a pattern, as before
    assert got == ["matched by the pattern"]


def test_local_hf_sources_that_cannot_be_read_say_why_not_that_the_network_is_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="saved with save_to_disk, which data_files do not apply to"):
        docs([{"source": "hf:./saved", "data_files": ["rows.jsonl"]}], tmp_path)
    with pytest.raises(DataError, match="saved with save_to_disk and has no configs; leave out :foo"):
        docs(["hf:./saved:foo"], tmp_path)  # the config was ignored
    with pytest.raises(ValueError, match="text_field applies to record files and datasets, not to .builtin:"):
        DataConfig(sources=[{"source": "builtin:python-stdlib", "text_field": "body"}])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="its data_files are empty"):
        docs([{"source": "hf:json", "data_files": ["empty.jsonl"]}], tmp_path)
    (tmp_path / "jdir").mkdir()
    (tmp_path / "jdir" / "rows.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match=r"check the folder .*jdir") as e:
        docs(["hf:./jdir:nonsense"], tmp_path)
    assert "offline" not in str(e.value)


def test_a_chat_dataset_read_as_text_says_it_holds_chat_records(tmp_path: Path) -> None:
    # it said "no column 'text'; set text_field", and text_field: messages then failed on the list
    import datasets

    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    datasets.Dataset.from_dict({"messages": msgs}).save_to_disk(str(tmp_path / "chat"))
    with pytest.raises(
        DataError, match=r"dataset holds a chat record \(`messages`\), in data read as plain text"
    ):
        docs(["hf:./chat"], tmp_path)


def test_a_windows_style_path_is_told_to_use_slashes(tmp_path: Path) -> None:
    from difftrain.data.config import DataConfig
    from difftrain.data.sources import check_local_sources

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("x")
    for raw in ("data\\train.txt", "data\train.txt"):  # as typed, and as YAML's "data\train.txt" reads
        with pytest.raises(DataError, match=r"does not exist; fix the path .*separate folders with /"):
            check_local_sources(DataConfig(sources=[raw]), tmp_path)
    check_local_sources(DataConfig(sources=["data/train.txt"]), tmp_path)


def test_eval_reads_a_chat_dataset_as_records_as_it_reads_a_chat_jsonl(tmp_path: Path) -> None:
    # an hf: dataset of `messages` given to `eval --data` on a chat fine-tune was read as text (and
    # refused), while the same records as .jsonl or .parquet were rendered through the template
    import datasets

    from difftrain.evals.windows import data_source, holds_records

    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    datasets.Dataset.from_dict({"messages": msgs}).save_to_disk(str(tmp_path / "chat"))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": msgs[0]}) + "\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert holds_records(data_source("chat.jsonl")) and holds_records(data_source("hf:./chat"))
        assert not holds_records(data_source("hf:./chat", text_field="messages"))  # --text-field: as text
    finally:
        os.chdir(cwd)
