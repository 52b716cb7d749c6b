"""Allocator traces: a recorded run of requests arriving, growing and finishing.

:func:`make_allocator_trace` simulates a tiny serving loop against a real :class:`BlockPool` and
records every change it made as an :class:`AllocatorEvent`. :func:`replay` applies such a
trace to any pool (yours too) and snapshots the pool after each event: the frames a page-map
step-through shows.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from itertools import accumulate

from kvlab.paging.block_pool import BlockPool, blocks_needed
from kvlab.paging.snapshot import PageMapFrame, page_map_frame

KINDS = ("arrive", "grow", "finish")


@dataclass(frozen=True)
class AllocatorEvent:
    """One change to the pool.

    ``kind`` is ``"arrive"`` (allocate ``num_tokens`` prompt tokens), ``"grow"`` (append
    ``num_tokens`` new tokens) or ``"finish"`` (free the sequence, which held ``num_tokens``).
    ``step`` is the engine step it happens in; one step usually has several events.
    """

    step: int
    kind: str
    seq_id: object
    num_tokens: int


def make_allocator_trace(num_blocks: int, block_size: int, num_requests: int, seed: int = 0, *,
                         prompt_lens: tuple[int, int] = (2, 12), output_lens: tuple[int, int] = (4, 16),
                         tokens_per_step: int = 2, max_running: int | None = None) -> list[AllocatorEvent]:
    """A trace of ``num_requests`` requests (seq ids 0, 1, ...) that is valid for any correct pool
    of ``num_blocks`` blocks of ``block_size``.

    Prompt and output lengths are drawn uniformly from the inclusive ranges; the first
    request arrives at step 0, the others 0-2 steps apart. Each step, finished requests free
    their blocks, arrived requests are admitted in order while their *final* length fits in
    the blocks not yet promised to running ones, then every running request grows by up to
    ``tokens_per_step`` tokens.

    Admitting on the final length means no grow can run out of blocks (a real engine admits
    more eagerly and preempts when it runs out; see chapter 8); blocks are still taken one
    at a time, as sequences grow.
    """
    capacity = num_blocks * block_size
    if prompt_lens[1] + output_lens[1] > capacity:
        raise ValueError(f"a request of up to {prompt_lens[1] + output_lens[1]} tokens can never fit in "
                         f"{num_blocks} blocks of {block_size} ({capacity} slots)")
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    rng = random.Random(seed)
    sizes = [(rng.randint(*prompt_lens), rng.randint(*output_lens)) for _ in range(num_requests)]
    arrival_steps = list(accumulate([0] + [rng.randint(0, 2) for _ in range(num_requests - 1)]))
    max_running = num_requests if max_running is None else max_running

    pool = BlockPool(num_blocks, block_size)
    waiting = deque(range(num_requests))
    to_generate: dict[int, int] = {}   # running seq id -> tokens it has still to generate
    events: list[AllocatorEvent] = []
    step = 0
    while waiting or to_generate:
        for seq in [s for s, left in to_generate.items() if left == 0]:
            events.append(AllocatorEvent(step, "finish", seq, pool.seq_lens[seq]))
            pool.free(seq)
            del to_generate[seq]
        promised = sum(blocks_needed(pool.seq_lens[s] + left, block_size) - len(pool.block_tables[s])
                       for s, left in to_generate.items())
        admitted = []
        while waiting and arrival_steps[waiting[0]] <= step and len(to_generate) < max_running:
            seq = waiting[0]
            prompt, output = sizes[seq]
            if blocks_needed(prompt + output, block_size) > pool.num_free_blocks - promised:
                break
            waiting.popleft()
            pool.allocate(seq, prompt)
            to_generate[seq] = output
            promised += blocks_needed(prompt + output, block_size) - blocks_needed(prompt, block_size)
            admitted.append(seq)
            events.append(AllocatorEvent(step, "arrive", seq, prompt))
        for seq, left in to_generate.items():
            if left and seq not in admitted:  # a request's arrival step is its prefill
                grow = min(tokens_per_step, left)
                pool.append(seq, grow)
                to_generate[seq] = left - grow
                events.append(AllocatorEvent(step, "grow", seq, grow))
        step += 1
    return events


def blocks_phrase(blocks) -> str:
    """"block 3" / "blocks 3, 7" / "no block": for frame titles."""
    blocks = list(blocks)
    if not blocks:
        return "no block"
    return ("block " if len(blocks) == 1 else "blocks ") + ", ".join(map(str, blocks))


def apply_allocator_event(pool, event: AllocatorEvent) -> str:
    """Apply one event to ``pool``; returns what happened in words (blocks read off its tables)."""
    before = list(pool.block_tables.get(event.seq_id, []))
    head = f"step {event.step}: seq {event.seq_id}"
    if event.kind == "arrive":
        pool.allocate(event.seq_id, event.num_tokens)
        taken = list(pool.block_tables[event.seq_id])
        return f"{head} arrives with {event.num_tokens} tokens -> takes {blocks_phrase(taken)}"
    if event.kind == "grow":
        pool.append(event.seq_id, event.num_tokens)
        taken = list(pool.block_tables[event.seq_id])[len(before):]
        if taken or not before:
            return f"{head} grows by {event.num_tokens} -> takes {blocks_phrase(taken)}"
        return f"{head} grows by {event.num_tokens} -> fits in block {before[-1]}"
    if event.kind == "finish":
        pool.free(event.seq_id)
        return f"{head} finishes -> frees {blocks_phrase(before)}"
    raise ValueError(f"unknown event kind {event.kind!r}; expected one of {KINDS}")


def replay(trace: list[AllocatorEvent], pool) -> list[PageMapFrame]:
    """Apply ``trace`` to ``pool`` in order; one page-map frame after each event.

    Works on any pool with the BlockPool interface. An error from the pool (e.g.
    NotImplementedError from an unfinished exercise) propagates, with the pool as the
    failing event left it.
    """
    return [page_map_frame(pool, title=apply_allocator_event(pool, event)) for event in trace]
