"""Prefix caching in :class:`kvlab.paging.BlockPool`: hits, salts, eviction, reset.

Unit tests pin the behaviour on small hand-made cases; a state machine then drives random
allocate / append / fork / free / reset sequences (failing calls included) with prefix
caching on. It keeps its own KV store of token ids, written the way an engine writes (only
the tokens a prefix hit did not cover), so a hit is checked against what its blocks really
hold, not against the pool's own bookkeeping.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvlab
from helpers import PoolMachineHelpers, snapshot
from kvlab.paging import BlockPool, blocks_needed
from kvlab.paging.prefix_hash import ROOT, hash_block, hash_blocks, root_hash
from kvlab.reference import gather_kv


def cached_pool(num_blocks=8, block_size=4):
    return BlockPool(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)


def alloc(pool, seq, tokens, salt=None):
    return pool.allocate(seq, len(tokens), list(tokens), salt)


P0, P1, P2, P3 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]   # one block each (size 4)


# -- hits --------------------------------------------------------------------------------------
def test_second_request_with_the_same_prompt_hits_every_full_block():
    pool = cached_pool()
    prompt = P0 + P1 + [17, 18]
    assert alloc(pool, "a", prompt) == [0, 1, 2]
    assert pool.num_cached_tokens["a"] == 0
    hashes = hash_blocks(prompt, 4)
    assert len(hashes) == 2
    assert pool.seq_hashes["a"] == hashes
    assert pool.cached_blocks == {hashes[0]: 0, hashes[1]: 1}
    assert pool.block_hashes[:3] == [hashes[0], hashes[1], None]
    assert alloc(pool, "b", prompt) == [0, 1, 3]
    assert pool.num_cached_tokens["b"] == 8
    assert pool.ref_counts[:4] == [2, 2, 1, 1]
    assert pool.seq_hashes["b"] == hashes
    # a prompt that shares only the first block hits only it
    assert alloc(pool, "c", P0 + P2 + [1]) == [0, 4, 5]
    assert pool.num_cached_tokens["c"] == 4
    # the written positions are all in private blocks: nothing is refused
    assert pool.slot_mapping("b", 8, 2) == [12, 13]
    assert pool.slot_mapping("c", 4, 5) == [16, 17, 18, 19, 20]


@pytest.mark.parametrize("num_full", [1, 2, 3])
def test_hit_is_capped_so_that_the_last_prompt_token_is_computed(num_full):
    pool = cached_pool(num_blocks=10)
    prompt = (P0 + P1 + P2)[:4 * num_full]
    first = alloc(pool, "a", prompt)
    second = alloc(pool, "b", prompt)
    assert pool.num_cached_tokens["b"] == 4 * (num_full - 1)
    assert second[:num_full - 1] == first[:num_full - 1]
    assert second[-1] not in first                  # the last block is computed again...
    last_hash = hash_blocks(prompt, 4)[-1]
    assert pool.cached_blocks[last_hash] == first[-1]
    assert pool.block_hashes[second[-1]] is None    # ...and the block cached earlier stays the cached one
    assert pool.seq_hashes["b"] == hash_blocks(prompt, 4)
    # one token more and every full block is a hit
    alloc(pool, "c", prompt + [99])
    assert pool.num_cached_tokens["c"] == 4 * num_full
    assert pool.block_table("c")[:num_full] == first


def test_hit_cap_with_one_token_blocks():
    pool = cached_pool(num_blocks=8, block_size=1)
    alloc(pool, "a", [5, 6, 7])
    alloc(pool, "b", [5, 6, 7])
    assert pool.num_cached_tokens["b"] == 2
    alloc(pool, "c", [5])
    assert pool.num_cached_tokens["c"] == 0        # a one-token prompt computes its only token
    alloc(pool, "d", [])
    assert pool.num_cached_tokens["d"] == 0 and pool.block_table("d") == []


def test_computed_blocks_is_what_allocate_then_reuses_and_changes_nothing():
    """The pool's query of a cached prefix (vLLM's get_computed_blocks) predicts allocate's hits."""
    pool = cached_pool(num_blocks=32)
    alloc(pool, "a", P0 + P1 + P2 + [99])
    alloc(pool, "s", P0 + P1 + [99], salt="tenant-b")
    pool.free("a")                                   # its cached blocks stay reusable (evictable)
    prompts = [(P0 + P1 + P2, None), (P0 + P1 + P2 + [7], None), (P0 + P3 + [1], None), (P0 + P1 + [1], "tenant-b"),
               (P0 + P1 + [1], "tenant-c"), (P1 + P0 + [1], None), (P0[:3], None), ([], None)]
    hits = []
    for i, (prompt, salt) in enumerate(prompts):
        before = snapshot(pool)
        hits.append(pool.computed_blocks(prompt, salt))
        assert snapshot(pool) == before, "a query changed the pool"
        table = alloc(pool, i, prompt, salt)
        assert hits[-1] == table[:pool.num_cached_tokens[i] // 4], (prompt, salt)
    assert hits == [[0, 1], [0, 1, 2], [0], [4, 5], [], [], [], []]
    disabled = BlockPool(num_blocks=4, block_size=4)
    alloc(disabled, "a", P0 + P1)
    assert disabled.computed_blocks(P0 + P1 + [1]) == [], "without prefix caching nothing is reused"


def test_partial_blocks_are_never_cached():
    pool = cached_pool()
    alloc(pool, "a", P0 + [5, 6])                    # block 1 is half full
    assert len(pool.cached_blocks) == 1
    assert pool.block_hashes[1] is None
    assert len(pool.seq_hashes["a"]) == 1
    alloc(pool, "b", P0 + [5, 6, 7])                 # extends a's partial block: only block 0 is a hit
    assert pool.num_cached_tokens["b"] == 4
    assert pool.block_table("b")[1] != 1
    assert len(pool.cached_blocks) == 1
    # once a's partial block fills, it is cached, and a later prompt hits it
    pool.free("b")
    pool.append("a", 2, [7, 8])
    assert pool.block_hashes[1] == hash_blocks(P0 + P1, 4)[1]
    assert pool.seq_hashes["a"] == hash_blocks(P0 + P1, 4)
    alloc(pool, "c", P0 + P1 + [9])
    assert pool.num_cached_tokens["c"] == 8
    assert pool.block_table("c")[:2] == [0, 1]


def test_different_salts_never_hit():
    pool = cached_pool(num_blocks=12)
    prompt = P0 + P1 + [9]
    a = alloc(pool, "a", prompt, salt="alice")
    b = alloc(pool, "b", prompt, salt="bob")
    n = alloc(pool, "n", prompt)                     # no salt: a third tenant
    assert pool.num_cached_tokens["b"] == pool.num_cached_tokens["n"] == 0
    assert not set(a) & set(b) and not set(a) & set(n) and not set(b) & set(n)
    assert len({pool.block_hashes[t[0]] for t in (a, b, n)}) == 3
    assert alloc(pool, "a2", prompt, salt="alice")[:2] == a[:2]      # same tenant: a hit
    assert pool.num_cached_tokens["a2"] == 8
    assert root_hash("alice") != root_hash("bob") != root_hash(None) == ROOT
    assert pool.seq_hashes["b"] == hash_blocks(prompt, 4, "bob")


def test_extra_keys_change_the_hash():
    tokens = P0
    plain = hash_block(ROOT, tokens)
    assert plain == hash_blocks(tokens, 4)[0]
    assert hash_block(plain, P1) == hash_blocks(P0 + P1, 4)[1]          # the chain, block by block
    lora1 = hash_block(ROOT, tokens, ("lora-1",))
    assert lora1 != plain
    assert lora1 != hash_block(ROOT, tokens, ("lora-2",))
    assert lora1 == hash_block(ROOT, tokens, ("lora-1",))               # deterministic
    assert hash_block(ROOT, tokens, ("a", "b")) != hash_block(ROOT, tokens, ("b", "a"))
    assert hash_block(ROOT, tokens, (1,)) != hash_block(ROOT, tokens, ("1",))
    # an extra key on block 0 changes every later hash of the chain
    assert hash_block(lora1, P1) != hash_block(plain, P1)
    # and salts change the root, so the whole chain
    assert hash_blocks(tokens, 4, "s") == [hash_block(root_hash("s"), tokens)]


@pytest.mark.parametrize("keys_a, keys_b", [
    pytest.param((1, 23), (12, 3), id="(1,23)-vs-(12,3)"),
    pytest.param((1, 2), (12,), id="(1,2)-vs-(12,)"),
    pytest.param(("ab",), ("a", "b"), id="('ab',)-vs-('a','b')"),
])
def test_different_extra_keys_give_different_hashes(keys_a, keys_b):
    """Extra keys are part of a block's identity: two different key tuples must never collide."""
    assert hash_block(ROOT, P0, keys_a) != hash_block(ROOT, P0, keys_b)


# -- eviction ----------------------------------------------------------------------------------
def test_freed_cached_blocks_are_evictable_and_revived_by_a_later_hit():
    pool = cached_pool()
    prompt = P0 + P1 + [9, 10]
    alloc(pool, "a", prompt)                         # [0, 1, 2]
    hashes = list(pool.block_hashes)
    assert pool.free("a") == [0, 1, 2]
    assert list(pool.evictable) == [1, 0]            # tail first
    assert list(pool.free_blocks) == [3, 4, 5, 6, 7, 2]   # the partial block held nothing cacheable
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    assert pool.block_hashes == hashes               # still cached
    assert alloc(pool, "b", prompt) == [0, 1, 3]     # revived: same hash, same block
    assert pool.num_cached_tokens["b"] == 8
    assert list(pool.evictable) == []
    assert pool.ref_counts[:4] == [1, 1, 0, 1]
    assert pool.block_hashes[:2] == hashes[:2]
    assert pool.cached_blocks == {hashes[0]: 0, hashes[1]: 1}


def test_allocation_takes_never_cached_free_blocks_before_evicting():
    pool = cached_pool(num_blocks=4)
    alloc(pool, "a", P0 + P1)                        # [0, 1], both cached
    pool.free("a")
    assert list(pool.free_blocks) == [2, 3] and list(pool.evictable) == [1, 0]
    assert alloc(pool, "b", P2 + P3) == [2, 3]       # the never-cached ones first
    assert list(pool.evictable) == [1, 0]
    assert len(pool.cached_blocks) == 4
    assert alloc(pool, "c", [7, 7, 7, 7]) == [1]     # then the least recent cached one
    assert list(pool.evictable) == [0]
    assert hash_blocks(P0 + P1, 4)[1] not in pool.cached_blocks
    assert pool.block_hashes[1] == hash_blocks([7, 7, 7, 7], 4)[0]


def test_eviction_order_is_least_recently_freed_first_and_tail_before_head():
    pool = cached_pool(num_blocks=6)
    alloc(pool, "a", P0 + P1)                        # [0, 1]
    alloc(pool, "b", P2 + P3)                        # [2, 3]
    alloc(pool, "x", [0] * 8)                        # [4, 5]: nothing free is left
    pool.free("b")
    pool.free("a")
    assert list(pool.evictable) == [3, 2, 1, 0]      # b's tail, b's head, then a's
    taken = [alloc(pool, f"n{i}", [50 + i] * 4)[0] for i in range(4)]
    assert taken == [3, 2, 1, 0]
    # a hit moves a block out of the queue; freeing it again puts it at the back
    pool.free("n3")                                  # block 0 again (cached under [53] * 4)
    pool.free("n0")                                  # block 3
    assert list(pool.evictable) == [0, 3]
    alloc(pool, "again", [53] * 4 + [1])             # hits block 0, needs one more: evicts 3
    assert pool.block_table("again") == [0, 3]
    assert pool.num_cached_tokens["again"] == 4


def test_evicted_block_loses_its_hash_and_later_prompts_hit_only_up_to_it():
    pool = cached_pool(num_blocks=5)
    prompt = P0 + P1 + P2 + [1]
    alloc(pool, "a", prompt)                         # [0, 1, 2, 3]
    hashes = hash_blocks(prompt, 4)
    pool.free("a")                                   # evictable [2, 1, 0], free [4, 3]
    alloc(pool, "x", [7] * 12)                       # takes 4, 3, then evicts 2 (a's tail)
    assert pool.block_table("x") == [4, 3, 2]
    assert hashes[2] not in pool.cached_blocks
    assert pool.block_hashes[2] == hash_blocks([7] * 12, 4)[2]
    pool.free("x")                                   # evictable [1, 0, 2, 3, 4]
    alloc(pool, "b", prompt)
    assert pool.num_cached_tokens["b"] == 8          # up to the evicted block, not beyond
    assert pool.block_table("b")[:2] == [0, 1]


def test_evicted_head_makes_its_cached_descendants_unreachable():
    pool = cached_pool(num_blocks=6)
    alloc(pool, "a", P0)                             # [0]: P0 cached in block 0
    alloc(pool, "b", P0)                             # capped: computes P0 again in block 1 (not cached)
    assert pool.block_table("b") == [1] and pool.block_hashes[1] is None
    pool.append("b", 5, P1 + [9])                    # block 2 = P1 after P0: cached; block 3 partial
    h0, h1 = hash_blocks(P0 + P1, 4)
    assert pool.cached_blocks == {h0: 0, h1: 2}
    pool.free("a")                                   # the head is freed first...
    pool.free("b")                                   # ...its descendant later
    assert list(pool.evictable) == [0, 2]
    assert list(pool.free_blocks) == [4, 5, 1, 3]
    alloc(pool, "x", [7] * 12)                       # never-cached blocks first: 4, 5, 1...
    assert pool.block_table("x") == [4, 5, 1]
    alloc(pool, "y", [8] * 4)                        # ...and 3
    assert pool.block_table("y") == [3]
    alloc(pool, "z", [8] * 3)                        # now one must be evicted: the least recent, the head
    assert pool.block_table("z") == [0]
    assert h0 not in pool.cached_blocks and pool.block_hashes[0] is None
    assert pool.cached_blocks[h1] == 2               # the descendant is still cached...
    pool.free("x")
    alloc(pool, "w", P0 + P1 + [9])                  # ...but no prompt can reach it
    assert pool.num_cached_tokens["w"] == 0


# -- reset -------------------------------------------------------------------------------------
def test_reset_prefix_cache():
    pool = cached_pool()
    assert pool.reset_prefix_cache()                 # nothing to forget
    alloc(pool, "a", P0 + P1 + [9])
    alloc(pool, "b", P2)
    pool.free("b")
    before = snapshot(pool)
    assert pool.reset_prefix_cache() is False        # a block is in use
    assert snapshot(pool) == before
    pool.free("a")
    assert list(pool.evictable) == [3, 1, 0]         # b's block, then a's tail, then a's head
    free_before = list(pool.free_blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert pool.block_hashes == [None] * 8
    assert list(pool.evictable) == []
    assert list(pool.free_blocks) == free_before + [3, 1, 0]  # least recent first
    assert sorted(pool.free_blocks) == list(range(8))
    alloc(pool, "c", P0 + P1 + [9])
    assert pool.num_cached_tokens["c"] == 0          # everything forgotten


# -- errors ------------------------------------------------------------------------------------
def test_out_of_blocks_on_allocate_with_hits_counts_revived_blocks_and_changes_nothing():
    pool = cached_pool(num_blocks=5)
    alloc(pool, "a", P0 + P1 + [9])                  # [0, 1, 2]
    alloc(pool, "x", [7] * 4)                        # [3]
    pool.free("a")                                   # evictable [1, 0], free [4, 2]
    assert pool.num_free_blocks == 4
    before = snapshot(pool)
    # 5 blocks, 2 of them hits: 3 more are needed, and reviving the hits leaves only 2 to take
    with pytest.raises(kvlab.OutOfBlocksError, match="sequence 'b' needs 3 more blocks, 2 are free"):
        alloc(pool, "b", P0 + P1 + P2 + P3 + [9])
    assert snapshot(pool) == before
    assert "b" not in pool
    # exactly what fits succeeds
    assert alloc(pool, "b", P0 + P1 + P2 + [9]) == [0, 1, 4, 2]
    assert pool.num_cached_tokens["b"] == 8
    assert pool.num_free_blocks == 0
    # hits held by a live sequence cost no free block at all
    pool.free("b")                                   # evictable [4, 1, 0], free [2]
    assert alloc(pool, "c", P0 + P1 + [9]) == [0, 1, 2]
    free = pool.num_free_blocks
    before = snapshot(pool)
    with pytest.raises(kvlab.OutOfBlocksError, match=f"needs {free + 1} more blocks, {free} are free"):
        alloc(pool, "d", P0 + P1 + [0] * (4 * free + 1))
    assert snapshot(pool) == before


@pytest.mark.parametrize("token_ids, got", [(None, "none"), ([1, 2], "2"), ([1, 2, 3, 4], "4")])
def test_prefix_caching_requires_the_prompt_tokens(token_ids, got):
    pool = cached_pool()
    alloc(pool, "a", P0 + [1])
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"token_ids must give the 3 new tokens, got {got}"):
        pool.allocate("b", 3, token_ids)
    with pytest.raises(ValueError, match=f"token_ids must give the 3 new tokens, got {got}"):
        pool.append("a", 3, token_ids)
    assert snapshot(pool) == before


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_allocate_with_out_of_range_token_ids_changes_nothing(bad):
    pool = cached_pool()
    alloc(pool, "a", P0 + [1])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="token ids must be in"):
        alloc(pool, "b", P0 + [bad])
    assert snapshot(pool) == before


@pytest.mark.parametrize("new_tokens", [
    pytest.param([3, -1], id="-1-completes-a-block"),
    pytest.param([-1], id="-1-in-a-partial-block"),
    pytest.param([2**32, 5], id="2**32-completes-a-block"),
])
def test_append_with_out_of_range_token_ids_changes_nothing(new_tokens):
    """Out-of-range ids are refused before anything changes, as allocate refuses them, whether
    or not they complete a block (an id accepted into a partial block would break the append
    that later fills it)."""
    pool = cached_pool()
    alloc(pool, "a", [1, 2])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="token ids must be in"):
        pool.append("a", len(new_tokens), new_tokens)
    assert snapshot(pool) == before


def test_out_of_blocks_on_append_with_prefix_caching_changes_nothing():
    pool = cached_pool(num_blocks=2)
    alloc(pool, "a", P0 + [1])
    pool.fork("a", "b")
    before = snapshot(pool)
    with pytest.raises(kvlab.OutOfBlocksError, match="'b' needs 1 more blocks, 0 are free"):
        pool.append("b", 1, [2])                     # copy-on-write needs a block
    assert snapshot(pool) == before


# -- fork and copy-on-write with prefix caching ----------------------------------------------
def test_fork_with_prefix_caching_copies_the_prompt_bookkeeping():
    pool = cached_pool()
    alloc(pool, "a", P0 + [9, 9], salt="s")
    alloc(pool, "p", P0 + P1 + [9], salt="s")
    assert pool.num_cached_tokens["p"] == 4
    pool.fork("p", "c")
    assert pool.seq_tokens["c"] == pool.seq_tokens["p"] and pool.seq_tokens["c"] is not pool.seq_tokens["p"]
    assert pool.seq_hashes["c"] == pool.seq_hashes["p"]
    assert pool.seq_salts["c"] == "s"
    assert pool.num_cached_tokens["c"] == 4
    # both sides fill the shared partial block with different tokens: each gets its own hash
    assert pool.block_table("p") == [0, 2, 3]        # block 0 was a hit
    pool.append("c", 3, [1, 1, 1])                   # copy-on-write
    assert pool.take_copies() == [(3, 4)]
    pool.append("p", 3, [2, 2, 2])                   # block 3 is p's alone now
    assert pool.take_copies() == []
    hc = hash_blocks(P0 + P1 + [9, 1, 1, 1], 4, "s")
    hp = hash_blocks(P0 + P1 + [9, 2, 2, 2], 4, "s")
    assert pool.seq_hashes["c"] == hc and pool.seq_hashes["p"] == hp
    assert pool.block_hashes[4] == hc[2] and pool.block_hashes[3] == hp[2]
    assert pool.seq_tokens["p"] == P0 + P1 + [9, 2, 2, 2]


def test_equal_blocks_filled_by_both_sides_of_a_fork_cache_once():
    pool = cached_pool()
    alloc(pool, "p", P0 + [9])
    pool.fork("p", "c")
    pool.append("c", 3, [1, 2, 3])                   # c: [0, 2], copy of block 1
    pool.append("p", 3, [1, 2, 3])                   # p: [0, 1], same tokens
    h = hash_blocks(P0 + [9, 1, 2, 3], 4)[1]
    assert pool.cached_blocks[h] == 2                # the first to fill wins
    assert pool.block_hashes[1] is None
    assert pool.seq_hashes["p"] == pool.seq_hashes["c"]


# -- property test: a state machine with prefix caching on -------------------------------------
MAX_SEQS = 6
SEQ_IDS = st.integers(min_value=0, max_value=MAX_SEQS - 1)
SALTS = [None, None, "t1", None, "t2"]     # mostly one tenant, so that prompts meet
VOCAB = st.integers(0, 2)
MOSTLY = st.sampled_from([True, True, True, False])   # hypothesis favours small integers: not these


class PrefixCacheMachine(PoolMachineHelpers, RuleBasedStateMachine):
    """Random allocate / append / fork / free / reset with prefix caching on.

    ``model`` is each live sequence's tokens, ``salts`` its salt. ``k``/``v`` form a KV store
    of token ids ``[num_blocks, block_size, 1, 1]``; an allocation writes only the tokens past
    its hit, so a wrong hit shows up as wrong tokens read back. ``hash_tokens`` remembers, for
    every block hash ever seen, the tokens of that block and the salt of its chain.
    """

    @initialize(num_blocks=st.sampled_from([6, 8, 4, 10, 12, 5, 9, 2, 1, 3]),
                block_size=st.sampled_from([2, 3, 4, 1]), data=st.data())
    def setup(self, num_blocks, block_size, data):
        self.pool = BlockPool(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)
        self.new_store(num_blocks, block_size)
        self.model: dict[int, list[int]] = {}
        self.salts: dict[int, object] = {}
        self.hash_tokens: dict[bytes, tuple[object, list[int]]] = {}
        self.prefixes = data.draw(
            st.lists(st.lists(VOCAB, min_size=block_size + 1, max_size=3 * block_size), min_size=3, max_size=3),
            label="prefixes")

    # -- helpers (attempt, write, fork_checked, copy_then_write, ...: PoolMachineHelpers) ---
    def read(self, table, n, flat=None):
        """The first ``n`` token ids stored through ``table`` (``flat``: the store, already read)."""
        if flat is None:
            return gather_kv(self.k, table, n).flatten().tolist()
        bs = self.pool.block_size
        return [flat[table[p // bs] * bs + p % bs] for p in range(n)]

    def takeable(self, keep=()):
        """Blocks a new allocation takes, in order: never-cached free ones, then least recent cached."""
        return list(self.pool.free_blocks) + [b for b in self.pool.evictable if b not in keep]

    def remember_hashes(self, seq):
        bs, tokens, salt = self.pool.block_size, self.model[seq], self.salts[seq]
        for i, h in enumerate(hash_blocks(tokens[:len(tokens) // bs * bs], bs, salt)):
            self.hash_tokens.setdefault(h, (salt, tokens[i * bs:(i + 1) * bs]))

    def do_fork(self, parent, child):
        if self.fork_checked(parent, child) is not None:
            assert self.pool.seq_hashes[child] == self.pool.seq_hashes[parent]
            assert self.pool.num_cached_tokens[child] == self.pool.num_cached_tokens[parent]
            self.salts[child] = self.salts[parent]

    def do_append(self, seq, tokens):
        pool, bs, n = self.pool, self.pool.block_size, len(tokens)
        old_len = len(self.model[seq])
        table_before = pool.block_table(seq)
        others_before = {s: pool.block_table(s) for s in self.model if s != seq}
        cow = n > 0 and old_len % bs != 0 and self.holders(table_before[-1]) > 1
        needed = blocks_needed(old_len + n, bs) - len(table_before) + cow
        takeable = self.takeable()
        if old_len + n > pool.capacity:
            expected, match = ValueError, "more than the pool's"
        elif needed > len(takeable):
            expected, match = kvlab.OutOfBlocksError, f"needs {needed} more blocks, {len(takeable)} are free"
        else:
            expected, match = None, None
        exc, taken = self.attempt(lambda: pool.append(seq, n, tokens), expected, match)
        event(f"append: {type(exc).__name__ if exc else 'copy-on-write' if cow else 'ok'}")
        if exc is not None:
            return
        assert taken == takeable[:needed]
        copies = pool.take_copies()
        if cow:
            assert copies == [(table_before[-1], taken[0])]
            assert pool.block_table(seq) == table_before[:-1] + taken
        else:
            assert copies == []
            assert pool.block_table(seq) == table_before + taken
        assert {s: pool.block_table(s) for s in others_before} == others_before
        self.copy_then_write(seq, copies, tokens)
        self.remember_hashes(seq)

    # -- rules --------------------------------------------------------------------------
    def draw_prompt(self, data):
        """A prompt built from one of the shared prefixes and a random suffix, and a salt."""
        bs = self.pool.block_size
        prefix = data.draw(st.sampled_from(self.prefixes))
        whole = data.draw(MOSTLY)                   # mostly the whole prefix, sometimes a piece of it
        prompt = list(prefix) if whole else prefix[:data.draw(st.integers(0, len(prefix)))]
        prompt = prompt + data.draw(st.lists(VOCAB, max_size=2 * bs), label="suffix")
        if data.draw(MOSTLY):                       # mostly a prompt the pool could hold
            prompt = prompt[:self.pool.capacity]
        return prompt, data.draw(st.sampled_from(SALTS), label="salt")

    def do_allocate(self, seq, prompt, salt):
        pool, bs, n = self.pool, self.pool.block_size, len(prompt)
        hashes = hash_blocks(prompt, bs, salt)
        hits = []                                   # the longest cached run, capped below n tokens
        for h in hashes[:(n - 1) // bs if n else 0]:
            if h not in pool.cached_blocks:
                break
            hits.append(pool.cached_blocks[h])
        needed = blocks_needed(n, bs) - len(hits)
        takeable = self.takeable(keep=hits)
        never_cached = len(pool.free_blocks)
        if seq in self.model:
            expected, match = ValueError, "already holds blocks"
        elif n > pool.capacity:
            expected, match = ValueError, "more than the pool's"
        elif needed > len(takeable):
            expected, match = kvlab.OutOfBlocksError, f"needs {needed} more blocks, {len(takeable)} are free"
        else:
            expected, match = None, None
        exc, table = self.attempt(lambda: pool.allocate(seq, n, prompt, salt), expected, match)
        event(f"allocate: {type(exc).__name__ if exc else 'hit' if hits else 'miss'}")
        if exc is not None:
            return
        if needed > never_cached:
            event("allocate: evicts")
        if any(b not in pool.evictable and pool.ref_counts[b] == 1 for b in hits):
            event("allocate: revives")
        assert table == hits + takeable[:needed]
        cached = len(hits) * bs
        assert pool.num_cached_tokens[seq] == cached
        # a hit's blocks already hold exactly the prompt's first tokens: the engine skips them
        assert self.read(hits, cached) == prompt[:cached]
        self.write(seq, cached, prompt[cached:])
        self.model[seq] = list(prompt)
        self.salts[seq] = salt
        self.remember_hashes(seq)

    def do_free(self, seq):
        pool = self.pool
        table = pool.block_table(seq)
        free_before, evictable_before = list(pool.free_blocks), list(pool.evictable)
        released = [b for b in table if self.holders(b) == 1]
        assert pool.free(seq) == released
        # cached blocks become evictable, tail first; the others go back to the free queue
        assert list(pool.evictable) == evictable_before + [b for b in reversed(released) if pool.block_hashes[b]]
        assert list(pool.free_blocks) == free_before + [b for b in released if pool.block_hashes[b] is None]
        event(f"free: {'keeps shared blocks' if len(released) < len(table) else 'releases all'}")
        del self.model[seq], self.salts[seq]

    # -- rules --------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        unused = [s for s in range(MAX_SEQS) if s not in self.model]
        seq = data.draw(st.sampled_from(unused) if unused and data.draw(MOSTLY) else SEQ_IDS)
        self.do_allocate(seq, *self.draw_prompt(data))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def finish_then_admit(self, data):
        """A request finishes and a new one arrives: the usual way a freed prefix is hit again."""
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.do_free(seq)
        self.do_allocate(seq, *self.draw_prompt(data))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        n = self.draw_n(data, seq)
        self.do_append(seq, data.draw(st.lists(VOCAB, min_size=n, max_size=n), label="tokens"))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        live = sorted(self.model)
        unused = [s for s in range(MAX_SEQS) if s not in self.model]
        child = data.draw(st.sampled_from(unused) if unused and data.draw(MOSTLY) else SEQ_IDS)
        parent = data.draw(st.sampled_from(live) if live and data.draw(MOSTLY) else SEQ_IDS)
        self.do_fork(parent, child)

    @precondition(lambda self: self.model and len(self.model) < MAX_SEQS)
    @rule(data=st.data())
    def fork_then_append(self, data):
        """Fork a live sequence, then grow one side: copy-on-write under prefix caching."""
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child = min(s for s in range(MAX_SEQS) if s not in self.model)
        self.do_fork(parent, child)
        seq = data.draw(st.sampled_from([child, parent]))
        n = self.draw_n(data, seq)
        self.do_append(seq, data.draw(st.lists(VOCAB, min_size=n, max_size=n), label="tokens"))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        self.do_free(data.draw(st.sampled_from(sorted(self.model))))
        if not data.draw(MOSTLY, label="keep the cache"):
            self.do_reset()                      # succeeds only once every block is free

    def do_reset(self):
        pool = self.pool
        idle = all(not table for table in pool.block_tables.values())
        free_before, evictable_before = list(pool.free_blocks), list(pool.evictable)
        before = snapshot(pool)
        done = pool.reset_prefix_cache()
        event(f"reset: {done}")
        assert done is idle
        if done:
            assert pool.cached_blocks == {} and pool.block_hashes == [None] * pool.num_blocks
            assert list(pool.evictable) == []
            assert list(pool.free_blocks) == free_before + evictable_before
        else:
            assert snapshot(pool) == before

    @rule(seq=SEQ_IDS, data=st.data())
    def failing_calls(self, seq, data):
        pool = self.pool
        if any(pool.block_tables.values()):
            self.do_reset()                      # refused: a block is in use
        if seq in self.model:
            self.attempt(lambda: pool.allocate(seq, 1, [0]), ValueError, "already holds blocks")
            n = data.draw(st.integers(0, 3))
            bad = data.draw(st.sampled_from([None, [0] * (n + 1)] + ([[0] * (n - 1)] if n else [])))
            length, bs = len(self.model[seq]), pool.block_size
            table = pool.block_table(seq)
            cow = n > 0 and length % bs != 0 and self.holders(table[-1]) > 1
            needed = blocks_needed(length + n, bs) - len(table) + cow
            if length + n > pool.capacity:      # the counts are checked first, then the tokens
                expected, match = ValueError, "more than the pool's"
            elif needed > pool.num_free_blocks:
                expected, match = kvlab.OutOfBlocksError, "more blocks"
            else:
                expected, match = ValueError, "token_ids must give"
            self.attempt(lambda: pool.append(seq, n, bad), expected, match)
        else:
            for call in (lambda: pool.free(seq), lambda: pool.append(seq, 1, [0]),
                         lambda: pool.fork(seq, seq + 100)):
                self.attempt(call, kvlab.UnknownSequenceError, "unknown sequence id")
            prefix = data.draw(st.sampled_from(self.prefixes))[:pool.capacity - 1]
            self.attempt(lambda: pool.allocate(seq, len(prefix) + 1, prefix), ValueError, "token_ids must give")
            self.attempt(lambda: pool.allocate(seq, len(prefix) + 1, prefix + [-1]), ValueError,
                         "token ids must be in")

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def cache_index_matches_block_hashes(self):
        pool = self.pool
        for h, block in pool.cached_blocks.items():
            assert pool.block_hashes[block] == h
        for block, h in enumerate(pool.block_hashes):
            if h is not None:
                assert pool.cached_blocks.get(h) == block

    @invariant()
    def free_evictable_and_used_partition_the_pool(self):
        pool = self.pool
        free, evictable = list(pool.free_blocks), list(pool.evictable)
        used = [b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0]
        assert len(set(free)) == len(free)
        assert not set(free) & set(evictable)
        assert sorted(free + evictable + used) == list(range(pool.num_blocks))
        assert all(pool.ref_counts[b] == 0 and pool.block_hashes[b] is None for b in free)
        assert all(pool.ref_counts[b] == 0 and pool.block_hashes[b] is not None for b in evictable)
        cached_idle = [b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0 and pool.block_hashes[b]]
        assert sorted(cached_idle) == sorted(evictable)
        assert pool.num_free_blocks == len(free) + len(evictable)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.pending_copies == []

    @invariant()
    def ref_counts_are_table_occurrences(self):
        counts = [0] * self.pool.num_blocks
        for table in self.pool.block_tables.values():
            for block in table:
                counts[block] += 1
        assert self.pool.ref_counts == counts

    @invariant()
    def every_sequence_reads_back_its_tokens_and_hashes(self):
        pool, bs = self.pool, self.pool.block_size
        assert set(pool.block_tables) == set(self.model)
        flat = self.k.flatten().tolist()
        for seq, tokens in self.model.items():
            table = pool.block_table(seq)
            assert pool.seq_len(seq) == len(tokens)
            assert len(table) == blocks_needed(len(tokens), bs)
            assert self.read(table, len(tokens), flat) == tokens
            assert pool.seq_tokens[seq] == tokens
            assert pool.seq_salts[seq] == self.salts[seq]
            full = len(tokens) // bs
            assert pool.seq_hashes[seq] == hash_blocks(tokens[:full * bs], bs, self.salts[seq])
            # a hashed block in a table is cached under this sequence's own hash for it
            for i, block in enumerate(table):
                if pool.block_hashes[block] is not None:
                    assert i < full and pool.block_hashes[block] == pool.seq_hashes[seq][i]

    @invariant()
    def cached_blocks_hold_what_their_hash_names(self):
        pool, bs = self.pool, self.pool.block_size
        flat = self.k.flatten().tolist()
        for h, block in pool.cached_blocks.items():
            salt, tokens = self.hash_tokens[h]
            assert self.read([block], bs, flat) == tokens
            for seq, table in pool.block_tables.items():
                if block in table:
                    assert self.salts[seq] == salt

    @invariant()
    def different_salts_never_share_a_block(self):
        owners: dict[int, set] = {}
        for seq, table in self.pool.block_tables.items():
            for block in table:
                owners.setdefault(block, set()).add(self.salts[seq])
        assert all(len(salts) == 1 for salts in owners.values())


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],   # no slow "explain"
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixCacheStateMachine = PrefixCacheMachine.TestCase
