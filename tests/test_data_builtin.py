"""Embedded corpora: needles land where asked and are answerable; docstring records are real code."""

from __future__ import annotations

import ast
import itertools

import pytest

from difftrain.data.builtin import make_needle_example, needle_documents, python_docstring_records
from difftrain.data.config import DocstringsSpec, NeedlesSpec, TokenizerTrainConfig
from difftrain.data.tokenizer import train_tokenizer


def test_needles_land_at_the_requested_depths_and_are_found_at_their_offsets() -> None:
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    ex = make_needle_example(context_chars=8000, n_needles=5, n_queries=3, depths=depths, seed=7)
    longest_sentence = max(len(s) for s in ex.haystack.split(". "))
    for needle, d in zip(ex.needles, depths, strict=True):
        assert ex.haystack[needle.char_offset :].startswith(needle.sentence)
        assert ex.text[needle.char_offset :].startswith(needle.sentence)
        assert needle.sentence == f"The magic number of {needle.key} is {needle.value}."
        assert abs(needle.char_offset - d * len(ex.haystack)) <= 2 * longest_sentence
        assert abs(needle.depth - d) < 0.03 and needle.requested_depth == d
    assert len({n.key for n in ex.needles}) == 5
    assert all(len(n.value) == 7 and n.value.isdigit() for n in ex.needles)
    assert 7600 <= len(ex.haystack) <= 8400


def test_the_query_asks_for_hidden_needles_and_the_answer_states_their_values() -> None:
    ex = make_needle_example(context_chars=3000, n_needles=4, n_queries=2, seed=3)
    by_key = {n.key: n.value for n in ex.needles}
    assert len(ex.query_keys) == 2 and set(ex.query_keys) <= set(by_key)
    assert ex.expected == [by_key[k] for k in ex.query_keys]
    assert ex.text == ex.prompt + ex.answer and ex.prompt.startswith(ex.haystack)
    assert ex.prompt.endswith("Answer:") and all(k in ex.question for k in ex.query_keys)
    for k, v in zip(ex.query_keys, ex.expected, strict=True):
        assert f"The magic number of {k} is {v}." in ex.answer
        assert ex.haystack.count(v) == 1  # the value appears once in the context: retrieval is needed
    filler = ex.haystack
    for n in ex.needles:
        filler = filler.replace(n.sentence, "")
    assert not any(ch.isdigit() for ch in filler) and "magic" not in filler  # no decoy facts


def test_needles_are_deterministic_for_a_seed_and_vary_across_seeds() -> None:
    a = make_needle_example(context_chars=2000, n_needles=3, seed=11)
    assert a == make_needle_example(context_chars=2000, n_needles=3, seed=11)
    assert a.text != make_needle_example(context_chars=2000, n_needles=3, seed=12).text
    spec = NeedlesSpec(num_documents=4, context_tokens=64, n_needles=2)
    assert list(needle_documents(spec)) == list(needle_documents(spec))
    assert len(set(needle_documents(spec))) == 4


def test_with_a_tokenizer_the_haystack_fills_the_token_budget() -> None:
    tok = train_tokenizer(
        (make_needle_example(context_chars=4000, seed=s).text for s in range(3)),
        TokenizerTrainConfig(vocab_size=400),
    )
    ex = make_needle_example(context_tokens=500, n_needles=3, seed=5, tokenizer=tok)
    assert ex.n_tokens == len(tok.encode(ex.haystack))
    assert 0.9 * 500 <= ex.n_tokens <= 500
    with pytest.raises(ValueError, match="exactly one"):
        make_needle_example(context_tokens=10, context_chars=10)


def test_docstring_records_split_real_functions_into_signature_plus_docstring_and_body() -> None:
    records = list(itertools.islice(python_docstring_records(), 300))
    assert len(records) == 300
    for r in records:
        code = r["prompt"] + r["response"]
        ast.parse(code)  # prompt + response is the function's own, valid source
        assert r["prompt"].lstrip().startswith(("def ", "async def ", "@", "class "))
        fn = next(
            n
            for n in ast.walk(ast.parse(r["prompt"]))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        )
        assert len(fn.body) == 1 and ast.get_docstring(fn)  # the prompt ends right after the docstring
        assert r["response"].strip()
        assert ":" in r["source"]
    # methods carry their class line; the record source names module:Class.method
    method = next(r for r in records if "." in r["source"].split(":")[1])
    assert method["prompt"].startswith("class " + method["source"].split(":")[1].split(".")[0] + ":")


def test_docstring_records_respect_their_limits() -> None:
    spec = DocstringsSpec(max_response_lines=3, min_docstring_chars=40)
    for r in itertools.islice(python_docstring_records(spec), 100):
        assert r["response"].count("\n") <= 3
