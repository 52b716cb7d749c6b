"""Chapter 4 answers: the same names and signatures as ``exercises/ch04.py``."""
from hashlib import sha256

from kvlab.errors import UnknownSequenceError
from kvlab.paging import BlockPool
from kvlab.paging.prefix_hash import hash_blocks, root_hash, token_bytes
# Given (not a task), shared with exercises/ch04.py: read kvlab/scaffold/ch04.py.
from kvlab.scaffold.ch04 import PIECES, my_pieces_user, pool_with_eviction, pool_with_prefix_caching  # noqa: F401


# -- task block_hashes ---------------------------------------------------------------------
def block_hashes(token_ids, block_size: int, salt=None) -> list[bytes]:
    data = token_bytes(token_ids)
    step = 4 * block_size                      # bytes per block
    parent, hashes = root_hash(salt), []
    for start in range(0, len(data) - step + 1, step):
        parent = sha256(parent + data[start:start + step]).digest()
        hashes.append(parent)
    return hashes


# -- task cached_prefix --------------------------------------------------------------------
def cached_prefix(pool: BlockPool, token_ids, salt=None) -> list[int]:
    if not pool.enable_prefix_caching or len(token_ids) == 0:
        return []
    reusable = (len(token_ids) - 1) // pool.block_size
    blocks = []
    for h in hash_blocks(token_ids[:reusable * pool.block_size], pool.block_size, salt):
        if h not in pool.cached_blocks:
            break
        blocks.append(pool.cached_blocks[h])
    return blocks


# -- task lru_eviction ---------------------------------------------------------------------
def take_free_block(pool: BlockPool) -> int:
    if pool.free_blocks:
        block = pool.free_blocks.popleft()
    else:
        block, _ = pool.evictable.popitem(last=False)     # least recently freed
        h = pool.block_hashes[block]
        if pool.cached_blocks.get(h) == block:
            del pool.cached_blocks[h]
        pool.block_hashes[block] = None
    pool.ref_counts[block] = 1
    return block


def release(pool: BlockPool, seq_id) -> list[int]:
    if seq_id not in pool.block_tables:
        raise UnknownSequenceError(f"unknown sequence id {seq_id!r}")
    table = pool.block_tables.pop(seq_id)
    for per_seq in (pool.seq_lens, pool.seq_tokens, pool.seq_salts, pool.seq_hashes, pool.num_cached_tokens):
        per_seq.pop(seq_id, None)
    released = []
    for block in table:
        pool.ref_counts[block] -= 1
        if pool.ref_counts[block] == 0:
            released.append(block)
    for block in reversed(released):
        if pool.block_hashes[block] is not None:
            pool.evictable[block] = None
    pool.free_blocks.extend(b for b in released if pool.block_hashes[b] is None)
    return released


# Given: kvlab's BlockPool with take_free_block and release plugged in.
PoolWithMyEviction = pool_with_eviction(take_free_block, release)

# Given: use_my_pieces(llm) serves an LLM with prefix caching from a pool running these four
# (hashing, lookup, eviction); returns which of them it runs.
use_my_pieces = my_pieces_user(block_hashes, cached_prefix, take_free_block, release)
