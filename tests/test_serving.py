"""Chapter 8's serving experiment: the Poisson trace, TTFT/ITL metrics, the step-cost model,
the virtual-time replay on today's scheduler, a real-time replay on the tiny engine, and
benchmarks/bench_serving.py's CPU mode."""
import functools
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import kvlab  # noqa: F401  (profile first)
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence
from kvlab.paging import BlockPool
from kvlab.workloads.replay import replay_realtime, scheduler_factory_like, simulate
from kvlab.workloads.serving import (LengthMix, RequestTiming, ServingRequest, StepCostModel, StepFeatures,
                                     StepRecord, poisson_trace, summarize)
from helpers import one_thread  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
SMALL = LengthMix().scaled(1 / 16)              # chats of 3-62 tokens, long prompts of 512-1024
COST = StepCostModel(c0=0.01, c_prefill=2e-5, c_decode=1e-4, c_kv=1e-7)


# -- the trace ------------------------------------------------------------------------------------
def test_trace_is_deterministic_for_a_seed():
    assert poisson_trace(50, 2.0, seed=3) == poisson_trace(50, 2.0, seed=3)
    assert poisson_trace(50, 2.0, seed=3) != poisson_trace(50, 2.0, seed=4)


def test_trace_rate_and_mix():
    trace = poisson_trace(4000, 5.0, seed=0)
    arrivals = np.array([r.arrival_time for r in trace])
    assert (np.diff(arrivals) > 0).all() and arrivals[0] > 0
    assert np.mean(np.diff(arrivals)) == pytest.approx(1 / 5.0, rel=0.05)
    assert len(trace) / arrivals[-1] == pytest.approx(5.0, rel=0.05)
    mix = LengthMix()
    long = [r for r in trace if r.prompt_len >= mix.long_prompt[0]]
    short = [r for r in trace if r.prompt_len < mix.long_prompt[0]]
    assert len(long) / len(trace) == pytest.approx(0.10, abs=0.02)
    assert all(mix.long_prompt[0] <= r.prompt_len <= mix.long_prompt[1] for r in long)
    assert all(mix.short_prompt[0] <= r.prompt_len <= mix.short_prompt[1] for r in short)
    assert all(50 <= r.output_len <= 400 for r in trace)
    # log-uniform: the median chat prompt is near the geometric mean of its bounds (~224)
    assert 170 < np.median([r.prompt_len for r in short]) < 300
    assert [r.request_id for r in trace[:3]] == ["r0", "r1", "r2"]


def test_mix_scaling_and_checks():
    assert SMALL.short_prompt == (3, 62) and SMALL.long_prompt == (512, 1024) and SMALL.short_output == (3, 25)
    assert SMALL.long_share == 0.10 and SMALL.max_tokens == 1024 + 25
    assert LengthMix(long_share=0.0).scaled(1e-6).short_prompt == (1, 1)
    assert not any(r.prompt_len > 1000 for r in poisson_trace(200, 1.0, mix=LengthMix(long_share=0.0)))
    with pytest.raises(ValueError, match="long_share"):
        LengthMix(long_share=1.5)
    with pytest.raises(ValueError, match="short_prompt"):
        LengthMix(short_prompt=(100, 10))
    with pytest.raises(ValueError, match="rate"):
        poisson_trace(5, 0.0)
    with pytest.raises(ValueError, match="num_requests"):
        poisson_trace(-1, 1.0)


def test_long_answers_form_a_tail_and_leave_other_traces_alone():
    plain = poisson_trace(300, 5.0, seed=4)
    assert poisson_trace(300, 5.0, seed=4, mix=LengthMix(long_answer_share=0.0)) == plain
    mix = LengthMix(short_output=(16, 256), long_answer_share=0.2)
    trace = poisson_trace(300, 5.0, seed=4, mix=mix)
    long = [r for r in trace if r.output_len >= 1024]
    assert 0.12 < len(long) / len(trace) < 0.28 and all(r.output_len <= 2048 for r in long)
    assert [r.prompt_len for r in trace] == [r.prompt_len for r in plain]     # prompts drawn as before
    assert mix.max_tokens == 16384 + 2048 and mix.scaled(1 / 16).long_answer == (64, 128)
    with pytest.raises(ValueError, match="long_answer_share"):
        LengthMix(long_answer_share=-0.1)



# -- metrics -----------------------------------------------------------------------------------------
def record(decode, prefill, threshold=100):
    return StepRecord(0.0, 0.1, prefill, decode, 1, 0, 0, bool(decode and prefill > threshold))


def test_summarize_against_hand_computed_values():
    a = RequestTiming("a", 0.0, 10, [1.0, 1.5, 2.5], finish=2.5)
    b = RequestTiming("b", 0.5, 20, [0.75, 1.0], finish=1.0)
    c = RequestTiming("c", 0.2, 99, [], finish=0.2, error="refused")
    assert a.ttft == 1.0 and a.first_token == 1.0 and a.itls == [0.5, 1.0] and c.ttft is None and c.failed
    steps = [record(1, 500), record(2, 0), record(0, 500), record(1, 50)]
    s = summarize([a, b, c], 2.5, steps)
    assert (s.num_requests, s.num_finished, s.num_failed) == (3, 2, 1)
    # TTFTs [1.0, 0.25]; numpy's linear percentile: p at rank (n - 1) * p / 100
    assert s.ttft_p50 == pytest.approx(0.625) and s.ttft_p99 == pytest.approx(0.25 + 0.99 * 0.75)
    # ITLs pooled: [0.25, 0.5, 1.0] -> p50 0.5, p99 at rank 1.98
    assert s.itl_p50 == pytest.approx(0.5) and s.itl_p99 == pytest.approx(0.5 + 0.98 * 0.5)
    assert (s.output_tokens, s.total_tokens) == (5, 35)
    assert s.output_throughput == pytest.approx(2.0) and s.total_throughput == pytest.approx(14.0)
    assert s.decode_behind_long_prefill == pytest.approx(1 / 3)     # of the 3 steps that decode
    assert summarize([a, b, c], 2.5).decode_behind_long_prefill is None


def test_summarize_with_nothing_to_measure():
    s = summarize([RequestTiming("x", 0.0, 5, [], error="refused")], 0.0)
    assert math.isnan(s.ttft_p50) and math.isnan(s.itl_p99) and s.num_failed == 1
    d = s.as_dict()
    assert d["ttft_p50"] is None and d["output_throughput"] is None
    json.dumps(d, allow_nan=False)


# -- the step-cost model ------------------------------------------------------------------------------
def synthetic_samples(model, n=300, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        prefill = int(rng.integers(0, 4096)) * int(rng.random() < 0.4)
        f = StepFeatures(prefill, int(rng.integers(1, 64)), int(rng.integers(0, 200_000)),
                         prefill * prefill // 2 + int(rng.integers(0, 10_000)) * prefill)
        samples.append((f, model.predict(f) * (1 + noise * rng.standard_normal())))
    return samples


def test_cost_model_fit_recovers_known_coefficients():
    true = StepCostModel(c0=0.008, c_prefill=6e-5, c_decode=2e-4, c_kv=3e-8, c_prefill_attn=4e-10)
    for relative in (True, False):
        fit = StepCostModel.fit(synthetic_samples(true), relative=relative)
        for name, value in true.to_json().items():
            assert getattr(fit, name) == pytest.approx(value, rel=1e-6), name
    noisy = StepCostModel.fit(synthetic_samples(true, noise=0.01, seed=1))
    assert noisy.c0 == pytest.approx(true.c0, rel=0.05) and noisy.c_prefill == pytest.approx(true.c_prefill, rel=0.05)
    assert np.median(noisy.relative_errors(synthetic_samples(true, seed=2))) < 0.02
    linear = StepCostModel.fit(synthetic_samples(true), quadratic=False)
    assert linear.c_prefill_attn == 0.0
    with pytest.raises(ValueError):
        StepCostModel.fit([])


def test_cost_model_predict_and_json_round_trip():
    f = StepFeatures(prefill_tokens=100, decode_tokens=4, kv_tokens_read=1000, prefill_attention=5050)
    m = StepCostModel(c0=0.01, c_prefill=1e-4, c_decode=1e-3, c_kv=1e-6, c_prefill_attn=1e-8)
    assert m.predict(f) == pytest.approx(0.01 + 0.01 + 0.004 + 0.001 + 5.05e-5)
    assert StepCostModel(c0=-1.0).predict(f) == 0.0
    assert StepCostModel.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert StepCostModel.from_json({"c0": 0.5}) == StepCostModel(c0=0.5)


def test_step_features_of_a_real_schedule():
    sched = Scheduler(BlockPool(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    sched.add(Sequence(0, "a", list(range(10)), params))
    out = sched.schedule()
    assert StepFeatures.from_schedule(out) == StepFeatures(10, 0, 0, 55)
    sched.update(out, [1])
    sched.add(Sequence(1, "b", list(range(6)), params))
    out = sched.schedule()                       # a decodes (11 tokens in cache after), b prefills
    assert StepFeatures.from_schedule(out) == StepFeatures(6, 1, 11, 21)
    rec = StepRecord.from_schedule(out, 1.0, 0.5, long_prefill_threshold=5)
    assert rec.decode_behind_long_prefill and rec.num_seqs == 2 and rec.features == StepFeatures(6, 1, 11, 21)
    assert not StepRecord.from_schedule(out, 1.0, 0.5, long_prefill_threshold=6).decode_behind_long_prefill
    sched.update(out, [1, 1])


# -- the virtual-time replay ----------------------------------------------------------------------------
def check_invariants(trace, result, cost):
    by_id = {r.request_id: r for r in trace}
    assert len(result.timings) == len(trace)
    for t in result.timings:
        r = by_id[t.request_id]
        assert t.finish is not None, t
        if t.failed:                          # refused, or ended when the cache could not hold it
            assert len(t.token_times) < r.output_len and t.error
            continue
        assert len(t.token_times) == r.output_len
        assert t.ttft >= 0 and t.first_token >= r.arrival_time
        assert all(b >= a for a, b in zip(t.token_times, t.token_times[1:]))
        assert t.finish == t.token_times[-1] <= result.duration
    starts = [s.start for s in result.steps]
    assert all(b >= a for a, b in zip(starts, starts[1:]))
    for s, nxt in zip(result.steps, result.steps[1:]):
        assert s.duration == pytest.approx(cost.predict(s.features))
        assert nxt.start >= s.start + s.duration - 1e-12
    summary = result.summary()
    served = [t for t in result.timings if not t.failed]
    assert summary.output_tokens == sum(by_id[t.request_id].output_len for t in served)
    assert summary.num_finished + summary.num_failed == len(trace)
    return summary


def test_simulate_serves_every_request_with_today_scheduler():
    trace = poisson_trace(60, 20.0, seed=1, mix=SMALL)
    make = functools.partial(Scheduler, max_num_seqs=8, max_num_batched_tokens=2048)
    for static in (False, True):
        result = simulate(trace, make, COST, num_blocks=1000, block_size=16, static=static)
        summary = check_invariants(trace, result, COST)
        assert summary.num_failed == 0 and summary.output_tokens == sum(r.output_len for r in trace)
        assert summary.decode_behind_long_prefill == 0.0      # threshold 2048 > any prompt here
        assert all(s.num_seqs <= 8 and s.prefill_tokens + s.decode_tokens <= 2048 for s in result.steps)
    # static batching waits for whole batches: its median TTFT is worse than continuous batching's
    cont = simulate(trace, make, COST, num_blocks=1000).summary()
    stat = simulate(trace, make, COST, num_blocks=1000, static=True).summary()
    assert stat.ttft_p50 > cont.ttft_p50


def test_simulate_counts_refused_requests_as_failed():
    trace = poisson_trace(60, 20.0, seed=1, mix=SMALL)
    make = functools.partial(Scheduler, max_num_seqs=8, max_num_batched_tokens=2048)
    result = simulate(trace, make, COST, num_blocks=30, block_size=16)     # 480 tokens: no long prompt fits
    summary = check_invariants(trace, result, COST)
    too_long = {r.request_id for r in trace if r.prompt_len > 480}
    assert too_long and {t.request_id for t in result.timings if t.failed} == too_long
    assert "KV cache is too small" in next(t.error for t in result.timings if t.failed)
    assert summary.num_failed == len(too_long)


def test_simulate_with_prompts_over_the_token_budget():
    """Today's scheduler refuses a prompt longer than max_num_batched_tokens (no chunking): it
    fails; a chunking scheduler serves it. Either way every request ends and is counted."""
    trace = poisson_trace(60, 20.0, seed=1, mix=SMALL)
    result = simulate(trace, functools.partial(Scheduler, max_num_seqs=8, max_num_batched_tokens=256), COST,
                      num_blocks=1000, long_prefill_threshold=64)
    summary = check_invariants(trace, result, COST)
    too_long = {r.request_id for r in trace if r.prompt_len > 256}
    failed = {t.request_id for t in result.timings if t.failed}
    assert too_long and failed in (set(), too_long)
    if failed:
        assert all("max_num_batched_tokens" in t.error for t in result.timings if t.failed)
    assert summary.num_failed == len(failed)
    assert all(s.prefill_tokens + s.decode_tokens <= 256 for s in result.steps)


def test_simulate_with_preemption_and_idle_gaps():
    trace = poisson_trace(40, 50.0, seed=2, mix=LengthMix(long_share=0.0).scaled(1 / 8))
    longest = max(r.prompt_len + r.output_len for r in trace)
    result = simulate(trace, functools.partial(Scheduler, max_num_seqs=8, max_num_batched_tokens=256), COST,
                      num_blocks=-(-longest // 4) + 2, block_size=4)
    assert result.num_preemptions > 0
    assert check_invariants(trace, result, COST).num_failed == 0
    # a cache smaller than one request's prompt + output: those requests fail part-way
    small = simulate(trace, functools.partial(Scheduler, max_num_seqs=8, max_num_batched_tokens=256), COST,
                     num_blocks=24, block_size=4)
    assert 0 < check_invariants(trace, small, COST).num_failed < len(trace)
    # sparse arrivals: the clock jumps to each arrival, so a lone request's TTFT is one step
    sparse = [ServingRequest("a", 1.0, 4, 3), ServingRequest("b", 5.0, 4, 2)]
    result = simulate(sparse, functools.partial(Scheduler, max_num_seqs=2, max_num_batched_tokens=16),
                      StepCostModel(c0=0.1), num_blocks=8, block_size=4)
    a, b = result.timings
    assert a.token_times == pytest.approx([1.1, 1.2, 1.3]) and b.token_times == pytest.approx([5.1, 5.2])
    assert result.steps[0].start == 1.0 and result.duration == pytest.approx(5.2)


def test_scheduler_factory_like_copies_the_settings():
    original = Scheduler(BlockPool(8, 4), max_num_seqs=3, max_num_batched_tokens=40, max_model_len=30,
                         eos_token_ids=[7])
    copy = scheduler_factory_like(original)(BlockPool(16, 4))
    assert (copy.max_num_seqs, copy.max_num_batched_tokens, copy.max_model_len, copy.eos_token_ids) == \
        (3, 40, 30, frozenset([7]))
    assert copy.pool.num_blocks == 16


# -- the real engine ---------------------------------------------------------------------------------------
def test_replay_realtime_on_the_tiny_engine(one_thread):
    from kvlab import LLM

    llm = LLM(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128)
    trace = [ServingRequest("a", 0.0, 12, 4), ServingRequest("b", 0.01, 20, 3),
             ServingRequest("big", 0.02, 200, 2), ServingRequest("c", 0.03, 5, 3)]
    result = replay_realtime(llm, trace, seed=1)
    by_id = {t.request_id: t for t in result.timings}
    assert by_id["big"].failed and "context" in by_id["big"].error          # 200 tokens >= max_model_len
    for r in trace:
        t = by_id[r.request_id]
        if r.request_id != "big":
            assert len(t.token_times) == r.output_len and t.ttft > 0 and not t.failed
            assert all(b >= a for a, b in zip(t.token_times, t.token_times[1:])) and t.finish == t.token_times[-1]
    assert result.summary().output_tokens == 10 and not llm.has_unfinished_requests()
    samples = result.cost_samples()
    assert len(samples) == len(result.steps) > 0 and all(sec > 0 for _, sec in samples)
    assert sum(f.prefill_tokens for f, _ in samples) >= 12 + 20 + 5
    static = replay_realtime(llm, trace[:2], seed=1, static=True)
    assert static.summary().num_finished == 2


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_serving_tiny_mode(tmp_path, one_thread):
    bench = load_bench()
    payload = bench.main(["--tiny", "--requests", "4", "--capacity-requests", "4", "--scale", str(1 / 64),
                          "--budgets", "32", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serving.json").read_text())
    assert saved["trace"]["requests"] == 4 and saved["cost_model"] is not None
    rows = {r["name"]: r for r in saved["rows"]}
    assert set(rows) == {"static", "continuous", "chunked-32", "chunked-32-fair"}
    assert payload["rows"][0]["name"] == "static"
    for name in ("static", "continuous"):
        assert rows[name]["num_requests"] == 4 and rows[name]["num_failed"] == 0
        assert rows[name]["simulated"]["num_requests"] == 4 and len(rows[name]["itl_quantiles_s"]) == 101
    chunked = rows["chunked-32"]
    assert "skipped" in chunked or chunked["num_failed"] == 0


def test_bench_serving_capacity_on_the_traces_own_requests(tmp_path, monkeypatch):
    """--capacity-requests 0: the capacity burst is the trace's own requests; --no-static-capacity
    measures static batching's no more. (Capacities and rows stubbed: no model runs here.)"""
    bench = load_bench()
    bursts = []
    monkeypatch.setattr(bench, "measure_capacity", lambda model, tok, base, settings, requests:
                        bursts.append((settings, requests)) or 2.0)
    monkeypatch.setattr(bench, "run_config", lambda model, tok, base, cfg, trace, args:
                        ({"name": cfg["name"], "skipped": "stubbed"}, None, None))
    payload = bench.main(["--tiny", "--requests", "5", "--capacity-requests", "0", "--no-static-capacity",
                          "--load", "0.5", "--out", str(tmp_path)])
    mix = LengthMix(**{k: tuple(v) if isinstance(v, list) else v for k, v in payload["trace"]["mix"].items()})
    warm_up, (settings, measured) = bursts
    assert len(warm_up[1]) == 8 and settings == bench.configs(2048, [32])[1]["settings"]
    own = poisson_trace(5, 1.0, 0, mix)
    assert [(r.prompt_len, r.output_len, r.arrival_time) for r in measured] == \
        [(r.prompt_len, r.output_len, 0.0) for r in own]
    assert payload["trace"]["rate_req_s"] == 1.0 and payload["trace"]["static_capacity_req_s"] is None


def test_bench_model_builder_on_the_cpu(one_thread):
    from kvlab import LLM

    bench = load_bench()
    model = bench.build_model(1, "cpu", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256)
    assert model.dtype == torch.bfloat16 and model.config.max_position_embeddings == 256
    llm = LLM(model, max_num_seqs=2)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    runs = bench.configs(256, [32])
    assert runs[0]["settings"]["scheduling_policy"] == "static" and runs[-1]["name"] == "chunked-32-fair"
