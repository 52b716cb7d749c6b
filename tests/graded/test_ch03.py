"""Graded tests of chapter 3: ``pytest tests/graded -m ch03 --impl=exercises``."""
import random

import pytest

from helpers import first_difference, outcome
from kvlab.errors import OutOfBlocksError, UnknownSequenceError
from kvlab.paging import BlockPool
from kvlab.workloads.beam_search import sharing_memory

pytestmark = pytest.mark.ch03


class GuardedPool(BlockPool):
    """A BlockPool whose own fork/append refuse: the functions under test must do the work."""

    def fork(self, *args, **kwargs):
        raise AssertionError("don't call pool.fork: change block_tables, seq_lens and ref_counts yourself")

    def append(self, *args, **kwargs):
        raise AssertionError("don't call pool.append: change the pool's state yourself")


def state(pool) -> dict:
    return {"block_tables": {s: list(t) for s, t in pool.block_tables.items()},
            "seq_lens": dict(pool.seq_lens), "ref_counts": list(pool.ref_counts),
            "free_blocks": list(pool.free_blocks), "pending_copies": list(pool.pending_copies)}


def shared_pool(num_blocks=8, block_size=4, prompt_len=6):
    """A guarded pool with "a" holding ``prompt_len`` tokens and "b" forked from it (by kvlab)."""
    pool = GuardedPool(num_blocks, block_size)
    pool.allocate("a", prompt_len)
    BlockPool.fork(pool, "a", "b")
    return pool


# -- fork ------------------------------------------------------------------------------------
@pytest.mark.task("fork")
def test_fork_shares_every_block(ch03):
    pool = GuardedPool(8, 4)
    pool.allocate("a", 6)
    got = ch03.fork(pool, "a", "b")
    assert got == [0, 1], f"fork returned {got}, expected the parent's table [0, 1]"
    want = {"block_tables": {"a": [0, 1], "b": [0, 1]}, "seq_lens": {"a": 6, "b": 6},
            "ref_counts": [2, 2, 0, 0, 0, 0, 0, 0], "free_blocks": [2, 3, 4, 5, 6, 7], "pending_copies": []}
    assert state(pool) == want, f"after fork: {first_difference(state(pool), want)}"
    ch03.fork(pool, "b", "c")
    assert pool.ref_counts[:2] == [3, 3], f"after a second fork, ref counts {pool.ref_counts[:2]}, expected [3, 3]"


@pytest.mark.task("fork")
def test_fork_gives_the_child_its_own_table(ch03):
    pool = GuardedPool(8, 4)
    pool.allocate("a", 4)
    ch03.fork(pool, "a", "b")
    assert pool.block_tables["b"] is not pool.block_tables["a"], "the child's table is the parent's list object"
    BlockPool.append(pool, "b", 1)    # b's block is full: b takes a new block, a must not
    assert pool.block_tables["a"] == [0], f"growing the child changed the parent's table to {pool.block_tables['a']}"


@pytest.mark.task("fork")
def test_fork_errors_change_nothing(ch03):
    pool = shared_pool()
    before = state(pool)
    for args, error in [(("nobody", "c"), UnknownSequenceError), (("a", "b"), ValueError),
                        (("nobody", "a"), UnknownSequenceError)]:
        with pytest.raises(error):
            ch03.fork(pool, *args)
        assert state(pool) == before, f"fork{args} raised but changed the pool: {first_difference(state(pool), before)}"


def random_pools(seed, sizes):
    """A seeded ``random.Random``, and a guarded pool and kvlab's of one ``(num_blocks, block_size)`` of ``sizes``."""
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice(sizes)
    return rng, GuardedPool(num_blocks, block_size), BlockPool(num_blocks, block_size)


def compare_on_workload(mine, ref, ops, learner_ops):
    """Apply every ``(kind, args)`` of ``ops`` to both pools (``learner_ops[kind]`` on ``mine``,
    kvlab's own method otherwise) and compare results, errors and full state after each one."""
    for step, (kind, args) in enumerate(ops):
        op = learner_ops.get(kind, getattr(BlockPool, kind))
        got = outcome(op, mine, *args)
        want = outcome(getattr(ref, kind), *args)
        assert got == want, f"step {step}: {kind}{args} gave {got}, expected {want}"
        problem = first_difference(state(mine), state(ref))
        assert not problem, f"step {step}: after {kind}{args}, {problem}"


def random_ops(rng, ref, steps, kinds, fork_args, append_ids):
    """Random operations drawn from ``ref``'s live sequences as they evolve."""
    block_size = ref.block_size
    for step in range(steps):
        live = sorted(ref.block_tables)
        kind = rng.choice(kinds)
        if kind == "allocate" or not live:
            yield "allocate", (1000 + step, rng.randrange(0, 2 * block_size))
        elif kind == "fork":
            yield "fork", fork_args(live, step)
        elif kind == "append":
            yield "append", (rng.choice(append_ids(live)), rng.randrange(0, 2 * block_size))
        else:
            yield "free", (rng.choice(live),)


@pytest.mark.task("fork")
@pytest.mark.parametrize("seed", range(3))
def test_fork_random_workload_matches_the_reference(ch03, seed):
    rng, mine, ref = random_pools(seed, [(16, 4), (24, 3), (12, 16)])
    ops = random_ops(rng, ref, 200, ["allocate", "fork", "fork", "append", "append", "free"],
                     fork_args=lambda live, step: (rng.choice(live + [-1]), rng.choice([2000 + step, 2000 + step, *live])),
                     append_ids=lambda live: live)
    compare_on_workload(mine, ref, ops, {"fork": ch03.fork})


# -- copy_on_write ---------------------------------------------------------------------------
@pytest.mark.task("copy_on_write")
def test_appending_to_a_shared_partial_block_copies_it(ch03):
    pool = shared_pool()                                    # a, b: [0, 1], 6 tokens, block 1 half full
    got = ch03.append_with_copy_on_write(pool, "b", 1)
    assert got == [2], f"append_with_copy_on_write(pool, 'b', 1) returned {got}, expected [2] (the copy)"
    want = {"block_tables": {"a": [0, 1], "b": [0, 2]}, "seq_lens": {"a": 6, "b": 7},
            "ref_counts": [2, 1, 1, 0, 0, 0, 0, 0], "free_blocks": [3, 4, 5, 6, 7], "pending_copies": [(1, 2)]}
    assert state(pool) == want, f"after the copy: {first_difference(state(pool), want)}"
    got = ch03.append_with_copy_on_write(pool, "a", 1)      # a is block 1's only holder now
    assert got == [], f"the last holder must write in place, but append returned {got}"
    assert pool.pending_copies == [(1, 2)], f"pending_copies became {pool.pending_copies}"


@pytest.mark.task("copy_on_write")
def test_a_copy_of_a_block_still_being_copied_reads_its_source(ch03):
    pool = shared_pool()                                    # a, b: [0, 1], 6 tokens, block 1 half full
    ch03.append_with_copy_on_write(pool, "b", 1)            # b: [0, 2], copy (1, 2) pending
    BlockPool.fork(pool, "b", "c")                          # c shares block 2 before that copy ran
    got = ch03.append_with_copy_on_write(pool, "c", 1)
    assert got == [3] and pool.block_tables["c"] == [0, 3], f"returned {got}, c's table {pool.block_tables['c']}"
    assert pool.pending_copies == [(1, 2), (1, 3)], (
        f"pending_copies {pool.pending_copies}, expected [(1, 2), (1, 3)]: the step runs its copies together, "
        "so block 2 holds nothing yet; c's copy must read the data from block 1, where it is")


@pytest.mark.task("copy_on_write")
def test_copy_then_growth_in_one_append(ch03):
    pool = shared_pool()
    got = ch03.append_with_copy_on_write(pool, "a", 7)      # 6 -> 13 tokens: copy block 1, then 2 new blocks
    assert got == [2, 3, 4], f"returned {got}, expected [2, 3, 4]: the copy's block first, then growth"
    assert pool.block_tables["a"] == [0, 2, 3, 4] and pool.pending_copies == [(1, 2)], \
        f"table {pool.block_tables['a']}, pending_copies {pool.pending_copies}"


@pytest.mark.task("copy_on_write")
def test_a_full_shared_block_is_not_copied(ch03):
    pool = shared_pool(prompt_len=8)                        # block 1 is full: new tokens go to a new block
    got = ch03.append_with_copy_on_write(pool, "b", 1)
    assert got == [2] and pool.pending_copies == [], f"returned {got}, pending_copies {pool.pending_copies}"
    assert pool.block_tables["b"] == [0, 1, 2] and pool.ref_counts[:3] == [2, 2, 1], state(pool)


@pytest.mark.task("copy_on_write")
def test_zero_tokens_copies_nothing(ch03):
    pool = shared_pool()
    before = state(pool)
    assert ch03.append_with_copy_on_write(pool, "b", 0) == []
    assert state(pool) == before, f"appending 0 tokens changed the pool: {first_difference(state(pool), before)}"


@pytest.mark.task("copy_on_write")
def test_the_copy_needs_a_free_block(ch03):
    pool = shared_pool(num_blocks=2)                       # both blocks in use, none free
    before = state(pool)
    with pytest.raises(OutOfBlocksError):
        ch03.append_with_copy_on_write(pool, "b", 1)      # fits in block 1's free slots, but block 1 is shared
    assert state(pool) == before, f"a failed append changed the pool: {first_difference(state(pool), before)}"
    pool = shared_pool(num_blocks=3)                       # one block free: 6 -> 9 tokens needs the copy and one more
    before = state(pool)
    with pytest.raises(OutOfBlocksError):
        ch03.append_with_copy_on_write(pool, "b", 3)
    assert state(pool) == before, \
        f"a failed append (a copy and a new block, one free) changed the pool: {first_difference(state(pool), before)}"


@pytest.mark.task("copy_on_write")
def test_growing_to_exactly_the_whole_pool(ch03):
    pool = GuardedPool(3, 4)
    pool.allocate("a", 5)
    got = outcome(ch03.append_with_copy_on_write, pool, "a", 7)
    assert got == ([2], None), f"append 7 tokens to 5 in a pool of 3 blocks of 4 gave {got}: 12 tokens fit exactly"
    assert pool.seq_lens["a"] == 12 and pool.block_tables["a"] == [0, 1, 2], state(pool)


@pytest.mark.task("copy_on_write")
def test_bad_arguments_are_refused_in_order(ch03):
    pool = shared_pool()
    before = state(pool)
    for args, error in [(("nobody", 1), UnknownSequenceError), (("b", -1), ValueError), (("b", 1.0), TypeError),
                        (("nobody", -1), ValueError), (("b", 27), ValueError)]:
        with pytest.raises(error):
            ch03.append_with_copy_on_write(pool, *args)
        assert state(pool) == before, f"append{args} raised but changed the pool"


@pytest.mark.task("copy_on_write")
@pytest.mark.parametrize("seed", range(3))
def test_copy_on_write_random_workload_matches_the_reference(ch03, seed):
    rng, mine, ref = random_pools(seed, [(16, 4), (20, 3), (10, 5)])

    def ops():
        for op in random_ops(rng, ref, 250, ["allocate", "fork", "fork", "append", "append", "append", "free"],
                             fork_args=lambda live, step: (rng.choice(live), 2000 + step),
                             append_ids=lambda live: live + [-1]):
            yield op
            if rng.random() < 0.3:                       # an engine step: copies handed to copy_blocks
                mine.take_copies(), ref.take_copies()

    compare_on_workload(mine, ref, ops(), {"append": ch03.append_with_copy_on_write})


# -- sharing_blocks --------------------------------------------------------------------------
@pytest.mark.task("sharing_blocks")
def test_sharing_blocks_worked_example(ch03):
    got = ch03.parallel_sampling_blocks(6, 5, 3, 4)
    assert got == (7, 9), (f"parallel_sampling_blocks(prompt_len=6, gen_len=5, n=3, block_size=4) = {got}, "
                           "expected (7, 9): block 0 shared, then 2 blocks per sample; 3 x 3 without sharing")


@pytest.mark.task("sharing_blocks")
def test_sharing_blocks_match_the_allocator(ch03):
    rng = random.Random(0)
    cases = [(16, 16, 4, 16), (1, 1, 2, 16), (17, 15, 4, 16), (64, 1, 1, 16), (5, 40, 3, 4)]
    cases += [(rng.randint(1, 80), rng.randint(1, 40), rng.randint(1, 6), rng.choice([1, 3, 4, 16])) for _ in range(30)]
    for prompt_len, gen_len, n, block_size in cases:
        measured = sharing_memory(prompt_len, gen_len, n, block_size, mode="parallel")
        want = (measured.shared_blocks, measured.unshared_blocks)
        got = ch03.parallel_sampling_blocks(prompt_len, gen_len, n, block_size)
        assert tuple(got) == want, (f"parallel_sampling_blocks({prompt_len}, {gen_len}, {n}, {block_size}) = {got}, "
                                    f"the allocator holds {want}")
