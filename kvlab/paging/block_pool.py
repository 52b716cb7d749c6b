"""BlockPool: the paged KV cache's allocator.

The cache is cut into ``num_blocks`` physical blocks of ``block_size`` token slots each. A
sequence owns a *block table*: the list of physical block ids holding its tokens in order,
so token ``pos`` lives in block ``block_table[pos // block_size]`` at offset
``pos % block_size``, i.e. in physical slot ``block_table[pos // block_size] * block_size +
pos % block_size``. Blocks are taken from a free queue only when a sequence's last block is
full, so at most ``block_size - 1`` slots per sequence are ever wasted.

Every method checks its arguments and the free count *before* changing anything: an error
leaves the pool exactly as it was.
"""
from __future__ import annotations

from collections import deque

from kvlab.errors import OutOfBlocksError, UnknownSequenceError


def check_count(name: str, value, *, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``, or a TypeError/ValueError that names ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Physical slots of the tokens at positions ``start .. start + num_tokens - 1``."""
    end = start + num_tokens
    if end > len(block_table) * block_size:
        raise ValueError(
            f"positions up to {end - 1} need {blocks_needed(end, block_size)} blocks, "
            f"the block table has {len(block_table)}"
        )
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


class BlockPool:
    """Fixed pool of KV-cache blocks with per-sequence block tables.

    >>> pool = BlockPool(num_blocks=8, block_size=4)
    >>> pool.allocate("a", 6)        # two blocks for six tokens
    [0, 1]
    >>> pool.append("a", 3)          # fills block 1, then needs one more
    [2]
    >>> pool.slot_mapping("a", start=6, num_tokens=3)
    [6, 7, 8]
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        check_count("num_blocks", num_blocks, minimum=1)
        check_count("block_size", block_size, minimum=1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))  # O(1) at both ends
        self.block_tables: dict[object, list[int]] = {}
        self.seq_lens: dict[object, int] = {}

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def capacity(self) -> int:
        """Token slots in the whole pool."""
        return self.num_blocks * self.block_size

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.block_tables

    def block_table(self, seq_id) -> list[int]:
        return list(self._table(seq_id))

    def seq_len(self, seq_id) -> int:
        self._table(seq_id)
        return self.seq_lens[seq_id]

    def can_append(self, seq_id, num_tokens: int = 1) -> bool:
        return self._new_blocks_for(seq_id, num_tokens) <= self.num_free_blocks

    def slot_mapping(self, seq_id, start: int, num_tokens: int) -> list[int]:
        """Physical slots of positions ``start .. start + num_tokens - 1`` of ``seq_id``."""
        table = self._table(seq_id)
        check_count("start", start)
        check_count("num_tokens", num_tokens)
        if start + num_tokens > self.seq_lens[seq_id]:
            raise ValueError(
                f"positions {start}..{start + num_tokens - 1} are beyond sequence {seq_id!r} "
                f"of length {self.seq_lens[seq_id]}"
            )
        return slot_mapping(table, start, num_tokens, self.block_size)

    # -- changes ------------------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Start sequence ``seq_id`` with room for ``num_tokens`` tokens; returns its block table."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it first")
        self.block_tables[seq_id] = []
        self.seq_lens[seq_id] = 0
        try:
            self.append(seq_id, num_tokens)
        except Exception:
            del self.block_tables[seq_id], self.seq_lens[seq_id]
            raise
        return self.block_table(seq_id)

    def append(self, seq_id, num_tokens: int = 1) -> list[int]:
        """Grow ``seq_id`` by ``num_tokens`` slots; returns the blocks newly taken (often none)."""
        needed = self._new_blocks_for(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {needed} more blocks, {self.num_free_blocks} are free"
            )
        new_blocks = [self.free_blocks.popleft() for _ in range(needed)]
        self.block_tables[seq_id].extend(new_blocks)
        self.seq_lens[seq_id] += num_tokens
        return new_blocks

    def free(self, seq_id) -> list[int]:
        """Return every block of ``seq_id`` to the free queue; returns them."""
        blocks = self._table(seq_id)
        del self.block_tables[seq_id], self.seq_lens[seq_id]
        self.free_blocks.extend(blocks)
        return blocks

    # -- helpers ------------------------------------------------------------------------
    def _table(self, seq_id) -> list[int]:
        try:
            return self.block_tables[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r} (never allocated, or freed)") from None

    def _new_blocks_for(self, seq_id, num_tokens: int) -> int:
        check_count("num_tokens", num_tokens)
        table = self._table(seq_id)
        new_len = self.seq_lens[seq_id] + num_tokens
        if new_len > self.capacity:
            raise ValueError(
                f"sequence {seq_id!r} would hold {new_len} tokens, more than the pool's "
                f"{self.capacity} slots ({self.num_blocks} blocks x {self.block_size})"
            )
        return blocks_needed(new_len, self.block_size) - len(table)
