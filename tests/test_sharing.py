"""Sharing blocks between sequences: ``fork``, reference counts and copy-on-write.

Unit tests pin the behaviour on small hand-made cases; a state machine then drives random
allocate / fork / append / free sequences (failing calls included) against a shadow model
of every sequence's *token contents*, with a real (tiny) KV store on the CPU: after every
append the recorded copies are applied, then the new tokens are written, and every live
sequence must read back exactly its own tokens. One slower test runs the same story through
the real ``write_kv`` and ``copy_blocks`` kernels.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvlab
from helpers import PoolMachineHelpers, check_free, snapshot
from kvlab.paging import BlockPool, allocate_kv_cache, blocks_needed
from kvlab.reference import copy_blocks_ref, gather_kv


def occurrences(pool: BlockPool) -> list[int]:
    """How many live block tables hold each block."""
    counts = [0] * pool.num_blocks
    for table in pool.block_tables.values():
        for block in table:
            counts[block] += 1
    return counts


# -- fork and reference counts -----------------------------------------------------------------
def test_fork_shares_every_block_and_bumps_ref_counts():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("p", 10)                      # blocks 0, 1, 2
    pool.allocate("other", 3)                   # block 3
    free_before = list(pool.free_blocks)
    assert pool.fork("p", "c") == [0, 1, 2]
    assert pool.block_table("c") == pool.block_table("p") == [0, 1, 2]
    assert pool.seq_len("c") == 10
    assert pool.ref_counts[:4] == [2, 2, 2, 1]
    assert list(pool.free_blocks) == free_before   # a fork takes no block
    assert pool.pending_copies == []
    assert pool.fork("c", "g") == [0, 1, 2]         # a fork of a fork: three holders
    assert pool.ref_counts[:4] == [3, 3, 3, 1]
    assert pool.num_used_blocks == 4


def test_fork_returns_a_copy_of_the_table():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate("p", 3)
    table = pool.fork("p", "c")
    table.append(99)
    assert pool.block_table("c") == [0, 1]
    pool.append("c", 1)                          # fills the shared block 1: copy-on-write
    assert pool.block_table("p") == [0, 1]       # the parent's table is its own list


def test_fork_of_an_empty_sequence():
    pool = BlockPool(num_blocks=2, block_size=2)
    pool.allocate("p", 0)
    assert pool.fork("p", "c") == []
    assert pool.append("c", 1) == [0]            # nothing to copy: a fresh block
    assert pool.pending_copies == []
    assert pool.block_table("p") == []


# -- copy-on-write ---------------------------------------------------------------------------
def test_append_to_child_with_shared_partial_last_block_copies_it():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("p", 6)                        # [0, 1], block 1 holds 2 of 4 tokens
    pool.fork("p", "c")
    assert pool.append("c", 1) == [2]            # a private copy of block 1
    assert pool.pending_copies == [(1, 2)]
    assert pool.block_table("c") == [0, 2]       # only the last entry is replaced
    assert pool.block_table("p") == [0, 1]       # the parent is untouched
    assert pool.seq_len("c") == 7 and pool.seq_len("p") == 6
    assert pool.ref_counts[:3] == [2, 1, 1]
    # the child's last block is private now: more tokens go in place, nothing more to copy
    assert pool.append("c", 1) == []
    assert pool.pending_copies == [(1, 2)]
    assert pool.slot_mapping("c", 6, 2) == [10, 11]
    # and the parent, sole holder of block 1 again, writes in place too
    assert pool.append("p", 1) == []
    assert pool.pending_copies == [(1, 2)]
    assert pool.slot_mapping("p", 6, 1) == [6]


def test_append_to_parent_copies_too_and_then_child_writes_in_place():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("p", 5)                        # [0, 1]
    pool.fork("p", "c")
    assert pool.append("p", 2) == [2]            # the writer gets the copy, whoever it is
    assert pool.take_copies() == [(1, 2)]
    assert pool.block_table("p") == [0, 2]
    assert pool.block_table("c") == [0, 1]
    assert pool.append("c", 3) == []             # block 1 is the child's alone now
    assert pool.take_copies() == []


def test_copy_on_write_then_growth_in_one_append():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("p", 3)                        # [0]
    pool.fork("p", "c")
    assert pool.append("c", 5) == [1, 2]         # copy of block 0, then one more block
    assert pool.take_copies() == [(0, 1)]
    assert pool.block_table("c") == [1, 2]
    assert pool.block_table("p") == [0]
    assert pool.ref_counts[:3] == [1, 1, 1]


def test_append_when_last_block_is_full_takes_a_fresh_block_and_copies_nothing():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("p", 8)                        # [0, 1], both full
    pool.fork("p", "c")
    assert pool.append("c", 1) == [2]
    assert pool.pending_copies == []
    assert pool.block_table("c") == [0, 1, 2]
    assert pool.block_table("p") == [0, 1]
    assert pool.ref_counts[:3] == [2, 2, 1]
    assert pool.slot_mapping("c", 8, 1) == [8]


def test_append_zero_tokens_to_a_shared_partial_block_copies_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate("p", 2)
    pool.fork("p", "c")
    assert pool.append("c", 0) == []
    assert pool.pending_copies == []
    assert pool.block_table("c") == [0]
    assert pool.can_append("c", 1)


def test_can_append_counts_the_copy():
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate("p", 2)                        # [0]
    pool.fork("p", "c")
    pool.allocate("x", 1)                        # [1]: nothing free
    before = snapshot(pool)
    assert pool.can_append("c", 0)
    assert not pool.can_append("c", 1)           # one slot is left in block 0, but it is shared
    assert snapshot(pool) == before
    pool.free("x")
    assert pool.can_append("c", 2) and not pool.can_append("c", 3)


def test_free_parent_then_child_releases_blocks_only_at_the_last_holder():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("p", 6)                        # [0, 1]
    pool.fork("p", "c")
    pool.append("c", 4)                          # c: [0, 2, 3] (2 copies 1, 3 is new)
    assert pool.take_copies() == [(1, 2)]
    free_before = list(pool.free_blocks)
    assert pool.free("p") == [1]                 # block 0 is still the child's
    assert pool.ref_counts[:4] == [1, 0, 1, 1]
    assert list(pool.free_blocks) == free_before + [1]
    assert pool.block_table("c") == [0, 2, 3]
    assert pool.free("c") == [0, 2, 3]
    assert pool.ref_counts == [0] * 8
    assert sorted(pool.free_blocks) == list(range(8))


def test_free_child_first_keeps_the_parent_whole():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate("p", 4)                        # [0, 1]
    pool.fork("p", "c")
    pool.fork("p", "d")
    assert pool.free("c") == []
    assert pool.free("p") == []
    assert pool.ref_counts == [1, 1, 0, 0]
    assert pool.free("d") == [0, 1]
    assert list(pool.free_blocks) == [2, 3, 0, 1]


def test_take_copies_returns_then_clears():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate("p", 5)                        # [0, 1]
    pool.fork("p", "a")
    pool.fork("p", "b")
    assert pool.take_copies() == []
    pool.append("a", 1)                          # (1, 2)
    pool.append("b", 1)                          # (1, 3): block 1 still has two holders
    assert pool.pending_copies == [(1, 2), (1, 3)]
    copies = pool.take_copies()
    assert copies == [(1, 2), (1, 3)]
    assert pool.pending_copies == []
    assert pool.take_copies() == []
    assert copies == [(1, 2), (1, 3)]            # the returned list is not cleared under us
    pool.append("p", 1)                          # block 1 is the parent's alone: no copy
    assert pool.take_copies() == []


# -- errors ----------------------------------------------------------------------------------
def _shared_pool():
    pool = BlockPool(num_blocks=6, block_size=4)
    pool.allocate("p", 6)                        # [0, 1]
    pool.allocate("x", 3)                        # [2]
    pool.fork("p", "c")
    pool.free("x")
    return pool


def test_fork_of_unknown_parent_raises_and_changes_nothing():
    pool = _shared_pool()
    before = snapshot(pool)
    with pytest.raises(kvlab.UnknownSequenceError, match="unknown sequence id 'ghost'"):
        pool.fork("ghost", "new")
    with pytest.raises(kvlab.UnknownSequenceError, match="unknown sequence id 'x'"):
        pool.fork("x", "new")                    # freed ids are unknown too
    assert snapshot(pool) == before
    assert "new" not in pool


@pytest.mark.parametrize("child", ["c", "p"])
def test_fork_onto_an_existing_id_raises_and_changes_nothing(child):
    pool = _shared_pool()
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"sequence '{child}' already exists") as info:
        pool.fork("p", child)
    assert not isinstance(info.value, kvlab.KVLabError)
    assert snapshot(pool) == before


def test_write_that_bypasses_copy_on_write_is_refused():
    pool = _shared_pool()
    pool.append("c", 0)
    before = snapshot(pool)
    # position 4 is in block 1, which p and c share
    with pytest.raises(kvlab.SharedBlockWriteError,
                       match=r"position 4 of sequence 'c' is in block 1, shared by 2 sequences.*copy-on-write"):
        pool.slot_mapping("c", 4, 2)
    with pytest.raises(kvlab.SharedBlockWriteError, match="position 5 of sequence 'p' is in block 1"):
        pool.slot_mapping("p", 5, 1)
    with pytest.raises(kvlab.SharedBlockWriteError, match="position 0 of sequence 'p' is in block 0"):
        pool.slot_mapping("p", 0, 6)
    assert snapshot(pool) == before
    assert issubclass(kvlab.SharedBlockWriteError, kvlab.KVLabError)
    # no tokens: nothing written, nothing refused
    assert pool.slot_mapping("c", 4, 0) == []
    # after copy-on-write the new slots are private and may be written
    pool.append("c", 1)
    assert pool.slot_mapping("c", 6, 1) == [pool.block_table("c")[1] * 4 + 2]
    with pytest.raises(kvlab.SharedBlockWriteError, match="in block 0"):
        pool.slot_mapping("c", 3, 4)             # block 0 is still shared


def test_out_of_blocks_during_copy_on_write_changes_nothing():
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate("p", 6)                        # [0, 1]
    pool.fork("p", "c")
    pool.allocate("x", 4)                        # [2]: no block left
    before = snapshot(pool)
    # one slot is left in block 1, but block 1 is shared: the copy needs a block too
    with pytest.raises(kvlab.OutOfBlocksError, match="sequence 'c' needs 1 more blocks, 0 are free"):
        pool.append("c", 1)
    with pytest.raises(kvlab.OutOfBlocksError, match="sequence 'p' needs 2 more blocks, 0 are free"):
        pool.append("p", 3)                      # the copy and one more block
    assert snapshot(pool) == before
    assert pool.take_copies() == []
    pool.free("x")
    assert pool.append("c", 1) == [2]
    assert pool.take_copies() == [(1, 2)]


# -- the real kernels on a scripted story ------------------------------------------------------
def test_fork_and_copy_on_write_with_the_real_kernels():
    from kvlab.kernels import copy_blocks, write_kv

    num_layers, num_blocks, block_size, num_kv_heads, head_dim = 2, 6, 4, 2, 4
    gen = torch.Generator().manual_seed(0)
    device = kvlab.profile.DEVICE
    cache = allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                              device=device)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    pool = BlockPool(num_blocks=num_blocks, block_size=block_size)
    want: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}   # per sequence: per layer (K, V)

    def new_kv(n):
        shape = (n, num_kv_heads, head_dim)
        return [(torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device))
                for _ in range(num_layers)]

    def write(seq, start, kv):
        slots = torch.tensor(pool.slot_mapping(seq, start, kv[0][0].shape[0]), dtype=torch.int64, device=device)
        for layer, (k, v) in enumerate(kv):
            write_kv(k, v, cache.k[layer], cache.v[layer], slots)

    def append(seq, n):
        old = pool.seq_len(seq)
        pool.append(seq, n)
        copies = pool.take_copies()
        if copies:
            copy_blocks([cache.k, cache.v], torch.tensor(copies, dtype=torch.int64, device=device))
        kv = new_kv(n)
        write(seq, old, kv)
        want[seq] = [(torch.cat([k0, k]), torch.cat([v0, v])) for (k0, v0), (k, v) in zip(want[seq], kv)]
        return copies

    def check_all():
        for seq, layers in want.items():
            for layer, (k, v) in enumerate(layers):
                table, n = pool.block_table(seq), pool.seq_len(seq)
                assert torch.equal(gather_kv(cache.k[layer], table, n), k), (seq, layer)
                assert torch.equal(gather_kv(cache.v[layer], table, n), v), (seq, layer)

    pool.allocate("p", 6)
    want["p"] = new_kv(6)
    write("p", 0, want["p"])
    pool.fork("p", "c")
    want["c"] = [(k.clone(), v.clone()) for k, v in want["p"]]
    check_all()
    with pytest.raises(kvlab.SharedBlockWriteError):
        pool.slot_mapping("c", 5, 1)
    assert append("c", 1) == [(1, 2)]            # copy-on-write, then the child's 7th token
    check_all()                                  # the parent still reads its own 6 tokens
    assert append("p", 3) == []                  # block 1 is the parent's alone: in place
    check_all()
    pool.fork("c", "g")
    want["g"] = [(k.clone(), v.clone()) for k, v in want["c"]]
    assert append("g", 2) == [(2, 4)]
    assert append("c", 1) == []
    check_all()
    # the kernels did what the references do, on a copy of the final state
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    copy_blocks_ref([k_ref, v_ref], torch.tensor([[0, 5]], dtype=torch.int64, device=device))
    copy_blocks([cache.k, cache.v], torch.tensor([[0, 5]], dtype=torch.int64, device=device))
    for got, ref in ((cache.k, k_ref), (cache.v, v_ref)):   # never-written slots are NaN in both
        assert torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got.nan_to_num(), ref.nan_to_num())


# -- property test: a state machine against a shadow model of token contents ------------------
SEQ_IDS = st.integers(min_value=0, max_value=4)
MOSTLY = st.sampled_from([True, True, True, False])   # hypothesis favours small integers: not these


class SharingMachine(PoolMachineHelpers, RuleBasedStateMachine):
    """Random allocate / fork / append / free against ``model``: each live sequence's tokens.

    ``k``/``v`` are a real KV store, ``[num_blocks, block_size, 1, 1]``: K holds each token's
    id, V its negation. Tokens are written through ``slot_mapping`` (which refuses shared
    blocks) and blocks are copied as ``copy_blocks`` copies them. Every token id is used once,
    so a token read back in the wrong sequence cannot go unnoticed. Every call that raises
    must leave the pool exactly as it was.
    """

    @initialize(num_blocks=st.integers(4, 12) | st.integers(1, 3), block_size=st.sampled_from([3, 2, 4, 1]),
                data=st.data())
    def setup(self, num_blocks, block_size, data):
        self.pool = BlockPool(num_blocks=num_blocks, block_size=block_size)
        self.new_store(num_blocks, block_size)
        self.model: dict[int, list[int]] = {}
        self.next_token = 0
        # start with one sequence, so that forks and copies come early
        self.do_allocate(0, data.draw(st.integers(1, max(1, self.pool.capacity // 2)), label="first length"))

    # -- helpers (attempt, write, fork_checked, copy_then_write, ...: PoolMachineHelpers) ---
    def fresh_tokens(self, n):
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return tokens

    def free_count(self):
        used = {b for table in self.pool.block_tables.values() for b in table}
        return self.pool.num_blocks - len(used)

    # -- rules --------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        unused = [s for s in range(5) if s not in self.model]
        seq = data.draw(st.sampled_from(unused) if unused and data.draw(MOSTLY) else SEQ_IDS)
        self.do_allocate(seq, data.draw(st.integers(0, 12), label="n"))

    def do_allocate(self, seq, n):
        free_before = list(self.pool.free_blocks)
        if seq in self.model:
            expected, match = ValueError, "already holds blocks"
        elif n > self.pool.capacity:
            expected, match = ValueError, "more than the pool's"
        elif blocks_needed(n, self.pool.block_size) > self.free_count():
            expected, match = kvlab.OutOfBlocksError, "more blocks"
        else:
            expected, match = None, None
        exc, table = self.attempt(lambda: self.pool.allocate(seq, n), expected, match)
        if exc is None:
            assert table == free_before[:blocks_needed(n, self.pool.block_size)]
            tokens = self.fresh_tokens(n)
            self.write(seq, 0, tokens)
            self.model[seq] = tokens

    def do_fork(self, parent, child):
        self.fork_checked(parent, child)

    def do_append(self, seq, n):
        pool, bs = self.pool, self.pool.block_size
        old_len = len(self.model[seq])
        table_before = pool.block_table(seq)
        others_before = {s: pool.block_table(s) for s in self.model if s != seq}
        free_before = list(pool.free_blocks)
        cow = n > 0 and old_len % bs != 0 and self.holders(table_before[-1]) > 1
        needed = blocks_needed(old_len + n, bs) - len(table_before) + cow
        if old_len + n > pool.capacity:
            self.attempt(lambda: pool.can_append(seq, n), ValueError)
            expected, match = ValueError, "more than the pool's"
        else:
            assert pool.can_append(seq, n) == (needed <= self.free_count())
            if needed > self.free_count():
                expected, match = kvlab.OutOfBlocksError, f"needs {needed} more blocks"
            else:
                expected, match = None, None
        exc, taken = self.attempt(lambda: pool.append(seq, n), expected, match)
        event(f"append: {type(exc).__name__ if exc else 'copy-on-write' if cow else 'ok'}")
        if exc is not None:
            return
        assert taken == free_before[:needed]
        table = pool.block_table(seq)
        copies = pool.take_copies()
        assert pool.pending_copies == []
        if cow:
            assert copies == [(table_before[-1], taken[0])]
            assert table == table_before[:-1] + taken
        else:
            assert copies == []
            assert table == table_before + taken
        assert {s: pool.block_table(s) for s in others_before} == others_before
        self.copy_then_write(seq, copies, self.fresh_tokens(n))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        live = sorted(self.model)
        unused = [s for s in range(5) if s not in self.model]
        fresh = unused and data.draw(MOSTLY)                   # mostly a new child id
        child = data.draw(st.sampled_from(unused) if fresh else SEQ_IDS)
        known = live and data.draw(MOSTLY)                     # mostly a live parent
        parent = data.draw(st.sampled_from(live) if known else SEQ_IDS)
        self.do_fork(parent, child)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.do_append(seq, self.draw_n(data, seq))

    @precondition(lambda self: self.model and len(self.model) < 5)
    @rule(data=st.data())
    def fork_then_append(self, data):
        """The copy-on-write story in one step: fork a live sequence, then grow one side."""
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child = min(s for s in range(5) if s not in self.model)
        self.do_fork(parent, child)
        seq = data.draw(st.sampled_from([child, parent]))
        self.do_append(seq, self.draw_n(data, seq))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        table = self.pool.block_table(seq)
        released = [b for b in table if self.holders(b) == 1]
        event(f"free: {'keeps shared blocks' if len(released) < len(table) else 'releases all'}")
        check_free(self.pool, seq, released)
        del self.model[seq]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def write_into_shared_block(self, data):
        """A write at positions inside a shared block must be refused; a private one is fine."""
        pool, bs = self.pool, self.pool.block_size
        seq = data.draw(st.sampled_from(sorted(self.model)))
        length = len(self.model[seq])
        if length == 0:
            return
        start = data.draw(st.integers(0, length - 1))
        n = data.draw(st.integers(1, length - start))
        table = pool.block_table(seq)
        shared = [i for i in range(start // bs, blocks_needed(start + n, bs)) if self.holders(table[i]) > 1]
        event(f"write: {'refused' if shared else 'private'}")
        if shared:
            self.attempt(lambda: pool.slot_mapping(seq, start, n), kvlab.SharedBlockWriteError,
                         f"is in block {table[shared[0]]}, shared by {self.holders(table[shared[0]])}")
        else:
            _, slots = self.attempt(lambda: pool.slot_mapping(seq, start, n))
            assert slots == [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    @rule(seq=SEQ_IDS, bad=st.sampled_from([-1, 1.0, None]))
    def failing_calls(self, seq, bad):
        if seq in self.model:
            self.attempt(lambda: self.pool.append(seq, bad), TypeError if type(bad) is not int else ValueError)
            self.attempt(lambda: self.pool.allocate(seq, 1), ValueError, "already holds blocks")
        else:
            for call in (lambda: self.pool.free(seq), lambda: self.pool.append(seq, 1),
                         lambda: self.pool.fork(seq, seq + 100)):
                self.attempt(call, kvlab.UnknownSequenceError, "unknown sequence id")

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def ref_counts_are_table_occurrences(self):
        assert self.pool.ref_counts == occurrences(self.pool)

    @invariant()
    def free_blocks_are_unheld_and_counts_add_up(self):
        pool = self.pool
        free = list(pool.free_blocks)
        assert len(set(free)) == len(free)
        held = {b for table in pool.block_tables.values() for b in table}
        assert not set(free) & held
        assert all(pool.ref_counts[b] == 0 for b in free)
        assert set(free) | held == set(range(pool.num_blocks))
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_used_blocks == len(held)
        assert not pool.evictable and pool.pending_copies == []

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        pool, bs = self.pool, self.pool.block_size
        assert set(pool.block_tables) == set(self.model)
        flat_k, flat_v = self.k.flatten().tolist(), self.v.flatten().tolist()   # one read of the store
        for seq, tokens in self.model.items():
            table = pool.block_table(seq)
            assert pool.seq_len(seq) == len(tokens)
            assert len(table) == blocks_needed(len(tokens), bs)
            slots = [table[p // bs] * bs + p % bs for p in range(len(tokens))]   # reads, through the table
            assert [flat_k[s] for s in slots] == tokens, (seq, tokens)
            assert [flat_v[s] for s in slots] == [-t for t in tokens]


SharingMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],   # no slow "explain"
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSharingStateMachine = SharingMachine.TestCase
