"""Embedded corpora: the Python standard library, a multi-needle retrieval task, docstring SFT.

- `builtin:python-stdlib`: the stdlib's own `.py` files, about 14 MB of real, varied text.
- `builtin:needles`: the multi-needle retrieval test of the Differential Transformer paper (§3.4).
- `builtin:python-docstrings`: instruction records (a function's signature and docstring → body).

A corpus is a pure function of its parameters (`random.Random(seed)` streams only).
"""

from __future__ import annotations

import ast
import hashlib
import io
import itertools
import random
import sysconfig
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from difftrain.data.config import DocstringsSpec, NeedlesSpec
from difftrain.errors import DataError

_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}
)


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from the parts (blake2b: stable across runs and machines, unlike hash())."""
    return int.from_bytes(
        hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little"
    )


def stdlib_dir() -> Path:
    """The folder of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    if any(part in _EXCLUDED_DIRS or part.startswith(("config-", ".")) for part in rel.parts[:-1]):
        return True
    # machine-specific build data, and stray test modules outside test folders
    return rel.name.startswith(("_sysconfigdata", "test_")) or rel.name.endswith("_test.py")


def stdlib_files() -> list[Path]:
    """The stdlib `.py` files, test suites excluded, sorted by relative path; DataError when the
    sources are absent (some distributions ship only bytecode)."""
    root = stdlib_dir()
    files = sorted(
        (p.relative_to(root).as_posix(), p)
        for p in (root.rglob("*.py") if root.is_dir() else [])
        if not _excluded(p.relative_to(root)) and p.is_file()
    )
    if len(files) < 10:
        raise DataError(
            f"builtin:python-stdlib: no Python standard library sources under {root} (this Python "
            "distribution ships only bytecode); install the full stdlib (e.g. Debian/Ubuntu "
            "'libpython3-stdlib', or use a python.org / pyenv / conda build), or train on a local "
            "folder of text instead (data.sources: [path/to/texts])"
        )
    return [p for _, p in files]


def read_python_source(path: Path) -> str:
    """Read a .py file honouring its PEP 263 encoding declaration (default UTF-8)."""
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return data.decode("utf-8", errors="replace")


def _function_record(
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, cls: ast.ClassDef | None
) -> tuple[str, str] | None:
    body = node.body
    doc = ast.get_docstring(node, clean=False)
    if doc is None or len(body) < 2 or node.end_lineno is None or body[0].end_lineno is None:
        return None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    doc_end = body[0].end_lineno
    indent = cls.col_offset if cls is not None else node.col_offset

    def text(part: list[str]) -> str:  # dedented to the top-level statement, each line ended
        part = [ln[indent:] if ln[:indent].isspace() or not ln[:indent] else ln for ln in part]
        return "".join(ln if ln.endswith("\n") else ln + "\n" for ln in part)

    tail = lines[doc_end : node.end_lineno]
    while tail and not tail[-1].strip():
        tail.pop()
    if not tail:
        return None
    prompt = text(lines[first - 1 : doc_end])
    return (f"class {cls.name}:\n" + prompt if cls is not None else prompt), text(tail)


def python_docstring_records(
    spec: DocstringsSpec | None = None, files: Sequence[Path] | None = None
) -> Iterator[dict[str, str]]:
    """Instruction records {"prompt", "response", "source"} from documented stdlib functions
    (top-level functions and methods of top-level classes, in file order).

    prompt: the function's decorators, signature and docstring (a method's preceded by its
    `class Name:` line); response: the rest of the body (prompt + response is its source).
    """
    spec = spec or DocstringsSpec()
    root = stdlib_dir()
    for path in stdlib_files() if files is None else files:
        text = read_python_source(path)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue  # a file this Python cannot parse (never the case for its own stdlib)
        lines = text.splitlines(keepends=True)
        try:
            module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
        except ValueError:
            module = path.stem
        candidates = [
            (node, top if isinstance(top, ast.ClassDef) else None)
            for top in tree.body
            for node in (top.body if isinstance(top, ast.ClassDef) else [top])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node, cls in candidates:
            doc = ast.get_docstring(node)
            if doc is None or len(doc) < spec.min_docstring_chars:
                continue
            rec = _function_record(lines, node, cls)
            if rec is None or rec[1].count("\n") > spec.max_response_lines:
                continue
            qual = f"{cls.name}.{node.name}" if cls is not None else node.name
            yield {"prompt": rec[0], "response": rec[1], "source": f"{module}:{qual}"}


_CITIES = (
    "Amsterdam Athens Auckland Bangkok Barcelona Beirut Belgrade Berlin Bogota Boston Brisbane "
    "Brussels Bucharest Budapest Cairo Calgary Chicago Copenhagen Dakar Delhi Denver Dublin "
    "Edinburgh Florence Geneva Glasgow Hamburg Hanoi Havana Helsinki Istanbul Jakarta Kyoto Lagos "
    "Lima Lisbon Liverpool London Madrid Manila Marseille Melbourne Miami Milan Montreal Moscow "
    "Mumbai Munich Nairobi Naples Oslo Ottawa Paris Perth Porto Prague Quito Riga Rome Santiago "
    "Seattle Seoul Seville Shanghai Singapore Sofia Stockholm Sydney Taipei Tallinn Tokyo Toronto "
    "Tunis Valencia Vancouver Venice Vienna Vilnius Warsaw Zagreb Zurich"
).split()

_SUBJECTS = (
    "The river, A quiet village, The old library, The baker, The committee, A small boat, The "
    "mountain path, Our neighbour, The orchestra, A curious child, The gardener, The "
    "lighthouse keeper, A travelling musician, The school teacher, The night train, An "
    "elderly painter, The fishing fleet, A young poet, The museum guard, The shepherd"
).split(", ")
_VERBS = (
    "drifted past, waited near, spoke about, looked toward, returned to, painted, wrote "
    "about, remembered, walked along, listened to, dreamed of, searched for, sang about, "
    "slowly crossed, quietly admired, often visited"
).split(", ")
_OBJECTS = (
    "the green hills, a forgotten garden, the harbour at dusk, the long winter, an empty "
    "station, the autumn market, the stone bridge, a field of sunflowers, the northern coast, "
    "the narrow streets, a distant island, the frozen lake, the crowded square, an abandoned "
    "mill, the evening tide, the cedar forest"
).split(", ")
_TAILS = (
    "||| before the rain began| without saying a word| as the light faded| for most of the "
    "afternoon| once again| with great care| in the early morning| while the bells rang| "
    "under a grey sky"
).split("|")


def _pick(rng: random.Random, seq: Sequence[Any]) -> Any:
    return seq[int(rng.random() * len(seq))]


def filler_sentence(rng: random.Random) -> str:
    """One sentence of haystack filler: plain English, no digits, never about magic numbers."""
    return f"{_pick(rng, _SUBJECTS)} {_pick(rng, _VERBS)} {_pick(rng, _OBJECTS)}{_pick(rng, _TAILS)}."


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Needle:
    """One hidden fact. `char_offset` is where `sentence` starts in the example's haystack (and
    text); `depth` is that offset divided by the haystack's length."""

    key: str
    value: str
    sentence: str
    char_offset: int
    depth: float
    requested_depth: float


@dataclass(frozen=True)
class NeedleExample:
    """A multi-needle retrieval example.

    text = prompt + answer; prompt = haystack + "\\n\\nQuestion: ...\\nAnswer:"; the model should
    continue the prompt with the answer, which states each queried key's value in query order.
    """

    text: str
    prompt: str
    answer: str
    haystack: str
    question: str
    needles: list[Needle]
    query_keys: list[str]
    expected: list[str]
    n_tokens: int | None = field(default=None)
    """Tokens of the haystack, when a tokenizer was given."""


def _needle_sentence(key: str, value: str) -> str:
    return f"The magic number of {key} is {value}."


def _question(keys: list[str]) -> str:
    if len(keys) == 1:
        return f"What is the magic number of {keys[0]}?"
    return f"What are the magic numbers of {', '.join(keys[:-1])} and {keys[-1]}?"


def _assemble(
    sentences: list[str], needles: list[tuple[str, str, float]]
) -> tuple[str, list[tuple[int, str]]]:
    """(haystack, per needle (char offset, sentence)): the needle sentences inserted at the
    sentence boundaries nearest their depths."""
    starts = [0, *itertools.accumulate(len(s) + 1 for s in sentences)]
    total = max(starts[-1] - 1, 0)
    at: dict[int, list[int]] = {}
    for i, (_, _, depth) in enumerate(needles):
        b = min(range(len(starts)), key=lambda j: (abs(starts[j] - depth * total), j))
        at.setdefault(b, []).append(i)
    parts: list[str] = []
    offsets: list[tuple[int, str]] = [(0, "")] * len(needles)
    pos = 0
    for b in range(len(sentences) + 1):
        for i in at.get(b, []):
            s = _needle_sentence(*needles[i][:2])
            offsets[i] = (pos, s)
            parts.append(s)
            pos += len(s) + 1
        if b < len(sentences):
            parts.append(sentences[b])
            pos += len(sentences[b]) + 1
    return " ".join(parts), offsets


def make_needle_example(
    *,
    context_tokens: int | None = None,
    context_chars: int | None = None,
    n_needles: int = 4,
    n_queries: int = 1,
    depths: Sequence[float] | None = None,
    seed: int = 0,
    tokenizer: _Encoder | None = None,
    chars_per_token: float = 4.0,
) -> NeedleExample:
    """Build one multi-needle retrieval example, deterministic for `seed`.

    The haystack is filler sentences of about `context_chars` characters (or `context_tokens`
    tokens: measured exactly with `tokenizer` when given — the haystack is then trimmed to at
    most `context_tokens` — else estimated as context_tokens × chars_per_token characters). Needle
    i ("The magic number of <key_i> is <value_i>.", key a distinct city, value 7 digits) goes to
    the sentence boundary nearest depths[i] × haystack length; `depths` holds one value per
    needle or one for all (default: uniform random per needle). `n_queries` distinct needles are
    asked for at the end.
    """
    if (context_tokens is None) == (context_chars is None):
        raise ValueError("give exactly one of context_tokens and context_chars")
    if not 1 <= n_needles <= len(_CITIES):
        raise ValueError(f"n_needles must be in [1, {len(_CITIES)}], got {n_needles}")
    if not 1 <= n_queries <= n_needles:
        raise ValueError(f"n_queries must be in [1, n_needles={n_needles}], got {n_queries}")
    rng = random.Random(seed)
    pool = list(_CITIES)
    keys = [pool.pop(int(rng.random() * len(pool))) for _ in range(n_needles)]
    values = [str(1_000_000 + int(rng.random() * 9_000_000)) for _ in range(n_needles)]
    if depths is None:
        ds = [rng.random() for _ in range(n_needles)]
    else:
        ds = [float(d) for d in depths]
        if len(ds) == 1:
            ds = ds * n_needles
        if len(ds) != n_needles or any(not 0.0 <= d <= 1.0 for d in ds):
            raise ValueError(
                f"depths must be one value in [0, 1] per needle (or one for all), got {list(depths)}"
            )
    order = list(range(n_needles))
    queried = [order.pop(int(rng.random() * len(order))) for _ in range(n_queries)]
    needle_specs = list(zip(keys, values, ds, strict=True))
    needle_chars = sum(len(_needle_sentence(k, v)) + 1 for k, v in zip(keys, values, strict=True))

    # an endless, seeded stream of filler sentences; the haystack takes a prefix of it
    filler_rng = random.Random(rng.getrandbits(64))
    stream: list[str] = []

    def sentences_for(budget_chars: float) -> list[str]:
        out, n = [], 0
        while n + needle_chars < budget_chars:
            if len(out) == len(stream):
                stream.append(filler_sentence(filler_rng))
            out.append(stream[len(out)])
            n += len(out[-1]) + 1
        return out

    budget = float(context_chars) if context_chars is not None else context_tokens * chars_per_token
    sentences = sentences_for(budget)
    haystack, offsets = _assemble(sentences, needle_specs)
    n_tokens = None
    if tokenizer is not None and context_tokens is not None:
        # rescale the character budget to the measured chars/token, then trim to the token budget
        for _ in range(4):
            n_tokens = len(tokenizer.encode(haystack))
            if 0.97 * context_tokens <= n_tokens <= context_tokens:
                break
            budget *= context_tokens / max(n_tokens, 1)
            sentences = sentences_for(budget)
            haystack, offsets = _assemble(sentences, needle_specs)
        n_tokens = len(tokenizer.encode(haystack))
        while n_tokens > context_tokens and sentences:
            per_sentence = n_tokens / (len(sentences) + len(needle_specs))
            drop = max(1, int((n_tokens - context_tokens) / per_sentence))
            sentences = sentences[:-drop]
            haystack, offsets = _assemble(sentences, needle_specs)
            n_tokens = len(tokenizer.encode(haystack))
    query_keys = [keys[i] for i in queried]
    expected = [values[i] for i in queried]
    question = _question(query_keys)
    prompt = f"{haystack}\n\nQuestion: {question}\nAnswer:"
    answer = " " + " ".join(map(_needle_sentence, query_keys, expected))
    n = max(len(haystack), 1)
    needles = [
        Needle(key=k, value=v, sentence=s, char_offset=off, depth=off / n, requested_depth=d)
        for (k, v, d), (off, s) in zip(needle_specs, offsets, strict=True)
    ]
    return NeedleExample(
        text=prompt + answer,
        prompt=prompt,
        answer=answer,
        haystack=haystack,
        question=question,
        needles=needles,
        query_keys=query_keys,
        expected=expected,
        n_tokens=n_tokens,
    )


def needle_documents(spec: NeedlesSpec | None = None) -> Iterator[str]:
    """The documents of `builtin:needles` (each a full example: haystack, question, answer)."""
    spec = spec or NeedlesSpec()
    for i in range(spec.num_documents):
        yield make_needle_example(
            context_chars=int(spec.context_tokens * spec.chars_per_token),
            n_needles=spec.n_needles,
            n_queries=spec.n_queries,
            depths=spec.depths,
            seed=stable_seed("needles", spec.seed, i),
        ).text


def needles_estimated_bytes(spec: NeedlesSpec | None = None) -> int:
    spec = spec or NeedlesSpec()
    return spec.num_documents * (int(spec.context_tokens * spec.chars_per_token) + 80 + 50 * spec.n_queries)
