"""Chapter 8 exercises: continuous batching with chunked prefill.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch08                                 # in a terminal
    kvlab.check("ch08")                              # in the notebook
    pytest tests/graded -m ch08 --impl=exercises     # the same tests, raw

Tasks: ``budgeted_step`` (what runs in one step under a token budget), ``metrics``
(``percentile`` and ``latency_metrics``: TTFT and ITL from token timestamps), ``preemption``
(``preemption_victims``: whom to preempt when blocks run out). The last one then runs inside
the real engine (``use_my_preemption(llm)``): greedy output with your rule must equal the
engine's own, token for token. Stuck? ``kvlab.use_solution("ch08")`` swaps in the answer and
keeps yours as ``exercises/ch08_mine.py``.

The records the tasks take and return (``RunningRequest``, ``WaitingRequest``, ``Scheduled``,
``LatencyMetrics``, ``RunningSeq``) are plain dataclasses, given in ``kvlab/scaffold/ch08.py``.
"""
import math  # noqa: F401  (you may use it)
from collections import defaultdict  # noqa: F401  (you may use it)

# Given (not a task), shared with solutions/ch08.py: read kvlab/scaffold/ch08.py.
from kvlab.scaffold.ch08 import (LatencyMetrics, RunningRequest, RunningSeq, Scheduled, WaitingRequest,  # noqa: F401
                                 my_preemption_user, scheduler_with_preemption)


# -- task budgeted_step ----------------------------------------------------------------------
def budgeted_step(running: list[RunningRequest], waiting: list[WaitingRequest], max_num_batched_tokens: int,
                  max_num_seqs: int, long_prefill_token_threshold: int = 0,
                  max_num_partial_prefills: int = 1) -> list[Scheduled]:
    """What runs in one step: a ``Scheduled(request_id, start, num_new)`` per request that gets
    tokens, in the order below. ``running`` is in admission order (oldest first), ``waiting``
    in arrival order; ``max_num_batched_tokens`` is the step's token budget.

    1. **Decodes**: every running request with one token left (``r.decoding``), in list order,
       computes that token (``start = r.num_computed``, ``num_new = 1``) while the budget lasts.
    2. **Chunks of partial prefills**: every other running request, in list order, computes its
       next chunk: ``min(tokens left, long_prefill_token_threshold, budget left)`` tokens (a
       threshold of 0 means no cap); a request whose chunk would be 0 gets nothing.
    3. **New requests**, first come first served: the next waiting request ``w`` computes its
       first chunk, from ``start = w.num_cached`` (its prefix-cache hit), of
       ``min(w.num_tokens - w.num_cached, threshold, budget left)`` tokens. Stop at the first
       request that cannot come in (no request overtakes it): the running and admitted
       requests number ``max_num_seqs`` already, or its chunk would be 0, or its chunk does not
       finish its tokens while ``max_num_partial_prefills`` requests are part-way through
       already (the running requests that are not decoding, plus the new ones whose chunk
       does not finish them).

    Every token taken comes out of the budget. Example: running ``[A: 10 of 11 computed,
    B: 0 of 40]``, waiting ``[C: 5 tokens]``, budget 16: ``A`` decodes (1), ``B`` takes a chunk
    of 15, nothing is left for ``C``.
    """
    raise NotImplementedError("budgeted_step: decodes (1 token each), then partial prefills' chunks "
                              "(min(left, threshold, budget)), then waiting requests in order until one cannot come in")


# -- task metrics ------------------------------------------------------------------------------
def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of a list of numbers, numpy's default definition:
    sort the ``n`` values; the percentile sits at rank ``r = (n - 1) * q / 100`` (0-based), linearly
    interpolated between the values at ranks ``floor(r)`` and ``floor(r) + 1``. NaN (``math.nan``)
    for an empty list. Example: ``percentile([4, 1, 3, 2], 50)`` is 2.5 (rank 1.5).
    """
    raise NotImplementedError("percentile: sort; r = (n - 1) * q / 100; interpolate between v[floor(r)] and the next")


def latency_metrics(arrivals: dict, token_times) -> LatencyMetrics:
    """TTFT and ITL, p50 and p99, of a serving run (``percentile`` above).

    ``arrivals``: request id -> the time it arrived (seconds). ``token_times``: ``(request_id,
    time)`` for every output token the engine produced, in any order; tokens of requests not in
    ``arrivals`` (failed, not measured) are left out.

    * **TTFT** of a request: the time of its first output token minus its arrival (a request
      without tokens has none).
    * **ITL**: the gaps between consecutive output tokens of one request (sorted by time),
      pooled over all requests: a request with ``k`` tokens contributes ``k - 1`` gaps.

    Returns ``LatencyMetrics(ttft_p50, ttft_p99, itl_p50, itl_p99)``; a percentile of no values
    is NaN.
    """
    raise NotImplementedError("latency_metrics: group the times by request and sort them; TTFT = first - arrival, "
                              "ITL = consecutive gaps (pooled); then percentile(..., 50) and (..., 99)")


# -- task preemption ---------------------------------------------------------------------------
def preemption_victims(running: list[RunningSeq], needy: int, blocks_short: int) -> list[int]:
    """Whom to preempt so that ``running[needy]`` can take its tokens: indices into ``running``,
    in the order they go. ``running`` is in admission order (oldest first); the step is
    ``blocks_short`` (> 0) free blocks short of what ``running[needy]`` needs. A preempted
    sequence gives back ``num_blocks`` blocks and waits to be recomputed from scratch.

    The rule: the **most recently admitted goes first**. The candidates are the sequences after
    ``needy`` whose turn has not come (``scheduled`` is False): take them from the youngest back
    and stop as soon as they free ``blocks_short`` blocks or more. Never take a sequence
    admitted before ``needy``, nor a scheduled one: they keep progressing. If all the candidates
    together do not free enough, ``needy`` itself goes last: it waits instead of the older ones.

    Example: ``running = [A(3 blocks), B(2), C(2, scheduled), D(1)]``, ``needy = 1`` (B),
    ``blocks_short = 1``: ``[3]`` (D). With ``blocks_short = 2``: ``[3, 1]`` (D, then B itself:
    C is scheduled, A is older).
    """
    raise NotImplementedError("preemption_victims: from the end back to needy + 1, take the unscheduled ones "
                              "until their num_blocks cover blocks_short; if they do not, add needy itself")


# Given: the engine's scheduler with your preemption_victims plugged in, and
# use_my_preemption(llm), which serves an LLM with it.
SchedulerWithMyPreemption = scheduler_with_preemption(preemption_victims)
use_my_preemption = my_preemption_user(SchedulerWithMyPreemption)
