"""The generation engine: cached == uncached, batched == alone, reproducible, stops where promised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftrain.data.config import TokenizerTrainConfig
from difftrain.data.tokenizer import train_tokenizer
from difftrain.errors import ConfigError, DataError
from difftrain.infer.generate import (
    Finished,
    GenerationConfig,
    Token,
    _Text,
    generate,
    generate_all,
    greedy,
    prompt_ids,
)
from difftrain.infer.sampling import SamplingConfig
from difftrain.model import ModelConfig, Transformer
from difftrain.model.transformer import LMOutput

ARCHS = ["baseline", "diff", "diff2"]
PROMPTS = [[5, 9, 2, 33, 17, 8, 41], [12, 3], [60, 1, 44, 7, 7, 19, 25, 30, 11, 2, 50]]


def tiny_model(arch: str, n_kv_heads: int | None = None, max_seq_len: int = 48, seed: int = 0) -> Transformer:
    # init_std 0.2 (not 0.02) makes the logits of a random model far from ties, so that exact
    # token equality between two float paths is a sharp test rather than a coin toss.
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
        max_seq_len=max_seq_len, init_std=0.2,
    )  # fmt: skip
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["hello world, the quick brown fox jumps over the lazy dog"] * 10 + [
        "def f(x):\n    return x"
    ] * 10
    return train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300))


# ----- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_cache_equals_recomputing_the_prefix(arch, n_kv_heads):
    model = tiny_model(arch, n_kv_heads)
    for prompt in PROMPTS:
        cached = greedy(model, [prompt], 30)[0]
        uncached = greedy(model, [prompt], 30, use_cache=False)[0]
        assert len(cached.token_ids) == 30
        assert cached.token_ids == uncached.token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_left_padded_greedy_equals_each_prompt_alone(arch):
    model = tiny_model(arch, n_kv_heads=2)
    alone = [greedy(model, [p], 20)[0].token_ids for p in PROMPTS]
    batched = [c.token_ids for c in greedy(model, PROMPTS, 20)]
    batched_uncached = [c.token_ids for c in greedy(model, PROMPTS, 20, use_cache=False)]
    assert batched == alone
    assert batched_uncached == alone


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_tokens_with_cache_equal_those_without(arch):
    model = tiny_model(arch)
    cfg = GenerationConfig(
        max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0), seed=7
    )
    cached = generate_all(model, PROMPTS, cfg)
    uncached = generate_all(model, PROMPTS, GenerationConfig(**{**cfg.__dict__, "use_cache": False}))
    assert [c.token_ids for c in cached] == [c.token_ids for c in uncached]


@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_decode_step_equals_the_cached_forward_on_a_left_padded_batch(arch, n_kv_heads):
    # static steps (what --compile runs) attend over every slot of the cache through a mask; the
    # cached forward over exactly the used slots. Same logits, step after step, for rows whose
    # prompts have different lengths (left padding) -- run eagerly, so the mask and slot logic
    # are tested without a compiler.
    model = tiny_model(arch, n_kv_heads)
    P = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in PROMPTS])
    pad = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in PROMPTS])
    with torch.inference_mode():
        ref, static = model.new_cache(3, max_len=P + 8), model.new_cache(3, max_len=P + 8)
        a = model(ids, cache=ref, key_padding_mask=pad).logits[:, -1]
        b = model(ids, cache=static, key_padding_mask=pad).logits[:, -1]
        static.start_static()
        for _ in range(8):
            nxt = a.argmax(-1)[:, None]
            a = model(nxt, cache=ref).logits[:, -1]
            b = model(nxt, cache=static).logits[:, -1]
            static.static_step_done()
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        assert static.length == ref.length == static.max_len
        for k1, k2 in zip(ref.keys + ref.values, static.keys + static.values, strict=True):
            torch.testing.assert_close(k2, k1, atol=2e-5, rtol=1e-5)


def test_compiled_generation_gives_the_eager_tokens_and_reuses_its_compiled_step():
    model = tiny_model("diff", n_kv_heads=2)
    greedy_cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(greedy=True))
    eager = [c.token_ids for c in generate_all(model, PROMPTS, greedy_cfg)]
    compiled_cfg = GenerationConfig(**{**greedy_cfg.__dict__, "compile": True})
    assert [c.token_ids for c in generate_all(model, PROMPTS, compiled_cfg)] == eager
    step = model.__dict__["_compiled_forward"]
    assert [c.token_ids for c in generate_all(model, PROMPTS[:1], compiled_cfg)] == eager[:1]
    assert model.__dict__["_compiled_forward"] is step


def test_compile_without_the_cache_is_refused():
    with pytest.raises(ConfigError, match="use_cache=False"):
        GenerationConfig(compile=True, use_cache=False)


def test_sampling_is_reproducible_for_a_seed_and_independent_of_the_batch():
    model = tiny_model("diff")
    sampling = SamplingConfig(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    cfg = GenerationConfig(max_new_tokens=16, sampling=sampling, seed=11)
    first = [c.token_ids for c in generate_all(model, PROMPTS, cfg)]
    again = [c.token_ids for c in generate_all(model, PROMPTS, cfg)]
    assert first == again
    # row i of a batch uses seed + i: drawing it alone with that seed gives the same sample
    alone = [generate_all(model, [p], cfg, seeds=[11 + i])[0].token_ids for i, p in enumerate(PROMPTS)]
    assert alone == first
    other = [
        c.token_ids for c in generate_all(model, PROMPTS, GenerationConfig(**{**cfg.__dict__, "seed": 12}))
    ]
    assert other != first
    # the same prompt with different seeds gives different samples (temperature 1.2 over 64 tokens)
    twins = generate_all(model, [PROMPTS[0]] * 2, cfg)
    assert twins[0].token_ids != twins[1].token_ids


def test_repetition_penalty_changes_greedy_choices_toward_unseen_tokens():
    model = tiny_model("baseline")
    plain = greedy(model, [PROMPTS[0]], 30)[0].token_ids
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(greedy=True, repetition_penalty=50.0))
    penalised = generate_all(model, [PROMPTS[0]], cfg)[0].token_ids
    seen_then_repeated = lambda ids: sum(t in PROMPTS[0] + ids[:j] for j, t in enumerate(ids))  # noqa: E731
    assert seen_then_repeated(penalised) < seen_then_repeated(plain)


# ----- stopping --------------------------------------------------------------------------------
def test_context_full_stops_with_reason_context_and_never_feeds_past_max_seq_len():
    model = tiny_model("diff2", max_seq_len=16)
    calls: list[int] = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["cache"].length + args[0].shape[1]), with_kwargs=True
    )
    (c,) = greedy(model, [list(range(1, 11))], 100)
    assert (len(c.token_ids), c.finish_reason) == (16 - 10 + 1, "context")
    assert max(calls) == 16  # the model never reads more than max_seq_len tokens
    (c,) = greedy(model, [list(range(1, 11))], 3)
    assert (len(c.token_ids), c.finish_reason) == (3, "length")
    (c,) = greedy(model, [list(range(1, 17))], 5)  # a prompt that fills the context gets one token
    assert (len(c.token_ids), c.finish_reason) == (1, "context")


def test_batched_sequences_stop_at_their_own_context_limit():
    model = tiny_model("baseline", max_seq_len=16)
    long, short = list(range(1, 15)), [3, 4]
    out = greedy(model, [long, short], 40)
    assert [(len(c.token_ids), c.finish_reason) for c in out] == [(3, "context"), (15, "context")]
    assert out[1].token_ids == greedy(model, [short], 40)[0].token_ids


def test_prompts_that_do_not_fit_are_rejected_with_a_data_error():
    model = tiny_model("diff", max_seq_len=16)
    with pytest.raises(DataError, match="prompt 2 is 17 tokens but the model's context is max_seq_len=16"):
        greedy(model, [[1, 2], [1] * 17], 4)
    with pytest.raises(DataError, match="prompt 1 is empty"):
        greedy(model, [[]], 4)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        greedy(model, [[1, 64]], 4)
    with pytest.raises(ConfigError, match="max_new_tokens=0"):
        GenerationConfig(max_new_tokens=0)


class ScriptedLM(nn.Module):
    """A stand-in LM that emits `script` in order (one-hot logits), for testing the stop logic."""

    def __init__(self, script: list[int], vocab_size: int, max_seq_len: int = 256) -> None:
        super().__init__()
        self.script = script
        self.config = ModelConfig(
            vocab_size=vocab_size, d_model=8, n_layers=1, n_heads=2, max_seq_len=max_seq_len
        )
        self.lm_head = nn.Linear(1, 1)
        self.prompt_len: int | None = None

    def forward(self, ids, key_padding_mask=None, **_):
        self.prompt_len = ids.shape[1] if self.prompt_len is None else self.prompt_len
        n = ids.shape[1] - self.prompt_len
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.config.vocab_size)
        logits[:, -1, self.script[min(n, len(self.script) - 1)]] = 1.0
        return LMOutput(logits=logits)


def scripted(tokenizer, text: str, tail: list[int] = ()) -> tuple[ScriptedLM, list[int]]:
    script = tokenizer.encode(text) + list(tail)
    return ScriptedLM(script, tokenizer.vocab_size), [tokenizer.eos_id]


def run_text(model, prompt, tokenizer, **cfg) -> tuple[str, object]:
    cfg = GenerationConfig(sampling=SamplingConfig(greedy=True), use_cache=False, **cfg)
    streamed, done = "", None
    for ev in generate(model, [prompt], cfg, tokenizer=tokenizer):
        if isinstance(ev, Token):
            assert "\ufffd" not in ev.text
            streamed += ev.text
        elif isinstance(ev, Finished):
            done = ev.completion
    return streamed, done


def test_stop_string_cuts_the_completion_and_is_never_streamed(tokenizer):
    model, prompt = scripted(tokenizer, "the quick brown fox. THE END and more text")
    streamed, c = run_text(model, prompt, tokenizer, stop=("THE END", "never"), max_new_tokens=100)
    assert c.finish_reason == "stop"
    assert c.text == streamed == "the quick brown fox. "
    assert tokenizer.decode(c.token_ids).startswith(
        "the quick brown fox. THE"
    )  # stopped on the token that completed it


def test_a_partial_stop_string_is_held_back_then_released_when_it_does_not_complete(tokenizer):
    model, prompt = scripted(tokenizer, "one THE ENDING two", [tokenizer.eos_id])
    streamed, c = run_text(model, prompt, tokenizer, stop=("THE ENDS",), max_new_tokens=100)
    assert c.finish_reason == "eos"
    assert c.text == streamed == "one THE ENDING two"
    assert c.token_ids[-1] == tokenizer.eos_id


def test_text_holds_back_only_a_possible_start_of_a_stop_string():
    class Chars:  # a "tokenizer" whose tokens are characters
        eos_id = pad_id = 0

        def stream_decoder(self, context=()):
            class D:
                push = staticmethod(chr)
                flush = staticmethod(lambda: "")

            return D()

    t = _Text(Chars(), ("<END>", "xy"), [])
    out = [t.push(ord(ch)) for ch in "ab<ENx<E"]
    assert "".join(s for s, _ in out) == "ab<ENx"  # "<E" is held back: it may become "<END>"
    assert t.push(ord("N"))[0] == "" and t.push(ord("D"))[0] == ""
    assert t.push(ord(">")) == ("", True)
    assert t.text == "ab<ENx"


def test_eos_ends_a_sequence_without_text_and_multibyte_characters_stream_intact(tokenizer):
    text = "naïve café 🙂 ok"  # ï, é and the emoji are not in the tiny vocabulary: split into byte tokens
    model, prompt = scripted(tokenizer, text, [tokenizer.eos_id, 5, 6])
    assert len(tokenizer.encode("🙂")) > 1
    streamed, c = run_text(model, prompt, tokenizer, max_new_tokens=100)
    assert (c.finish_reason, c.text, streamed) == ("eos", text, text)


def test_max_new_tokens_ends_with_reason_length_and_the_text_flushed(tokenizer):
    model, prompt = scripted(tokenizer, "hello world hello world hello world")
    streamed, c = run_text(model, prompt, tokenizer, max_new_tokens=3)
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert streamed == c.text == tokenizer.decode(c.token_ids)


def test_prompt_ids_start_with_the_document_separator(tokenizer):
    assert prompt_ids(tokenizer, "hello") == [tokenizer.eos_id, *tokenizer.encode("hello")]
    assert prompt_ids(tokenizer, "") == [tokenizer.eos_id]


class _Ids:
    """A "tokenizer" of `vocab_size` ids, `unused_ids` of them gaps, each token printing "x"."""

    eos_id = pad_id = 0

    def __init__(self, vocab_size: int, unused_ids: list[int] | None = None) -> None:
        self.vocab_size, self.unused_ids = vocab_size, unused_ids or []

    def stream_decoder(self, context=()):
        class D:
            push = staticmethod(lambda i: "x")
            flush = staticmethod(lambda: "")

        return D()


def test_rows_past_the_tokenizer_are_never_drawn():
    # vocab_size: auto pads the embedding to a multiple of 64; those rows stand for no token, and
    # a young model gives them no -inf logit: they were drawn (30 of 573 samples after 5 steps)
    model = tiny_model("diff")  # 64 rows for a 40-token tokenizer
    with torch.no_grad():
        model.lm_head.weight[40:] = model.lm_head.weight[40:] * 0 + 5.0 * model.lm_head.weight[:1].sign()
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.5), stop_at_eos=False)
    free = generate_all(model, PROMPTS, cfg)  # (without a tokenizer every row is a token id)
    assert any(t >= 40 for c in free for t in c.token_ids)
    masked = generate_all(model, PROMPTS, cfg, tokenizer=_Ids(40))
    assert all(t < 40 for c in masked for t in c.token_ids)


def test_ids_that_are_gaps_in_the_tokenizer_are_never_drawn():
    # a tokenizer.json whose ids have gaps: the rows between them stand for no token either
    model = tiny_model("diff")
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=2.0), stop_at_eos=False)
    free = generate_all(model, PROMPTS, cfg)
    assert any(t % 2 for c in free for t in c.token_ids)
    masked = generate_all(model, PROMPTS, cfg, tokenizer=_Ids(64, list(range(1, 64, 2))))  # odd ids: gaps
    assert not any(t % 2 for c in masked for t in c.token_ids)
