"""The generation engine: batched, KV-cached, streaming decoding for baseline, diff and diff2.

`generate(model, prompts, config)` yields a `Token` for every token a sequence produces and a
`Finished` (with its `Completion`) when it stops; `generate_all` drains it.

Prompts of lengths L_i are left-padded to P = max L_i; the padding is masked out of attention and
each row gets RoPE positions 0 … L_i − 1, so each row computes exactly what it would alone.

    prefill:  logits = model(ids (B, P), cache, key_padding_mask)[:, −1]   (fills the KV cache)
    decode:   v_t ~ sampler(logits);  logits = model(v_t (B, 1), cache)[:, −1]

A sequence stops (first match wins) at `eos` (not part of the text), `stop` (a stop string: the
text is cut before it), `length` (`max_new_tokens`) or `context`: a prompt of L tokens gets at most
max_seq_len − L + 1 new ones; the window never slides. Row i samples from its own generator seeded
`seeds[i]` (default `config.seed + i`), so a sample does not depend on its batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from difftrain.errors import DataError
from difftrain.infer.sampling import Sampler
from difftrain.infer.settings import GenerationConfig, SamplingConfig

FinishReason = Literal["eos", "stop", "length", "context"]


@dataclass
class Completion:
    """One finished sequence. `token_ids`: all tokens produced (a final eos included); `text`:
    their text without the eos, cut before a stop string."""

    seq: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    first_token_s: float
    time_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.time_s if self.time_s > 0 else float("inf")


@dataclass
class Token:
    """Sequence `seq` produced `token_id`; `text` is the text that became final with it ("" while
    a multi-byte character or a possible stop string is incomplete, or without a tokenizer)."""

    seq: int
    token_id: int
    text: str


@dataclass
class Finished:
    seq: int
    completion: Completion


def prompt_ids(tokenizer: Any, text: str, *, document_start: bool = True) -> list[int]:
    """Token ids of a text prompt, after the token a document starts after (`document_start_id`:
    <|eos|>, or an imported tokenizer's bos) or, without `document_start` (an instruction or chat
    prompt), after the tokenizer's `record_start_id`, if any."""
    from difftrain.data.tokenizer import record_start_id

    ids = tokenizer.encode(text)
    start = (
        getattr(tokenizer, "document_start_id", tokenizer.eos_id)
        if document_start
        else record_start_id(tokenizer)
    )
    return ids if start is None else [start, *ids]


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_seq_len: int) -> None:
    """DataError unless every prompt is non-empty, in the vocabulary and fits the context."""
    if len(prompts) == 0:
        raise DataError("no prompts to generate from")
    for i, p in enumerate(prompts, start=1):
        if len(p) == 0:
            raise DataError(f"prompt {i} is empty (no tokens); give some text, or start from <|eos|>")
        if len(p) > max_seq_len:
            raise DataError(
                f"prompt {i} is {len(p)} tokens but the model's context is max_seq_len={max_seq_len} tokens; "
                f"shorten it by at least {len(p) - max_seq_len} tokens"
            )
        if bad := [t for t in p if not 0 <= int(t) < vocab_size]:
            raise DataError(
                f"prompt {i} has token id {bad[0]} outside the model's vocabulary (0 … {vocab_size - 1}); "
                "was it encoded with another tokenizer?"
            )


class _Text:
    """Decoded text of one sequence: emits what is final, holds back a possible stop string."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], prompt: Sequence[int]) -> None:
        # decoded in the prompt's context (a SentencePiece "▁world" after "Hello" is " world")
        self.decoder = tokenizer.stream_decoder(context=prompt)
        self.stops = stops
        self.text = ""
        self.emitted = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (newly final text, whether a stop string was reached)."""
        self.text += self.decoder.push(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """Flush the decoder; return the rest of the text."""
        self.text += self.decoder.flush()
        return self._advance(final=True)[0]

    def _advance(self, final: bool) -> tuple[str, bool]:
        # A stop string cannot start before `emitted`: the longest suffix that is a prefix of a
        # stop string is always held back, and any earlier start would be a longer such suffix.
        if hits := [j for s in self.stops if (j := self.text.find(s, self.emitted)) >= 0]:
            cut = min(hits)
            out, self.text, self.emitted = self.text[self.emitted : cut], self.text[:cut], cut
            return out, True
        # held back: the longest suffix of the text that is a proper prefix of a stop string
        longest = (
            next((k for k in range(min(len(s) - 1, len(self.text)), 0, -1) if self.text.endswith(s[:k])), 0)
            for s in self.stops
        )
        keep = 0 if final else max(longest, default=0)
        end = max(self.emitted, len(self.text) - keep)
        out, self.emitted = self.text[self.emitted : end], end
        return out, False


class _Forward:
    """Prefill once, then feed one token per step into a preallocated KV cache of `capacity`;
    with `capacity=None` (the reference path) recompute the whole sequence every step instead."""

    def __init__(
        self, model: torch.nn.Module, ids: Tensor, mask: Tensor | None, capacity: int | None
    ) -> None:
        self.model, self.ids, self.mask = model, ids, mask
        self.cache = None if capacity is None else model.new_cache(ids.shape[0], max_len=capacity)  # type: ignore[operator]

    def prefill(self) -> Tensor:
        return self.model(self.ids, cache=self.cache, key_padding_mask=self.mask).logits[:, -1].float()

    def step(self, next_ids: Tensor) -> Tensor:
        if self.cache is not None:
            return self.model(next_ids[:, None], cache=self.cache).logits[:, -1].float()
        self.ids = torch.cat((self.ids, next_ids[:, None]), dim=1)
        if self.mask is not None:
            self.mask = torch.cat((self.mask, self.mask.new_ones(self.mask.shape[0], 1)), dim=1)
        return self.prefill()


class _CompiledForward(_Forward):
    """A cached `_Forward` whose decode steps run the compiled forward over a static cache; the
    prefill (once per generation, of varying length) runs eagerly."""

    def __init__(self, model: torch.nn.Module, ids: Tensor, mask: Tensor | None, capacity: int) -> None:
        super().__init__(model, ids, mask, capacity)
        self.graphs = ids.device.type == "cuda"
        # compiled once and kept on the model (a new batch size or cache length compiles once more,
        # then runs with symbolic sizes); on CUDA each step replays as one CUDA graph
        if "_compiled_forward" not in model.__dict__:
            mode = "reduce-overhead" if self.graphs else None
            model.__dict__["_compiled_forward"] = torch.compile(model.forward, mode=mode)
        self.decode = model.__dict__["_compiled_forward"]

    def prefill(self) -> Tensor:
        logits = super().prefill()
        c = self.cache
        c.start_static()
        if self.graphs:  # what the CUDA graph reads and writes stays at one address for the run
            for t in (*c.keys, *c.values, c.key_padding_mask, c.next_position, c.slot):
                torch._dynamo.mark_static_address(t)
        return logits

    def step(self, next_ids: Tensor) -> Tensor:
        if self.graphs:  # the previous step's outputs have been read: the graph may reuse them
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.decode(next_ids[:, None], cache=self.cache).logits[:, -1].float()
        self.cache.static_step_done()
        return logits


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    tokenizer: Any = None,
    eos_id: int | None = None,
    seeds: Sequence[int] | None = None,
) -> Iterator[Token | Finished]:
    """Generate continuations of `prompts` (token ids) as one batch, yielding events as they happen.

    model: a `Transformer` in eval mode. tokenizer: needed for text and stop strings; eos_id
    defaults to its eos. seeds: one per prompt. Logit rows the tokenizer has no token for (past its
    vocabulary, or its `unused_ids`) are never drawn.
    """
    config = config or GenerationConfig()
    mc = model.config  # type: ignore[attr-defined]
    check_prompts(prompts, mc.vocab_size, mc.max_seq_len)
    if config.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode the generated text")
    if eos_id is None and tokenizer is not None:
        eos_id = tokenizer.eos_id
    eos = eos_id if config.stop_at_eos else None
    B = len(prompts)
    seeds = [config.seed + i for i in range(B)] if seeds is None else list(seeds)
    if len(seeds) != B:
        raise ValueError(f"{len(seeds)} seeds for {B} prompts")
    device = model.lm_head.weight.device  # type: ignore[union-attr]

    # Left-pad into (B, P); sequence i may produce at most `limits[i]` tokens.
    lens = [len(p) for p in prompts]
    P = max(lens)
    limits = [min(config.max_new_tokens, mc.max_seq_len - L + 1) for L in lens]
    pad = tokenizer.pad_id if tokenizer is not None else 0
    ids = torch.tensor([[pad] * (P - len(p)) + [int(t) for t in p] for p in prompts], device=device)
    mask = torch.arange(P, device=device) >= torch.tensor([P - L for L in lens], device=device)[:, None]
    mask_arg = None if min(lens) == P else mask

    sampler = Sampler(config.sampling, seeds, device)
    seen = None
    if config.sampling.repetition_penalty != 1.0:
        seen = torch.zeros(B, mc.vocab_size, dtype=torch.bool, device=device)
        seen[mask.nonzero(as_tuple=True)[0], ids[mask]] = True
    # rows of no token (untrained, so not −inf in a young model): past the tokenizer, and its gaps
    n_tokens = min(getattr(tokenizer, "vocab_size", None) or mc.vocab_size, mc.vocab_size)
    gaps = [i for i in getattr(tokenizer, "unused_ids", ()) if i < n_tokens]
    banned = torch.cat((torch.tensor(gaps, dtype=torch.long), torch.arange(n_tokens, mc.vocab_size)))
    banned_ids = banned.to(device) if len(banned) else None

    texts = [_Text(tokenizer, config.stop, p) if tokenizer is not None else None for p in prompts]
    produced: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    with torch.inference_mode():
        capacity = P + max(limits) - 1 if config.use_cache else None
        run = (_CompiledForward if config.compile else _Forward)(model, ids, mask_arg, capacity)
        t0 = time.perf_counter()
        logits = run.prefill()
    for step in range(max(limits)):
        with torch.inference_mode():
            if banned_ids is not None:
                logits = logits.index_fill(1, banned_ids, float("-inf"))
            next_ids = sampler(logits, seen)
            if seen is not None:
                seen.scatter_(1, next_ids[:, None], True)
        if step == 0:
            first_token_s = time.perf_counter() - t0
        for i, tok in enumerate(next_ids.tolist()):
            if done[i]:
                continue
            produced[i].append(tok)
            text_state = texts[i]
            reason: FinishReason | None = None
            text = ""
            if tok == eos:
                reason = "eos"
            elif text_state is not None:
                text, stopped = text_state.push(tok)
                reason = "stop" if stopped else None
            if reason is None and len(produced[i]) >= limits[i]:
                reason = "length" if len(produced[i]) >= config.max_new_tokens else "context"
            if reason in ("eos", "length", "context") and text_state is not None:
                text += text_state.finish()
            yield Token(i, tok, text)
            if reason is not None:
                done[i] = True
                completion = Completion(
                    seq=i,
                    prompt_ids=[int(t) for t in prompts[i]],
                    token_ids=produced[i],
                    text=text_state.text if text_state is not None else "",
                    finish_reason=reason,
                    first_token_s=first_token_s,
                    time_s=time.perf_counter() - t0,
                )
                yield Finished(i, completion)
        if all(done):
            break
        with torch.inference_mode():
            logits = run.step(next_ids)


def generate_all(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    **kwargs: Any,
) -> list[Completion]:
    """Run `generate` to the end; the completions in prompt order."""
    out = {
        ev.seq: ev.completion for ev in generate(model, prompts, config, **kwargs) if isinstance(ev, Finished)
    }
    return [out[i] for i in sorted(out)]


def greedy(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    tokenizer: Any = None,
    eos_id: int | None = None,
    stop: Sequence[str] = (),
    use_cache: bool = True,
) -> list[Completion]:
    """Greedy completions of a batch (what the evaluations use)."""
    cfg = GenerationConfig(max_new_tokens, SamplingConfig(greedy=True), tuple(stop), use_cache=use_cache)
    return generate_all(model, prompts, cfg, tokenizer=tokenizer, eos_id=eos_id)
