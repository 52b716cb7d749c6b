"""Chapter 4, given: a ``BlockPool`` that runs your LRU eviction (``take_free_block``, ``release``)."""
from kvlab.paging import BlockPool


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
