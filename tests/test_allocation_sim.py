"""kvlab.workloads.allocation: the trace, the address space, and the simulator's invariants."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.workloads import allocation as sim
from kvlab.workloads.allocation import FREE, HOLE, POLICIES, RESERVED, STORED, ContiguousSpace

MAX_LEN, BUDGET = 1024, 8 * 1024


@pytest.fixture(scope="module")
def trace():
    return sim.make_request_trace(300, max_model_len=MAX_LEN, prompt_mean=100, output_mean=200, max_tokens=512,
                                  seed=3)


@pytest.fixture(scope="module")
def results(trace):
    return sim.compare_policies(trace, BUDGET)


# -- the trace --------------------------------------------------------------------------------
def test_trace_lengths_respect_the_limits(trace):
    assert len(trace) == 300
    assert (trace.prompt_lens >= 1).all() and (trace.output_lens >= 1).all()
    assert (trace.total_lens <= MAX_LEN).all()
    assert (trace.output_lens <= trace.max_tokens).all() and (trace.max_tokens <= 512).all()
    assert (trace.prompt_lens + trace.max_tokens <= MAX_LEN).all()


def test_trace_is_deterministic_and_heavy_tailed():
    a, b = sim.make_request_trace(2000, seed=7), sim.make_request_trace(2000, seed=7)
    assert np.array_equal(a.prompt_lens, b.prompt_lens) and np.array_equal(a.output_lens, b.output_lens)
    assert not np.array_equal(a.prompt_lens, sim.make_request_trace(2000, seed=8).prompt_lens)
    assert np.median(a.prompt_lens) < 0.8 * a.prompt_lens.mean()  # lognormal: median below mean


def test_poisson_arrivals():
    t = sim.make_request_trace(500, arrival_rate=0.5, seed=1)
    assert (np.diff(t.arrivals) >= 0).all()
    assert 800 < t.arrivals[-1] < 1200  # about 500 / 0.5 steps


def test_oracle_max_tokens():
    t = sim.make_request_trace(200, max_tokens=None)
    assert np.array_equal(t.max_tokens, t.output_lens)


@pytest.mark.parametrize("kwargs, word", [
    (dict(num_requests=0), "num_requests"), (dict(max_model_len=1), "max_model_len"),
    (dict(sigma=0), "sigma"), (dict(arrival_rate=-1.0), "arrival_rate"), (dict(max_tokens=0), "max_tokens"),
])
def test_trace_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        sim.make_request_trace(**kwargs)


# -- the address space ------------------------------------------------------------------------
def test_contiguous_space_first_fit_and_merge():
    space = ContiguousSpace(100)
    assert [space.allocate(n) for n in (30, 30, 30)] == [0, 30, 60]
    assert space.allocate(20) is None  # 10 free
    space.free(0, 30)
    space.free(60, 30)
    assert space.holes == [(0, 30), (60, 40)]
    assert space.allocate(35) == 60  # first hole that fits, not the first hole
    space.free(30, 30)
    assert space.holes == [(0, 60), (95, 5)]


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
@settings(max_examples=80, deadline=None)
def test_contiguous_space_matches_a_bitmap(ops):
    space, used, live = ContiguousSpace(200), np.zeros(200, bool), []
    for alloc, n in ops:
        if alloc or not live:
            start = space.allocate(n)
            runs = [i for i in range(201 - n) if not used[i:i + n].any()]
            assert start == (runs[0] if runs else None)
            if start is not None:
                used[start:start + n] = True
                live.append((start, n))
        else:
            start, n = live.pop(len(live) // 2)
            space.free(start, n)
            used[start:start + n] = False
        assert space.free_slots == (~used).sum()
        ends = [s + n for s, n in space.holes]
        assert all(e < s for e, (s, _) in zip(ends, space.holes[1:]))  # sorted, disjoint, merged


# -- the simulator ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_and_every_token_is_decoded_once(trace, results, policy):
    r = results[policy]
    assert r.finished == len(trace)
    assert r.new_tokens.sum() == trace.output_lens.sum()


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_never_exceeds_the_budget(results, policy):
    r = results[policy]
    assert (r.stored <= r.reserved).all()
    assert (r.reserved + r.external <= BUDGET).all()
    assert (r.utilisation <= 1).all()
    s = r.summary()
    assert 0 < s.utilisation <= 1 and s.utilisation + s.internal_frag + s.external_frag <= 1 + 1e-9


def test_contiguous_max_has_only_internal_fragmentation(results):
    r = results["contiguous-max"]
    assert (r.external == 0).all()
    assert r.running.max() == BUDGET // MAX_LEN
    assert (r.reserved == r.running * MAX_LEN).all()


def test_contiguous_request_shows_external_fragmentation(results):
    assert results["contiguous-request"].external.max() > 0


def test_paged_waste_is_under_one_block_per_sequence(results):
    r = results["paged"]
    assert (r.external == 0).all()
    assert (r.internal <= r.running * (r.block_size - 1)).all()


def test_paged_runs_at_least_as_many_requests(results):
    paged, fixed = results["paged"].summary(), results["contiguous-max"].summary()
    assert paged.max_running >= fixed.max_running
    assert paged.mean_running >= fixed.mean_running
    assert paged.utilisation > results["contiguous-request"].summary().utilisation > fixed.utilisation


def test_simulation_is_deterministic(trace, results):
    again = sim.simulate(trace, "paged", BUDGET)
    for field in ("stored", "reserved", "running", "waiting", "new_tokens"):
        assert np.array_equal(getattr(again, field), getattr(results["paged"], field))
    assert again.summary() == results["paged"].summary()


def test_max_num_seqs_caps_concurrency(trace):
    r = sim.simulate(trace, "paged", BUDGET, max_num_seqs=5)
    assert r.running.max() == 5 and r.finished == len(trace)


def test_light_load_finishes_without_waiting():
    t = sim.make_request_trace(100, max_model_len=MAX_LEN, arrival_rate=0.02, seed=4)
    r = sim.simulate(t, "contiguous-max", 64 * MAX_LEN)
    assert r.finished == 100 and r.summary().mean_running > 0
    assert (r.waiting == 0).all()


@given(seed=st.integers(0, 10_000), budget_blocks=st.integers(64, 300), block_size=st.sampled_from([1, 4, 16, 64]))
@settings(max_examples=15, deadline=None)
def test_paged_invariants_on_random_traces(seed, budget_blocks, block_size):
    t = sim.make_request_trace(60, max_model_len=512, prompt_mean=60, output_mean=80, seed=seed)
    budget = max(budget_blocks * block_size, 1024)
    r = sim.simulate(t, "paged", budget, block_size=block_size)
    assert r.finished == 60 and r.new_tokens.sum() == t.output_lens.sum()
    assert (r.reserved <= budget).all()
    assert (r.internal <= r.running * (block_size - 1)).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_map_agrees_with_the_state(trace, policy):
    s = sim.AllocationSimulator(trace, policy, BUDGET)
    for _ in range(150):
        s.step()
    slots = s.memory_map()
    counts = np.bincount(slots, minlength=4)
    stored = sum(s.prompt[r] + s.generated[r] for r in s.running)
    reserved = sum(s.reserved[r] for r in s.running) * s.block_size
    assert counts[STORED] == stored and counts[STORED] + counts[RESERVED] == reserved
    if policy == "paged":
        assert counts[HOLE] == 0
    else:
        assert counts[HOLE] + counts[FREE] == s.space.free_slots


def test_memory_maps_at(trace):
    maps = sim.memory_maps_at(trace, BUDGET, 100)
    assert set(maps) == set(POLICIES) and all(m.shape == (BUDGET,) for m in maps.values())


@pytest.mark.parametrize("kwargs, word", [
    (dict(policy="buddy"), "policy"), (dict(budget_tokens=MAX_LEN - 1), "budget_tokens"),
    (dict(block_size=0), "block_size"), (dict(watermark=1.0), "watermark"),
    (dict(max_num_seqs=0), "max_num_seqs"),
])
def test_simulator_bad_arguments(trace, kwargs, word):
    args = dict(policy="paged", budget_tokens=BUDGET) | kwargs
    with pytest.raises(ValueError, match=word):
        sim.AllocationSimulator(trace, **args)


def test_summary_table_lists_every_policy(results):
    table = sim.summary_table(results)
    assert all(p in table for p in POLICIES)


# -- block size (claim 5) ---------------------------------------------------------------------
def test_last_block_waste():
    assert sim.last_block_waste([1, 16, 17, 0], 16) == 30
    assert sim.last_block_waste([5, 9], 1) == 0
    with pytest.raises(ValueError, match="seq_lens"):
        sim.last_block_waste([-1], 16)


@given(st.lists(st.integers(0, 10_000), max_size=50), st.integers(1, 512))
@settings(max_examples=60, deadline=None)
def test_last_block_waste_formula(lens, block_size):
    want = sum(-(-n // block_size) * block_size - n for n in lens)
    assert sim.last_block_waste(lens, block_size) == want
    assert sim.last_block_waste(lens, block_size) <= len(lens) * (block_size - 1)


def test_block_size_sweep(trace):
    rows = sim.block_size_sweep(trace, BUDGET, block_sizes=(1, 4, 16, 64))
    assert [r.block_size for r in rows] == [1, 4, 16, 64]
    assert rows[0].last_block_waste == 0
    for r in rows:
        assert r.last_block_waste < r.block_size
        assert r.max_table_entries == -(-MAX_LEN // r.block_size)
    entries = [r.table_entries for r in rows]
    assert entries == sorted(entries, reverse=True)
    assert rows[0].waste_frac <= rows[-1].waste_frac
    assert "table width" in sim.sweep_table(rows)


# -- the chapter's figures build from these results -------------------------------------------
def test_figures_build(trace, results):
    from matplotlib.figure import Figure

    from kvlab.viz import memory as vm

    figures = [
        vm.plot_kv_bytes_per_token(), vm.plot_capacity(["llama-3-8b", "llama-3-70b"], "H100-80GB"),
        vm.plot_trace_lengths(trace), vm.plot_memory_over_time(results), vm.plot_policy_summary(results),
        vm.plot_memory_maps(sim.memory_maps_at(trace, BUDGET, 50), step=50),
        vm.plot_block_size_sweep(sim.block_size_sweep(trace, BUDGET, block_sizes=(8, 16))),
    ]
    assert all(isinstance(f, Figure) and f.axes for f in figures)
