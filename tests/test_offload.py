"""Chapter 9's second tier: the swap-or-recompute cost model, host blocks, the byte-exact
round trip of blocks through host memory, and the engine preempting by swapping."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvlab  # noqa: F401  (profile first)
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.offload import (HostBlockAllocator, HostKVCache, PreemptionCosts, crossover_tokens,
                                  preemption_mode, recompute_seconds, swap_seconds)
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence, SequenceStatus
from kvlab.paging import BlockPool
from kvlab.paging.kv_cache import allocate_kv_cache
from test_engine import BLOCK, checkpoint, ragged_prompts  # noqa: F401  (checkpoint: a fixture)

COSTS = PreemptionCosts(bandwidth=50e9, latency=50e-6, prefill_per_token=30e-6, prefill_per_token_sq=1e-9)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# -- the cost model --------------------------------------------------------------------------------
def test_swap_and_recompute_costs():
    assert swap_seconds(1000, 1000, COSTS) == pytest.approx(2 * (50e-6 + 1e6 / 50e9))
    assert recompute_seconds(1000, COSTS) == pytest.approx(1000 * 30e-6 + 1e6 * 1e-9)


def test_the_crossover_is_where_swapping_gets_cheaper():
    n = crossover_tokens(128 * 1024, COSTS)
    assert n is not None and n > 1
    for tokens in (n - 1, n):
        swap = swap_seconds(tokens, 128 * 1024, COSTS) < recompute_seconds(tokens, COSTS)
        assert swap == (tokens >= n)
        assert preemption_mode(tokens, 128 * 1024, COSTS, 1 << 40) == ("swap" if tokens >= n else "recompute")
    # a transfer that costs more per token than a prefill never pays
    assert crossover_tokens(10**9, PreemptionCosts(bandwidth=1e9, latency=1.0, prefill_per_token=1e-6)) is None


def test_no_room_on_the_host_means_recompute():
    assert preemption_mode(10_000, 1000, COSTS, host_free_bytes=10_000 * 1000) == "swap"
    assert preemption_mode(10_000, 1000, COSTS, host_free_bytes=10_000 * 1000 - 1) == "recompute"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_preemption_mode_refuses_bad_counts(bad):
    with pytest.raises((ValueError, TypeError), match="num_tokens"):
        preemption_mode(bad, 1000, COSTS, 1 << 30)


# -- host blocks -----------------------------------------------------------------------------------
def test_host_blocks_come_in_runs_and_merge_back():
    host = HostBlockAllocator(10)
    a, b, c = host.allocate(3), host.allocate(4), host.allocate(3)
    assert (a, b, c) == ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9]) and host.num_free_blocks == 0
    host.free(a)
    host.free(c)
    with pytest.raises(ValueError, match="no run of 4"):
        host.allocate(4)                    # 6 free, but in two runs of 3
    assert host.num_free_blocks == 6        # a refused request changes nothing
    host.free(b)
    assert host.runs == {0: 10}
    with pytest.raises(ValueError, match="not allocated"):
        host.free([3])


@pytest.mark.parametrize("bad, message", [([0, 1, 12], "not allocated"), ([2, 0, 2], "named twice"),
                                          ([1, 5], "not allocated"), ([0.5], "host block"), (["0"], "host block")])
def test_a_refused_free_gives_nothing_back(bad, message):
    host = HostBlockAllocator(12)
    host.allocate(4)
    runs = dict(host.runs)
    with pytest.raises((ValueError, TypeError), match=message):
        host.free(bad)
    assert host.runs == runs and host.num_free_blocks == 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=40))
def test_host_blocks_never_leak(ops):
    host, held = HostBlockAllocator(24), []
    for take, count in ops:
        if take and count <= host.largest_run():
            held.append(host.allocate(count))
        elif held:
            host.free(held.pop(random.Random(count).randrange(len(held))))
        assert host.num_free_blocks + sum(map(len, held)) == 24
        assert len({b for run in held for b in run}) == sum(map(len, held))
    for run in held:
        host.free(run)
    assert host.runs == {0: 24}


# -- bytes through host memory ---------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_blocks_come_back_byte_for_byte(kv_cache_dtype):
    """Swap random blocks out, poison them, swap them back into other blocks: the same bytes,
    values and scales, in every layer; no other block touched."""
    gen = torch.Generator().manual_seed(0)
    cache = allocate_kv_cache(3, 12, 4, 2, 8, dtype=torch.float32, device=kvlab.profile.DEVICE,
                              kv_cache_dtype=kv_cache_dtype)
    for t in cache.block_tensors():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen))
    before = [t.clone() for t in cache.block_tensors()]
    host = HostKVCache(cache, num_blocks=6)
    assert host.bytes_per_block * 4 == 4 * sum(t[0, 0].numel() * t.element_size() * 3 for t in cache.block_tensors())
    host.swap_out([7, 2, 9], [1, 2, 3])
    for t in cache.block_tensors():
        t[:, [7, 2, 9]] = t[:, [0]]                         # the blocks are reused meanwhile
    host.swap_in([1, 2, 3], [4, 11, 5])
    for t, old in zip(cache.block_tensors(), before):
        t, old = t.view(torch.uint8), old.view(torch.uint8)       # bytes: random bits include NaNs
        assert torch.equal(t[:, [4, 11, 5]], old[:, [7, 2, 9]])
        untouched = [b for b in range(12) if b not in (7, 2, 9, 4, 11, 5)]
        assert torch.equal(t[:, untouched], old[:, untouched])


def test_a_transfer_needs_one_host_run():
    cache = allocate_kv_cache(1, 4, 4, 1, 8, dtype=torch.float32, device=kvlab.profile.DEVICE)
    with pytest.raises(ValueError, match="consecutive run"):
        HostKVCache(cache, 4).swap_out([0, 1], [0, 2])


@pytest.mark.parametrize("direction", ["out", "in"])
@pytest.mark.parametrize("gpu_blocks, host_blocks, error, message", [
    ([0, 4], [0, 1], ValueError, "out of range"),          # the cache has 4 blocks
    ([-1], [0], ValueError, "gpu block"),
    ([1], [0, 1], ValueError, "pair up"),
    ([1, 2], [2, 3, 4], ValueError, "pair up"),
    ([1], [7], ValueError, "out of range"),                # the host has 4 blocks
    ([1, 2], [-2, -1], ValueError, "host block"),
    ([2.7], [0], TypeError, "gpu block"),
])
def test_a_refused_transfer_copies_nothing(direction, gpu_blocks, host_blocks, error, message):
    gen = torch.Generator().manual_seed(1)
    cache = allocate_kv_cache(2, 4, 4, 1, 8, dtype=torch.float32, device=kvlab.profile.DEVICE)
    for t in cache.block_tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    host = HostKVCache(cache, 4)
    host.storage.fill_(7)
    before = [t.clone() for t in cache.block_tensors()] + [host.storage.clone()]
    with pytest.raises(error, match=message):
        if direction == "out":
            host.swap_out(gpu_blocks, host_blocks)
        else:
            host.swap_in(host_blocks, gpu_blocks)
    for t, old in zip(list(cache.block_tensors()) + [host.storage], before):
        assert torch.equal(t, old)


def test_a_swap_in_writes_each_device_block_once():
    cache = allocate_kv_cache(1, 4, 4, 1, 8, dtype=torch.float32, device=kvlab.profile.DEVICE)
    host = HostKVCache(cache, 4)
    host.swap_out([1, 1], [0, 1])                           # one block, kept twice: allowed
    with pytest.raises(ValueError, match="named twice"):
        host.swap_in([0, 1], [2, 2])


# -- the engine ------------------------------------------------------------------------------------
def served(llm, prompts):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_both_tiers_empty(llm):
    assert llm.pool.num_free_blocks == llm.pool.num_blocks and not llm.pool.block_tables
    s = llm.scheduler
    assert not (s.running or s.waiting or s.swapped)
    s.schedule()                            # frees the host blocks the last swap-in read
    assert s.host_blocks.num_free_blocks == s.host_blocks.num_blocks


@pytest.mark.parametrize("case", ["swap", "swap+prefix_caching", "auto", "swap+fp8"])
def test_swapped_sequences_generate_what_they_would_have(checkpoint, case):
    prompts = ragged_prompts(shared_prefix=2 * BLOCK + 3 if "prefix" in case else 0)
    longest = -(-(max(map(len, prompts)) + GREEDY.max_tokens) // BLOCK)
    extra = dict(kv_cache_dtype="fp8") if "fp8" in case else {}
    want = served(LLM(checkpoint, block_size=BLOCK, **extra), prompts)
    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=longest + 1, swap_space=0.001,
              preemption_mode=case.split("+")[0], enable_prefix_caching="prefix" in case, **extra)
    assert served(llm, prompts) == want
    s = llm.scheduler
    assert s.num_preemptions > 0 and (s.num_swapped_out > 0 or case == "auto")
    if case == "swap":
        assert s.num_swapped_out == s.num_preemptions
    assert_both_tiers_empty(llm)


def test_without_swap_space_preemption_recomputes(checkpoint):
    prompts = ragged_prompts()
    longest = -(-(max(map(len, prompts)) + GREEDY.max_tokens) // BLOCK)
    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=longest + 1, preemption_mode="swap")
    served(llm, prompts)
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.num_swapped_out == 0


@pytest.mark.parametrize("setting, value", [("swap_space", -1), ("swap_space", "4"), ("preemption_mode", "spill")])
def test_bad_offload_settings_are_refused(checkpoint, setting, value):
    with pytest.raises(ValueError, match=setting):
        LLM(checkpoint, **{setting: value})


def test_a_swap_out_books_host_blocks_and_frees_the_device_ones():
    """One step that swaps: the output names the sequence and its (device, host) pairs; the
    sequence keeps its progress, and comes back before any new request."""
    pool = BlockPool(4, block_size=4)
    host = HostBlockAllocator(8)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, host_blocks=host, preemption_mode="swap")
    a, b = Sequence(0, "a", list(range(1, 9))), Sequence(1, "b", list(range(1, 9)))
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()                          # both prompts: 2 + 2 blocks
    sched.update(out, [5, 6])
    tables = {s.seq_id: pool.block_table(s.seq_id) for s in (a, b)}
    out = sched.schedule()                          # a needs a third block: b swaps out
    assert out.swapped_out == [b] and out.preempted == [b] and b.status is SequenceStatus.SWAPPED
    assert out.blocks_to_swap_out == list(zip(tables[1], b.host_blocks)) and b.num_computed_tokens == 8
    assert b.seq_id not in pool and host.num_free_blocks == 6
    sched.update(out, [7])
    sched.add(Sequence(2, "c", [1, 2]))
    sched.finish_sequence(a, "stop")
    out = sched.schedule()            # b comes back first (it computes from the next step); then c
    assert out.swapped_in == [b] and [item.seq.seq_id for item in out.scheduled] == [2]
    assert [h for h, _ in out.blocks_to_swap_in] == [0, 1] and b.status is SequenceStatus.RUNNING
    assert sched.running == [b, out.scheduled[0].seq]
    sched.update(out, [3])
    out = sched.schedule()
    assert [item.seq.seq_id for item in out.scheduled] == [1, 2] and out.scheduled[0].start == 8
    assert host.num_free_blocks == 8


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["swap", "auto", "recompute"]), st.booleans())
def test_no_block_leaks_across_both_tiers(seed, mode, caching):
    """Random requests through a small pool and host tier: at every step each device block is
    held or free and each host block belongs to one swapped sequence or is free; at the end,
    everything is free."""
    rng = random.Random(seed)
    pool = BlockPool(10, block_size=4, enable_prefix_caching=caching)
    host = HostBlockAllocator(12)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16, host_blocks=host, preemption_mode=mode,
                      preemption_costs=PreemptionCosts(1e9, 1e-6, 1e-5), bytes_per_token=1000)
    shared = [rng.randrange(1, 50) for _ in range(6)]
    for i in range(8):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
        seq = Sequence(i, str(i), prompt, SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True))
        sched.add(seq)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        booked = sum(len(s.host_blocks) for s in sched.swapped) + len(sched._host_to_free)
        assert booked + host.num_free_blocks == host.num_blocks
        if out.scheduled:
            sched.update(out, [rng.randrange(1, 50) for _ in out.sample_seqs])
    assert not sched.has_unfinished()
    sched.schedule()
    assert pool.num_free_blocks == pool.num_blocks and host.num_free_blocks == host.num_blocks
