"""Chapter 4 exercises: automatic prefix caching.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch04                                 # in a terminal
    kvlab.check("ch04")                              # in the notebook
    pytest tests/graded -m ch04 --impl=exercises     # the same tests, raw

Tasks: ``block_hashes`` (the block-hash chain), ``cached_prefix`` (which cached blocks a
prompt reuses), ``lru_eviction`` (``take_free_block`` and ``release``: what happens to cached
blocks when sequences finish and when memory runs out). Stuck? ``kvlab.use_solution("ch04")``
swaps in the answer and keeps yours as ``exercises/ch04_mine.py``.
"""
from hashlib import sha256  # noqa: F401  (you will use it)

from kvlab.errors import UnknownSequenceError  # noqa: F401  (you will raise it)
from kvlab.paging import BlockPool
from kvlab.paging.prefix_hash import hash_blocks, root_hash, token_bytes  # noqa: F401  (given helpers)
# Given (not a task), shared with solutions/ch04.py: read kvlab/scaffold/ch04.py.
from kvlab.scaffold.ch04 import PIECES, my_pieces_user, pool_with_eviction, pool_with_prefix_caching  # noqa: F401


# -- task block_hashes ---------------------------------------------------------------------
def block_hashes(token_ids, block_size: int, salt=None) -> list[bytes]:
    """The chained hash of every *full* block of ``token_ids`` (a partial last block has none).

    Block 0's parent is ``root_hash(salt)``; block ``i``'s parent is block ``i - 1``'s hash, and

        hash(block i) = SHA-256(parent hash + the block's token ids as bytes).digest()

    ``token_bytes(ids)`` gives the bytes (4 little-endian bytes per token). The result must
    equal ``kvlab.paging.prefix_hash.hash_blocks(token_ids, block_size, salt)``.
    """
    raise NotImplementedError("block_hashes: start from root_hash(salt); for each full block, "
                              "parent = sha256(parent + token_bytes(block)).digest()")


# -- task cached_prefix --------------------------------------------------------------------
def cached_prefix(pool: BlockPool, token_ids, salt=None) -> list[int]:
    """The cached blocks ``pool.allocate`` would reuse for prompt ``token_ids``; change nothing.

    Walk the prompt's block hashes (``hash_blocks``, or your ``block_hashes``) and look each up
    in ``pool.cached_blocks`` (hash -> block) until the first miss. Reuse at most
    ``(len(token_ids) - 1) // pool.block_size`` blocks: the last prompt token is always
    computed, because its logits give the first output token. Without prefix caching
    (``pool.enable_prefix_caching`` false) nothing is reused.
    """
    raise NotImplementedError("cached_prefix: look the prompt's block hashes up in pool.cached_blocks, "
                              "stop at the first miss, cap at (len(token_ids) - 1) // block_size blocks")


# -- task lru_eviction ---------------------------------------------------------------------
def take_free_block(pool: BlockPool) -> int:
    """A free block for new KV, held once. ``BlockPool`` calls this whenever it needs a block.

    * A never-cached free block if there is one: the left of ``pool.free_blocks``.
    * Otherwise evict the least recently freed cached block: the first of ``pool.evictable``
      (an OrderedDict, block -> None, least recent first). Evicting means its hash no longer
      names it: remove the hash from ``pool.cached_blocks`` (if it maps to this block) and set
      ``pool.block_hashes[block] = None``.
    * Either way set ``pool.ref_counts[block] = 1`` and return the block.

    The pool checks that a block is free before calling: you need not.
    """
    raise NotImplementedError("take_free_block: pool.free_blocks first; else pop the first of pool.evictable "
                              "and drop its hash from pool.cached_blocks and pool.block_hashes")


def release(pool: BlockPool, seq_id) -> list[int]:
    """``pool.free(seq_id)``: drop the sequence's hold on its blocks; return the blocks released.

    * An unknown ``seq_id`` raises ``UnknownSequenceError``, changing nothing.
    * Forget the sequence: remove ``seq_id`` from ``block_tables``, ``seq_lens``, ``seq_tokens``,
      ``seq_salts``, ``seq_hashes`` and ``num_cached_tokens`` (the last four may lack it).
    * Decrement the reference count of each block of its table; the blocks that reach 0 are
      released (return them in table order).
    * A released block that carries a hash (``pool.block_hashes[b] is not None``) stays cached:
      add it to the end of ``pool.evictable``, the sequence's **tail first** (last block
      first), so its head, which other prompts are likelier to share, is evicted last. The
      others go to the right of ``pool.free_blocks``, in table order.
    """
    raise NotImplementedError("release: ref_counts -= 1; blocks reaching 0 with a hash go to pool.evictable "
                              "in reverse table order, the others to pool.free_blocks")


# Given: kvlab's BlockPool with take_free_block and release plugged in.
PoolWithMyEviction = pool_with_eviction(take_free_block, release)

# Given: use_my_pieces(llm) serves an LLM with prefix caching from a pool running your four functions
# (hashing, lookup, eviction); returns which of them it runs.
use_my_pieces = my_pieces_user(block_hashes, cached_prefix, take_free_block, release)
