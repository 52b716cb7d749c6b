"""Replaying a request trace (chapter 8), with :mod:`kvlab.workloads.serving`'s records.

* :func:`simulate`: the trace in virtual time on the real scheduler and block pool, each step
  costed by a :class:`~kvlab.workloads.serving.StepCostModel` (no model weights; seconds on a CPU);
* :func:`replay_realtime`: the trace in wall-clock time on a real :class:`kvlab.LLM`.
"""
from __future__ import annotations

import inspect
import itertools
import math
import time
from collections import deque
from dataclasses import replace

import numpy as np

from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.sequence import Sequence
from kvlab.paging.block_pool import BlockPool
from kvlab.workloads.serving import (LONG_PREFILL_TOKENS, RequestTiming, ServingRequest, ServingResult,
                                     StepCostModel, StepRecord)


class _Arrivals:
    """The trace in arrival order, handed to the engine as the clock passes each arrival.

    Static batching: arrived requests wait until the engine is idle, then go in together,
    at most ``batch`` of them; the next batch waits for this one to finish.
    """

    def __init__(self, trace, static: bool, batch: int):
        self.pending = deque(sorted(trace, key=lambda r: r.arrival_time))
        self.arrived: deque[ServingRequest] = deque()
        self.static, self.batch = static, batch

    @property
    def done(self) -> bool:
        return not (self.pending or self.arrived)

    @property
    def next_arrival(self) -> float:
        return self.pending[0].arrival_time if self.pending else math.inf

    def due(self, now: float, idle: bool) -> list[ServingRequest]:
        while self.pending and self.pending[0].arrival_time <= now:
            self.arrived.append(self.pending.popleft())
        if self.static and not idle:
            return []
        n = min(self.batch, len(self.arrived)) if self.static else len(self.arrived)
        return [self.arrived.popleft() for _ in range(n)]


def _timings(trace) -> dict[str, RequestTiming]:
    return {r.request_id: RequestTiming(r.request_id, r.arrival_time, r.prompt_len) for r in trace}


def scheduler_factory_like(scheduler):
    """A factory for :func:`simulate` that builds schedulers with ``scheduler``'s settings on a
    new pool: every constructor argument after the pool is read back from the attribute of the
    same name (its default where there is none)."""
    cls = type(scheduler)
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]   # after self, pool
    settings = {p.name: getattr(scheduler, p.name) for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and hasattr(scheduler, p.name)}
    return lambda pool: cls(pool, **settings)


def simulate(trace, make_scheduler, cost_model: StepCostModel, *, num_blocks: int, block_size: int = 16,
             max_steps: int = 1_000_000, static: bool = False,
             long_prefill_threshold: int = LONG_PREFILL_TOKENS, token_id: int = 1, on_step=None) -> ServingResult:
    """Replay ``trace`` in virtual time on a real scheduler and :class:`BlockPool`, without a model.

    ``make_scheduler(pool)`` builds the scheduler on the pool of ``num_blocks`` blocks of
    ``block_size`` tokens (``functools.partial(Scheduler, max_num_seqs=..., ...)``: its
    options pass through unchanged). Requests join when the clock passes their arrival; each
    step lasts ``cost_model.predict`` of what it computes; every prompt and sampled token is
    ``token_id`` (the pool has no prefix caching) and requests end by length (``ignore_eos``).
    A token's time is the end of the step that produced it. When nothing runs, the clock
    jumps to the next arrival. The scheduler reads this clock (``prefill_priority_after`` waits
    in virtual seconds), and a sequence's arrival is its request's. Requests the scheduler
    refuses finish with their error and count as failed. ``static``: static batching by
    admission: arrived requests wait until the scheduler is idle, then go in together, at most
    ``max_num_seqs`` of them. ``on_step(out, record, scheduler, arrived)``, if given, sees every
    step after it is recorded (``arrived``: requests that arrived but have not joined).
    """
    scheduler = make_scheduler(BlockPool(num_blocks, block_size))
    arrivals = _Arrivals(trace, static, scheduler.max_num_seqs)
    timings, seq_ids = _timings(trace), itertools.count()
    clock, steps = 0.0, []
    scheduler.clock = lambda: clock
    while not arrivals.done or scheduler.has_unfinished():
        for r in arrivals.due(clock, idle=not scheduler.has_unfinished()):
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            seq = Sequence(next(seq_ids), r.request_id, [token_id] * r.prompt_len, params)
            seq.arrival_time = r.arrival_time
            scheduler.add(seq)
        if not scheduler.has_unfinished():
            clock = max(clock, arrivals.next_arrival)
            continue
        if len(steps) >= max_steps:
            raise RuntimeError(f"the replay did not finish within max_steps={max_steps} steps")
        out = scheduler.schedule()
        for seq in out.finished:
            timings[seq.request_id].finish, timings[seq.request_id].error = clock, seq.error or seq.finish_reason
        if not out.scheduled:
            if out.finished:
                continue
            raise RuntimeError("the scheduler scheduled nothing while requests were waiting")
        record = StepRecord.from_schedule(out, clock, 0.0, long_prefill_threshold)
        record = replace(record, duration=cost_model.predict(record.features))
        clock += record.duration
        seqs = out.sample_seqs
        before = [seq.num_output_tokens for seq in seqs]
        scheduler.update(out, [token_id] * len(seqs))
        _record_tokens(timings, seqs, before, clock)
        steps.append(record)
        if on_step is not None:
            on_step(out, record, scheduler, list(arrivals.arrived))
    return ServingResult(list(timings.values()), steps, clock, scheduler.num_preemptions)


def _record_tokens(timings: dict, seqs, before: list[int], now: float) -> None:
    """Stamp ``now`` on the output tokens each sequence gained in a step (none for a prompt
    chunk that does not end its prompt, several for accepted drafts)."""
    for seq, n in zip(seqs, before):
        t = timings[seq.request_id]
        t.token_times += [now] * (seq.num_output_tokens - n)
        if seq.is_finished and t.finish is None:
            t.finish = now
            if seq.finish_reason == "error":
                t.error = seq.error or "error"


def _synchronize(llm) -> None:
    device = getattr(getattr(llm, "model_runner", None), "device", None)
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def replay_realtime(llm, trace, *, seed: int = 0, static: bool = False,
                    long_prefill_threshold: int = LONG_PREFILL_TOKENS) -> ServingResult:
    """Replay ``trace`` in wall-clock time on a real :class:`kvlab.LLM`.

    Prompts are random token ids of the model's vocabulary (drawn from ``seed`` before the
    clock starts); each request asks for its ``output_len`` tokens, greedy, ignoring EOS.
    Requests are added with :meth:`LLM.add_request` once their arrival time has passed, and
    :meth:`LLM.step` runs while any is unfinished (sleeping until the next arrival when none
    is). A token's time is the end of the step that returned it; each step's schedule
    (``llm.last_schedule``) and wall time are recorded, for :meth:`ServingResult.cost_samples`.
    A request the engine refuses counts as failed. ``static`` as in :func:`simulate`.
    """
    rng = np.random.default_rng(seed)
    vocab = llm.config.vocab_size
    prompts = {r.request_id: rng.integers(0, vocab, r.prompt_len).tolist() for r in trace}
    arrivals = _Arrivals(trace, static, llm.scheduler.max_num_seqs)
    timings, steps = _timings(trace), []
    preemptions = llm.scheduler.num_preemptions
    _synchronize(llm)
    origin = time.perf_counter()
    while not arrivals.done or llm.has_unfinished_requests():
        now = time.perf_counter() - origin
        for r in arrivals.due(now, idle=not llm.has_unfinished_requests()):
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            try:
                llm.add_request({"prompt_token_ids": prompts[r.request_id]}, params, request_id=r.request_id)
            except (ValueError, TypeError) as e:
                timings[r.request_id].finish, timings[r.request_id].error = now, str(e)
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, arrivals.next_arrival - now) if not arrivals.done else 0.0)
            continue
        start = time.perf_counter() - origin
        outputs = llm.step()
        _synchronize(llm)
        now = time.perf_counter() - origin
        for o in outputs:
            t = timings[o.request_id]
            got = len(o.outputs[0].token_ids) if o.outputs else 0
            t.token_times += [now] * (got - len(t.token_times))
            if o.finished and t.finish is None:
                t.finish, t.error = now, o.error
        if llm.last_schedule is not None and llm.last_schedule.scheduled:
            steps.append(StepRecord.from_schedule(llm.last_schedule, start, now - start, long_prefill_threshold))
    duration = time.perf_counter() - origin
    return ServingResult(list(timings.values()), steps, duration, llm.scheduler.num_preemptions - preemptions)
