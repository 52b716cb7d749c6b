"""Unit and property tests of :class:`kvlab.paging.BlockPool` and its helpers."""
from __future__ import annotations

import doctest
import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvlab
from helpers import check_free
from kvlab.paging import BlockPool, blocks_needed, slot_mapping
from kvlab.paging import block_pool as block_pool_module
from kvlab.paging.block_pool import check_count


def snapshot(pool: BlockPool):
    """Everything observable about a pool, in a form that compares by value (order included)."""
    return (
        pool.num_blocks,
        pool.block_size,
        list(pool.free_blocks),
        [(seq_id, list(table)) for seq_id, table in pool.block_tables.items()],
        list(pool.seq_lens.items()),
    )


# -- helpers --------------------------------------------------------------------------------
def test_module_docstring_examples():
    result = doctest.testmod(block_pool_module, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_docstring_example():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate("a", 6) == [0, 1]
    assert pool.append("a", 3) == [2]
    assert pool.slot_mapping("a", start=6, num_tokens=3) == [6, 7, 8]
    assert pool.block_table("a") == [0, 1, 2]
    assert pool.seq_len("a") == 9
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 3


@pytest.mark.parametrize("num_tokens, block_size, expected", [
    (0, 4, 0), (1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (7, 1, 7), (16, 16, 1),
    (17, 16, 2),
])
def test_blocks_needed(num_tokens, block_size, expected):
    assert blocks_needed(num_tokens, block_size) == expected


def test_slot_mapping_function_by_hand():
    # block_size 4, table [5, 2, 7]: position p -> table[p // 4] * 4 + p % 4
    table = [5, 2, 7]
    assert slot_mapping(table, 0, 12, 4) == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    assert slot_mapping(table, 3, 3, 4) == [23, 8, 9]
    assert slot_mapping(table, 11, 1, 4) == [31]
    assert slot_mapping(table, 12, 0, 4) == []
    with pytest.raises(ValueError, match="block table has 3"):
        slot_mapping(table, 10, 3, 4)


def test_check_count():
    assert check_count("n", 0) == 0
    assert check_count("n", 5, minimum=1) == 5
    with pytest.raises(ValueError, match="n must be >= 1"):
        check_count("n", 0, minimum=1)
    with pytest.raises(TypeError, match="n must be an int"):
        check_count("n", True)
    with pytest.raises(TypeError, match="n must be an int"):
        check_count("n", 2.0)


# -- allocation ------------------------------------------------------------------------------
def test_fresh_pool():
    pool = BlockPool(num_blocks=6, block_size=3)
    assert pool.num_free_blocks == 6
    assert pool.num_used_blocks == 0
    assert pool.capacity == 18
    assert list(pool.free_blocks) == [0, 1, 2, 3, 4, 5]
    assert "a" not in pool


def test_default_block_size():
    assert BlockPool(num_blocks=2).block_size == 16


def test_allocate_zero_tokens_gives_empty_table():
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate("a", 0) == []
    assert "a" in pool
    assert pool.block_table("a") == []
    assert pool.seq_len("a") == 0
    assert pool.num_free_blocks == 4
    assert pool.slot_mapping("a", 0, 0) == []
    # the first appended token takes the first block
    assert pool.append("a", 1) == [0]


def test_new_block_only_when_last_block_is_full():
    block_size = 4
    pool = BlockPool(num_blocks=6, block_size=block_size)
    pool.allocate("a", 0)
    for n in range(1, 5 * block_size + 1):
        new = pool.append("a", 1)
        if n % block_size == 1:  # first token of a block
            assert new == [(n - 1) // block_size], n
        else:
            assert new == [], n
        assert pool.seq_len("a") == n
        assert len(pool.block_table("a")) == math.ceil(n / block_size)
        assert pool.num_free_blocks == 6 - math.ceil(n / block_size)
    assert pool.block_table("a") == [0, 1, 2, 3, 4]
    assert pool.can_append("a", block_size)


def test_append_several_tokens_fills_last_block_first():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("a", 3)                # one block, one slot left
    assert pool.append("a", 1) == []     # fills it
    assert pool.append("a", 0) == []
    assert pool.append("a", 5) == [1, 2]
    assert pool.seq_len("a") == 9


def test_block_table_returns_a_copy():
    pool = BlockPool(num_blocks=4, block_size=2)
    table = pool.allocate("a", 3)
    table.append(99)
    pool.block_table("a").append(99)
    assert pool.block_table("a") == [0, 1]


def test_slot_mapping_by_hand():
    pool = BlockPool(num_blocks=6, block_size=2)
    pool.allocate("a", 3)   # blocks 0, 1
    pool.allocate("b", 2)   # block 2
    pool.append("a", 2)     # a: 5 tokens, fills block 1, takes block 3
    assert pool.block_table("a") == [0, 1, 3]
    assert pool.slot_mapping("a", 0, 5) == [0, 1, 2, 3, 6]
    assert pool.slot_mapping("b", 0, 2) == [4, 5]
    assert pool.slot_mapping("a", 4, 1) == [6]
    assert pool.slot_mapping("a", 2, 2) == [2, 3]
    assert pool.slot_mapping("a", 5, 0) == []


def test_can_append():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate("a", 5)
    pool.allocate("b", 1)
    before = snapshot(pool)
    assert pool.can_append("a", 3)       # fits in the last block
    assert pool.can_append("a", 7)       # needs one more block, one is free
    assert not pool.can_append("a", 8)   # needs two
    assert pool.can_append("a")          # default: one token
    assert pool.can_append("a", 0)
    assert snapshot(pool) == before      # a query, not a reservation


def test_free_returns_blocks_to_free_queue_and_they_are_reused():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate("a", 3)   # [0, 1]
    pool.allocate("b", 2)   # [2]
    assert list(pool.free_blocks) == [3]
    assert pool.free("a") == [0, 1]
    assert "a" not in pool
    assert list(pool.free_blocks) == [3, 0, 1]
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 1
    # freed blocks go to the back of the queue: 3 is reused first, then 0 and 1
    assert pool.allocate("c", 6) == [3, 0, 1]
    assert pool.num_free_blocks == 0
    # a freed id can be allocated again
    pool.free("b")
    assert pool.allocate("a", 1) == [2]


def test_free_empty_sequence():
    pool = BlockPool(num_blocks=2, block_size=2)
    pool.allocate("a", 0)
    assert pool.free("a") == []
    assert list(pool.free_blocks) == [0, 1]


def test_whole_pool_can_be_used():
    pool = BlockPool(num_blocks=3, block_size=5)
    assert pool.allocate("a", 15) == [0, 1, 2]
    assert pool.num_free_blocks == 0
    assert pool.slot_mapping("a", 0, 15) == list(range(15))


def test_any_hashable_seq_id():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate(0, 1)
    pool.allocate(("req", 7), 1)
    assert pool.block_table(0) == [0]
    assert pool.block_table(("req", 7)) == [1]


# -- errors ---------------------------------------------------------------------------------
def _busy_pool():
    pool = BlockPool(num_blocks=6, block_size=4)
    pool.allocate("a", 5)
    pool.allocate("b", 4)
    pool.allocate("c", 2)
    pool.free("b")          # free queue is no longer sorted
    pool.append("a", 4)
    return pool


def test_out_of_blocks_on_allocate_changes_nothing():
    pool = _busy_pool()
    before = snapshot(pool)
    free = pool.num_free_blocks
    with pytest.raises(kvlab.OutOfBlocksError, match=f"needs {free + 1} more blocks, {free} are free"):
        pool.allocate("d", (free + 1) * pool.block_size)
    assert snapshot(pool) == before
    assert "d" not in pool


def test_out_of_blocks_on_append_changes_nothing():
    pool = _busy_pool()
    before = snapshot(pool)
    room = pool.num_free_blocks * pool.block_size + (-pool.seq_len("c") % pool.block_size)
    with pytest.raises(kvlab.OutOfBlocksError, match="'c' needs"):
        pool.append("c", room + 1)
    assert snapshot(pool) == before
    # exactly the room left succeeds
    pool.append("c", room)
    assert pool.num_free_blocks == 0


def test_out_of_blocks_is_a_kvlab_error():
    assert issubclass(kvlab.OutOfBlocksError, kvlab.KVLabError)
    pool = BlockPool(num_blocks=2, block_size=1)
    pool.allocate("a", 1)
    pool.allocate("b", 1)
    with pytest.raises(kvlab.KVLabError):
        pool.append("a", 1)


def test_free_twice_raises_unknown_sequence_and_changes_nothing():
    pool = _busy_pool()
    pool.free("c")
    before = snapshot(pool)
    with pytest.raises(kvlab.UnknownSequenceError, match="'c'"):
        pool.free("c")
    assert snapshot(pool) == before


def test_unknown_sequence_error_is_a_key_error_with_a_readable_message():
    assert issubclass(kvlab.UnknownSequenceError, KeyError)
    assert issubclass(kvlab.UnknownSequenceError, kvlab.KVLabError)
    pool = BlockPool(num_blocks=2, block_size=2)
    with pytest.raises(KeyError) as info:
        pool.free("ghost")
    assert str(info.value) == "unknown sequence id 'ghost' (never allocated, or freed)"


@pytest.mark.parametrize("call", [
    pytest.param(lambda p: p.free("zz"), id="free"),
    pytest.param(lambda p: p.append("zz", 1), id="append"),
    pytest.param(lambda p: p.append("zz", 0), id="append-0"),
    pytest.param(lambda p: p.block_table("zz"), id="block_table"),
    pytest.param(lambda p: p.seq_len("zz"), id="seq_len"),
    pytest.param(lambda p: p.can_append("zz", 1), id="can_append"),
    pytest.param(lambda p: p.slot_mapping("zz", 0, 1), id="slot_mapping"),
    pytest.param(lambda p: p.slot_mapping("zz", 0, 0), id="slot_mapping-0-tokens"),
])
def test_unknown_ids_raise_unknown_sequence_and_change_nothing(call):
    pool = _busy_pool()
    before = snapshot(pool)
    with pytest.raises(kvlab.UnknownSequenceError, match="unknown sequence id 'zz'"):
        call(pool)
    assert snapshot(pool) == before


@pytest.mark.parametrize("call, name", [
    pytest.param(lambda p: p.allocate("d", -1), "num_tokens", id="allocate"),
    pytest.param(lambda p: p.append("a", -1), "num_tokens", id="append"),
    pytest.param(lambda p: p.can_append("a", -2), "num_tokens", id="can_append"),
    pytest.param(lambda p: p.slot_mapping("a", -1, 1), "start", id="slot_mapping-start"),
    pytest.param(lambda p: p.slot_mapping("a", 0, -1), "num_tokens", id="slot_mapping-num_tokens"),
])
def test_negative_counts_raise_value_error(call, name):
    pool = _busy_pool()
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        call(pool)
    assert snapshot(pool) == before
    assert "d" not in pool


@pytest.mark.parametrize("bad", [1.0, 2.5, True, False, "3", None])
@pytest.mark.parametrize("method", ["allocate", "append", "can_append", "slot_mapping-start",
                                    "slot_mapping-num_tokens"])
def test_non_int_counts_raise_type_error(method, bad):
    pool = _busy_pool()
    before = snapshot(pool)
    calls = {
        "allocate": (lambda: pool.allocate("d", bad), "num_tokens"),
        "append": (lambda: pool.append("a", bad), "num_tokens"),
        "can_append": (lambda: pool.can_append("a", bad), "num_tokens"),
        "slot_mapping-start": (lambda: pool.slot_mapping("a", bad, 1), "start"),
        "slot_mapping-num_tokens": (lambda: pool.slot_mapping("a", 0, bad), "num_tokens"),
    }
    call, name = calls[method]
    with pytest.raises(TypeError, match=f"{name} must be an int, got {type(bad).__name__}"):
        call()
    assert snapshot(pool) == before
    assert "d" not in pool


@pytest.mark.parametrize("method", ["allocate", "append"])
def test_cache_must_be_a_bool(method):
    pool = _busy_pool()
    before = snapshot(pool)
    with pytest.raises(TypeError, match="cache must be True or False"):
        if method == "allocate":
            pool.allocate("d", 2, cache="no")
        else:
            pool.append("a", 1, cache="no")
    assert snapshot(pool) == before
    assert "d" not in pool


def test_count_beyond_whole_pool_capacity_is_value_error_not_out_of_blocks():
    pool = BlockPool(num_blocks=4, block_size=4)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="more than the pool's 16 slots") as info:
        pool.allocate("a", 17)
    assert not isinstance(info.value, kvlab.OutOfBlocksError)
    assert snapshot(pool) == before
    assert "a" not in pool

    pool.allocate("a", 10)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="would hold 17 tokens") as info:
        pool.append("a", 7)
    assert not isinstance(info.value, kvlab.OutOfBlocksError)
    assert snapshot(pool) == before
    # within capacity but beyond the free blocks: that one is OutOfBlocksError
    pool.allocate("b", 4)
    with pytest.raises(kvlab.OutOfBlocksError):
        pool.append("a", 6)
    assert pool.can_append("a", 2) and not pool.can_append("a", 3)


def test_allocating_an_existing_id_raises_and_changes_nothing():
    pool = _busy_pool()
    before = snapshot(pool)
    with pytest.raises(ValueError, match="'a' already holds blocks"):
        pool.allocate("a", 1)
    with pytest.raises(ValueError, match="'c' already holds blocks"):
        pool.allocate("c", 0)
    assert snapshot(pool) == before


def test_slot_mapping_beyond_sequence_length():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate("a", 5)   # two blocks, but only five tokens
    before = snapshot(pool)
    with pytest.raises(ValueError, match="beyond sequence 'a' of length 5"):
        pool.slot_mapping("a", 0, 6)
    with pytest.raises(ValueError, match="beyond sequence 'a' of length 5"):
        pool.slot_mapping("a", 5, 1)
    with pytest.raises(ValueError, match="beyond sequence 'a' of length 5"):
        pool.slot_mapping("a", 6, 0)
    assert snapshot(pool) == before
    assert pool.slot_mapping("a", 5, 0) == []


@pytest.mark.parametrize("args, exc, match", [
    ((0,), ValueError, "num_blocks must be >= 1"),
    ((-3,), ValueError, "num_blocks must be >= 1"),
    ((4, 0), ValueError, "block_size must be >= 1"),
    ((4, -1), ValueError, "block_size must be >= 1"),
    ((4.0,), TypeError, "num_blocks must be an int"),
    ((True,), TypeError, "num_blocks must be an int"),
    (("4",), TypeError, "num_blocks must be an int"),
    ((4, 2.0), TypeError, "block_size must be an int"),
    ((4, True), TypeError, "block_size must be an int"),
    ((4, None), TypeError, "block_size must be an int"),
])
def test_constructor_validation(args, exc, match):
    with pytest.raises(exc, match=match):
        BlockPool(*args)


# -- property test: a state machine against a shadow model ------------------------------------
SEQ_IDS = st.integers(min_value=0, max_value=5)
BAD_COUNTS = st.sampled_from([-1, -7, 1.0, 0.5, True, False, "2", None])


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / append / free / slot_mapping sequences, checked against ``model``.

    ``model`` maps each live sequence id to its length. Every call that raises must leave the
    pool exactly as it was.
    """

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
    def setup(self, num_blocks, block_size):
        self.pool = BlockPool(num_blocks=num_blocks, block_size=block_size)
        self.model: dict[int, int] = {}

    # -- helpers ------------------------------------------------------------------------
    def blocks_of(self, length):
        return -(-length // self.pool.block_size)

    def model_free(self):
        return self.pool.num_blocks - sum(self.blocks_of(n) for n in self.model.values())

    def attempt(self, call, expected_exc=None):
        """Run ``call``; if it raises, check that nothing changed. Returns (exception, result)."""
        before = snapshot(self.pool)
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - any failure must leave the pool unchanged
            assert snapshot(self.pool) == before, f"{type(exc).__name__} changed the pool"
            if expected_exc is not None:
                assert isinstance(exc, expected_exc), (exc, expected_exc)
            return exc, None
        assert expected_exc is None, f"expected {expected_exc.__name__}, got result {result!r}"
        return None, result

    # -- rules --------------------------------------------------------------------------
    @rule(seq=SEQ_IDS, n=st.integers(0, 30))
    def allocate(self, seq, n):
        free_before = list(self.pool.free_blocks)
        if seq in self.model or n > self.pool.capacity:
            expected = ValueError
        elif self.blocks_of(n) > self.model_free():
            expected = kvlab.OutOfBlocksError
        else:
            expected = None
        exc, table = self.attempt(lambda: self.pool.allocate(seq, n), expected)
        if exc is None:
            assert table == free_before[:self.blocks_of(n)]
            self.model[seq] = n

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 12))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        free_before = list(self.pool.free_blocks)
        table_before = self.pool.block_table(seq)
        new_len = self.model[seq] + n
        new_blocks = self.blocks_of(new_len) - self.blocks_of(self.model[seq])
        if new_len > self.pool.capacity:
            self.attempt(lambda: self.pool.can_append(seq, n), ValueError)
        else:
            assert self.pool.can_append(seq, n) == (new_blocks <= len(free_before))
        if new_len > self.pool.capacity:
            expected = ValueError
        elif new_blocks > len(free_before):
            expected = kvlab.OutOfBlocksError
        else:
            expected = None
        exc, taken = self.attempt(lambda: self.pool.append(seq, n), expected)
        if exc is None:
            assert taken == free_before[:new_blocks]
            assert self.pool.block_table(seq) == table_before + taken
            self.model[seq] = new_len

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        check_free(self.pool, seq, self.pool.block_table(seq))
        del self.model[seq]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def slot_mapping(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        length = self.model[seq]
        start = data.draw(st.integers(0, length))
        n = data.draw(st.integers(0, length - start))
        slots = self.pool.slot_mapping(seq, start, n)
        table = self.pool.block_table(seq)
        bs = self.pool.block_size
        assert slots == [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    @rule(seq=SEQ_IDS)
    def free_or_query_unknown(self, seq):
        if seq in self.model:
            return
        for call in (lambda: self.pool.free(seq), lambda: self.pool.append(seq, 1),
                     lambda: self.pool.block_table(seq), lambda: self.pool.seq_len(seq),
                     lambda: self.pool.can_append(seq, 1), lambda: self.pool.slot_mapping(seq, 0, 1),
                     lambda: self.pool.slot_mapping(seq, 0, 0)):
            self.attempt(call, kvlab.UnknownSequenceError)

    @rule(seq=SEQ_IDS, bad=BAD_COUNTS)
    def bad_count(self, seq, bad):
        expected = ValueError if type(bad) is int else TypeError
        if seq in self.model:
            self.attempt(lambda: self.pool.append(seq, bad), expected)
            self.attempt(lambda: self.pool.slot_mapping(seq, bad, 0), expected)
            self.attempt(lambda: self.pool.slot_mapping(seq, 0, bad), expected)
            self.attempt(lambda: self.pool.allocate(seq, 1), ValueError)  # existing id
        else:
            self.attempt(lambda: self.pool.allocate(seq, bad), expected)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extra=st.integers(1, 5))
    def slot_mapping_beyond_length(self, data, extra):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        start = data.draw(st.integers(0, self.model[seq]))
        n = self.model[seq] - start + extra
        self.attempt(lambda: self.pool.slot_mapping(seq, start, n), ValueError)

    @rule(seq=SEQ_IDS, extra=st.integers(1, 10))
    def beyond_capacity(self, seq, extra):
        length = self.model.get(seq, 0)
        n = self.pool.capacity - length + extra
        if seq in self.model:
            exc, _ = self.attempt(lambda: self.pool.append(seq, n), ValueError)
        else:
            exc, _ = self.attempt(lambda: self.pool.allocate(seq, n), ValueError)
        assert not isinstance(exc, kvlab.OutOfBlocksError)

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def counts_add_up(self):
        pool = self.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_free_blocks == len(pool.free_blocks) == self.model_free()

    @invariant()
    def every_block_in_exactly_one_place(self):
        places = list(self.pool.free_blocks)
        for table in self.pool.block_tables.values():
            places += table
        assert sorted(places) == list(range(self.pool.num_blocks))

    @invariant()
    def tables_match_model(self):
        pool = self.pool
        assert set(pool.block_tables) == set(self.model)
        assert dict(pool.seq_lens) == self.model
        for seq, length in self.model.items():
            assert seq in pool
            assert pool.seq_len(seq) == length
            assert len(pool.block_table(seq)) == math.ceil(length / pool.block_size)

    @invariant()
    def slots_distinct_and_in_range(self):
        slots = []
        for seq, length in self.model.items():
            slots += self.pool.slot_mapping(seq, 0, length)
        assert len(slots) == sum(self.model.values())
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < self.pool.capacity for s in slots)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolStateMachine = BlockPoolMachine.TestCase
