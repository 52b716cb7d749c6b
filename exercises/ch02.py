"""Chapter 2 exercises: a block allocator, slot mapping, and the write-KV kernel.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch02                                 # in a terminal
    kvlab.check("ch02")                              # in the notebook
    pytest tests/graded -m ch02 --impl=exercises     # the same tests, raw

Tasks: ``block_pool`` (BlockPool.allocate / append / free), ``slot_mapping``,
``write_kv_kernel``. Stuck? ``kvlab.use_solution("ch02")`` swaps in the answer and keeps
yours as ``exercises/ch02_mine.py``. Done? ``use_my_pieces(llm)`` (given, at the end) serves the
course's engine on your pieces: notebook 02, section 9.
"""
import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import triton
import triton.language as tl

from kvlab.errors import OutOfBlocksError, UnknownSequenceError  # noqa: F401  (you will raise these)
# Given (not tasks), shared with solutions/ch02.py: read kvlab/scaffold/ch02.py.
from kvlab.scaffold.ch02 import PIECES, BlockPoolState, my_pieces_user, write_kv_with  # noqa: F401


# -- task block_pool -----------------------------------------------------------------------
class BlockPool(BlockPoolState):
    """``num_blocks`` physical blocks of ``block_size`` token slots, shared by sequences.

    State (given by ``BlockPoolState``, with ``num_free_blocks`` and ``block_table(seq_id)``):
    ``free_blocks`` holds the ids of free blocks (take from the left, return to the right);
    ``block_tables[seq_id]`` lists a sequence's physical blocks in order; ``seq_lens[seq_id]``
    counts its tokens.

    Rules your methods must keep:
    * a sequence holds exactly ceil(seq_len / block_size) blocks: take a new block only when
      the last one is full;
    * an error leaves the pool exactly as it was (check everything before changing anything);
    * errors: ``OutOfBlocksError`` when too few blocks are free; ``UnknownSequenceError`` for
      an id the pool does not hold; ``ValueError`` for a negative count, a sequence whose
      new length could never fit in the whole pool (``num_blocks * block_size`` slots), or
      allocating an id that already exists; ``TypeError``
      for a count that is not an int.
    """

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Start sequence ``seq_id`` with ``num_tokens`` tokens; return its block table."""
        raise NotImplementedError("BlockPool.allocate: take ceil(num_tokens / block_size) blocks "
                                  "from the left of free_blocks")

    def append(self, seq_id, num_tokens: int = 1) -> list[int]:
        """Grow ``seq_id`` by ``num_tokens`` tokens; return the newly taken blocks (often [])."""
        raise NotImplementedError("BlockPool.append: how many blocks does the new length need, "
                                  "beyond those the sequence has?")

    def free(self, seq_id) -> list[int]:
        """Give every block of ``seq_id`` back (to the right of free_blocks); return them."""
        raise NotImplementedError("BlockPool.free: return the table's blocks and forget the sequence")


# -- task slot_mapping ---------------------------------------------------------------------
def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Physical slots of token positions ``start .. start + num_tokens - 1`` of one sequence.

    Position ``pos`` lives in block ``block_table[pos // block_size]`` at offset
    ``pos % block_size``. Raise ValueError if a position is beyond the table's blocks.
    """
    raise NotImplementedError("slot_mapping: slot = physical block * block_size + offset in block")


# -- task write_kv_kernel ------------------------------------------------------------------
@triton.jit
def write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    key_token_stride, value_token_stride, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """One program copies elements ``[pid1 * BLOCK, pid1 * BLOCK + BLOCK)`` of token ``pid0``.

    * Token ``t``'s K row starts at ``key_ptr + t * key_token_stride`` and has ``ROW``
      (= num_kv_heads * head_dim) contiguous elements; the same for V.
    * Its slot is ``slot_mapping_ptr[t]`` (int64); slot ``s`` starts at element ``s * ROW``
      of the flattened caches. A slot of -1 is padding: write nothing.
    * Mask elements past ``ROW``.
    * Skip slot -1 with the mask, as one comparison: ``row_len = tl.where(slot >= 0, ROW, 0)``,
      ``mask = cols < row_len``. (``(cols < ROW) & (slot >= 0)``, a block ``&`` a scalar, runs
      on a GPU but Triton 3.9's CPU interpreter rejects it: "mask has unsupported dtype".)
    * An unmasked store of slot -1 writes before the cache: on the CPU that can crash the
      grader or pass silently; the graded test checks for it.
    """
    raise NotImplementedError("write_kv_kernel: load the slot, load the K and V rows, store them "
                              "at slot * ROW (masked; skip slot -1: mask = cols < tl.where(slot >= 0, ROW, 0))")


# Given: write_kv(key, value, k_cache, v_cache, slot_mapping) launches your kernel.
write_kv = write_kv_with(write_kv_kernel)

# Given: use_my_pieces(llm) serves an LLM with your BlockPool, slot_mapping and
# write_kv_kernel plugged in (kvlab/scaffold/ch02.py says how).
use_my_pieces = my_pieces_user(BlockPool, slot_mapping, write_kv)
