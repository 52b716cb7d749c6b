"""Chapter 3 answers: the same names and signatures as ``exercises/ch03.py``."""
from kvlab.errors import OutOfBlocksError, UnknownSequenceError
from kvlab.paging import blocks_needed
from kvlab.paging.block_pool import check_count
# Given (not a task), shared with exercises/ch03.py: read kvlab/scaffold/ch03.py.
from kvlab.scaffold.ch03 import PIECES, my_pieces_user, pool_with_fork_and_append  # noqa: F401


# -- task fork -------------------------------------------------------------------------------
def fork(pool, parent, child) -> list[int]:
    if parent not in pool.block_tables:
        raise UnknownSequenceError(f"unknown sequence id {parent!r}")
    if child in pool.block_tables:
        raise ValueError(f"sequence {child!r} already exists: fork needs a new id")
    table = pool.block_tables[parent]
    for block in table:
        pool.ref_counts[block] += 1
    pool.block_tables[child] = list(table)
    pool.seq_lens[child] = pool.seq_lens[parent]
    return list(table)


# -- task copy_on_write ----------------------------------------------------------------------
def append_with_copy_on_write(pool, seq_id, num_tokens: int = 1) -> list[int]:
    check_count("num_tokens", num_tokens)
    if seq_id not in pool.block_tables:
        raise UnknownSequenceError(f"unknown sequence id {seq_id!r}")
    table, length = pool.block_tables[seq_id], pool.seq_lens[seq_id]
    new_len = length + num_tokens
    if new_len > pool.num_blocks * pool.block_size:
        raise ValueError(f"{new_len} tokens can never fit in {pool.num_blocks} blocks of {pool.block_size}")
    copy = num_tokens > 0 and length % pool.block_size != 0 and pool.ref_counts[table[-1]] > 1
    grow = blocks_needed(new_len, pool.block_size) - len(table)
    if copy + grow > len(pool.free_blocks):
        raise OutOfBlocksError(f"need {copy + grow} blocks, {len(pool.free_blocks)} are free")
    taken = []
    if copy:
        shared = table[-1]
        table[-1] = pool._take_free_block()
        pool.ref_counts[shared] -= 1          # the others still hold it
        # the copies run together: a block still waiting for its own copy has no data yet
        source = next((src for src, dst in pool.pending_copies if dst == shared), shared)
        pool.pending_copies.append((source, table[-1]))
        taken.append(table[-1])
    for _ in range(grow):
        table.append(pool._take_free_block())
        taken.append(table[-1])
    pool.seq_lens[seq_id] = new_len
    return taken


# -- task sharing_blocks ---------------------------------------------------------------------
def parallel_sampling_blocks(prompt_len: int, gen_len: int, n: int, block_size: int) -> tuple[int, int]:
    # Full prompt blocks stay shared. A partly filled last prompt block is copied by every
    # sample but the last to write (that one keeps the original), so each sample holds the
    # blocks from there on alone.
    per_sequence = blocks_needed(prompt_len + gen_len, block_size)
    shared = prompt_len // block_size
    return shared + n * (per_sequence - shared), n * per_sequence


# Given: kvlab's BlockPool with fork and append replaced by these.
MyBlockPool = pool_with_fork_and_append(fork, append_with_copy_on_write)

# Given: use_my_pieces(llm) serves an LLM from a pool running these.
use_my_pieces = my_pieces_user(fork, append_with_copy_on_write)
