"""Allocator traces and their replay; the seed article's cache against the course's write path."""
import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvlab import profile  # noqa: E402
from kvlab.paging import BlockPool, allocate_kv_cache, batch_slot_mapping, blocks_needed  # noqa: E402
from kvlab.paging.seed_cache import SeedPagedAttentionCache, append_tokens_one_by_one  # noqa: E402
from kvlab.reference import gather_kv, write_kv_ref  # noqa: E402
from kvlab.viz.page_map import frame_problems  # noqa: E402
from kvlab.workloads.allocator_trace import (  # noqa: E402
    KINDS,
    AllocatorEvent,
    apply_allocator_event,
    make_allocator_trace,
    replay,
)


def check_invariants(frame, pool_size):
    owners = [b for table in frame.block_tables.values() for b in table]
    assert len(owners) == len(set(owners)), "a block is owned twice"
    assert frame.num_used + len(frame.free_blocks) == pool_size
    assert not set(owners) & set(frame.free_blocks)
    for seq, table in frame.block_tables.items():
        assert len(table) == blocks_needed(frame.seq_lens[seq], frame.block_size)
    assert frame_problems(frame) == []


def test_trace_is_deterministic_and_well_formed():
    trace = make_allocator_trace(num_blocks=24, block_size=4, num_requests=10, seed=0)
    assert trace == make_allocator_trace(num_blocks=24, block_size=4, num_requests=10, seed=0)
    assert trace != make_allocator_trace(num_blocks=24, block_size=4, num_requests=10, seed=1)
    assert 40 <= len(trace) <= 120
    assert {e.kind for e in trace} == set(KINDS)
    assert [e.step for e in trace] == sorted(e.step for e in trace)
    for seq in range(10):
        kinds = [e.kind for e in trace if e.seq_id == seq]
        assert kinds[0] == "arrive" and kinds[-1] == "finish" and set(kinds[1:-1]) <= {"grow"}
        grown = sum(e.num_tokens for e in trace if e.seq_id == seq and e.kind in ("arrive", "grow"))
        assert grown == next(e.num_tokens for e in trace if e.seq_id == seq and e.kind == "finish")


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(4, 40), block_size=st.integers(1, 8), num_requests=st.integers(0, 12),
       seed=st.integers(0, 10**6), tokens_per_step=st.integers(1, 4), max_running=st.none() | st.integers(1, 4))
def test_replay_on_a_fresh_pool_never_fails_and_keeps_invariants(num_blocks, block_size, num_requests, seed,
                                                                 tokens_per_step, max_running):
    longest = num_blocks * block_size
    trace = make_allocator_trace(num_blocks, block_size, num_requests, seed,
                                 prompt_lens=(1, max(1, longest // 3)), output_lens=(0, longest // 2),
                                 tokens_per_step=tokens_per_step, max_running=max_running)
    pool = BlockPool(num_blocks, block_size)
    frames = replay(trace, pool)
    assert len(frames) == len(trace)
    for frame in frames:
        check_invariants(frame, num_blocks)
    assert pool.num_free_blocks == num_blocks and not pool.block_tables


def test_replay_titles_say_what_happened():
    pool = BlockPool(num_blocks=8, block_size=4)
    trace = [AllocatorEvent(0, "arrive", 3, 6), AllocatorEvent(1, "grow", 3, 1),
             AllocatorEvent(2, "grow", 3, 2), AllocatorEvent(3, "finish", 3, 9)]
    titles = [f.title for f in replay(trace, pool)]
    assert titles == ["step 0: seq 3 arrives with 6 tokens -> takes blocks 0, 1",
                      "step 1: seq 3 grows by 1 -> fits in block 1",
                      "step 2: seq 3 grows by 2 -> takes block 2",
                      "step 3: seq 3 finishes -> frees blocks 0, 1, 2"]


def test_make_allocator_trace_rejects_requests_that_can_never_fit():
    with pytest.raises(ValueError, match="never fit"):
        make_allocator_trace(num_blocks=2, block_size=4, num_requests=1, prompt_lens=(4, 6), output_lens=(2, 3))


def test_apply_allocator_event_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="unknown event kind"):
        apply_allocator_event(BlockPool(4, 4), AllocatorEvent(0, "swap", 0, 1))


def random_kv(num_tokens, num_layers=2, num_heads=2, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_layers, num_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_seed_cache_writes_what_write_kv_ref_writes():
    num_blocks, block_size, num_layers, num_tokens = 8, 4, 2, 11
    keys, values = random_kv(num_tokens, num_layers)
    seed = SeedPagedAttentionCache(num_blocks, block_size, num_layers, 2, 8, dtype=torch.float32)
    seed.allocate_request("r")
    append_tokens_one_by_one(seed, "r", keys, values)

    pool = BlockPool(num_blocks, block_size)
    pool.allocate("r", num_tokens)
    cache = allocate_kv_cache(num_layers, num_blocks, block_size, 2, 8, dtype=torch.float32)
    cache.k.zero_()
    cache.v.zero_()
    slots = batch_slot_mapping(pool, [("r", 0, num_tokens)])
    for layer in range(num_layers):
        write_kv_ref(keys[:, layer], values[:, layer], cache.k[layer], cache.v[layer], slots)

    assert seed.block_tables["r"] == pool.block_table("r") == [0, 1, 2]
    for layer in range(num_layers):  # same values at the same (block, offset), zeros elsewhere
        assert torch.equal(seed.k_cache(layer), cache.k[layer])
        assert torch.equal(seed.v_cache(layer), cache.v[layer])


def test_seed_cache_interleaved_requests_read_back_through_their_tables():
    seed = SeedPagedAttentionCache(num_blocks=12, block_size=3, num_layers=1, num_heads=2, head_dim=8,
                                   dtype=torch.float32)
    lengths = {"a": 7, "b": 5, "c": 9}
    kv = {r: random_kv(n, num_layers=1, seed=i) for i, (r, n) in enumerate(lengths.items())}
    for r in lengths:
        seed.allocate_request(r)
    for pos in range(max(lengths.values())):  # one token of each request in turn
        for r, n in lengths.items():
            if pos < n:
                seed.append_token(r, pos, kv[r][0][pos], kv[r][1][pos])
    seed.release_request("b")
    assert seed.free_blocks[-2:] == [1, 4]
    for r in ("a", "c"):
        table, n = seed.block_tables[r], lengths[r]
        assert torch.equal(gather_kv(seed.k_cache(0), table, n), kv[r][0][:, 0])
        assert torch.equal(gather_kv(seed.v_cache(0), table, n), kv[r][1][:, 0])


def test_seed_cache_matches_the_write_kv_kernel():
    from kvlab.kernels import write_kv

    device, num_tokens = profile.DEVICE, 6
    keys, values = (t.to(device) for t in random_kv(num_tokens, num_layers=1))
    seed = SeedPagedAttentionCache(4, 4, 1, 2, 8, dtype=torch.float32, device=device)
    seed.allocate_request(0)
    append_tokens_one_by_one(seed, 0, keys, values)
    pool = BlockPool(4, 4)
    pool.allocate(0, num_tokens)
    cache = allocate_kv_cache(1, 4, 4, 2, 8, dtype=torch.float32, device=device)
    cache.k.zero_()
    cache.v.zero_()
    write_kv(keys[:, 0].contiguous(), values[:, 0].contiguous(), cache.k[0], cache.v[0],
             batch_slot_mapping(pool, [(0, 0, num_tokens)], device=device))
    assert torch.equal(seed.k_cache(0), cache.k[0]) and torch.equal(seed.v_cache(0), cache.v[0])
