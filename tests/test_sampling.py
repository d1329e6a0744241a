"""Each sampling step against a distribution computed by hand on a fixed logits vector."""

from __future__ import annotations

import math

import pytest
import torch

from difftrain.errors import ConfigError
from difftrain.infer.sampling import Sampler, SamplingConfig, draw, next_token_probs

# z = log p for p = (0.4, 0.3, 0.15, 0.1, 0.05): softmax(z) is p exactly, so every expected
# distribution below is a few fractions of these numbers.
P = [0.4, 0.3, 0.15, 0.1, 0.05]
Z = torch.tensor([[math.log(p) for p in P]])


def probs(**kw) -> list[float]:
    cfg = SamplingConfig(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw})
    return next_token_probs(Z, cfg)[0].tolist()


def normalised(xs: list[float]) -> list[float]:
    return [x / sum(xs) for x in xs]


def close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True))


def test_temperature_one_with_every_filter_off_is_the_softmax():
    assert close(probs(), P)


def test_temperature_raises_probabilities_to_the_power_one_over_t():
    assert close(probs(temperature=2.0), normalised([p**0.5 for p in P]))
    assert close(probs(temperature=0.5), normalised([p**2 for p in P]))


def test_top_k_keeps_the_k_most_probable_tokens_renormalised():
    assert close(probs(top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0])
    assert close(probs(top_k=1), [1, 0, 0, 0, 0])
    assert close(probs(top_k=5), P)


def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_p():
    # masses before each token: 0, 0.4, 0.7, 0.85, 0.95
    assert close(probs(top_p=0.75), normalised([0.4, 0.3, 0.15, 0, 0]))
    assert close(probs(top_p=0.5), normalised([0.4, 0.3, 0, 0, 0]))
    assert close(probs(top_p=0.3), [1, 0, 0, 0, 0])  # the top token always survives
    assert close(probs(top_p=0.9), normalised([0.4, 0.3, 0.15, 0.1, 0]))


def test_top_p_works_on_unsorted_logits():
    order = [3, 0, 4, 2, 1]
    z = Z[:, order]
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=0.75)
    expected = normalised([[0.4, 0.3, 0.15, 0, 0][i] for i in order])
    assert close(next_token_probs(z, cfg)[0].tolist(), expected)


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    assert close(probs(min_p=0.3), normalised([0.4, 0.3, 0.15, 0, 0]))  # threshold 0.12
    assert close(probs(min_p=0.5), normalised([0.4, 0.3, 0, 0, 0]))  # threshold 0.2
    assert close(probs(min_p=0.1), P)  # threshold 0.04


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    z = torch.tensor([[2.0, -1.0, 0.5, -0.5]])
    seen = torch.tensor([[True, True, False, False]])
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=2.0)
    expected = torch.softmax(torch.tensor([1.0, -2.0, 0.5, -0.5]), dim=0).tolist()
    assert close(next_token_probs(z, cfg, seen)[0].tolist(), expected)


def test_greedy_takes_the_argmax_after_the_repetition_penalty():
    z = torch.tensor([[2.0, 1.5, -3.0]])
    seen = torch.tensor([[True, False, False]])
    for cfg in (SamplingConfig(greedy=True), SamplingConfig(temperature=0.0)):
        assert Sampler(cfg, [0], torch.device("cpu"))(z).tolist() == [0]
    penalised = SamplingConfig(greedy=True, repetition_penalty=2.0)  # 2.0 → 1.0 < 1.5
    assert Sampler(penalised, [0], torch.device("cpu"))(z, seen).tolist() == [1]
    assert close(next_token_probs(z, penalised, seen)[0].tolist(), [0, 1, 0])


def test_the_steps_compose_in_order_temperature_top_k_top_p_min_p():
    # T = 0.5 → q ∝ p²: (0.16, 0.09, 0.0225, 0.01, 0.0025)/0.285; top-k 4 drops the last;
    # top-p 0.9 on (0.16, 0.09, 0.0225, 0.01)/0.2825 = (.566, .319, .080, .035): masses before
    # are 0, .566, .885, .965 → keep three; min-p 0.2: threshold .2·.16 = .032 relative → drops
    # 0.0225 (< 0.032), keeps 0.16 and 0.09.
    assert close(probs(temperature=0.5, top_k=4, top_p=0.9), normalised([0.16, 0.09, 0.0225, 0, 0]))
    assert close(probs(temperature=0.5, top_k=4, top_p=0.9, min_p=0.2), normalised([0.16, 0.09, 0, 0, 0]))


def test_draws_follow_the_distribution_and_never_pick_a_filtered_token():
    n = 4000
    target = torch.tensor(normalised([0.4, 0.3, 0.15, 0, 0]))
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens = draw(target.expand(n, 5).clone(), gens)
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert freq[3:].sum() == 0
    assert (freq - target).abs().max() < 0.03  # 4 standard errors of a frequency near 0.5


def test_the_sampler_is_reproducible_per_seed():
    z = Z.expand(3, 5)
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)
    a = Sampler(cfg, [1, 2, 3], torch.device("cpu"))
    b = Sampler(cfg, [1, 2, 3], torch.device("cpu"))
    draws_a = [a(z).tolist() for _ in range(20)]
    assert draws_a == [b(z).tolist() for _ in range(20)]
    # row i depends only on its seed: the same seed alone gives the same sequence of draws
    c = Sampler(cfg, [2], torch.device("cpu"))
    assert [row[1] for row in draws_a] == [c(Z)[0].item() for _ in range(20)]
    other = Sampler(cfg, [4, 5, 6], torch.device("cpu"))
    assert [other(z).tolist() for _ in range(20)] != draws_a


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"temperature": -0.5}, "temperature=-0.5 is invalid"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_p": 0.0}, r"top_p=0.0 is outside \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 is outside \(0, 1\]"),
        ({"top_p": float("nan")}, "top_p=nan"),
        ({"top_k": -1}, "top_k=-1"),
        ({"min_p": 1.5}, r"min_p=1.5 is outside \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 is invalid"),
    ],
)
def test_invalid_sampling_values_are_config_errors(kw, message):
    with pytest.raises(ConfigError, match=message):
        SamplingConfig(**kw)
