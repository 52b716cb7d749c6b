"""Chapter 4, given: a ``BlockPool`` that runs your LRU eviction (``take_free_block``, ``release``),
and ``use_my_pieces(llm)``, which serves an ``LLM`` with prefix caching from your four pieces."""
from kvlab.paging import BlockPool
from kvlab.paging.prefix_hash import hash_blocks
from kvlab.scaffold import check_pieces, is_written

PIECES = ("block_hashes", "cached_prefix", "take_free_block", "release")


def pool_with_eviction(take_free_block, release) -> type[BlockPool]:
    """The class ``PoolWithMyEviction``: kvlab's ``BlockPool`` with the two functions plugged in."""

    class PoolWithMyEviction(BlockPool):
        """kvlab's ``BlockPool`` with your ``take_free_block`` and ``release`` plugged in (given)."""

        def _take_free_block(self) -> int:
            return take_free_block(self)

        def free(self, seq_id) -> list[int]:
            return release(self, seq_id)

    PoolWithMyEviction.__qualname__ = "PoolWithMyEviction"
    return PoolWithMyEviction


def pool_with_prefix_caching(block_hashes, cached_prefix, take_free_block, release) -> type[BlockPool]:
    """The class ``PoolWithMyPrefixCache``: ``PoolWithMyEviction`` that also hashes full blocks
    with ``block_hashes`` and finds a prompt's cached blocks with ``cached_prefix``."""

    class PoolWithMyPrefixCache(pool_with_eviction(take_free_block, release)):
        """kvlab's ``BlockPool`` with your four prefix-caching functions plugged in (given)."""

        def computed_blocks(self, token_ids, salt=None) -> list[int]:
            return cached_prefix(self, token_ids, salt)      # allocate reuses these blocks

        def _register_full_blocks(self, seq_id, hashes=None, upto=None) -> None:
            # kvlab's pool chains on from the last hash it made; yours hashes from the start.
            tokens = self.seq_tokens[seq_id]
            super()._register_full_blocks(seq_id, block_hashes(tokens, self.block_size, self.seq_salts[seq_id]), upto)

    PoolWithMyPrefixCache.__qualname__ = "PoolWithMyPrefixCache"
    return PoolWithMyPrefixCache


def _cached_pool() -> BlockPool:
    pool = BlockPool(4, 2, enable_prefix_caching=True)
    pool.allocate(0, 3, [1, 2, 3])
    return pool


def _probe_release(release) -> None:
    release(_cached_pool(), 0)


PROBES = {"block_hashes": lambda f: f([1, 2, 3], 2),
          "cached_prefix": lambda f: f(_cached_pool(), [1, 2, 3]),
          "take_free_block": lambda f: f(_cached_pool()),
          "release": _probe_release}
KVLAB_PIECES = {"block_hashes": hash_blocks, "cached_prefix": BlockPool.computed_blocks,
                "take_free_block": BlockPool._take_free_block, "release": BlockPool.free}


def my_pieces_user(block_hashes, cached_prefix, take_free_block, release):
    """The function ``use_my_pieces``, bound to one implementation's pieces."""
    mine = {"block_hashes": block_hashes, "cached_prefix": cached_prefix, "take_free_block": take_free_block,
            "release": release}

    def use_my_pieces(llm, pieces=None) -> list[str]:
        """Serve ``llm`` from a ``PoolWithMyPrefixCache`` running your ``pieces``; returns those it runs.

        ``pieces``: a subset of ``PIECES``; by default every one you have written (one that
        still raises ``NotImplementedError`` stays kvlab's). ``llm`` must have
        ``enable_prefix_caching=True`` and no request queued: its pool is replaced by a fresh
        one of the same size (``llm.use_pool``), with an empty cache.
        """
        if pieces is None:
            pieces = [name for name in PIECES if is_written(lambda: PROBES[name](mine[name]))]
        check_pieces(pieces, PIECES)
        if not llm.pool.enable_prefix_caching:
            raise ValueError("use_my_pieces needs an LLM with enable_prefix_caching=True")
        chosen = [mine[name] if name in pieces else KVLAB_PIECES[name] for name in PIECES]
        pool_class = pool_with_prefix_caching(*chosen)
        llm.use_pool(pool_class(llm.pool.num_blocks, llm.pool.block_size, enable_prefix_caching=True))
        return [name for name in PIECES if name in pieces]

    return use_my_pieces
