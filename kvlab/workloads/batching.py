"""What chapter 8 runs and measures: the scheduler's decisions recorded step by step, and the
serving experiment replayed in virtual time.

* :func:`record_schedule` drives a real :class:`~kvlab.engine.LLM` one ``step()`` at a time
  and keeps, per step, which requests computed prompt chunks (and how many tokens) or decoded,
  the token budget, preemptions, who waited, and the page map after the step;
* :func:`replay` does the same for a request trace on a bare scheduler and block pool, in
  virtual time: it is :func:`~kvlab.workloads.replay.simulate` (each step lasts what a
  :class:`~kvlab.workloads.serving.StepCostModel` says; the scheduler reads the virtual clock,
  so ``prefill_priority_after``, the fairness rule, acts in replay time), keeping every step;
* :func:`serving_replay` runs chapter 8's configurations (static, continuous, chunked with
  several budgets, the fairness rule) on one trace with a step-cost model of the GPU:
  :func:`cost_model_for` picks the GPU run's fit when it is usable, else
  :data:`DEFAULT_COST_MODEL`.

Drawing is in :mod:`kvlab.viz.schedule`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from kvlab.accounting import get_spec, kv_budget_bytes, kv_bytes_per_token
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.paging.snapshot import PageMapFrame, page_map_frame
from kvlab.workloads.replay import simulate
from kvlab.workloads.serving import (LONG_PREFILL_TOKENS, LengthMix, RequestTiming, ServingRequest,
                                     ServingSummary, StepCostModel, StepFeatures, poisson_trace, summarize)

# -- an H200 step-cost model for the 8B-shaped model, until the GPU run fits one ------------------
#: Seconds per step of the Llama-3-8B-shaped model in bf16 on an H200, from the roofline and the
#: engine's measured decode steps (``benchmarks/results/engine.json``, 2,176-token contexts):
#:
#: * ``c0`` 5.0 ms: a batch-1 decode step took 5.07 ms, most of it reading 15 GB of weights;
#: * ``c_kv`` 3.07e-8 s: one cached token's K/V (128 KiB over 32 layers) at 4.27 TB/s;
#: * ``c_decode`` 1.7e-5 s: what the batch-32 step (7.68 ms) adds beyond ``c0`` and its KV reads,
#:   per sequence;
#: * ``c_prefill`` 3.2e-5 s: 2 x 8.0e9 FLOPs per prompt token at 500 TFLOP/s (72% of the H200's
#:   measured bf16 matmul rate);
#: * ``c_prefill_attn`` 1.75e-9 s: 4 x 32 heads x 128 x 32 layers FLOPs per (query, key) pair
#:   of causal attention at 300 TFLOP/s.
#:
#: A 16K-token prompt then costs ~0.76 s in one step, a decode step of 64 sequences at 1K tokens ~8 ms.
DEFAULT_COST_MODEL = StepCostModel(c0=5.0e-3, c_prefill=3.2e-5, c_decode=1.7e-5, c_kv=3.07e-8,
                                   c_prefill_attn=1.75e-9)


def cost_model_for(bench) -> tuple[StepCostModel, str]:
    """The step-cost model to replay with, and where it comes from: the fit of the GPU run
    (a :class:`~kvlab.benchmark_results.ServingBenchmark`) when it has one with no negative
    coefficient (that would make a step cheaper for computing more: a fit artefact), else
    :data:`DEFAULT_COST_MODEL`."""
    fit = None if bench is None else bench.cost_model
    if fit is None:
        return DEFAULT_COST_MODEL, "the default (no GPU fit here)"
    negative = {k: v for k, v in fit.items() if v < 0}
    if negative:
        named = ", ".join(f"{k} = {v:.3g}" for k, v in negative.items())
        return DEFAULT_COST_MODEL, f"the default: the GPU run's fit has a negative coefficient ({named})"
    return StepCostModel.from_json(fit), f"fitted on the GPU run's steps ({bench.env.get('gpu', '?')})"


CONTEXT = 32768          # the GPU benchmark's max_model_len (Llama 3.1's context)
MAX_NUM_SEQS = 64        # the GPU benchmark's max_num_seqs
BLOCK_SIZE = 16


def default_num_blocks(spec="llama-3-8b", gpu="H200-141GB", block_size: int = BLOCK_SIZE,
                       gpu_memory_utilization: float = 0.9) -> int:
    """Blocks of the KV cache the model leaves on the GPU (vLLM's estimate: weights subtracted,
    activations ignored)."""
    per_block = kv_bytes_per_token(get_spec(spec)) * block_size
    return kv_budget_bytes(spec, gpu, gpu_memory_utilization) // per_block


# -- what one step did ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Scheduled:
    """One sequence in a step: it computed positions ``start .. start + num_new - 1`` of the
    ``total`` tokens it had to compute (its prompt; prompt + output when recomputed)."""

    request_id: str
    seq_id: int
    start: int
    num_new: int
    total: int
    prompt_len: int
    prefill: bool          # prompt tokens (a whole prompt, a chunk, or a recompute after preemption)
    samples: bool          # the step reached its last token: it emitted a token
    recompute: bool = False

    @property
    def is_decode(self) -> bool:
        """Decodes, as :class:`~kvlab.workloads.serving.StepFeatures` counts them (the cost model's rule)."""
        return self.start == self.total - 1 and self.start >= self.prompt_len


@dataclass(frozen=True)
class ScheduleStep:
    """What the scheduler ran in one step. ``start`` and ``duration`` are seconds of a replay,
    or the step's index and 1 for a recorded engine run (time counted in steps)."""

    index: int
    budget: int                 # max_num_batched_tokens
    max_num_seqs: int
    scheduled: tuple            # Scheduled items, in the step's packed order
    preempted: tuple = ()       # request ids sent back to the waiting queue this step
    finished: tuple = ()        # request ids that ended with this step
    waiting: tuple = ()         # request ids that had arrived but computed nothing this step
    start: float = 0.0
    duration: float = 1.0
    page_map: PageMapFrame | None = None    # the pool after the step

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def tokens(self) -> int:
        """Tokens of the budget used."""
        return sum(s.num_new for s in self.scheduled)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled if s.prefill)

    @property
    def decodes(self) -> tuple:
        return tuple(s for s in self.scheduled if not s.prefill)

    @property
    def prefills(self) -> tuple:
        return tuple(s for s in self.scheduled if s.prefill)

    @property
    def features(self) -> StepFeatures:
        """The inputs of a :class:`~kvlab.workloads.serving.StepCostModel`."""
        pre = dec = kv = attn = 0
        for s in self.scheduled:
            if s.is_decode:
                dec, kv = dec + s.num_new, kv + s.start + s.num_new
            else:
                pre += s.num_new
                attn += s.num_new * s.start + s.num_new * (s.num_new + 1) // 2
        return StepFeatures(pre, dec, kv, attn)

    def decode_behind_prefill(self, threshold: int = LONG_PREFILL_TOKENS) -> bool:
        """It decoded while computing more than ``threshold`` prompt tokens: those decodes waited."""
        return bool(self.decodes) and self.prefill_tokens > threshold


def _scheduled(out) -> tuple:
    """:class:`Scheduled` items of a SchedulerOutput (before or after ``update``)."""
    items = []
    for s in out.scheduled:
        seq = s.seq
        total = s.start + s.num_new if s.samples else seq.num_tokens
        items.append(Scheduled(seq.request_id, seq.seq_id, s.start, s.num_new, total, seq.num_prompt_tokens,
                               s.is_prefill, s.samples, s.is_prefill and total > seq.num_prompt_tokens))
    return tuple(items)


@dataclass
class ScheduleRun:
    """A recorded run: its steps, each request's timing (same clock as the steps), and its length."""

    steps: list
    timings: list                     # RequestTiming per request, in arrival order
    duration: float
    num_preemptions: int = 0
    settings: dict = field(default_factory=dict)

    def summary(self) -> ServingSummary:
        """TTFT/ITL percentiles and throughput (:func:`~kvlab.workloads.serving.summarize`)."""
        return summarize(self.timings, self.duration)

    def behind_long_prefill(self, threshold: int = LONG_PREFILL_TOKENS) -> float:
        """Share of decoding steps that also computed more than ``threshold`` prompt tokens."""
        decoding = [s for s in self.steps if s.decodes]
        return sum(s.decode_behind_prefill(threshold) for s in decoding) / len(decoding) if decoding else 0.0

    def occupancy(self) -> float:
        """Time-weighted share of the ``max_num_seqs`` batch slots that ran a sequence."""
        total = sum(s.duration for s in self.steps)
        if not total:
            return math.nan
        return sum(len(s.scheduled) / s.max_num_seqs * s.duration for s in self.steps) / total

    def timing(self, request_id: str) -> RequestTiming:
        return next(t for t in self.timings if t.request_id == request_id)


# -- a real engine, step by step ------------------------------------------------------------------
def record_schedule(llm, prompts, sampling_params=None, *, arrive_at=None, max_steps: int = 1000,
                    page_maps: bool = True) -> ScheduleRun:
    """Serve ``prompts`` on ``llm`` one :meth:`~kvlab.engine.LLM.step` at a time and record each step.

    ``prompts``: a list of prompts (text, token ids, or dicts as for ``generate``), named
    ``r0``, ``r1``, ...; ``sampling_params``: one for all or one per prompt (default: greedy, 16
    tokens). ``arrive_at``: the step index at which each prompt is added (default: all before
    the first step). Time is counted in steps: a request added before step ``i`` arrives at
    ``i``; a token sampled in step ``i`` comes at ``i + 1``. The page map is the pool after
    each step (``page_maps=False`` skips it).
    """
    prompts = list(prompts)
    if sampling_params is None:
        sampling_params = SamplingParams(temperature=0, max_tokens=16)
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    arrive_at = [0] * len(prompts) if arrive_at is None else [int(a) for a in arrive_at]
    if not (len(params) == len(arrive_at) == len(prompts)):
        raise ValueError(f"{len(prompts)} prompts need as many sampling_params and arrive_at entries, "
                         f"got {len(params)} and {len(arrive_at)}")
    if llm.has_unfinished_requests():
        raise ValueError("record_schedule needs an idle engine: other requests are running")
    order = sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    ids = [f"r{i}" for i in range(len(prompts))]
    timings = {rid: None for rid in ids}
    added: list[str] = []
    steps: list[ScheduleStep] = []
    sched = llm.scheduler
    preempted_before = sched.num_preemptions
    names: dict = {}
    index = 0
    while order or llm.has_unfinished_requests():
        if not llm.has_unfinished_requests() and arrive_at[order[0]] > index:
            index = arrive_at[order[0]]              # idle: jump to the next arrival
        while order and arrive_at[order[0]] <= index:
            i = order.pop(0)
            rid = llm.add_request(prompts[i], params[i], request_id=ids[i])
            seq = llm.requests[rid].seqs[0]
            timings[rid] = RequestTiming(rid, float(index), seq.num_prompt_tokens)
            added.append(rid)
        if len(steps) >= max_steps:
            raise RuntimeError(f"the run did not finish within max_steps={max_steps} steps")
        outputs = llm.step()
        out = llm.last_schedule
        for o in outputs:
            t = timings.get(o.request_id)
            if t is None:
                continue
            got = len(o.outputs[0].token_ids) if o.outputs else 0
            t.token_times += [index + 1.0] * (got - len(t.token_times))
            if o.finished and t.finish is None:
                t.finish, t.error = index + 1.0, o.error
        ran = {s.seq.request_id for s in out.scheduled}
        names.update((s.seq.seq_id, seq_name(s.seq)) for s in out.scheduled)
        finished = tuple(o.request_id for o in outputs if o.finished and o.request_id in timings)
        waiting = tuple(rid for rid in added if rid not in ran and timings[rid].finish is None)
        steps.append(ScheduleStep(index, sched.max_num_batched_tokens, sched.max_num_seqs, _scheduled(out),
                                  tuple(s.request_id for s in out.preempted), finished, waiting,
                                  float(index), 1.0, _by_request(page_map_frame(llm.pool, f"after step {index}"),
                                                                 names) if page_maps else None))
        index += 1
    return ScheduleRun(steps, [timings[rid] for rid in added], float(index),
                       sched.num_preemptions - preempted_before, _settings(sched))


def _by_request(frame: PageMapFrame, names: dict) -> PageMapFrame:
    """``frame`` with each sequence named by its request (see :func:`seq_name`), not its seq id."""
    def name(seq):
        return names.get(seq, seq)

    return replace(frame, owners=tuple(None if o is None else name(o) for o in frame.owners),
                   block_tables={name(s): t for s, t in frame.block_tables.items()},
                   seq_lens={name(s): n for s, n in frame.seq_lens.items()})


def seq_name(seq) -> str:
    """A sequence's name in the figures: its request id (``id/i`` for the i-th extra sample)."""
    return seq.request_id if seq.index == 0 else f"{seq.request_id}/{seq.index}"


def _settings(sched) -> dict:
    keys = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
            "max_num_partial_prefills", "scheduling_policy", "prefill_priority_after")
    return {k: getattr(sched, k) for k in keys if hasattr(sched, k)}


# -- a trace in virtual time ----------------------------------------------------------------------
def replay(trace, make_scheduler, cost_model: StepCostModel, *, num_blocks: int, block_size: int = BLOCK_SIZE,
           static: bool = False, page_maps: bool = False, max_steps: int = 1_000_000,
           token_id: int = 1) -> ScheduleRun:
    """:func:`~kvlab.workloads.replay.simulate`'s replay of ``trace`` on ``make_scheduler(pool)``
    in virtual time (same steps, same timings), keeping every step as a :class:`ScheduleStep`
    (and the pool's page map after it, if ``page_maps``)."""
    steps, names, last = [], {}, {}

    def keep(out, record, scheduler, arrived):
        items = _scheduled(out)
        ran = {s.request_id for s in items}
        names.update((s.seq.seq_id, seq_name(s.seq)) for s in out.scheduled)
        waiting = tuple(r.request_id for r in arrived) + tuple(
            s.request_id for s in (*scheduler.waiting, *scheduler.running) if s.request_id not in ran)
        finished = tuple(dict.fromkeys(s.request_id for s in out.sample_seqs if s.is_finished))
        index = len(steps)
        steps.append(ScheduleStep(index, scheduler.max_num_batched_tokens, scheduler.max_num_seqs, items,
                                  tuple(s.request_id for s in out.preempted), finished, waiting,
                                  record.start, record.duration,
                                  _by_request(page_map_frame(scheduler.pool, f"after step {index}"), names)
                                  if page_maps else None))
        last["scheduler"] = scheduler

    result = simulate(trace, make_scheduler, cost_model, num_blocks=num_blocks, block_size=block_size,
                      max_steps=max_steps, static=static, token_id=token_id, on_step=keep)
    settings = _settings(last["scheduler"]) if last else {}
    return ScheduleRun(steps, result.timings, result.duration, result.num_preemptions, settings)


def burst(trace) -> list[ServingRequest]:
    """``trace`` with every request arriving at time 0."""
    return [replace(r, arrival_time=0.0) for r in trace]


# -- chapter 8's experiment ----------------------------------------------------------------------
def experiment_configs(context: int = CONTEXT, budgets=(512, 2048, 8192), fairness: float | None = 0.1) -> list[dict]:
    """The configurations of ``benchmarks/bench_serving.py``, by the same names and settings:
    "static" (the scheduler's static policy) and "continuous", both with whole prompts in a
    budget of the whole context; "chunked-B" per budget B; and "chunked-M-fair", the middle
    budget with the fairness rule (``prefill_priority_after=fairness`` seconds; None: left out).
    ``static`` (batching by admission) is False for all of them."""
    whole = {"enable_chunked_prefill": False, "max_num_batched_tokens": context}
    configs = [{"name": "static", "static": False, "settings": {**whole, "scheduling_policy": "static"}},
               {"name": "continuous", "static": False, "settings": whole}]
    configs += [{"name": f"chunked-{b}", "static": False,
                 "settings": {"enable_chunked_prefill": True, "max_num_batched_tokens": b}} for b in budgets]
    if fairness is not None and budgets:
        middle = sorted(budgets)[len(budgets) // 2]
        configs.append({"name": f"chunked-{middle}-fair", "static": False,
                        "settings": {"enable_chunked_prefill": True, "max_num_batched_tokens": middle,
                                     "prefill_priority_after": fairness}})
    return configs


def scheduler_for(settings: dict, max_num_seqs: int = MAX_NUM_SEQS, context: int = CONTEXT):
    """A ``make_scheduler(pool)`` with ``settings`` (Scheduler keywords)."""
    return partial(Scheduler, max_num_seqs=max_num_seqs, max_model_len=context, **settings)


def replay_capacity(requests, cost_model: StepCostModel, *, num_blocks: int, max_num_seqs: int = MAX_NUM_SEQS,
                    context: int = CONTEXT, block_size: int = BLOCK_SIZE) -> float:
    """Requests/s of the continuous engine serving ``requests`` all at once (as the GPU benchmark
    measures its capacity): requests served / time to serve them all."""
    settings = experiment_configs(context, ())[1]["settings"]
    run = replay(burst(requests), scheduler_for(settings, max_num_seqs, context), cost_model,
                 num_blocks=num_blocks, block_size=block_size)
    return run.summary().num_finished / run.duration


def serving_replay(trace, cost_model: StepCostModel = DEFAULT_COST_MODEL, configs=None, *,
                   num_blocks: int | None = None, max_num_seqs: int = MAX_NUM_SEQS, context: int = CONTEXT,
                   block_size: int = BLOCK_SIZE) -> dict:
    """``{name: ScheduleRun}``: ``trace`` replayed on every configuration (default
    :func:`experiment_configs`) with ``cost_model``; ``num_blocks`` defaults to an 8B model's on an H200."""
    num_blocks = default_num_blocks(block_size=block_size) if num_blocks is None else num_blocks
    configs = experiment_configs(context) if configs is None else configs
    return {c["name"]: replay(trace, scheduler_for(c["settings"], max_num_seqs, context), cost_model,
                              num_blocks=num_blocks, block_size=block_size, static=c["static"])
            for c in configs}


def experiment_trace(bench=None, *, num_requests: int = 300, load: float = 0.9, seed: int = 0,
                     mix: LengthMix = LengthMix(), cost_model: StepCostModel = DEFAULT_COST_MODEL,
                     capacity_requests: int = 200, num_blocks: int | None = None,
                     max_num_seqs: int = MAX_NUM_SEQS, context: int = CONTEXT) -> tuple[list, dict]:
    """The trace to replay, and how it was made.

    With the GPU benchmark's result (``bench``, a :class:`~kvlab.benchmark_results.ServingBenchmark`
    with a trace): the GPU run's own trace (same requests, rate, seed and mix). Without one: as the
    benchmark makes it, with the capacity measured by :func:`replay_capacity` on a burst of
    ``capacity_requests`` requests (seed + 1; 0: the trace's own requests) and ``cost_model``.
    """
    if bench is not None and bench.trace is not None:
        t = bench.trace
        mix = LengthMix(**{k: tuple(v) if isinstance(v, list) else v for k, v in t["mix"].items()})
        trace = poisson_trace(int(t["requests"]), float(t["rate_req_s"]), int(t["seed"]), mix)
        return trace, {"source": "the GPU run's trace", "requests": len(trace), "rate_req_s": float(t["rate_req_s"]),
                       "load": t.get("load"), "seed": int(t["seed"]), "capacity_req_s": t.get("capacity_req_s")}
    num_blocks = default_num_blocks() if num_blocks is None else num_blocks
    bursting = poisson_trace(num_requests, 1.0, seed, mix) if capacity_requests == 0 else \
        poisson_trace(capacity_requests, 1.0, seed + 1, mix)
    capacity = replay_capacity(bursting, cost_model, num_blocks=num_blocks, max_num_seqs=max_num_seqs, context=context)
    rate = load * capacity
    trace = poisson_trace(num_requests, rate, seed, mix)
    return trace, {"source": "made here (no GPU trace)", "requests": num_requests, "rate_req_s": rate, "load": load,
                   "seed": seed, "capacity_req_s": capacity}


def long_request_ttfts(run: ScheduleRun, min_prompt: int) -> np.ndarray:
    """TTFTs of the requests whose prompt has at least ``min_prompt`` tokens."""
    return np.array([t.ttft for t in run.timings if t.prompt_len >= min_prompt and t.ttft is not None])
