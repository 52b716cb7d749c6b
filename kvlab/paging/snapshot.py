"""Snapshots of a block pool: who owns each physical block, how full it is, the block tables.

A :class:`PageMapFrame` is a plain copy, so a list of them records how a pool evolved (trace
replays, step-through widgets). :mod:`kvlab.viz.page_map` draws them. A "pool" is anything
with ``num_blocks``, ``block_size``, ``block_tables`` (seq id -> list of block ids) and
``seq_lens`` (seq id -> tokens): :class:`kvlab.paging.BlockPool`, or your own.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageMapFrame:
    """A pool's state at one moment. Plain copies: later changes to the pool don't reach it."""

    num_blocks: int
    block_size: int
    owners: tuple          # owners[b]: the seq id whose table holds physical block b, or None
    fills: tuple           # fills[b]: tokens stored in block b / block_size, in [0, 1]
    block_tables: dict     # seq id -> tuple of physical block ids, logical order
    seq_lens: dict         # seq id -> tokens the sequence holds
    free_blocks: tuple | None = None   # the pool's own free list, when it has one
    title: str = ""
    ref_counts: tuple | None = None    # ref_counts[b], when the pool counts holders (sharing)
    cached: tuple | None = None        # cached[b]: block b carries a prefix-cache hash
    evictable: tuple | None = None     # free blocks that still hold cached KV, least recent first
    pending_copies: tuple = ()         # copy-on-write (src, dst) pairs not yet copied

    @property
    def num_used(self) -> int:
        return sum(owner is not None for owner in self.owners)

    def holders(self, block: int) -> int:
        """How many block-table entries point at ``block`` (> 1: shared)."""
        return sum(table.count(block) for table in self.block_tables.values())

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used

    @property
    def num_tokens(self) -> int:
        """Tokens each sequence holds, added up (a shared block counts once per holder)."""
        return sum(self.seq_lens.values())

    @property
    def num_stored_tokens(self) -> int:
        """Token slots physically filled: a shared block counts once."""
        return round(sum(self.fills) * self.block_size)


def tokens_in_block(seq_len: int, logical_block: int, block_size: int) -> int:
    """How many of a sequence's ``seq_len`` tokens sit in its ``logical_block``-th block."""
    return max(0, min(block_size, seq_len - logical_block * block_size))


def page_map_frame(pool, title: str = "") -> PageMapFrame:
    """Snapshot ``pool``: owner and fill of every physical block, tables and lengths copied."""
    num_blocks, block_size = int(pool.num_blocks), int(pool.block_size)
    tables = {seq: tuple(int(b) for b in table) for seq, table in pool.block_tables.items()}
    seq_lens = {seq: int(pool.seq_lens.get(seq, 0)) for seq in tables}
    owners: list = [None] * num_blocks
    fills = [0.0] * num_blocks
    for seq, table in tables.items():
        for logical, block in enumerate(table):
            if 0 <= block < num_blocks and owners[block] is None:  # a clash is reported by frame_problems
                owners[block] = seq
                fills[block] = tokens_in_block(seq_lens[seq], logical, block_size) / block_size
    free = getattr(pool, "free_blocks", None)
    free = None if free is None else tuple(int(b) for b in free)
    refs = getattr(pool, "ref_counts", None)
    hashes = getattr(pool, "block_hashes", None)
    evictable = getattr(pool, "evictable", None)
    return PageMapFrame(num_blocks, block_size, tuple(owners), tuple(fills), tables, seq_lens, free, title,
                        ref_counts=None if refs is None else tuple(int(r) for r in refs),
                        cached=None if hashes is None else tuple(h is not None for h in hashes),
                        evictable=None if evictable is None else tuple(int(b) for b in evictable),
                        pending_copies=tuple(getattr(pool, "pending_copies", ())))


def frame_problems(frame: PageMapFrame) -> list[str]:
    """Broken paging invariants in ``frame``, in words; empty when the pool is consistent.

    Checks: block ids in range, each table exactly ceil(seq_len / block_size) long, a block
    in several table entries only when the pool's reference count says it is shared that
    many times, and (when the pool shows its free list) every block either free (or
    evictable) or owned, never both, never twice free.
    """
    problems = []
    holders: dict[int, list] = {}
    for seq, table in frame.block_tables.items():
        for block in table:
            if not 0 <= block < frame.num_blocks:
                problems.append(f"seq {seq!r} holds block {block}, outside 0..{frame.num_blocks - 1}")
            holders.setdefault(block, []).append(seq)
        expected = -(-frame.seq_lens[seq] // frame.block_size)
        if len(table) != expected:
            problems.append(f"seq {seq!r} has {frame.seq_lens[seq]} tokens in {len(table)} blocks, "
                            f"expected {expected}")
    for block, seqs in sorted(holders.items()):
        refs = frame.ref_counts[block] if frame.ref_counts and 0 <= block < frame.num_blocks else 1
        if len(seqs) != refs and (len(seqs) > 1 or frame.ref_counts):
            problems.append(f"block {block} is held {len(seqs)} times (by {', '.join(map(repr, seqs))}) "
                            f"but its reference count is {refs}")
    for block, refs in enumerate(frame.ref_counts or ()):
        if refs and block not in holders:
            problems.append(f"block {block} has reference count {refs} but no table holds it")
    if frame.free_blocks is not None:
        free = frame.free_blocks + (frame.evictable or ())
        if len(set(free)) != len(free):
            problems.append("the free list names a block twice")
        if both := sorted(set(free) & holders.keys()):
            problems.append(f"blocks {both} are both free and owned")
        if lost := sorted(set(range(frame.num_blocks)) - set(free) - holders.keys()):
            problems.append(f"blocks {lost} are neither free nor owned (leaked)")
    return problems
