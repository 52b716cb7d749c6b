"""Graded tests of chapter 2: ``pytest tests/graded -m ch02 --impl=exercises``."""
import random

import pytest
import torch

from helpers import random_span
from kvlab import profile
from kvlab.errors import OutOfBlocksError, UnknownSequenceError
from kvlab.paging import BlockPool as ReferencePool
from kvlab.paging import slot_mapping as reference_slot_mapping
from kvlab.reference import write_kv_ref

pytestmark = pytest.mark.ch02


def state(pool):
    return list(pool.free_blocks), {s: list(t) for s, t in pool.block_tables.items()}, dict(pool.seq_lens)


def outcome(op, *args):
    """(result, None) or (None, exception type) of calling op."""
    try:
        return op(*args), None
    except (OutOfBlocksError, UnknownSequenceError, ValueError, TypeError) as e:
        return None, type(e)


# -- block_pool ------------------------------------------------------------------------------
@pytest.mark.task("block_pool")
def test_takes_a_block_only_when_the_last_is_full(ch02):
    pool = ch02.BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate("a", 3) == [0], "3 tokens need 1 block of 4"
    grew = [pool.append("a", 1) for _ in range(6)]
    assert grew == [[], [1], [], [], [], [2]], f"append(1) x6 from length 3 returned {grew}"
    assert pool.block_table("a") == [0, 1, 2] and pool.seq_lens["a"] == 9


@pytest.mark.task("block_pool")
def test_free_returns_blocks_to_the_right_of_the_queue(ch02):
    pool = ch02.BlockPool(num_blocks=6, block_size=2)
    pool.allocate("a", 3)
    pool.allocate("b", 2)
    assert pool.free("a") == [0, 1]
    assert list(pool.free_blocks) == [3, 4, 5, 0, 1], f"free queue after free('a'): {list(pool.free_blocks)}"
    assert "a" not in pool.block_tables and "a" not in pool.seq_lens


@pytest.mark.task("block_pool")
def test_out_of_blocks_changes_nothing(ch02):
    pool = ch02.BlockPool(num_blocks=4, block_size=4)
    pool.allocate("a", 10)
    pool.allocate("b", 1)
    before = state(pool)
    with pytest.raises(OutOfBlocksError):
        pool.allocate("c", 1)
    assert state(pool) == before, "a failed allocate changed the pool"
    with pytest.raises(OutOfBlocksError):
        pool.append("a", 3)
    assert state(pool) == before, "a failed append changed the pool"


@pytest.mark.task("block_pool")
def test_bad_ids_and_counts_are_refused(ch02):
    pool = ch02.BlockPool(num_blocks=4, block_size=4)
    pool.allocate("a", 1)
    before = state(pool)
    for op, args, error in [
        (pool.free, ("nope",), UnknownSequenceError),
        (pool.append, ("nope", 1), UnknownSequenceError),
        (pool.allocate, ("a", 1), ValueError),      # the id exists
        (pool.allocate, ("b", -1), ValueError),
        (pool.append, ("a", -2), ValueError),
        (pool.allocate, ("b", 17), ValueError),     # more than the whole pool: can never fit
        (pool.allocate, ("b", 2.0), TypeError),
        (pool.append, ("a", "3"), TypeError),
    ]:
        with pytest.raises(error):
            op(*args)
        assert state(pool) == before, f"{op.__name__}{args} raised but changed the pool"
    pool.free("a")
    with pytest.raises(UnknownSequenceError):
        pool.free("a")


@pytest.mark.task("block_pool")
@pytest.mark.parametrize("seed", range(3))
def test_random_workload_matches_the_reference(ch02, seed):
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(16, 4), (32, 16), (9, 3)])
    mine, ref = ch02.BlockPool(num_blocks, block_size), ReferencePool(num_blocks, block_size)
    for step in range(300):
        live = list(ref.block_tables)
        kind = rng.choice(["allocate", "append", "append", "append", "free"])
        if kind == "allocate":
            args = (rng.choice([step, *live[:1]]), rng.randrange(0, 3 * block_size))
        elif kind == "append":
            args = (rng.choice(live + [-1]) if live else -1, rng.randrange(0, 2 * block_size))
        else:
            args = (rng.choice(live + [-1]) if live else -1,)
        got = outcome(getattr(mine, kind), *args)
        want = outcome(getattr(ref, kind), *args)
        assert got == want, f"step {step}: {kind}{args} gave {got}, expected {want}"
        assert state(mine) == (list(ref.free_blocks), ref.block_tables, ref.seq_lens), \
            f"step {step}: state differs after {kind}{args}"



@pytest.mark.task("block_pool")
def test_a_sequence_may_fill_the_whole_pool(ch02):
    pool = ch02.BlockPool(num_blocks=3, block_size=4)
    assert pool.allocate("a", 12) == [0, 1, 2], "12 tokens fit exactly in 3 blocks of 4: allocate must not refuse them"
    pool.free("a")
    pool.allocate("a", 5)
    assert pool.append("a", 7) == [2], "growing to exactly the pool's 12 slots must succeed"
    assert outcome(pool.append, "a", 0) == ([], None), "appending 0 tokens to a full pool takes nothing"


@pytest.mark.task("block_pool")
def test_append_beyond_the_whole_pool_is_a_value_error(ch02):
    pool = ch02.BlockPool(num_blocks=4, block_size=4)
    pool.allocate("a", 10)                                  # 3 blocks, 1 free
    before = state(pool)
    got = outcome(pool.append, "a", 7)
    assert got == (None, ValueError), \
        (f"append('a', 7) to a 10-token sequence in a 16-slot pool gave {got}: the new length, 17, can never fit "
         "in the whole pool, which is a ValueError (not OutOfBlocksError: freeing blocks would not help)")
    assert state(pool) == before, "a refused append changed the pool"

# -- slot_mapping ----------------------------------------------------------------------------
@pytest.mark.task("slot_mapping")
def test_slot_mapping_worked_example(ch02):
    got = ch02.slot_mapping([3, 7, 1], start=2, num_tokens=5, block_size=4)
    assert got == [14, 15, 28, 29, 30], f"slot_mapping([3, 7, 1], start=2, num_tokens=5, block_size=4) = {got}"


@pytest.mark.task("slot_mapping")
def test_slot_mapping_random(ch02):
    rng = random.Random(0)
    for _ in range(200):
        table, block_size, start, end = random_span(rng, [1, 2, 3, 16], 100, 6)
        n = end - start
        want = reference_slot_mapping(table, start, n, block_size)
        got = ch02.slot_mapping(table, start, n, block_size)
        assert got == want, f"slot_mapping({table}, {start}, {n}, {block_size}) = {got}, expected {want}"


@pytest.mark.task("slot_mapping")
def test_slot_mapping_beyond_the_table(ch02):
    with pytest.raises(ValueError):
        ch02.slot_mapping([0, 1], start=6, num_tokens=3, block_size=4)


# -- write_kv_kernel -------------------------------------------------------------------------
@pytest.mark.task("write_kv_kernel")
@pytest.mark.parametrize("dtype,num_kv_heads,head_dim", [(torch.float32, 2, 16), (torch.float16, 3, 8)])
def test_write_kv_kernel_matches_reference(ch02, guard, dtype, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_tokens = 6, 4, 13
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 9]] = -1                                      # padding tokens write nothing
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    # kvlab.check grades on the CPU interpreter; plain pytest on a GPU machine compiles natively.
    slots, key, value = slots.to(profile.DEVICE), key.to(profile.DEVICE), value.to(profile.DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = guard.full(shape, float("nan"), dtype=dtype, device=profile.DEVICE, name="k_cache")
    v_cache = guard.full(shape, float("nan"), dtype=dtype, device=profile.DEVICE, name="v_cache")
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ch02.write_kv(key, value, k_cache, v_cache, slots)
    guard.check()                                           # nothing stored outside the caches
    write_kv_ref(key, value, k_want, v_want, slots)
    check_caches(k_cache, v_cache, k_want, v_want, block_size)


def check_caches(k_cache, v_cache, k_want, v_want, block_size, hint=""):
    for name, got, want in (("k_cache", k_cache, k_want), ("v_cache", v_cache, v_want)):
        same = (got == want) | (got.isnan() & want.isnan())
        if not bool(same.all()):
            block, offset, head, d = (int(i) for i in (~same).nonzero()[0])
            raise AssertionError(f"{name}[{block}, {offset}, {head}, {d}] = {got[block, offset, head, d]}, "
                                 f"expected {want[block, offset, head, d]} (slot {block * block_size + offset}){hint}")


@pytest.mark.task("write_kv_kernel")
@pytest.mark.parametrize("case", ["long rows", "strided rows"])
def test_write_kv_kernel_long_and_strided_rows(ch02, guard, case):
    """Rows longer than one program's BLOCK (2048), and K/V rows that are slices of wider tensors
    (a fused QKV projection's output, say), each with its own token stride."""
    gen = torch.Generator().manual_seed(2)
    # 16 slots: the guard's margins (a cache's size on each side) catch a store a few rows past the end
    num_blocks, block_size = 8, 2
    slots = torch.tensor([3, 0, -1], dtype=torch.int64)      # slot 0 is a slot like any other
    num_tokens = len(slots)
    if case == "long rows":
        num_kv_heads, head_dim = 2, 1040                    # ROW = 2080: two programs per token
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
        hint = ": a row longer than BLOCK is split over program_id(1)"
    else:
        num_kv_heads, head_dim = 2, 8
        row = num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, 3 * row, generator=gen)
        kv = torch.randn(num_tokens, 2 * row + 5, generator=gen)
        key = qkv[:, row:2 * row].view(num_tokens, num_kv_heads, head_dim)            # token stride 3 * ROW
        value = kv[:, 5:5 + row].view(num_tokens, num_kv_heads, head_dim)            # token stride 2 * ROW + 5
        hint = ": K and V rows are strided, each with its own token stride (key_token_stride, value_token_stride)"
    slots, key, value = slots.to(profile.DEVICE), key.to(profile.DEVICE), value.to(profile.DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = guard.full(shape, float("nan"), device=profile.DEVICE, name="k_cache")
    v_cache = guard.full(shape, float("nan"), device=profile.DEVICE, name="v_cache")
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ch02.write_kv(key, value, k_cache, v_cache, slots)
    guard.check()
    write_kv_ref(key, value, k_want, v_want, slots)
    check_caches(k_cache, v_cache, k_want, v_want, block_size, hint)
