"""The settings of `generate`, checked on construction; free of torch, so that `difftrain generate`
and `chat` refuse a bad option before torch loads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from difftrain.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the logits (the math: `difftrain.infer.sampling`)."""

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    greedy: bool = False

    def __post_init__(self) -> None:
        t, k, p, m, r = self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        # written as `not (ok)` so that NaN is rejected too
        if not (t >= 0 and math.isfinite(t)):
            raise ConfigError(
                f"temperature={t} is invalid: it must be a finite number ≥ 0 (e.g. --temperature 0.8; 0 or --greedy "
                "picks the most probable token)"
            )
        if not (isinstance(k, int) and k >= 0):
            raise ConfigError(f"top_k={k} is invalid: it must be a whole number ≥ 0 (0 turns top-k off)")
        if not (0 < p <= 1):
            raise ConfigError(
                f"top_p={p} is outside (0, 1]: it is the probability mass kept (e.g. --top-p 0.95; 1 turns it off)"
            )
        if not (0 <= m <= 1):
            raise ConfigError(f"min_p={m} is outside [0, 1]: e.g. --min-p 0.05 (0 turns it off)")
        if not (r > 0 and math.isfinite(r)):
            raise ConfigError(
                f"repetition_penalty={r} is invalid: it must be > 0 (1 is off, 1.1-1.3 discourages repeats)"
            )

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    use_cache: bool = True
    seed: int = 0
    compile: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ConfigError(
                f"max_new_tokens={self.max_new_tokens} must be a whole number ≥ 1: e.g. --max-new-tokens 256"
            )
        if any(s == "" for s in self.stop):
            raise ConfigError("a stop string is empty: every --stop needs at least one character")
        if self.compile and not self.use_cache:
            raise ConfigError(
                "compile runs the cached decode step; it cannot be combined with use_cache=False"
            )
        object.__setattr__(self, "stop", tuple(self.stop))
