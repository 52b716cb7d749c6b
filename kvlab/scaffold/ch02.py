"""Chapter 2, given: the block pool's state and the launcher of the write-KV kernel."""
from collections import deque

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import triton

from kvlab.errors import UnknownSequenceError


class BlockPoolState:
    """The state of ``BlockPool`` and its given methods; the tasks are ``allocate``, ``append``, ``free``.

    ``free_blocks`` holds the ids of free blocks (take from the left, return to the right);
    ``block_tables[seq_id]`` lists a sequence's physical blocks in order; ``seq_lens[seq_id]``
    counts its tokens.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = deque(range(num_blocks))
        self.block_tables: dict = {}
        self.seq_lens: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def block_table(self, seq_id) -> list[int]:
        if seq_id not in self.block_tables:
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r}")
        return list(self.block_tables[seq_id])


def write_kv_with(write_kv_kernel):
    """``write_kv(key, value, k_cache, v_cache, slot_mapping)``, launching ``write_kv_kernel``."""

    def write_kv(key, value, k_cache, v_cache, slot_mapping):
        """Launch the kernel: key/value [num_tokens, num_kv_heads, head_dim] into the caches."""
        num_tokens, row = key.shape[0], key.shape[1] * key.shape[2]
        block = min(triton.next_power_of_2(row), 2048)
        grid = (num_tokens, triton.cdiv(row, block))
        write_kv_kernel[grid](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                              ROW=row, BLOCK=block)

    return write_kv
