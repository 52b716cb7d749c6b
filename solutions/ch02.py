"""Chapter 2 answers: the same names and signatures as ``exercises/ch02.py``."""
import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)

from kvlab.errors import OutOfBlocksError, UnknownSequenceError
# The write_kv_kernel answer is the course's own kernel: read kernels/write_kv.py.
from kvlab.kernels.write_kv import write_kv_kernel
# Given (not tasks), shared with exercises/ch02.py: read kvlab/scaffold/ch02.py.
from kvlab.scaffold.ch02 import PIECES, BlockPoolState, my_pieces_user, write_kv_with  # noqa: F401
from kvlab.validation import check_count


# -- task block_pool -----------------------------------------------------------------------
class BlockPool(BlockPoolState):
    """``num_blocks`` physical blocks of ``block_size`` token slots, shared by sequences."""

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        check_count("num_tokens", num_tokens)
        self._blocks_needed(num_tokens, have=0)  # raises before anything changes
        self.block_tables[seq_id] = []
        self.seq_lens[seq_id] = 0
        self.append(seq_id, num_tokens)
        return self.block_table(seq_id)

    def append(self, seq_id, num_tokens: int = 1) -> list[int]:
        table = self.block_table(seq_id)
        check_count("num_tokens", num_tokens)
        new_len = self.seq_lens[seq_id] + num_tokens
        needed = self._blocks_needed(new_len, have=len(table))
        new_blocks = [self.free_blocks.popleft() for _ in range(needed)]
        self.block_tables[seq_id].extend(new_blocks)
        self.seq_lens[seq_id] = new_len
        return new_blocks

    def free(self, seq_id) -> list[int]:
        blocks = self.block_table(seq_id)
        del self.block_tables[seq_id], self.seq_lens[seq_id]
        self.free_blocks.extend(blocks)
        return blocks

    def _blocks_needed(self, num_tokens, have):
        """Blocks ``num_tokens`` tokens need beyond the ``have`` held; raises if they can't be had."""
        if num_tokens > self.num_blocks * self.block_size:
            raise ValueError(f"{num_tokens} tokens can never fit in {self.num_blocks} blocks of {self.block_size}")
        needed = -(-num_tokens // self.block_size) - have
        if needed > len(self.free_blocks):
            raise OutOfBlocksError(f"need {needed} blocks, {len(self.free_blocks)} are free")
        return needed


# -- task slot_mapping ---------------------------------------------------------------------
def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    if start + num_tokens > len(block_table) * block_size:
        raise ValueError(f"position {start + num_tokens - 1} is beyond the table's {len(block_table)} blocks")
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, start + num_tokens)]


# -- task write_kv_kernel ------------------------------------------------------------------
# Given: write_kv(key, value, k_cache, v_cache, slot_mapping) launches the kernel.
write_kv = write_kv_with(write_kv_kernel)

# Given: use_my_pieces(llm) serves an LLM with your BlockPool, slot_mapping and
# write_kv_kernel plugged in (kvlab/scaffold/ch02.py says how).
use_my_pieces = my_pieces_user(BlockPool, slot_mapping, write_kv)
