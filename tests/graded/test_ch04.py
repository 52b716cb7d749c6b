"""Graded tests of chapter 4: ``pytest tests/graded -m ch04 --impl=exercises``."""
import random

import pytest

from helpers import first_difference, outcome
from kvlab.errors import OutOfBlocksError, UnknownSequenceError
from kvlab.paging import BlockPool as ReferencePool
from kvlab.paging.prefix_hash import hash_blocks, root_hash

pytestmark = pytest.mark.ch04


def cache_state(pool):
    """Everything the tasks may change, as plain comparable values."""
    return {
        "free_blocks": list(pool.free_blocks),
        "evictable (least recent first)": list(pool.evictable),
        "cached_blocks": dict(pool.cached_blocks),
        "block_hashes": list(pool.block_hashes),
        "ref_counts": list(pool.ref_counts),
        "block_tables": {s: list(t) for s, t in pool.block_tables.items()},
        "seq_lens": dict(pool.seq_lens),
        "seq_hashes": {s: list(h) for s, h in pool.seq_hashes.items()},
    }


def random_prompt(rng, prefixes, block_size):
    """A prompt that often starts with one of a few shared prefixes, so the cache gets hits."""
    head = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
    return head + [rng.randrange(100) for _ in range(rng.randrange(0, 3 * block_size))]


def random_workload(rng, steps, block_size):
    """Operations (name, args) on sequences 0, 1, ...: arrive, grow, finish, and mistakes."""
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(block_size, 4 * block_size))] for _ in range(3)]
    live, ops = [], []
    for step in range(steps):
        kind = rng.choice(["allocate", "allocate", "append", "append", "free", "free"])
        if kind == "allocate":
            prompt = random_prompt(rng, prefixes, block_size)
            salt = rng.choice([None, None, "tenant-b"])
            ops.append(("allocate", (step, len(prompt), prompt, salt)))
            live.append(step)
        elif kind == "append" and live:
            n = rng.randrange(1, 2 * block_size)
            ops.append(("append", (rng.choice(live), n, [rng.randrange(100) for _ in range(n)])))
        elif kind == "free":
            seq = rng.choice(live + [-1]) if live else -1     # -1: an unknown id
            ops.append(("free", (seq,)))
            if seq in live:
                live.remove(seq)
    return ops


# -- block_hashes ----------------------------------------------------------------------------
@pytest.mark.task("block_hashes")
def test_block_hashes_worked_example(ch04):
    from hashlib import sha256

    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    first = sha256(root_hash(None) + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0])).digest()
    got = ch04.block_hashes(tokens, 4)
    assert len(got) == 2, f"9 tokens in blocks of 4: 2 full blocks and a partial one (no hash), got {len(got)} hashes"
    assert got[0] == first, "block 0's hash must be sha256(root_hash(None) + its 4 tokens as little-endian uint32)"
    assert got == hash_blocks(tokens, 4), "block 1's hash must chain from block 0's"


@pytest.mark.task("block_hashes")
def test_block_hashes_match_kvlab_on_random_prompts(ch04):
    rng = random.Random(0)
    for _ in range(100):
        block_size = rng.choice([1, 2, 4, 16])
        tokens = [rng.randrange(2**32) if rng.random() < 0.05 else rng.randrange(50_000)
                  for _ in range(rng.randrange(0, 70))]
        salt = rng.choice([None, "tenant-a", b"\x00bytes"])
        got, want = ch04.block_hashes(tokens, block_size, salt), hash_blocks(tokens, block_size, salt)
        if got != want:
            first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            raise AssertionError(f"block_hashes({len(tokens)} tokens, block_size={block_size}, salt={salt!r}): "
                                 f"{len(got)} hashes, expected {len(want)}; the first difference is at block {first}")


@pytest.mark.task("block_hashes")
def test_block_hashes_chain_and_salt(ch04):
    tokens = list(range(40))
    whole = ch04.block_hashes(tokens, 8)
    assert ch04.block_hashes(tokens[:24], 8) == whole[:3], "a prompt's prefix must get the same first hashes"
    changed = tokens[:3] + [999] + tokens[4:]
    assert all(a != b for a, b in zip(ch04.block_hashes(changed, 8), whole)), \
        "changing a token of block 0 must change every later hash (they chain through it)"
    salted = ch04.block_hashes(tokens, 8, salt="tenant-a")
    assert all(a != b for a, b in zip(salted, whole)), "a salt must change every hash (it is in the root)"
    assert ch04.block_hashes([], 8) == [] and ch04.block_hashes(tokens[:7], 8) == [], "no full block: no hash"


# -- cached_prefix ---------------------------------------------------------------------------
@pytest.mark.task("cached_prefix")
def test_cached_prefix_worked_example(ch04):
    pool = ReferencePool(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 13))                      # 3 full blocks
    pool.allocate("a", 12, prompt)
    assert ch04.cached_prefix(pool, prompt + [50, 51]) == [0, 1, 2], "all three cached blocks start this prompt"
    assert ch04.cached_prefix(pool, prompt) == [0, 1], \
        "the same 12-token prompt reuses only 2 blocks: its last token must be computed (its logits)"
    assert ch04.cached_prefix(pool, [1, 2, 3, 4, 0, 6, 7, 8, 9]) == [0], "the walk stops at the first miss"
    assert ch04.cached_prefix(pool, prompt + [50], salt="tenant-b") == [], "another tenant's salt finds nothing"
    assert ch04.cached_prefix(pool, []) == [], "an empty prompt reuses nothing"


@pytest.mark.task("cached_prefix")
@pytest.mark.parametrize("seed", range(3))
def test_cached_prefix_predicts_allocate(ch04, seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    pool = ReferencePool(num_blocks=40, block_size=block_size, enable_prefix_caching=True)
    for name, args in random_workload(rng, 150, block_size):
        if name == "allocate":
            seq, n, prompt, salt = args
            before = cache_state(pool)
            got = ch04.cached_prefix(pool, prompt, salt)
            assert cache_state(pool) == before, "cached_prefix changed the pool"
            try:
                table = pool.allocate(seq, n, prompt, salt)
            except OutOfBlocksError:
                continue
            want = table[:pool.num_cached_tokens[seq] // block_size]
            assert got == want, \
                f"cached_prefix for a {n}-token prompt (salt {salt!r}) gave {got}; allocate reused {want}"
        else:
            outcome(getattr(pool, name), *args)
    disabled = ReferencePool(num_blocks=4, block_size=2)
    disabled.allocate("a", 4)
    assert ch04.cached_prefix(disabled, [1, 2, 3, 4, 5]) == [], "without prefix caching nothing is reused"



@pytest.mark.task("cached_prefix")
def test_cached_prefix_stops_at_the_first_miss_even_if_a_later_block_is_cached(ch04):
    pool = ReferencePool(num_blocks=6, block_size=2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    pool.allocate("a", 5, prompt, cache=False)               # a and b compute the same prompt at once
    pool.allocate("b", 5, prompt, cache=False)
    pool.cache_blocks("a", 2)                                # block 0 of a is cached first: hash 0 -> block 0
    pool.cache_blocks("b", 4)                                # hash 1 -> b's block 4 (b's copy of block 0 is not cached)
    pool.free("a")
    pool.allocate("c", 5, [9, 8, 7, 6, 5])                   # takes the free blocks 1, 2, then evicts block 0
    assert pool.cached_blocks.get(hash_blocks(prompt, 2)[1]) == 4 and 0 not in pool.cached_blocks.values()
    got = ch04.cached_prefix(pool, prompt)
    assert got == [], (f"cached_prefix gave {got}: the prompt's block 0 is no longer cached, so nothing is reused, "
                       "even though its block 1's hash is still in the cache (a prefix cannot have a gap)")


# -- lru_eviction ----------------------------------------------------------------------------
@pytest.mark.task("lru_eviction")
def test_release_puts_cached_blocks_in_the_evictable_queue_tail_first(ch04):
    pool = ch04.PoolWithMyEviction(num_blocks=6, block_size=2, enable_prefix_caching=True)
    pool.allocate("a", 5, [1, 2, 3, 4, 5])             # blocks 0, 1 full (cached), 2 partial
    released = pool.free("a")
    assert released == [0, 1, 2], f"free('a') returned {released}, expected its blocks [0, 1, 2]"
    assert list(pool.evictable) == [1, 0], \
        f"evictable {list(pool.evictable)}: the tail (1) must come before the head (0)"
    assert list(pool.free_blocks) == [3, 4, 5, 2], \
        f"free_blocks {list(pool.free_blocks)}: the partial block 2 has no hash, it joins the free list"
    kept = [name for name in ("block_tables", "seq_lens", "seq_tokens", "seq_salts", "seq_hashes", "num_cached_tokens")
            if "a" in getattr(pool, name)]
    assert not kept, f"the sequence must be forgotten, but free('a') left it in {kept}"
    with pytest.raises(UnknownSequenceError):
        pool.free("a")


@pytest.mark.task("lru_eviction")
def test_never_cached_blocks_go_first_then_least_recently_freed(ch04):
    pool = ch04.PoolWithMyEviction(num_blocks=6, block_size=2, enable_prefix_caching=True)
    pool.allocate("a", 5, [1, 2, 3, 4, 5])
    pool.free("a")                                      # evictable [1, 0]; free [3, 4, 5, 2]
    pool.allocate("b", 8, [9, 9, 8, 8, 7, 7, 6, 6])     # four blocks: the never-cached ones
    assert pool.block_table("b") == [3, 4, 5, 2], f"b got {pool.block_table('b')}: never-cached blocks come first"
    assert list(pool.evictable) == [1, 0], "nothing cached may be evicted while never-cached blocks are free"
    h1 = pool.block_hashes[1]
    pool.append("b", 1, [5])                            # now an eviction: block 1, the least recent
    assert pool.block_table("b")[-1] == 1, f"append evicted {pool.block_table('b')[-1]}, expected block 1 (the tail)"
    assert pool.block_hashes[1] is None and h1 not in pool.cached_blocks, "an evicted block must lose its hash"
    assert pool.ref_counts[1] == 1, "the block taken must be held once"
    pool.free("b")
    assert pool.allocate("c", 3, [1, 2, 3])[0] == 0 and pool.num_cached_tokens["c"] == 2, \
        "block 0 (a's head, freed after its tail) must still be cached and reused"


@pytest.mark.task("lru_eviction")
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_matches_kvlab(ch04, seed):
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(12, 2), (16, 4), (24, 4)])
    mine = ch04.PoolWithMyEviction(num_blocks, block_size, enable_prefix_caching=True)
    ref = ReferencePool(num_blocks, block_size, enable_prefix_caching=True)
    for i, (name, args) in enumerate(random_workload(rng, 300, block_size)):
        got, want = outcome(getattr(mine, name), *args), outcome(getattr(ref, name), *args)
        shown = args if name != "allocate" else (args[0], args[1], "...", args[3])
        assert got == want, f"operation {i}: {name}{shown} gave {got}, expected {want}"
        problem = first_difference(cache_state(mine), cache_state(ref))
        assert not problem, f"operation {i}: after {name}{shown}, {problem}"
