"""Chapter 8, given: the plain records the tasks work on, and the engine's scheduler with your
preemption rule plugged in (``use_my_preemption(llm)``)."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import SequenceStatus
from kvlab.paging import blocks_needed


# -- budgeted_step -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunningRequest:
    """A request in the running batch: the K/V of its first ``num_computed`` tokens is cached,
    out of ``num_tokens`` (its prompt, plus what it has generated). With one token left it
    *decodes* (that token is the one it sampled last, or its prompt's last); with more it is
    part-way through its prompt (a *partial prefill*)."""

    request_id: str
    num_computed: int
    num_tokens: int

    @property
    def decoding(self) -> bool:
        return self.num_tokens - self.num_computed == 1


@dataclass(frozen=True)
class WaitingRequest:
    """A queued request of ``num_tokens`` tokens, whose first ``num_cached`` are already in the
    prefix cache (a multiple of the block size; less than ``num_tokens``)."""

    request_id: str
    num_tokens: int
    num_cached: int = 0


@dataclass(frozen=True)
class Scheduled:
    """One request of a step: it computes positions ``start .. start + num_new - 1``."""

    request_id: str
    start: int
    num_new: int


# -- metrics -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LatencyMetrics:
    """TTFT and ITL percentiles, in seconds (NaN when there is nothing to measure)."""

    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float


# -- preemption --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunningSeq:
    """A running sequence, as the preemption rule sees it. ``num_blocks``: the blocks it would
    give back if preempted (those no other sequence shares); ``num_computed``: the tokens whose
    K/V it would lose, to be recomputed later; ``scheduled``: its turn in this step has come
    already (the scheduler visits the running sequences oldest first)."""

    seq_id: int
    num_blocks: int
    num_computed: int
    scheduled: bool = False


def scheduler_with_preemption(preemption_victims) -> type[Scheduler]:
    """The class ``SchedulerWithMyPreemption``: the engine's scheduler choosing its victims
    with your ``preemption_victims``."""

    class SchedulerWithMyPreemption(Scheduler):
        """kvlab's ``Scheduler`` whose victims your ``preemption_victims`` chooses (given)."""

        def preemption_victims(self, seq, num_new, candidates):
            pool, bs = self.pool, self.pool.block_size
            table, length = pool.block_table(seq.seq_id), pool.seq_len(seq.seq_id)
            copy = length % bs != 0 and pool.ref_counts[table[-1]] > 1      # its last block, copied on write
            short = blocks_needed(length + num_new, bs) - len(table) + copy - pool.num_free_blocks
            running = [s for s in self.running if s.status is SequenceStatus.RUNNING]    # not preempted yet
            waits = {id(s) for s in candidates}
            records = [RunningSeq(s.seq_id, sum(pool.ref_counts[b] == 1 for b in pool.block_table(s.seq_id)),
                                  s.num_computed_tokens, scheduled=s is not seq and id(s) not in waits)
                       for s in running]
            return [running[i] for i in preemption_victims(records, running.index(seq), short)]

    SchedulerWithMyPreemption.__qualname__ = "SchedulerWithMyPreemption"
    return SchedulerWithMyPreemption


def my_preemption_user(scheduler_class):
    """The function ``use_my_preemption``, bound to one implementation's scheduler class."""

    def use_my_preemption(llm):
        """Serve ``llm`` with your preemption rule: its scheduler becomes a
        ``SchedulerWithMyPreemption`` with the same settings, on the same pool. Call it before
        any request is queued. Returns ``llm``."""
        if llm.has_unfinished_requests():
            raise RuntimeError("use_my_preemption: the scheduler can only be replaced while no request is queued")
        s = llm.scheduler
        llm.scheduler = scheduler_class(
            s.pool, s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.eos_token_ids,
            s.num_lookahead_tokens, enable_chunked_prefill=s.enable_chunked_prefill,
            long_prefill_token_threshold=s.long_prefill_token_threshold,
            max_num_partial_prefills=s.max_num_partial_prefills, scheduling_policy=s.scheduling_policy,
            prefill_priority_after=s.prefill_priority_after, clock=s.clock)
        return llm

    return use_my_preemption
