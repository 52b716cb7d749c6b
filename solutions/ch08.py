"""Chapter 8 answers: the same names and signatures as ``exercises/ch08.py``."""
import math
from collections import defaultdict

# Given (not a task), shared with exercises/ch08.py: read kvlab/scaffold/ch08.py.
from kvlab.scaffold.ch08 import (LatencyMetrics, RunningRequest, RunningSeq, Scheduled, WaitingRequest,  # noqa: F401
                                 my_preemption_user, scheduler_with_preemption)


# -- task budgeted_step ----------------------------------------------------------------------
def budgeted_step(running: list[RunningRequest], waiting: list[WaitingRequest], max_num_batched_tokens: int,
                  max_num_seqs: int, long_prefill_token_threshold: int = 0,
                  max_num_partial_prefills: int = 1) -> list[Scheduled]:
    budget, out = max_num_batched_tokens, []
    cap = long_prefill_token_threshold or math.inf
    for r in running:
        if r.decoding and budget >= 1:
            out.append(Scheduled(r.request_id, r.num_computed, 1))
            budget -= 1
    for r in running:
        n = min(r.num_tokens - r.num_computed, cap, budget)
        if not r.decoding and n > 0:
            out.append(Scheduled(r.request_id, r.num_computed, n))
            budget -= n
    num_seqs = len(running)
    partial = sum(not r.decoding for r in running)
    for w in waiting:
        n = min(w.num_tokens - w.num_cached, cap, budget)
        finishes = w.num_cached + n == w.num_tokens
        if num_seqs == max_num_seqs or n == 0 or (not finishes and partial >= max_num_partial_prefills):
            break
        out.append(Scheduled(w.request_id, w.num_cached, n))
        budget -= n
        num_seqs += 1
        partial += not finishes
    return out


# -- task metrics ------------------------------------------------------------------------------
def percentile(values, q: float) -> float:
    if len(values) == 0:
        return math.nan
    v = sorted(values)
    rank = (len(v) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def latency_metrics(arrivals: dict, token_times) -> LatencyMetrics:
    times = defaultdict(list)
    for request_id, t in token_times:
        if request_id in arrivals:
            times[request_id].append(t)
    ttfts, itls = [], []
    for request_id, ts in times.items():
        ts.sort()
        ttfts.append(ts[0] - arrivals[request_id])
        itls += [b - a for a, b in zip(ts, ts[1:])]
    return LatencyMetrics(percentile(ttfts, 50), percentile(ttfts, 99), percentile(itls, 50), percentile(itls, 99))


# -- task preemption ---------------------------------------------------------------------------
def preemption_victims(running: list[RunningSeq], needy: int, blocks_short: int) -> list[int]:
    victims, freed = [], 0
    for i in range(len(running) - 1, needy, -1):
        if freed >= blocks_short:
            break
        if not running[i].scheduled:
            victims.append(i)
            freed += running[i].num_blocks
    if freed < blocks_short:
        victims.append(needy)
    return victims


# Given: the engine's scheduler with your preemption_victims plugged in, and
# use_my_preemption(llm), which serves an LLM with it.
SchedulerWithMyPreemption = scheduler_with_preemption(preemption_victims)
use_my_preemption = my_preemption_user(SchedulerWithMyPreemption)
