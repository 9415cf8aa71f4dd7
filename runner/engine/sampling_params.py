"""The engine's sampling parameters (what runner.engine.sampler.Sampler draws with), apart from torch so that
processes that only check requests (the server's front end) need none."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from runner.errors import PmxError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: no top-k cut
    top_p: float = 1.0         # 1: no nucleus cut
    seed: Optional[int] = None
    min_p: float = 0.0                 # drop tokens less likely than min_p times the most likely one (0: off)
    repetition_penalty: float = 1.0    # > 0: logits of tokens seen (prompt and output) divided (> 0) or multiplied
    frequency_penalty: float = 0.0     # subtracted once per time a token was generated
    presence_penalty: float = 0.0      # subtracted once from every token generated at least once
    logit_bias: Optional[tuple] = None  # ((token id, bias), ...) added to the logits

    def __post_init__(self):
        def finite(name: str) -> float:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                raise PmxError(f"--{name} must be a finite number, got {v!r}")
            return v

        if finite("temperature") < 0:
            raise PmxError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise PmxError(f"--top_k must be >= 0, got {self.top_k}")
        if not 0 < finite("top_p") <= 1:
            raise PmxError(f"--top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= finite("min_p") <= 1:
            raise PmxError(f"--min_p must be in [0, 1], got {self.min_p}")
        if not finite("repetition_penalty") > 0:
            raise PmxError(f"--repetition_penalty must be > 0, got {self.repetition_penalty}")
        finite("frequency_penalty")
        finite("presence_penalty")
        if self.logit_bias is not None:
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            try:
                bias = tuple(sorted((int(t), float(b)) for t, b in pairs))
            except (TypeError, ValueError):
                raise PmxError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
            if any(t < 0 or not math.isfinite(b) for t, b in bias):
                raise PmxError("logit_bias must map token ids >= 0 to finite numbers")
            object.__setattr__(self, "logit_bias", bias or None)

    @property
    def adjusts(self) -> bool:
        """The logits are changed before the draw (a bias, a penalty): they depend on more than the model."""
        return bool(self.logit_bias) or self.repetition_penalty != 1 or self.frequency_penalty != 0 or \
            self.presence_penalty != 0
