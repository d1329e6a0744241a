"""Bad input never ends in a traceback, a hang, code execution or a write outside out_dir.

Property-based (hypothesis, fixed derandomized profile): random bytes, structurally mutated
recipes (keys deleted, unknown keys added, values replaced by wrong types, huge or negative
numbers, NaN/inf, sections replaced by scalars), text-level mutations of a valid recipe (YAML
punctuation, tabs, anchors/aliases, NUL and non-UTF-8 bytes), and random `key=value`
overrides, each fed to the recipe loader and to `difftrain pretrain --dry-run` (in-process,
`difftrain.cli.app.main`). Each case either loads / exits 0 or raises a DifftrainError / exits
2 with one red line; nothing else. A SIGALRM deadline turns a hang into a failure, and the
whole folder tree is compared before and after: a dry run writes nothing. A list of known-nasty
files (alias bombs, deep nesting, python tags, empty, UTF-16...) is checked explicitly.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import signal
from pathlib import Path

import pytest
import yaml
from conftest import make_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

from difftrain.cli.app import main
from difftrain.errors import DifftrainError
from difftrain.recipe import load_recipe

PROFILE = settings.get_profile("reliability")
EXAMPLES = {"bytes": 120, "mutations": 150, "text": 150, "overrides": 100}  # what the suite tries


@contextlib.contextmanager
def deadline(seconds: int = 10):
    """Fail (TimeoutError, which nothing in difftrain catches) instead of hanging."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def tree(root: Path) -> set[tuple[str, int]]:
    return {(str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    """A folder with a corpus, used as the current folder and HOME (the default cache lives
    there), so that any write a case makes shows up in its tree."""
    root = tmp_path_factory.mktemp("fuzz")
    make_corpus(root)
    base = {
        "name": "fuzz",
        "seed": 1,
        "out_dir": str(root / "runs"),
        "model": {"arch": "diff", "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32},
        "data": {"sources": [str(root / "corpus")], "val_fraction": 0.1, "cache_dir": str(root / "cache")},
        "tokenizer": {"train": {"vocab_size": 320}},
        "train": {"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "save_every": 2},
        "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
        "logging": {"progress": False, "tensorboard": False},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("HOME", str(root))
        mp.delenv("XDG_CACHE_HOME", raising=False)
        yield root, base


def check(root: Path, data: bytes, overrides: tuple[str, ...] = ()) -> int:
    """Feed one recipe (and overrides) to the loader and to `pretrain --dry-run`; return the exit."""
    path = root / "case.yaml"
    path.write_bytes(data)
    before = tree(root)
    with deadline():
        try:
            load_recipe(path, list(overrides))
            loaded = True
        except DifftrainError as e:
            assert str(e).strip(), "an error without a message"
            loaded = False
        rc = main(["pretrain", str(path), *overrides, "--dry-run"])
    assert rc in (0, 2)
    assert (rc == 0) == loaded or rc == 2  # a recipe that does not load never plans
    assert tree(root) == before, "a dry run wrote a file"
    return rc


# -- strategies ------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10**6),
    st.integers(-(10**400), 10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        ["auto", "..", "../..", "/", "~", "cuda", "fsdp", "bf16-mixed", "16-mixed", "1e999", "-1"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out.extend(_paths(v, (*prefix, k)))
    return out


@st.composite
def mutated(draw, base: dict) -> dict:
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["delete", "set", "set", "unknown", "scalar-section"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "set":
            parent[path[-1]] = draw(values)
        elif action == "unknown":
            target = parent[path[-1]] if isinstance(parent[path[-1]], dict) else parent
            target[draw(st.sampled_from(["learning_rate", "n_layer", "steps", "x", "model", ""]))] = draw(
                values
            )
        else:
            parent[path[-1]] = draw(scalars)
    return data


NASTY = [
    "\t",
    ":",
    ": ",
    "- ",
    "&a ",
    "*a",
    "!!",
    "!!python/name:os.system ",
    "[",
    "]",
    "{",
    "}",
    "#",
    "|",
    ">",
    "%",
    "@",
    "`",
    '"',
    "'",
    "\\",
    "\x00",
    "é",
    "\n",
    "<<: *a\n",
    "? ",
]


@st.composite
def text_mutated(draw, base: dict) -> bytes:
    text = yaml.safe_dump(base, sort_keys=False).encode()
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "insert", "delete", "bytes", "duplicate-line"]))
        if op == "insert":
            text = text[:i] + draw(st.sampled_from(NASTY)).encode() + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 20)) :]
        elif op == "bytes":
            text = text[:i] + draw(st.binary(min_size=1, max_size=4)) + text[i:]
        else:
            lines = text.split(b"\n")
            j = draw(st.integers(0, len(lines) - 1))
            text = b"\n".join([*lines[: j + 1], lines[j], *lines[j + 1 :]])
    return text


# -- properties ------------------------------------------------------------------------------


@settings(PROFILE, max_examples=EXAMPLES["bytes"])
@given(data=st.binary(max_size=400))
def test_random_bytes_load_or_fail_with_a_difftrain_error(arena, data):
    check(arena[0], data)


@settings(PROFILE, max_examples=EXAMPLES["mutations"])
@given(data=st.data())
def test_structurally_mutated_recipes_load_or_fail_with_a_difftrain_error(arena, data):
    root, base = arena
    recipe = data.draw(mutated(base))
    check(root, yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True).encode())


@settings(PROFILE, max_examples=EXAMPLES["text"])
@given(data=st.data())
def test_text_mutated_recipes_load_or_fail_with_a_difftrain_error(arena, data):
    root, base = arena
    check(root, data.draw(text_mutated(base)))


KEYS = [
    "train.max_steps",
    "train.max_tokens",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.devices",
    "train.num_nodes",
    "train.seq_len",
    "model.d_model",
    "model.n_heads",
    "model.n_kv_heads",
    "model.vocab_size",
    "optim.lr",
    "optim.betas",
    "data.sources",
    "name",
    "out_dir",
    "train",
    "model",
    "x.y",
    "",
    ".",
    "train..max_steps",
]


@settings(PROFILE, max_examples=EXAMPLES["overrides"])
@given(
    overrides=st.lists(
        st.one_of(
            st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), st.text(max_size=12)),
            st.builds(
                lambda k, v: f"{k}={v}",
                st.sampled_from(KEYS),
                st.sampled_from(
                    ["1e999", "-1", "0", "null", "[", "9" * 500, "nan", ".inf", "{a: 1}", "[1, 2]", "&a [*a]"]
                ),
            ),
            st.text(max_size=15),
        ),
        max_size=3,
    )
)
def test_random_overrides_apply_or_fail_with_a_difftrain_error(arena, overrides):
    root, base = arena
    check(root, yaml.safe_dump(base).encode(), tuple(o for o in overrides if not o.startswith("-")))


def test_the_valid_base_recipe_plans(arena):
    """The mutations start from a recipe that is valid (so they test the edges, not a dead end)."""
    root, base = arena
    assert check(root, yaml.safe_dump(base).encode()) == 0


# -- known-nasty files -----------------------------------------------------------------------


def _bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _python_tag(marker: Path) -> str:
    return f"name: !!python/object/apply:os.system ['touch {marker}']\n"


NASTY_FILES = {
    "empty": b"",
    "whitespace": b"  \n\n\t\n",
    "comment-only": b"# nothing here\n",
    "null": b"~\n",
    "list": b"- name: x\n- model: y\n",
    "scalar": b"just a string\n",
    "alias-bomb": _bomb().encode(),
    "recursive-alias": b"a: &a [*a]\n",
    "deep-flow-nesting": b"a: " + b"[" * 1500 + b"]" * 1500 + b"\n",
    "deep-block-nesting": "".join("  " * i + f"k{i}:\n" for i in range(200)).encode(),
    "utf16": "name: x\n".encode("utf-16"),
    "latin1": "name: caf\xe9\n".encode("latin-1"),
    "nul": b"name: a\x00b\n",
    "huge-file": b"# " + b"x" * 1_100_000 + b"\n",
    "huge-int": b"name: x\nseed: " + b"9" * 5000 + b"\n",
    "unhashable-key": b"? [a, b]\n: 1\n",
    "tab-indent": b"name: x\nmodel:\n\td_model: 32\n",
    "extends-itself": b"extends: case.yaml\nname: x\n",
    "extends-missing": b"extends: no-such-recipe\nname: x\n",
    "extends-number": b"extends: 12\nname: x\n",
    "extends-passwd": b"extends: /etc/passwd\nname: x\n",
    "extends-dev-zero": b"extends: /dev/zero\nname: x\n",
}


@pytest.mark.parametrize("case", list(NASTY_FILES))
def test_known_nasty_files_end_in_one_red_line(arena, case, capsys):
    root, _ = arena
    assert check(root, NASTY_FILES[case]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("error:") and "Traceback" not in err


@pytest.mark.parametrize("where", ["value", "key", "extends"])
def test_a_python_tag_in_a_recipe_is_refused_not_executed(arena, where, capsys):
    root, base = arena
    marker = root.parent / f"pwned-{where}"
    tag = f"!!python/object/apply:os.system ['touch {marker}']"
    text = {
        "value": _python_tag(marker),
        "key": f"{tag}: 1\nname: x\n",
        "extends": f"extends: {tag}\n",
    }[where]
    assert check(root, text.encode()) == 2
    assert "invalid YAML" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize(
    "override",
    ["model.d_model=1" + "0" * 400, "train.max_tokens=1" + "0" * 400],
    ids=["d_model", "max_tokens"],
)
def test_huge_numbers_do_not_overflow_float_arithmetic(arena, override):
    """Both once raised OverflowError (float division of a 400-digit int)."""
    root, base = arena
    data = copy.deepcopy(base)
    data["train"].pop("max_steps")
    data["train"]["max_tokens"] = 1000
    assert check(root, yaml.safe_dump(data).encode(), (override,)) == 0


@pytest.mark.parametrize(
    "key, override",
    [
        ("optim.lr", "optim.lr=.inf"),
        ("model.init_std", "model.init_std=.nan"),
        ("data.sources.0.weight", None),
    ],
)
def test_non_finite_numbers_are_refused_by_key(arena, key, override, capsys):
    root, base = arena
    data = copy.deepcopy(base)
    data["data"]["sources"] = [{"path": base["data"]["sources"][0], "weight": math.inf}]
    if override:
        data["data"]["sources"][0]["weight"] = 1.0
    assert check(root, yaml.safe_dump(data).encode(), (override,) if override else ()) == 2
    err = capsys.readouterr().err
    assert re.search(rf"`{re.escape(key)}`(='[^']*':)? must be a finite number", err), err
    if override:  # the override is named, not the file it overrides
        assert f"override `{key}`" in err


@pytest.mark.parametrize("value", ["&a [*a]", _bomb().replace("\n", ", ").join("{}")])
def test_alias_tricks_in_an_override_are_refused(arena, value, capsys):
    root, base = arena
    assert check(root, yaml.safe_dump(base).encode(), (f"train.max_steps={value}",)) == 2
    assert "override `train.max_steps`" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [-1, 2**32, 2**64])
def test_seeds_outside_what_numpy_accepts_are_refused(arena, seed, capsys):
    """Lightning replaces an out-of-range seed by 0: seeds -1 and 2**32 would silently give the
    same run as seed 0."""
    root, base = arena
    assert check(root, yaml.safe_dump(base).encode(), (f"seed={seed}",)) == 2
    assert "`seed`" in capsys.readouterr().err


def test_dry_run_of_every_shipped_recipe_plans_or_says_why(arena):
    from difftrain.recipe import shipped_recipes

    root, _ = arena
    before = tree(root)
    for name in shipped_recipes():
        with deadline():
            assert main(["pretrain", name, "--dry-run"]) in (0, 2), name
    assert tree(root) == before
    assert os.getcwd() == str(root)
