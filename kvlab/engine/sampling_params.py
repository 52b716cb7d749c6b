"""SamplingParams: how one request wants its tokens chosen, and when to stop.

The fields and their defaults are vLLM's, so ``SamplingParams(temperature=0, max_tokens=32)``
means the same thing here and there::

    temperature   0 picks the most likely token (greedy); higher flattens the distribution
    top_k         keep only the k most likely tokens (0 or -1: keep all)
    top_p         keep the smallest set of most likely tokens whose probability reaches p
    max_tokens    stop after this many new tokens (finish_reason "length")
    seed          seeds the request's own random generator: same seed, same samples
    stop          a string or list of strings that end the text (not included in it)
    stop_token_ids  token ids that end the output (included in token_ids)
    n             independent samples of the same prompt (they share its KV blocks)
    ignore_eos    keep going past the model's end-of-sequence token
    output_kind   what LLM.step reports of an unfinished request: CUMULATIVE (everything so
                  far, every step) or FINAL_ONLY (nothing until it finishes; LLM.generate's way)

Construction never raises: the engine calls :meth:`SamplingParams.validate` on each request,
so that one bad request gets an error of its own while the rest of the batch still runs.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """vLLM's kinds of :meth:`LLM.step` output. ``CUMULATIVE``: each step that advances a request
    returns its whole output so far (text decoded each time). ``FINAL_ONLY``: only its finished
    output, so the steps in between spend no host time on it. (vLLM's ``DELTA``, only the new
    tokens, is not offered.)"""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (a single string is one stop string)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> "SamplingParams":
        """Return ``self`` if every field is usable, else raise a ValueError naming the field."""
        for rule in (self._check_counts, self._check_temperature, self._check_top_p, self._check_top_k,
                     self._check_seed, self._check_stop, self._check_stop_token_ids):
            rule()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY, got {self.output_kind!r}")
        return self

    # -- the rules ------------------------------------------------------------------------
    def _check_counts(self) -> None:
        for name in ("n", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def _check_temperature(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), "
                             f"got {self.temperature!r}")

    def _check_top_p(self) -> None:
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def _check_top_k(self) -> None:
        if not _is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an int >= 1 (below 2**31), or -1 or 0 to keep every token, "
                             f"got {self.top_k!r}")

    def _check_seed(self) -> None:
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    def _check_stop(self) -> None:
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")

    def _check_stop_token_ids(self) -> None:
        ids = self.stop_token_ids
        if ids is None:
            return
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {ids!r}")
