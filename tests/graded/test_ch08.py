"""Graded tests of chapter 8: ``pytest tests/graded -m ch08 --impl=exercises``."""
import functools
import math
import random

import numpy as np
import pytest
import torch

from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence
from kvlab.paging import BlockPool
from kvlab.scaffold.ch08 import RunningRequest, RunningSeq, Scheduled, WaitingRequest
from kvlab.workloads.replay import simulate
from kvlab.workloads.serving import LengthMix, StepCostModel, poisson_trace
from helpers import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.ch08


def add_request(scheduler, seq_id, prompt_len, max_tokens):
    prompt = [1 + (seq_id * 7 + i) % 50 for i in range(prompt_len)]
    seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduler.add(seq)
    return seq


def finish_step(scheduler, out):
    scheduler.update(out, [1 + s.num_tokens % 50 for s in out.sample_seqs])


# -- budgeted_step -----------------------------------------------------------------------------
def run(ch08, running, waiting, budget, max_num_seqs=8, threshold=0, partials=1):
    got = ch08.budgeted_step(running, waiting, budget, max_num_seqs, threshold, partials)
    assert isinstance(got, list) and all(isinstance(s, Scheduled) for s in got), \
        f"budgeted_step must return a list of Scheduled, got {got!r}"
    return [(s.request_id, s.start, s.num_new) for s in got]


@pytest.mark.task("budgeted_step")
def test_budgeted_step_worked_example(ch08):
    running = [RunningRequest("A", 10, 11), RunningRequest("B", 0, 40)]
    assert run(ch08, running, [WaitingRequest("C", 5)], 16) == [("A", 10, 1), ("B", 0, 15)], \
        "A decodes one token, B's chunk takes the 15 left, nothing is left for C"
    assert run(ch08, running, [WaitingRequest("C", 5)], 60) == [("A", 10, 1), ("B", 0, 40), ("C", 0, 5)], \
        "with budget to spare, B's whole prompt and then C's"


@pytest.mark.task("budgeted_step")
def test_decodes_go_before_older_chunks(ch08):
    running = [RunningRequest("A", 0, 30), RunningRequest("B", 4, 5), RunningRequest("C", 7, 8)]
    assert run(ch08, running, [], 8, threshold=6) == [("B", 4, 1), ("C", 7, 1), ("A", 0, 6)], \
        "the decodes (B, C) first, then A's chunk, capped at the threshold of 6"
    assert run(ch08, running, [], 4) == [("B", 4, 1), ("C", 7, 1), ("A", 0, 2)], \
        "A's chunk is what the decodes leave of the budget"


@pytest.mark.task("budgeted_step")
def test_admission_is_first_come_first_served(ch08):
    waiting = [WaitingRequest("W1", 20, num_cached=16), WaitingRequest("W2", 30), WaitingRequest("W3", 2)]
    assert run(ch08, [], waiting, 16) == [("W1", 16, 4), ("W2", 0, 12)], \
        "W1 starts after its 16 cached tokens; W2 takes the rest as a first chunk; W3 may not overtake W2"
    assert run(ch08, [], waiting, 40, partials=1) == [("W1", 16, 4), ("W2", 0, 30), ("W3", 0, 2)]
    assert run(ch08, [RunningRequest("P", 0, 50)], waiting, 60, partials=1) == [("P", 0, 50), ("W1", 16, 4)], \
        "P is part-way through its prompt: W2's chunk (budget 6 of its 30) may not start a second partial prefill"
    assert run(ch08, [RunningRequest("P", 0, 50)], waiting, 60, partials=2) == \
        [("P", 0, 50), ("W1", 16, 4), ("W2", 0, 6)]
    assert run(ch08, [RunningRequest("D", 3, 4)], waiting, 100, max_num_seqs=2) == [("D", 3, 1), ("W1", 16, 4)], \
        "max_num_seqs=2: D and W1"


@pytest.mark.task("budgeted_step")
def test_threshold_caps_every_chunk(ch08):
    waiting = [WaitingRequest("W1", 20), WaitingRequest("W2", 3)]
    assert run(ch08, [RunningRequest("P", 8, 50)], waiting, 100, threshold=8, partials=3) == \
        [("P", 8, 8), ("W1", 0, 8), ("W2", 0, 3)]
    assert run(ch08, [], [], 10) == [] and run(ch08, [RunningRequest("A", 5, 5 + 1)], [], 1) == [("A", 5, 1)]


@pytest.mark.task("budgeted_step")
def test_the_budget_limits_decodes_too(ch08):
    running = [RunningRequest("A", 0, 20), RunningRequest("B", 4, 5), RunningRequest("C", 6, 7),
               RunningRequest("D", 2, 3)]
    assert run(ch08, running, [WaitingRequest("W", 3)], 2) == [("B", 4, 1), ("C", 6, 1)], \
        "budget 2, three decodes: B and C decode; D and A get nothing this step (a decode costs a token of the budget)"
    assert run(ch08, running[:2], [WaitingRequest("W", 3)], 1) == [("B", 4, 1)], \
        "the decode takes the whole budget: A's chunk would be 0 tokens, so A is not in the step at all"


def engine_state(scheduler):
    running = [RunningRequest(s.request_id, s.num_computed_tokens, s.num_tokens) for s in scheduler.running]
    waiting = [WaitingRequest(s.request_id, s.num_tokens) for s in scheduler.waiting]
    return running, waiting


@pytest.mark.task("budgeted_step")
@pytest.mark.parametrize("seed", range(4))
def test_budgeted_step_matches_the_engines_scheduler(ch08, seed):
    """Every step of a random trace: what the engine's scheduler runs (a pool large enough that
    nothing is preempted) is what your budgeted_step says."""
    rng = random.Random(seed)
    budget, max_num_seqs = rng.choice([(8, 4), (16, 3), (32, 6), (64, 8)])
    threshold, partials = rng.choice([0, 0, 4, 10]), rng.choice([1, 2])
    scheduler = Scheduler(BlockPool(1000, 4), max_num_seqs, budget, long_prefill_token_threshold=threshold,
                          max_num_partial_prefills=partials)
    for i in range(12):
        add_request(scheduler, i, rng.randrange(1, 60), rng.randrange(1, 8))
    step = 0
    while scheduler.has_unfinished():
        running, waiting = engine_state(scheduler)
        decoding = {r.request_id for r in running if r.decoding}
        out = scheduler.schedule()
        items = [(s.seq.request_id, s.start, s.num_new) for s in out.scheduled]
        ids = {r.request_id for r in running}
        want = ([x for x in items if x[0] in decoding] + [x for x in items if x[0] in ids - decoding]
                + [x for x in items if x[0] not in ids])
        got = run(ch08, running, waiting, budget, max_num_seqs, threshold, partials)
        assert got == want, (f"step {step} (budget {budget}, max_num_seqs {max_num_seqs}, threshold {threshold}, "
                             f"max_num_partial_prefills {partials}), running {running}, waiting {waiting}: "
                             f"got {got}, the engine ran {want}")
        finish_step(scheduler, out)
        step += 1


# -- metrics -----------------------------------------------------------------------------------
@pytest.mark.task("metrics")
def test_percentile_worked_examples(ch08):
    assert ch08.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5), "rank (4 - 1) * 0.5 = 1.5: halfway from 2 to 3"
    assert ch08.percentile([10, 20, 30], 99) == pytest.approx(29.8), "rank 1.98: 20 + 0.98 * (30 - 20)"
    assert ch08.percentile([7], 99) == 7 and ch08.percentile([1, 9], 0) == 1 and ch08.percentile([1, 9], 100) == 9
    assert math.isnan(ch08.percentile([], 50)), "no values: NaN"


@pytest.mark.task("metrics")
def test_percentile_matches_numpy(ch08):
    rng = random.Random(0)
    for _ in range(200):
        values = [rng.expovariate(1.0) for _ in range(rng.randrange(1, 40))]
        q = rng.choice([0, 1, 50, 90, 99, 100, rng.uniform(0, 100)])
        assert ch08.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15), \
            f"percentile of {len(values)} values at q={q}"


@pytest.mark.task("metrics")
def test_latency_metrics_worked_example(ch08):
    arrivals = {"a": 0.0, "b": 1.0, "c": 2.0}
    events = [("b", 1.5), ("a", 0.5), ("a", 0.7), ("b", 2.5), ("a", 1.0), ("x", 9.0)]   # "x": not measured
    got = ch08.latency_metrics(arrivals, events)
    # TTFTs: a 0.5, b 0.5 (c has no token); ITLs: a 0.2, 0.3; b 1.0
    assert (got.ttft_p50, got.ttft_p99) == pytest.approx((0.5, 0.5))
    assert got.itl_p50 == pytest.approx(0.3) and got.itl_p99 == pytest.approx(0.3 + 0.98 * 0.7)
    none = ch08.latency_metrics({"a": 0.0}, [("a", 1.0)])
    assert none.ttft_p50 == pytest.approx(1.0) and math.isnan(none.itl_p50) and math.isnan(none.itl_p99), \
        "one token: a TTFT, no gap"


@pytest.mark.task("metrics")
def test_latency_metrics_count_only_measured_tokens(ch08):
    arrivals = {"a": 0.0, "b": 0.0, "c": 0.0}
    events = [("b", 3.5), ("a", 1.0), ("b", 3.0), ("a", 1.5), ("b", 4.5)]     # c: no token yet
    got = ch08.latency_metrics(arrivals, events)
    assert (got.ttft_p50, got.ttft_p99) == pytest.approx((2.0, 1.0 + 0.99 * 2.0)), \
        "TTFTs are a's 1.0 and b's 3.0: c has no token, so it has no TTFT (not a TTFT of 0)"
    unmeasured = [("x", 7.0), ("x", 9.0), ("x", 11.0), ("x", 13.0)]
    got = ch08.latency_metrics(arrivals, events + unmeasured)
    assert (got.itl_p50, got.itl_p99) == pytest.approx((0.5, 0.5 + 0.98 * 0.5)), \
        "ITLs are a's 0.5 and b's 0.5, 1.0: x is not in arrivals, so none of its tokens count (no TTFT, no gaps)"


@pytest.mark.task("metrics")
def test_latency_metrics_tokens_at_the_same_time(ch08):
    got = ch08.latency_metrics({"a": 0.0}, [("a", 1.0), ("a", 2.0), ("a", 1.0), ("a", 1.0)])
    assert (got.itl_p50, got.itl_p99) == pytest.approx((0.0, 0.98)), \
        "4 tokens, 3 of them at t=1.0 (a step that accepted drafts): 3 gaps, 0, 0 and 1.0"
    assert (got.ttft_p50, got.ttft_p99) == pytest.approx((1.0, 1.0))


@pytest.mark.task("metrics")
@pytest.mark.parametrize("static", [False, True])
def test_latency_metrics_match_summarize_on_a_replayed_trace(ch08, static):
    """A Poisson trace replayed on the real scheduler in virtual time; some requests are too
    long for the cache and fail: they are not measured."""
    trace = poisson_trace(40, 30.0, seed=3, mix=LengthMix(long_share=0.1).scaled(1 / 32))
    make = functools.partial(Scheduler, max_num_seqs=6, max_num_batched_tokens=64)
    result = simulate(trace, make, StepCostModel(c0=0.01, c_prefill=1e-4, c_decode=1e-3), num_blocks=40,
                      block_size=8, static=static)
    summary = result.summary()
    assert summary.num_failed > 0
    arrivals = {t.request_id: t.arrival for t in result.timings if not t.failed}
    events = [(t.request_id, x) for t in result.timings for x in t.token_times]
    random.Random(0).shuffle(events)
    got = ch08.latency_metrics(arrivals, events)
    want = (summary.ttft_p50, summary.ttft_p99, summary.itl_p50, summary.itl_p99)
    assert (got.ttft_p50, got.ttft_p99, got.itl_p50, got.itl_p99) == pytest.approx(want, rel=1e-9), \
        "(ttft_p50, ttft_p99, itl_p50, itl_p99) differ from kvlab.workloads.serving.summarize"


# -- preemption --------------------------------------------------------------------------------
def victims(ch08, blocks, needy, short, scheduled=()):
    running = [RunningSeq(i, b, 10 * b, scheduled=i in scheduled) for i, b in enumerate(blocks)]
    got = ch08.preemption_victims(running, needy, short)
    assert isinstance(got, list), f"preemption_victims must return a list of indices, got {got!r}"
    return got


@pytest.mark.task("preemption")
def test_preemption_worked_example(ch08):
    assert victims(ch08, [3, 2, 2, 1], 1, 1, scheduled={2}) == [3], "D alone frees the one block short"
    assert victims(ch08, [3, 2, 2, 1], 1, 2, scheduled={2}) == [3, 1], \
        "D frees 1 of 2; C is scheduled and A is older: B itself goes last"


@pytest.mark.task("preemption")
def test_the_youngest_go_first_and_no_more_than_needed(ch08):
    assert victims(ch08, [1, 1, 1, 1, 1], 0, 2) == [4, 3], "the two most recently admitted"
    assert victims(ch08, [1, 1, 5, 1, 1], 0, 3) == [4, 3, 2], "the youngest first, even if an older one frees more"
    assert victims(ch08, [2, 2, 2], 0, 1) == [2], "stop as soon as enough is free"
    assert victims(ch08, [4, 1, 1], 2, 1) == [2], "the youngest needs room: nobody older goes, it waits itself"
    assert victims(ch08, [4], 0, 1) == [0], "alone and short: itself (the engine then fails it)"
    assert victims(ch08, [1, 1, 1, 1], 1, 5, scheduled={3}) == [2, 1], "never a scheduled one, never an older one"


@pytest.mark.task("preemption")
def test_a_candidate_that_frees_no_block_still_goes_in_its_turn(ch08):
    assert victims(ch08, [2, 1, 0, 1, 0], 0, 1) == [4, 3], \
        "4 frees no block (its blocks are all shared) but is the youngest: it goes first, then 3 frees the one"
    assert victims(ch08, [1, 0, 0], 0, 1) == [2, 1, 0], \
        "2 and 1 free nothing: both go, youngest first, and then 0 itself"


def drive(scheduler, prompts, check=None):
    seqs = [add_request(scheduler, i, p, m) for i, (p, m) in enumerate(prompts)]
    steps = []
    while scheduler.has_unfinished():
        running = list(scheduler.running)
        out = scheduler.schedule()
        if check:
            check(running, out)
        steps.append(([(s.seq.seq_id, s.start, s.num_new) for s in out.scheduled], [s.seq_id for s in out.preempted]))
        finish_step(scheduler, out)
    return seqs, steps


@pytest.mark.task("preemption")
@pytest.mark.parametrize("seed", range(3))
def test_your_rule_in_the_engines_scheduler(ch08, seed):
    """Your rule inside the engine's scheduler (``SchedulerWithMyPreemption``), on a pool too
    small for the batch: every step is the engine's own, and the oldest running sequence runs
    in every step and is never preempted, so no request starves."""
    rng = random.Random(seed)
    prompts = [(rng.randrange(4, 40), rng.randrange(4, 24)) for _ in range(10)]
    num_blocks = max(-(-(p + m) // 4) for p, m in prompts) + rng.randrange(0, 4)

    def oldest_runs(running, out):
        if running:
            assert running[0] in [s.seq for s in out.scheduled], \
                f"the oldest running sequence ({running[0].seq_id}) did not run: it was preempted"

    make = dict(max_num_seqs=4, max_num_batched_tokens=24)
    mine = ch08.SchedulerWithMyPreemption(BlockPool(num_blocks, 4), **make)
    seqs, got = drive(mine, prompts, oldest_runs)
    _, want = drive(Scheduler(BlockPool(num_blocks, 4), **make), prompts)
    assert mine.num_preemptions > 0, "the test needs preemptions"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (f"step {i}: with your rule the step ran {g[0]} and preempted {g[1]}; "
                        f"the engine's rule: {w[0]}, {w[1]}")
    assert len(got) == len(want) and all(s.num_output_tokens == s.params.max_tokens for s in seqs)


PROMPT_CHARS = (200, 120, 260, 160, 90)


def small_engine():
    from kvlab import LLM

    return LLM(max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks=9, dtype="float32")


@pytest.fixture(scope="module")
def engine_run(one_thread):
    """The engine's own greedy output and preemption count on code prompts, in a cache too small
    for all of them at once."""
    from kvlab.workloads.code_prompts import load_code_prompts

    prompts = [text[:n] for text, n in zip(load_code_prompts(), PROMPT_CHARS)]
    params = SamplingParams(temperature=0, max_tokens=20)
    llm = small_engine()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, params, [o.outputs[0].token_ids for o in outputs], llm.scheduler.num_preemptions


@pytest.mark.task("preemption")
def test_your_rule_in_the_engine_keeps_greedy_output(ch08, engine_run):
    prompts, params, want, preemptions = engine_run
    llm = ch08.use_my_preemption(small_engine())
    assert isinstance(llm.scheduler, ch08.SchedulerWithMyPreemption)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    errors = [o.error for o in outputs if o.error]
    assert not errors, f"the engine failed with your preemption rule: {errors[0]}"
    assert preemptions > 0, "the test needs preemptions"
    assert llm.scheduler.num_preemptions == preemptions, \
        f"your rule preempted {llm.scheduler.num_preemptions} times, the engine's {preemptions}"
    for i, (o, w) in enumerate(zip(outputs, want)):
        got = o.outputs[0].token_ids
        first = next((j for j, (a, b) in enumerate(zip(got, w)) if a != b), min(len(got), len(w)))
        assert got == w, f"prompt {i}: with your rule the greedy tokens differ from the engine's at token {first}"
    assert llm.pool.num_free_blocks == llm.pool.num_blocks, "blocks are still held after every request finished"
