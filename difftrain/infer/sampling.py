"""Next-token sampling: logits z (B, V) → token ids (B,).

The pipeline, in the order of Hugging Face transformers' logits processors and warpers:

1. repetition penalty θ (CTRL, Keskar et al. 2019): for every token v already in the sequence
   (prompt or generated), z_v ← z_v / θ if z_v > 0 else z_v · θ. θ = 1 is off.
2. greedy (`greedy=True` or temperature T = 0): v = argmax_v z_v, and stop here.
3. temperature: z ← z / T.
4. top-k: keep the k largest z_v (tokens tied with the k-th are kept too). k = 0 is off.
5. top-p (nucleus, Holtzman et al. 2020): sort p = softmax(z) descending and keep the smallest
   prefix whose mass reaches p_top, i.e. token (j) is kept iff Σ_{i<j} p_(i) < p_top (the most
   probable token always survives). p_top = 1 is off.
6. min-p (Nguyen et al. 2024): keep v iff p_v ≥ min_p · max_u p_u, p = softmax(z) after the
   steps above. min_p = 0 is off.
7. p = softmax(z) over the survivors; draw v ~ p.

The draw is an exponential race: v = argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d., an exact
sample from p (E_v/p_v ~ Exp(p_v), and the smallest of independent exponentials is v with
probability p_v / Σ_u p_u). Each row has its own `torch.Generator`, so sample i of a seed is the
same whether it is drawn alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from difftrain.infer.settings import SamplingConfig


def filtered_logits(logits: Tensor, cfg: SamplingConfig, seen: Tensor | None = None) -> Tensor:
    """Steps 1 and 3-6 of the pipeline on fp32 logits (B, V); seen (B, V) bool; −inf marks removed
    tokens."""
    z, inf = logits.float(), float("-inf")
    if seen is not None and cfg.repetition_penalty != 1.0:  # 1
        r = cfg.repetition_penalty
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    if cfg.is_greedy:
        return z
    z = z / cfg.temperature  # 3
    if 0 < cfg.top_k < z.shape[-1]:  # 4
        z = z.masked_fill(z < torch.topk(z, cfg.top_k, dim=-1).values[..., -1:], inf)
    if cfg.top_p < 1.0:  # 5
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        drop_sorted = torch.cumsum(probs, dim=-1) - probs >= cfg.top_p
        z = z.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), inf)
    if cfg.min_p > 0.0:  # 6
        probs = torch.softmax(z, dim=-1)
        z = z.masked_fill(probs < cfg.min_p * probs.max(dim=-1, keepdim=True).values, inf)
    return z


def next_token_probs(logits: Tensor, cfg: SamplingConfig, seen: Tensor | None = None) -> Tensor:
    """The distribution the sampler draws from (B, V); one-hot on the argmax when greedy."""
    z = filtered_logits(logits, cfg, seen)
    if cfg.is_greedy:
        return torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).to(z.dtype)
    return torch.softmax(z, dim=-1)


def draw(probs: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """One token per row: argmax_v p_v / E_v, E_v ~ Exp(1) from the row's generator."""
    noise = torch.empty_like(probs)
    for row, g in zip(noise, generators, strict=True):
        row.exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


class Sampler:
    """Chooses the next tokens of a batch; row i draws from its own generator seeded `seeds[i]`."""

    def __init__(self, cfg: SamplingConfig, seeds: Sequence[int], device: torch.device) -> None:
        self.cfg = cfg
        gens = [] if cfg.is_greedy else seeds
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in gens]

    def __call__(self, logits: Tensor, seen: Tensor | None = None) -> Tensor:
        """logits (B, V) → token ids (B,) long."""
        if self.cfg.is_greedy:
            return filtered_logits(logits, self.cfg, seen).argmax(dim=-1)
        return draw(next_token_probs(logits, self.cfg, seen), self.generators)
