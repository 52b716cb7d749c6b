"""Serving experiments: request traces, latency metrics, and a step-cost replay (chapter 8).

A serving engine is judged by what each user sees, from per-request token timestamps:

* **TTFT** (time to first token): first output token's time minus the request's arrival. It
  includes the queueing delay and the prompt's prefill.
* **ITL** (inter-token latency): the gaps between consecutive output tokens of one request,
  pooled over all requests. A decode step makes one token per running sequence, so a
  request's ITL is the duration of the steps it decodes in.

Continuous batching packs new prompts into the same step as running decodes. A step's time
grows with the tokens it computes, so a 16K-token prefill sharing a step with decodes makes
that step, and the gap between those requests' tokens, last as long as the prefill: ITL's
tail (p99) is set by the longest prefills. Chunked prefill caps the prompt tokens per step
(``max_num_batched_tokens``), trading a longer TTFT for long prompts against a bounded ITL.

This module has:

* :func:`poisson_trace`: Poisson arrivals with a :class:`LengthMix` of prompt/output lengths;
* :class:`RequestTiming` and :func:`summarize`: TTFT/ITL percentiles and throughput;
* :class:`StepCostModel`: a step's time from what it computes, fitted by least squares;
* :class:`StepRecord` and :class:`ServingResult`: what a replay of a trace records
  (:mod:`kvlab.workloads.replay` replays one, in virtual or wall-clock time).

Percentiles are numpy's default (``method="linear"``): for ``n`` sorted values, the ``q``-th
percentile is linearly interpolated at rank ``(n - 1) * q / 100``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from kvlab.validation import check_count

#: A step whose prefill tokens exceed this counts as "long" (see :class:`StepRecord`).
LONG_PREFILL_TOKENS = 2048


# -- the trace ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServingRequest:
    """One request of a trace: when it arrives (seconds) and how many tokens it brings and wants."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths of a trace: short chats plus a share of long prompts.

    A request is long with probability ``long_share``. Each length is drawn log-uniformly
    (every doubling of length equally likely) between the inclusive bounds of its range.
    Defaults: chats of 50-1,000 prompt and 50-400 output tokens; 10% long prompts of 8K-16K
    tokens (a document to summarise, a long context) with 50-400 output tokens.

    ``long_answer_share``: the share of requests (chats and long prompts alike) whose answer is
    drawn from ``long_answer`` instead (an essay, a file of code): a long tail of answer
    lengths, which is what a static batch waits on. 0 by default.
    """

    short_prompt: tuple[int, int] = (50, 1000)
    short_output: tuple[int, int] = (50, 400)
    long_prompt: tuple[int, int] = (8192, 16384)
    long_output: tuple[int, int] = (50, 400)
    long_share: float = 0.10
    long_answer: tuple[int, int] = (1024, 2048)
    long_answer_share: float = 0.0

    def __post_init__(self):
        for f in ("short_prompt", "short_output", "long_prompt", "long_output", "long_answer"):
            lo, hi = getattr(self, f)
            check_count(f"{f}[0]", lo, minimum=1)
            check_count(f"{f}[1]", hi, minimum=lo)
        for f in ("long_share", "long_answer_share"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"{f} must be in [0, 1], got {getattr(self, f)!r}")

    def scaled(self, scale: float) -> "LengthMix":
        """The same mix with every bound multiplied by ``scale`` (rounded, at least 1)."""
        def s(r):
            return max(1, round(r[0] * scale)), max(1, round(r[1] * scale))

        return replace(self, short_prompt=s(self.short_prompt), short_output=s(self.short_output),
                       long_prompt=s(self.long_prompt), long_output=s(self.long_output),
                       long_answer=s(self.long_answer))

    @property
    def max_tokens(self) -> int:
        """The longest prompt + output the mix can draw."""
        answer = self.long_answer[1] if self.long_answer_share > 0 else 0
        return max(self.short_prompt[1] + max(self.short_output[1], answer),
                   self.long_prompt[1] + max(self.long_output[1], answer))


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int], size: int) -> np.ndarray:
    lo, hi = bounds
    return np.minimum(np.floor(np.exp(rng.uniform(np.log(lo), np.log(hi + 1), size))), hi).astype(int)


def poisson_trace(num_requests: int, rate: float, seed: int = 0, mix: LengthMix = LengthMix()) -> list[ServingRequest]:
    """``num_requests`` requests arriving as a Poisson process of ``rate`` requests/s (gaps drawn
    from an exponential of mean ``1 / rate``, the first after one gap), lengths from ``mix``.
    The same seed gives the same trace."""
    check_count("num_requests", num_requests)
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 (requests/s), got {rate!r}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, num_requests))
    is_long = rng.random(num_requests) < mix.long_share
    prompts = np.where(is_long, _log_uniform(rng, mix.long_prompt, num_requests),
                       _log_uniform(rng, mix.short_prompt, num_requests))
    outputs = np.where(is_long, _log_uniform(rng, mix.long_output, num_requests),
                       _log_uniform(rng, mix.short_output, num_requests))
    if mix.long_answer_share > 0:     # drawn only then: a mix without long answers keeps its old traces
        long_answer = rng.random(num_requests) < mix.long_answer_share
        outputs = np.where(long_answer, _log_uniform(rng, mix.long_answer, num_requests), outputs)
    return [ServingRequest(f"r{i}", float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


# -- metrics --------------------------------------------------------------------------------
@dataclass
class RequestTiming:
    """When one request arrived, got each output token, and finished (seconds, one clock).
    ``error`` is set when the engine refused or failed it."""

    request_id: str
    arrival: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    error: str | None = None

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return None if not self.token_times else self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        """Gaps between its consecutive output tokens."""
        return np.diff(self.token_times).tolist()

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class ServingSummary:
    """What :func:`summarize` reports. Latencies in seconds, throughputs in tokens/s; NaN where
    there is nothing to measure."""

    num_requests: int
    num_finished: int          # served to the end
    num_failed: int            # refused or ended with an error
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    output_tokens: int
    total_tokens: int          # prompt + output tokens of the requests that were not failed
    duration: float
    output_throughput: float
    total_throughput: float
    decode_behind_long_prefill: float | None = None   # share of decoding steps, see StepRecord

    def as_dict(self) -> dict:
        """Plain values for JSON (NaN as None)."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def _percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(timings, duration: float, steps=None) -> ServingSummary:
    """TTFT and ITL p50/p99 over the requests that were not failed, throughput over ``duration``
    seconds and, given the run's :class:`StepRecord` list, the share of decoding steps that
    waited behind a long prefill."""
    timings = list(timings)
    served = [t for t in timings if not t.failed]
    ttfts = [t.ttft for t in served if t.token_times]
    itls = [gap for t in served for gap in t.itls]
    out_tokens = sum(len(t.token_times) for t in served)
    total = out_tokens + sum(t.prompt_len for t in served)
    share = None
    if steps is not None:
        decoding = [s for s in steps if s.decode_tokens]
        share = sum(s.decode_behind_long_prefill for s in decoding) / len(decoding) if decoding else 0.0
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: math.nan)
    return ServingSummary(
        num_requests=len(timings), num_finished=sum(t.finish is not None for t in served),
        num_failed=len(timings) - len(served), ttft_p50=_percentile(ttfts, 50), ttft_p99=_percentile(ttfts, 99),
        itl_p50=_percentile(itls, 50), itl_p99=_percentile(itls, 99), output_tokens=out_tokens,
        total_tokens=total, duration=duration, output_throughput=rate(out_tokens), total_throughput=rate(total),
        decode_behind_long_prefill=share)


# -- what a step computes, and what it costs -----------------------------------------------------
@dataclass(frozen=True)
class StepFeatures:
    """What one step computes, the inputs of :class:`StepCostModel`.

    A scheduled sequence *decodes* if it computes just its last sampled token (plus the ``k``
    drafts it verifies, if any) after its whole prompt; everything else (a prompt, a chunk of
    one, a recompute after preemption) is *prefill*.

    ``prefill_tokens``, ``decode_tokens``: tokens computed by each kind (every one of them goes
    through the weights). ``kv_tokens_read``: cached tokens the decodes attend to (their
    sequence lengths). ``prefill_attention``: the prefill's (query, key) pairs of causal
    attention, ``n * start + n * (n + 1) / 2`` for ``n`` tokens after ``start`` cached ones:
    quadratic in a prompt's length.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_tokens_read: int = 0
    prefill_attention: int = 0

    @classmethod
    def from_schedule(cls, out) -> "StepFeatures":
        """The features of a :class:`~kvlab.engine.scheduler.SchedulerOutput` (before or after
        its step ran: only what the schedule fixed is read)."""
        pre = dec = kv = attn = 0
        for item in out.scheduled:
            if not item.is_prefill:
                dec += item.num_new
                kv += item.start + item.num_new
            else:
                pre += item.num_new
                attn += item.num_new * item.start + item.num_new * (item.num_new + 1) // 2
        return cls(pre, dec, kv, attn)


_COEFFICIENTS = ("c0", "c_prefill", "c_decode", "c_kv", "c_prefill_attn")


@dataclass(frozen=True)
class StepCostModel:
    """A step's seconds from its :class:`StepFeatures`::

        t = c0 + c_prefill * prefill_tokens + c_decode * decode_tokens
               + c_kv * kv_tokens_read + c_prefill_attn * prefill_attention

    ``c0``: the fixed cost of a step (reading every weight once, launches, scheduling, the
    sampler). ``c_prefill``, ``c_decode``: compute per token through the weights.
    ``c_kv``: reading one cached token's K/V for a decode. ``c_prefill_attn``: one (query, key)
    pair of prefill attention (its quadratic part; 0 when not fitted).
    """

    c0: float = 0.0
    c_prefill: float = 0.0
    c_decode: float = 0.0
    c_kv: float = 0.0
    c_prefill_attn: float = 0.0

    @staticmethod
    def _row(f: StepFeatures) -> list[float]:
        return [1.0, f.prefill_tokens, f.decode_tokens, f.kv_tokens_read, f.prefill_attention]

    def predict(self, features: StepFeatures) -> float:
        """Seconds of a step (never negative)."""
        coef = [getattr(self, c) for c in _COEFFICIENTS]
        return max(0.0, float(np.dot(coef, self._row(features))))

    @classmethod
    def fit(cls, samples, *, quadratic: bool = True, relative: bool = True) -> "StepCostModel":
        """Least-squares fit on ``(StepFeatures, seconds)`` samples. ``relative``: minimise the
        relative error, so that the many short decode steps count as much as the rare long
        prefills; ``quadratic=False`` leaves out ``c_prefill_attn``."""
        samples = list(samples)
        if not samples:
            raise ValueError("fit needs at least one (StepFeatures, seconds) sample")
        x = np.array([cls._row(f) for f, _ in samples], dtype=float)
        y = np.array([t for _, t in samples], dtype=float)
        if not quadratic:
            x = x[:, :4]
        if relative:
            if (y <= 0).any():
                raise ValueError("a relative fit needs every step's seconds > 0")
            x, y = x / y[:, None], np.ones_like(y)
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0                      # a feature never seen: coefficient 0
        coef = np.zeros(x.shape[1])
        kept = list(range(x.shape[1]))
        while kept:             # a cost is never negative: drop a term that fits below 0, refit the rest
            fit = np.linalg.lstsq(x[:, kept] / scale[kept], y, rcond=None)[0] / scale[kept]
            if (fit >= 0).all():
                coef[kept] = fit
                break
            kept.pop(int(np.argmin(fit)))
        return cls(*(float(c) for c in coef))

    def relative_errors(self, samples) -> np.ndarray:
        """``|predicted - measured| / measured`` per sample."""
        return np.array([abs(self.predict(f) - t) / t for f, t in samples])

    def to_json(self) -> dict:
        return {c: getattr(self, c) for c in _COEFFICIENTS}

    @classmethod
    def from_json(cls, data: dict) -> "StepCostModel":
        return cls(**{c: float(data.get(c, 0.0)) for c in _COEFFICIENTS})


@dataclass(frozen=True)
class StepRecord:
    """One step of a run: when it started, how long it took, and what it computed.

    ``decode_behind_long_prefill``: the step decoded at least one sequence while computing
    more than ``long_prefill_threshold`` prefill tokens: those decodes' next token waited for
    the prefill.
    """

    start: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    kv_tokens_read: int
    prefill_attention: int
    decode_behind_long_prefill: bool

    @classmethod
    def from_schedule(cls, out, start: float, duration: float,
                      long_prefill_threshold: int = LONG_PREFILL_TOKENS) -> "StepRecord":
        f = StepFeatures.from_schedule(out)
        return cls(start, duration, f.prefill_tokens, f.decode_tokens, len(out.scheduled), f.kv_tokens_read,
                   f.prefill_attention, bool(f.decode_tokens and f.prefill_tokens > long_prefill_threshold))

    @property
    def features(self) -> StepFeatures:
        return StepFeatures(self.prefill_tokens, self.decode_tokens, self.kv_tokens_read, self.prefill_attention)


@dataclass
class ServingResult:
    """A replayed trace: per-request timings, per-step records, the run's length (seconds)."""

    timings: list[RequestTiming]
    steps: list[StepRecord]
    duration: float
    num_preemptions: int = 0

    def summary(self) -> ServingSummary:
        return summarize(self.timings, self.duration, self.steps)

    def cost_samples(self) -> list[tuple[StepFeatures, float]]:
        """``(features, seconds)`` of every step, for :meth:`StepCostModel.fit`."""
        return [(s.features, s.duration) for s in self.steps]
