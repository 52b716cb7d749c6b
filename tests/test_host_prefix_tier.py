"""Chapter 9's host tier for the prefix cache: blocks the device cache evicts are kept on the
host (LRU, bounded) and brought back on a hit, byte for byte; nothing leaks across the tiers."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvlab  # noqa: F401  (profile first)
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.offload import HostBlockAllocator, HostKVCache, HostPrefixCache, PreemptionCosts
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence
from kvlab.paging import BlockPool
from kvlab.paging.kv_cache import allocate_kv_cache
from kvlab.paging.prefix_hash import hash_blocks
from test_engine import BLOCK, checkpoint  # noqa: F401  (checkpoint: a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# -- the tier alone ----------------------------------------------------------------------------
def test_the_tier_is_lru_and_bounded():
    tier = HostPrefixCache([10, 11, 12])
    for block, h in enumerate([b"a", b"b", b"c"]):
        tier.save(block, h)
    tier.save(7, b"a")                       # already there: used again, no copy
    tier.save(3, b"d")                       # full: "b", the least recently used, goes
    assert tier.lookup(b"b") is None and [tier.lookup(h) for h in (b"a", b"c", b"d")] == [10, 12, 11]
    assert tier.take([b"c"]) == [12] and len(tier) == 2
    tier.restore([12], [5])
    saves, loads = tier.take_transfers()
    assert saves == [(0, 10), (1, 11), (2, 12), (3, 11)] and loads == [(12, 5)]
    tier.save(4, b"e")                       # 12 is read this step: "a" makes room instead
    assert tier.lookup(b"a") is None and tier.lookup(b"e") == 10
    tier.next_step()
    assert sorted(tier.free) == [12] and tier.num_saved == 5 and tier.num_restored == 1


def test_refused_takes_and_restores_change_nothing():
    tier = HostPrefixCache([6, 7])
    tier.save(3, b"a")
    tier.save(4, b"b")
    for bad in ([b"b", b"zz"], [b"a", b"a"]):
        with pytest.raises(ValueError, match="block_hashes"):
            tier.take(bad)
        assert dict(tier.entries) == {b"a": 6, b"b": 7} and tier.reading == []
    with pytest.raises(ValueError, match="pair up"):
        tier.restore(tier.take([b"a"]), [0, 1])
    assert tier.take_transfers()[1] == [] and tier.num_restored == 0


def test_a_pool_without_caching_takes_no_tier():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        BlockPool(4, 4).attach_host_tier(HostPrefixCache([0]))


@pytest.mark.parametrize("bad, error", [([1, 1], ValueError), ([-1], ValueError), ([0.5], TypeError)])
def test_a_tier_owns_distinct_host_blocks(bad, error):
    with pytest.raises(error, match="host block"):
        HostPrefixCache(bad)


@pytest.mark.parametrize("bad", [None, object(), HostBlockAllocator(4)])
def test_a_pool_takes_only_a_tier(bad):
    pool = BlockPool(4, 2, enable_prefix_caching=True)
    with pytest.raises(TypeError, match="HostPrefixCache"):
        pool.attach_host_tier(bad)
    assert pool.host_tier is None


@pytest.mark.parametrize("bad, error", [([-4], ValueError), ([1, 9], ValueError), ([1.0], TypeError)])
def test_forget_refuses_blocks_the_pool_does_not_have(bad, error):
    pool = BlockPool(4, 2, enable_prefix_caching=True)
    pool.allocate("a", 4, [1, 2, 3, 4])
    pool.free("a")
    cached = dict(pool.cached_blocks)
    with pytest.raises(error, match="block"):
        pool.forget(bad)
    assert pool.cached_blocks == cached


# -- bytes -------------------------------------------------------------------------------------
def test_host_hits_restore_the_same_bytes():
    """A prompt's blocks are evicted by other prompts (saved to the host), the device blocks are
    scribbled over, then the prompt comes again: its hit goes through the host tier and the
    blocks it gets hold exactly the evicted bytes, in every layer."""
    gen = torch.Generator().manual_seed(0)
    cache = allocate_kv_cache(2, 6, 4, 2, 8, dtype=torch.float32, device=kvlab.profile.DEVICE)
    for t in cache.block_tensors():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen))
    host = HostKVCache(cache, num_blocks=4)
    tier = HostPrefixCache(range(4))
    pool = BlockPool(6, block_size=4, enable_prefix_caching=True)
    pool.attach_host_tier(tier)

    def run_transfers():
        saves, loads = tier.take_transfers()
        for device, h in saves:
            host.swap_out([device], [h])
        for h, device in loads:
            host.swap_in([h], [device])
        tier.next_step()
        return saves, loads

    prompt = list(range(1, 14))                             # 3 full blocks and one token
    table = pool.allocate("a", 13, prompt)
    pool.free("a")
    before = [t[:, table[:3]].clone() for t in cache.block_tensors()]
    pool.allocate("b", 24, list(range(100, 124)))            # every block: a's are evicted
    saves, _ = run_transfers()
    assert sorted(d for d, _ in saves) == sorted(table[:3])
    for t in cache.block_tensors():
        t[:, table[:3]] = 0                                  # b's K/V overwrites them
    pool.free("b")
    pool.allocate("c", 13, prompt)
    assert pool.num_cached_tokens["c"] == 12
    _, loads = run_transfers()
    assert len(loads) == 3
    restored = pool.block_table("c")[:3]
    for t, old in zip(cache.block_tensors(), before):
        assert torch.equal(t[:, restored].view(torch.uint8), old.view(torch.uint8))


# -- the engine --------------------------------------------------------------------------------
def test_a_shared_prefix_survives_gpu_memory_pressure(checkpoint):
    """A long shared prefix is served, other prompts evict it from the device, then it comes
    again: the hit is brought back from the host, and the tokens are what a plain engine makes."""
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(1, 280, (5 * BLOCK,), generator=gen).tolist()
    first, again = prefix + [7, 8, 9], prefix + [11, 12]
    others = [torch.randint(1, 280, (5 * BLOCK + 3,), generator=gen).tolist() for _ in range(2)]
    plain = LLM(checkpoint, block_size=BLOCK)
    bytes_per_block = plain.model_runner.kv_cache.nbytes // plain.model_runner.num_blocks
    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=8, enable_prefix_caching=True,
              swap_space=64 * bytes_per_block / 2**30)
    assert llm.scheduler.host_prefix_cache is not None
    outputs = []
    for prompt in (first, *others, again):
        want = plain.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0]
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        outputs.append(got)
    s = llm.scheduler
    assert s.num_host_prefix_saved >= 5 and s.num_host_prefix_hits == 5
    assert outputs[-1].num_cached_tokens == 5 * BLOCK
    assert llm.pool.num_free_blocks == llm.pool.num_blocks and not llm.pool.block_tables
    s.schedule()
    assert s.host_blocks.num_free_blocks == s.host_blocks.num_blocks


def test_no_prefix_tier_without_prefix_caching(checkpoint):
    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=8, swap_space=0.001)
    assert llm.scheduler.host_prefix_cache is None and llm.pool.host_tier is None


# -- no leaks, and the right K/V, across both tiers -------------------------------------------
def check_pool(pool):
    held = {b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0}
    free, evictable = set(pool.free_blocks), set(pool.evictable)
    assert len(pool.free_blocks) == len(free) and not (held & free or held & evictable or free & evictable)
    assert held | free | evictable == set(range(pool.num_blocks))
    counts = [0] * pool.num_blocks
    for table in pool.block_tables.values():
        for b in table:
            counts[b] += 1
    assert counts == pool.ref_counts
    assert all(pool.block_hashes[b] == h for h, b in pool.cached_blocks.items())


def check_tier(tier):
    entries, free, reading = list(tier.entries.values()), list(tier.free), list(tier.reading)
    everything = entries + free + reading
    assert sorted(everything) == sorted(tier.host_blocks)      # each host block in one place


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["swap", "auto", "recompute"]), st.integers(0, 6))
def test_no_block_leaks_and_hits_hold_their_kv(seed, mode, tier_blocks):
    """Random prompts with shared prefixes through a small pool, swap space and prefix tier. A
    model of the cache's contents follows every step's copies (swap-outs, then swap-ins, then
    the forward): each block the prefix cache names holds the K/V of its hash, each host entry
    too; device and host blocks are each in one place; at the end only the caches keep any."""
    rng = random.Random(seed)
    pool = BlockPool(10, block_size=4, enable_prefix_caching=True)
    host = HostBlockAllocator(8)
    tier = HostPrefixCache(range(8, 8 + tier_blocks))
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16, host_blocks=host, preemption_mode=mode,
                      preemption_costs=PreemptionCosts(1e9, 1e-6, 1e-5), bytes_per_token=1000,
                      host_prefix_cache=tier)
    shared = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 9]))] for _ in range(2)]
    for i in range(10):
        prompt = (rng.choice(shared) if rng.random() < 0.7 else []) + \
            [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))]
        sched.add(Sequence(i, str(i), prompt, SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=True)))
    device, on_host = {}, {}          # what each block holds: (sequence, block index) as written

    def kv(label):
        """The hash naming the K/V a block holds (its label while the block is not full)."""
        if label is None:
            return None
        seq, i = label
        tokens = seq.token_ids[:(i + 1) * 4]
        return hash_blocks(tokens, 4, seq.cache_salt)[i] if len(tokens) == (i + 1) * 4 else label

    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_pool(pool)
        check_tier(tier)
        assert sum(len(s.host_blocks) for s in sched.swapped) + len(sched._host_to_free) + \
            host.num_free_blocks == host.num_blocks
        assert all(h < 8 for s in sched.swapped for h in s.host_blocks)
        for d, h in out.blocks_to_swap_out:      # the runner's order: out, in, the forward
            on_host[h] = device.get(d)
        for h, d in out.blocks_to_swap_in:
            device[d] = on_host.get(h)
        for h, d in out.prefix_blocks_restored:
            assert kv(device[d]) == pool.block_hashes[d]
        for block_hash, h in tier.entries.items():
            assert kv(on_host[h]) == block_hash
        for item in out.scheduled:
            table = pool.block_table(item.seq.seq_id)
            for i in range(item.start // 4, -(-item.seq_len // 4)):
                device[table[i]] = (item.seq, i)
        if out.scheduled:
            sched.update(out, [rng.randrange(1, 50) for _ in out.sample_seqs])
        for block_hash, b in pool.cached_blocks.items():
            assert kv(device[b]) == block_hash
    assert not sched.has_unfinished()
    sched.schedule()
    check_pool(pool)
    check_tier(tier)
    assert pool.num_free_blocks == pool.num_blocks and host.num_free_blocks == host.num_blocks
    assert len(tier.free) + len(tier) == tier_blocks
