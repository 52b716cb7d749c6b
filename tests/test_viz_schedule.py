"""Chapter 8's recordings and pictures: a real engine's schedule step by step, the virtual-time
replay (against simulate), the experiment's configurations, the GPU benchmark's reader, and
the figures drawn from them."""
import functools
import importlib.util
import json
import math
import random
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import kvlab  # noqa: E402,F401  (profile first)
from kvlab import benchmark_results as br  # noqa: E402
from kvlab.engine import LLM, SamplingParams  # noqa: E402
from kvlab.engine.scheduler import Scheduler  # noqa: E402
from kvlab.paging.snapshot import frame_problems  # noqa: E402
from kvlab.viz.schedule import (  # noqa: E402
    NO_GPU,
    BudgetSegment,
    GanttSegment,
    compare_gantts,
    budget_segments,
    describe_step,
    draw_gantt,
    draw_schedule_frame,
    gantt_rows,
    latency_curve,
    latency_curves,
    missing_gpu_note,
    plot_budget_tradeoff,
    plot_latency_cdfs,
    plot_token_gaps,
    schedule_frames,
    schedule_stepper,
    seed_timeline,
    tradeoff_points,
)
from kvlab.workloads.batching import (  # noqa: E402
    DEFAULT_COST_MODEL,
    ScheduleRun,
    ScheduleStep,
    Scheduled,
    burst,
    cost_model_for,
    default_num_blocks,
    experiment_configs,
    experiment_trace,
    long_request_ttfts,
    record_schedule,
    replay,
    replay_capacity,
    scheduler_for,
    serving_replay,
)
from kvlab.workloads.serving import (  # noqa: E402
    LengthMix,
    RequestTiming,
    ServingRequest,
    StepCostModel,
    poisson_trace,
)
from kvlab.workloads.replay import simulate  # noqa: E402
from helpers import one_thread  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
SMALL = LengthMix().scaled(1 / 16)          # chats of 3-62 tokens, long prompts of 512-1024
COST = StepCostModel(c0=0.01, c_prefill=2e-5, c_decode=1e-4, c_kv=1e-7, c_prefill_attn=1e-9)


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


def greedy(*max_tokens):
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]


# -- a real engine, step by step ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chunked_run(one_thread):
    """Chunks of a 100-token prompt beside decodes, a pool small enough for one preemption."""
    llm = LLM(num_gpu_blocks=23, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512)
    run = record_schedule(llm, prompts([12, 18, 15, 100, 20]), greedy(20, 14, 24, 8, 10), arrive_at=[0, 0, 1, 3, 6])
    return llm, run


def test_record_schedule_keeps_the_budget_and_covers_every_prompt(chunked_run):
    llm, run = chunked_run
    assert run.num_preemptions >= 1 and not llm.has_unfinished_requests()
    computed = {}
    for step in run.steps:
        assert step.tokens <= step.budget == 32 and len(step.scheduled) <= step.max_num_seqs == 4
        assert len({s.request_id for s in step.scheduled}) == len(step.scheduled)
        assert not set(step.waiting) & {s.request_id for s in step.scheduled}
        for s in step.scheduled:
            if s.start == 0:
                computed[s.request_id] = 0                     # admitted, or recomputed after preemption
            assert s.start == computed[s.request_id]       # chunks follow each other, no gap, no overlap
            computed[s.request_id] += s.num_new
            assert s.samples == (s.start + s.num_new == s.total)
    # each request ends having computed its prompt and every output token but the last
    for t, n_out in zip(run.timings, (20, 14, 24, 8, 10)):
        assert len(t.token_times) == n_out and t.finish == t.token_times[-1]
        assert computed[t.request_id] == t.prompt_len + n_out - 1
    r3 = [s for step in run.steps for s in step.scheduled if s.request_id == "r3"]
    assert any(s.recompute for s in r3) and {s.num_new for s in r3 if s.prefill and not s.samples} <= {29, 30, 31}
    assert [t.arrival for t in run.timings] == [0, 0, 1, 3, 6]
    assert run.timing("r4").arrival == 6.0 and run.duration == len(run.steps)


def test_record_schedule_page_maps_are_named_by_request(chunked_run):
    _, run = chunked_run
    for step in run.steps:
        frame = step.page_map
        assert frame is not None and frame_problems(frame) == []
        assert set(frame.block_tables) <= {"r0", "r1", "r2", "r3", "r4"}
        assert set(frame.owners) - {None} <= set(frame.block_tables)
    preempting = next(s for s in run.steps if s.preempted)
    assert "r3" not in preempting.page_map.block_tables          # its blocks went back to the pool
    assert run.steps[-1].page_map.num_used == 0


def test_static_policy_on_the_timeline(one_thread):
    ps, params = prompts([30, 50, 20, 40, 25, 35]), greedy(4, 12, 6, 3, 9, 5)
    runs = {name: record_schedule(LLM(max_num_seqs=3, max_num_batched_tokens=256, max_model_len=256, **kw), ps, params)
            for name, kw in {"static": {"scheduling_policy": "static"}, "continuous": {}}.items()}
    static = runs["static"]
    for step in static.steps:                # a batch never takes a newcomer once it decodes
        assert not (step.decodes and any(s.start == 0 for s in step.prefills))
    assert len(static.steps) > len(runs["continuous"].steps)
    assert static.occupancy() < runs["continuous"].occupancy() <= 1
    # same greedy tokens whatever the policy: only the timing changes
    assert [len(t.token_times) for t in static.timings] == [len(t.token_times) for t in runs["continuous"].timings]


def test_record_schedule_refuses_bad_calls(one_thread):
    llm = LLM(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    with pytest.raises(ValueError, match="as many"):
        record_schedule(llm, prompts([5, 6]), greedy(2), arrive_at=[0, 0])
    llm.add_request(prompts([5])[0], greedy(2)[0])
    with pytest.raises(ValueError, match="idle engine"):
        record_schedule(llm, prompts([5]))


def test_record_schedule_jumps_idle_gaps(one_thread):
    llm = LLM(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    run = record_schedule(llm, prompts([5, 6]), greedy(2, 2), arrive_at=[0, 10], page_maps=False)
    assert [s.index for s in run.steps] == [0, 1, 10, 11] and run.steps[0].page_map is None
    assert run.timing("r1").ttft == 1.0


# -- the virtual-time replay ---------------------------------------------------------------------------
@pytest.mark.parametrize("settings,static", [({"max_num_batched_tokens": 2048, "enable_chunked_prefill": False}, False),
                                              ({"max_num_batched_tokens": 2048, "enable_chunked_prefill": False}, True),
                                              ({"max_num_batched_tokens": 64}, False)])
def test_replay_gives_simulate_numbers(settings, static):
    trace = poisson_trace(60, 20.0, seed=1, mix=SMALL)
    make = functools.partial(Scheduler, max_num_seqs=8, **settings)
    run = replay(trace, make, COST, num_blocks=400, static=static)
    sim = simulate(trace, make, COST, num_blocks=400, static=static)
    assert [t.token_times for t in run.timings] == [t.token_times for t in sim.timings]
    assert run.duration == pytest.approx(sim.duration) and run.num_preemptions == sim.num_preemptions
    assert [s.duration for s in run.steps] == pytest.approx([s.duration for s in sim.steps])
    assert [s.features for s in run.steps] == [s.features for s in sim.steps]
    assert run.behind_long_prefill(64) == pytest.approx(
        simulate(trace, make, COST, num_blocks=400, static=static, long_prefill_threshold=64).summary()
        .decode_behind_long_prefill)


def test_replay_with_preemption_records_page_maps():
    trace = poisson_trace(30, 50.0, seed=2, mix=LengthMix(long_share=0.0).scaled(1 / 8))
    longest = max(r.prompt_len + r.output_len for r in trace)
    run = replay(trace, functools.partial(Scheduler, max_num_seqs=8, max_num_batched_tokens=64), COST,
                 num_blocks=-(-longest // 4) + 2, block_size=4, page_maps=True)
    assert run.num_preemptions > 0 and run.summary().num_failed == 0
    assert sum(len(s.preempted) for s in run.steps) == run.num_preemptions
    assert all(frame_problems(s.page_map) == [] for s in run.steps)
    assert all(set(s.page_map.block_tables) <= {r.request_id for r in trace} for s in run.steps)


def test_fairness_rule_acts_in_virtual_time():
    """A long prompt behind decodes: with prefill_priority_after its chunks go first once it
    has waited that long (replay seconds), so it gets more of each step's budget."""
    trace = [ServingRequest(f"c{i}", 0.0, 8, 400) for i in range(20)] + [ServingRequest("long", 0.05, 2000, 2)]
    runs = {}
    for fair in (None, 0.1):
        make = scheduler_for({"max_num_batched_tokens": 64, "prefill_priority_after": fair}, max_num_seqs=32,
                             context=4096)
        runs[fair] = replay(trace, make, COST, num_blocks=2000)
    plain, fair = runs[None], runs[0.1]
    assert fair.timing("long").ttft < plain.timing("long").ttft
    chunk = next(s for s in fair.steps if s.start > 0.05 + 0.1 + 0.02 and s.prefills)
    assert chunk.scheduled[0].request_id == "long" and chunk.scheduled[0].num_new == 64   # before the decodes
    assert long_request_ttfts(fair, 1000).tolist() == [fair.timing("long").ttft]


def test_experiment_configs_match_the_benchmark():
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "bench_serving.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert experiment_configs(32768, (512, 2048, 8192)) == bench.configs(32768, (512, 2048, 8192))
    assert [c["name"] for c in experiment_configs(2048, (64,), fairness=None)] == ["static", "continuous", "chunked-64"]


def test_default_sizes_and_cost_model():
    assert default_num_blocks() == (int(0.9 * 150_109_880_320) - 8_030_261_248 * 2) // (131072 * 16)
    step_16k = DEFAULT_COST_MODEL.predict(ScheduleStep(0, 32768, 64, (Scheduled("x", 0, 0, 16384, 16384, 16384,
                                                                                 True, True),)).features)
    assert 0.6 < step_16k < 0.9                    # a 16K-token prefill of an 8B model on an H200


def test_serving_replay_and_capacity():
    trace = poisson_trace(40, 30.0, seed=0, mix=SMALL)
    runs = serving_replay(trace, COST, experiment_configs(2048, (64,), fairness=None), num_blocks=800, max_num_seqs=8,
                          context=2048)
    assert list(runs) == ["static", "continuous", "chunked-64"]
    assert all(r.summary().num_failed == 0 for r in runs.values())
    assert runs["chunked-64"].settings["max_num_batched_tokens"] == 64
    assert all(s.tokens <= 64 for s in runs["chunked-64"].steps)
    capacity = replay_capacity(trace, COST, num_blocks=800, max_num_seqs=8, context=2048)
    whole = replay(burst(trace), scheduler_for(experiment_configs(2048, ())[1]["settings"], 8, 2048), COST,
                   num_blocks=800)
    assert capacity == pytest.approx(40 / whole.duration)


def test_experiment_trace_from_the_benchmark_or_made_here():
    payload = {"trace": {"requests": 12, "rate_req_s": 3.0, "seed": 4, "load": 0.9,
                         "mix": {"short_prompt": [3, 62], "short_output": [3, 25], "long_prompt": [512, 1024],
                                 "long_output": [3, 25], "long_share": 0.1}}, "rows": []}
    bench = br.serving_benchmark(payload)
    trace, info = experiment_trace(bench)
    assert trace == poisson_trace(12, 3.0, 4, SMALL) and info["source"] == "the GPU run's trace"
    trace, info = experiment_trace(None, num_requests=10, mix=SMALL, cost_model=COST, capacity_requests=10,
                                   num_blocks=800, max_num_seqs=8, context=2048)
    assert len(trace) == 10 and info["rate_req_s"] == pytest.approx(0.9 * info["capacity_req_s"])
    # capacity_requests=0: the capacity of a burst of the trace's own requests (seed 4), not seed 5's
    trace, info = experiment_trace(None, num_requests=10, seed=4, mix=SMALL, cost_model=COST, capacity_requests=0,
                                   num_blocks=800, max_num_seqs=8, context=2048)
    own = replay_capacity(poisson_trace(10, 1.0, 4, SMALL), COST, num_blocks=800, max_num_seqs=8, context=2048)
    other = replay_capacity(poisson_trace(10, 1.0, 5, SMALL), COST, num_blocks=800, max_num_seqs=8, context=2048)
    assert info["capacity_req_s"] == pytest.approx(own) and own != pytest.approx(other)
    assert [(r.prompt_len, r.output_len) for r in trace] == \
        [(r.prompt_len, r.output_len) for r in poisson_trace(10, 1.0, 4, SMALL)]


# -- words and pure figure data ------------------------------------------------------------------------
def hand_step(**kw):
    items = (Scheduled("a", 0, 40, 1, 41, 10, False, True), Scheduled("b", 1, 10, 1, 11, 10, False, True),
             Scheduled("c", 2, 64, 32, 200, 200, True, False))
    return ScheduleStep(**{"index": 3, "budget": 64, "max_num_seqs": 4, "scheduled": items, "waiting": ("d",),
                           "preempted": ("e",), "finished": ("b",), **kw})


def test_describe_step_and_seed_timeline():
    assert describe_step(hand_step()) == ("step 3: 34/64 tokens | decode a b | prefill c prompt 64-95 of 200 "
                                          "(32, chunk) | waiting d | PREEMPTED e | done b")
    line = seed_timeline([hand_step()])[0]
    assert line.startswith("t=4: [prefill_chunk c 32 + decode_batch=2]") and line.endswith("34/64 tokens (53%)")
    whole = hand_step(scheduled=(Scheduled("x", 5, 0, 10, 10, 10, True, True),))
    assert "x prompt 10 (whole)" in describe_step(whole) and "[prefill x 10]" in seed_timeline([whole])[0]


def test_step_features_and_budget_segments():
    step = hand_step()
    f = step.features
    assert (f.prefill_tokens, f.decode_tokens, f.kv_tokens_read) == (32, 2, 41 + 11)
    assert f.prefill_attention == 32 * 64 + 32 * 33 // 2
    segs = budget_segments(step)
    assert [s.kind for s in segs] == ["decode", "decode", "prefill", "unused"]
    assert sum(s.tokens for s in segs) == 64 and segs[2] == BudgetSegment("c +32", 32, "prefill", "c")
    assert step.decode_behind_prefill(16) and not step.decode_behind_prefill(32)


def hand_run():
    steps = [ScheduleStep(0, 8, 2, (Scheduled("a", 0, 0, 6, 6, 6, True, False),), waiting=("b",), start=0, duration=1),
             ScheduleStep(1, 8, 2, (Scheduled("a", 0, 6, 2, 8, 8, True, True),), waiting=("b",), start=1, duration=1),
             ScheduleStep(2, 8, 2, (Scheduled("a", 0, 8, 1, 9, 8, False, True),
                                    Scheduled("b", 1, 0, 4, 4, 4, True, True)), start=2, duration=1),
             ScheduleStep(3, 8, 2, (Scheduled("a", 0, 9, 1, 10, 8, False, True),
                                    Scheduled("b", 1, 4, 1, 5, 4, False, True)), start=3, duration=1),
             ScheduleStep(4, 8, 2, (Scheduled("a", 0, 10, 1, 11, 8, False, True),), preempted=("b",), waiting=("b",),
                          start=4, duration=2)]
    timings = [RequestTiming("a", 0.0, 8, [2.0, 3.0, 4.0, 6.0], 6.0), RequestTiming("b", 0.0, 4, [3.0, 4.0])]
    return ScheduleRun(steps, timings, 6.0)


def test_gantt_rows_merge_decodes_and_keep_chunks():
    a, b = gantt_rows(hand_run())
    assert a.segments == (GanttSegment(0, 1, "prefill", 6), GanttSegment(1, 2, "prefill", 2),
                          GanttSegment(2, 6, "decode"))
    assert b.segments == (GanttSegment(0, 2, "waiting"), GanttSegment(2, 3, "prefill", 4), GanttSegment(3, 4, "decode"),
                          GanttSegment(4, 6, "waiting"))
    assert b.preempted_at == (4,) and (a.first_token, a.finish) == (2.0, 6.0) and a.colour_key == "a"
    run = hand_run()
    assert run.occupancy() == pytest.approx((0.5 + 0.5 + 1 + 1 + 0.5 * 2) / 6)
    assert run.behind_long_prefill(3) == pytest.approx(1 / 3) and run.behind_long_prefill(4) == 0.0


def test_schedule_frames_follow_the_steps(chunked_run):
    _, run = chunked_run
    frames = schedule_frames(run)
    assert [f.step for f in frames] == run.steps and all(f.run is run for f in frames)
    assert frames[3].caption == describe_step(run.steps[3])


# -- latency curves and the trade-off -------------------------------------------------------------------
PAYLOAD = {
    "env": {"gpu": "NVIDIA H200", "date": "2026-12-01"}, "model": "8B-shaped, 32 layers", "context": 32768,
    "engine": {"max_num_seqs": 64, "max_model_len": 32768},
    "trace": {"requests": 300, "rate_req_s": 9.0, "seed": 0, "load": 0.9, "capacity_req_s": 10.0,
              "mix": {"short_prompt": [50, 1000], "short_output": [50, 400], "long_prompt": [8192, 16384],
                      "long_output": [50, 400], "long_share": 0.1}},
    "long_prefill_tokens": 2048,
    "cost_model": {"c0": 0.005, "c_prefill": 3e-5, "c_decode": 2e-5, "c_kv": 3e-8, "c_prefill_attn": 1e-9},
    "rows": [
        {"name": "static", "static": True,
         "settings": {"enable_chunked_prefill": False, "max_num_batched_tokens": 32768},
         "ttft_p50": 2.0, "ttft_p99": 5.0, "itl_p50": 0.006, "itl_p99": 0.01, "output_throughput": 900.0,
         "total_throughput": 8000.0, "ttft_s": [1.0, 2.0, 3.0], "itl_quantiles_s": list(np.linspace(0.005, 0.02, 101))},
        {"name": "continuous", "static": False, "settings": {"enable_chunked_prefill": False,
                                                              "max_num_batched_tokens": 32768},
         "ttft_p50": 0.03, "ttft_p99": 0.8, "itl_p50": 0.006, "itl_p99": 0.05, "output_throughput": 1200.0,
         "total_throughput": 10000.0, "ttft_s": [0.02, 0.03, None],
         "itl_quantiles_s": list(np.linspace(0.005, 0.7, 101))},
        {"name": "chunked-512", "static": False,
         "settings": {"enable_chunked_prefill": True, "max_num_batched_tokens": 512},
         "ttft_p50": 0.04, "ttft_p99": 1.1, "itl_p50": 0.006, "itl_p99": None, "output_throughput": 1190.0,
         "total_throughput": 9900.0},
        {"name": "chunked-2048", "settings": {}, "skipped": "refused"},
        {"name": "chunked-8192", "ttft_p50": 0.1},
    ],
}


def test_serving_benchmark_reader(tmp_path):
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(PAYLOAD))
    bench = br.read_serving_benchmark(path)
    assert [r["name"] for r in bench.rows] == ["static", "continuous", "chunked-512"]
    assert math.isnan(bench.row("chunked-512")["itl_p99"]) and math.isnan(bench.row("continuous")["ttft_s"][2])
    assert bench.cost_model["c0"] == 0.005 and bench.long_prefill_tokens == 2048 and bench.engine["max_num_seqs"] == 64
    assert bench.why_missing("trace") is None and bench.why_missing("continuous") is None
    assert "skipped by the benchmark: refused" in bench.why_missing("chunked-2048")
    assert "malformed" in bench.why_missing("chunked-8192") and "ttft_p99" in bench.why_missing("chunked-8192")
    assert br.read_serving_benchmark(tmp_path / "none.json") is None
    assert missing_gpu_note(None) == NO_GPU and missing_gpu_note(bench, "continuous") is None


def test_cost_model_for_a_benchmark():
    assert cost_model_for(None) == (DEFAULT_COST_MODEL, "the default (no GPU fit here)")
    model, source = cost_model_for(br.serving_benchmark(PAYLOAD))
    assert model == StepCostModel.from_json(PAYLOAD["cost_model"]) and "NVIDIA H200" in source
    bad = dict(PAYLOAD, cost_model={**PAYLOAD["cost_model"], "c_prefill_attn": -3e-9})
    model, source = cost_model_for(br.serving_benchmark(bad))
    assert model == DEFAULT_COST_MODEL and "c_prefill_attn = -3e-09" in source
    assert cost_model_for(br.serving_benchmark({"rows": []}))[0] == DEFAULT_COST_MODEL


def test_serving_benchmark_reader_degrades_part_by_part():
    bench = br.serving_benchmark({"rows": "oops", "trace": {"requests": 3}, "cost_model": {"c0": "fast"}}, "x.json")
    assert bench.rows == () and bench.trace is None and bench.cost_model is None
    for part, words in (("rows", "not a list"), ("trace", "malformed"), ("cost_model", "malformed")):
        assert words in bench.why_missing(part)
    assert "not in the file" in br.serving_benchmark({}).why_missing("cost_model")
    bad_quantiles = dict(PAYLOAD["rows"][1], itl_quantiles_s=[0.1, 0.2])
    assert "101" in br.serving_benchmark({"rows": [bad_quantiles]}).why_missing("continuous")
    with pytest.raises(TypeError):
        br.serving_benchmark([])


def test_latency_curves_from_the_benchmark_and_from_runs():
    curve = latency_curve("x", [1.0, 2.0, 3.0, None], [0.1] * 99 + [0.5])
    assert curve.ttft[curve.ttft_percents.index(50)] == pytest.approx(2.0)
    assert curve.itl[curve.itl_percents.index(99.9)] == pytest.approx(np.percentile([0.1] * 99 + [0.5], 99.9))
    curves = latency_curves(br.serving_benchmark(PAYLOAD))
    assert [c.name for c in curves] == ["static", "continuous"] and all(c.source == "GPU" for c in curves)
    assert curves[1].itl_percents == tuple(range(1, 100))
    assert curves[1].itl[98] == pytest.approx(PAYLOAD["rows"][1]["itl_quantiles_s"][99])
    run = hand_run()
    (replayed,) = latency_curves({"hand": run})
    assert replayed.source == "replay" and replayed.ttft[replayed.ttft_percents.index(50)] == pytest.approx(2.5)


def test_tradeoff_points():
    points = tradeoff_points(br.serving_benchmark(PAYLOAD))
    assert [(p.name, p.budget) for p in points] == [("continuous", None), ("chunked-512", 512)]
    assert points[1].throughput == 9900.0 and math.isnan(points[1].itl_p99) and math.isnan(points[1].itl_max)
    assert points[0].itl_max == pytest.approx(0.7)
    trace = poisson_trace(30, 30.0, seed=0, mix=SMALL)
    runs = serving_replay(trace, COST, experiment_configs(2048, (64,), fairness=None), num_blocks=800, max_num_seqs=8,
                          context=2048)
    points = tradeoff_points(runs, capacities={"continuous": 123.0})
    assert [(p.name, p.budget, p.source) for p in points] == [("continuous", None, "replay"),
                                                              ("chunked-64", 64, "replay")]
    assert points[0].throughput == 123.0
    assert points[1].throughput == pytest.approx(runs["chunked-64"].summary().total_throughput)
    assert points[1].itl_max == max(g for t in runs["chunked-64"].timings for g in t.itls)
    fair = serving_replay(trace, COST, experiment_configs(2048, (64,))[-1:], num_blocks=800, max_num_seqs=8,
                          context=2048)
    assert tradeoff_points(fair) == []                    # the fairness run is not a point of the sweep


# -- figures --------------------------------------------------------------------------------------------
def test_figures_draw(chunked_run):
    _, run = chunked_run
    figs = [draw_gantt(run, "title"), compare_gantts({"a": run, "b": run}),
            draw_gantt(hand_run(), x_unit="s", window=(1, 5), cursor=(2, 3)),
            draw_schedule_frame(schedule_frames(run)[5]), draw_schedule_frame(schedule_frames(hand_run())[0]),
            plot_latency_cdfs(latency_curves(br.serving_benchmark(PAYLOAD)) + latency_curves({"hand": hand_run()})),
            plot_budget_tradeoff(tradeoff_points(br.serving_benchmark(PAYLOAD))
                                 + tradeoff_points({"hand": hand_run()})),
            plot_token_gaps({"hand": hand_run()}, window=(0, 6))]
    assert all(isinstance(f, Figure) for f in figs)


def test_stepper_widget(chunked_run):
    ipywidgets = pytest.importorskip("ipywidgets")
    _, run = chunked_run
    box = schedule_stepper(run, title="steps")
    assert isinstance(box, ipywidgets.VBox)
    slider = box.children[1].children[1]
    assert slider.max == len(run.steps) - 1
    slider.value = 4                         # the callback redraws frame 4, and nothing else
