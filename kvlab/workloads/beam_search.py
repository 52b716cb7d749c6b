"""Parallel sampling and beam search on the block pool: sequences that share their KV blocks.

Both start from one prompt and grow several sequences from it. On a paged cache they are
written with three pool operations only:

* ``fork(parent, child)``: the child shares every block of the parent (reference counts + 1);
* ``append(seq_id, 1)``: one new token; if the last block is partly filled and shared, the
  pool first gives the sequence a private copy of it (copy-on-write) and records the
  ``(src, dst)`` pair that :func:`kvlab.kernels.copy_blocks` must copy before the next forward;
* ``free(seq_id)``: drop a sequence; blocks go back to the pool when their last holder leaves.

There is no KV cache here, only bookkeeping: after each step the copy pairs are taken from the
pool and counted, as an engine would hand them to ``copy_blocks``. To drive a real cache, call
:func:`start_beams` and :func:`beam_search_step` yourself and copy / write between steps.

Memory: with sharing, k sequences of a P-token prompt and L generated tokens each hold about
``P + k*L`` tokens' worth of blocks instead of ``k*(P + L)``: see :func:`sharing_memory`.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from kvlab.paging.block_pool import BlockPool, blocks_needed
from kvlab.paging.snapshot import page_map_frame
from kvlab.workloads.allocator_trace import blocks_phrase

MODES = ("parallel", "beam")


# -- recording -----------------------------------------------------------------------------
def _recorder(record) -> Callable[[object, str], None]:
    """``note(pool, title)``: snapshot the pool into ``record`` (a list or a callback), or do nothing."""
    if record is None:
        return lambda pool, title: None
    add = record.append if isinstance(record, list) else record
    return lambda pool, title: add(page_map_frame(pool, title))


def append_one(pool, seq_id) -> str:
    """Append one token to ``seq_id``; returns what the pool did, in words."""
    copies_before = len(pool.pending_copies)
    taken = pool.append(seq_id, 1)
    copies = pool.pending_copies[copies_before:]
    if copies:
        src, dst = copies[-1]
        return f"copy-on-write: shared block {src} copied into block {dst}"
    if taken:
        return f"takes {blocks_phrase(taken)}"
    return f"writes into block {pool.block_tables[seq_id][-1]}"


# -- what a run did ------------------------------------------------------------------------
@dataclass(frozen=True)
class Beam:
    """One hypothesis: the sequence holding its KV, its generated tokens, their summed log-prob."""

    seq_id: int
    tokens: tuple[int, ...]
    score: float


@dataclass
class DecodeRun:
    """What a decoding run did to the pool, step by step (entry 0: after the prompt)."""

    blocks_per_step: list[int] = field(default_factory=list)   # blocks in use after each step
    copies: list[list[tuple[int, int]]] = field(default_factory=list)  # copy-on-write pairs of each step
    forks: int = 0
    beams: list[Beam] = field(default_factory=list)            # beam search: final beams, best first

    @property
    def peak_blocks(self) -> int:
        return max(self.blocks_per_step)

    @property
    def final_blocks(self) -> int:
        """Blocks in use when generation ends, before the sequences are freed."""
        return self.blocks_per_step[-1]

    @property
    def num_copies(self) -> int:
        return sum(len(step) for step in self.copies)

    def end_step(self, pool) -> None:
        """Record the blocks in use, and take the step's copy-on-write pairs from the pool."""
        self.blocks_per_step.append(pool.num_used_blocks)
        self.copies.append(pool.take_copies())


# -- parallel sampling ---------------------------------------------------------------------
def parallel_sampling(pool, prompt_len: int, n: int, output_lens, record=None) -> DecodeRun:
    """``n`` samples of one prompt: sample 0 holds the prompt, samples 1..n-1 fork it.

    ``output_lens`` is one int for all samples or ``n`` ints. Every step each unfinished
    sample appends one token; a sample is freed after its last one. ``record`` (a list, or a
    callback taking a :class:`~kvlab.paging.snapshot.PageMapFrame`) gets a snapshot after
    every operation.
    """
    lens = [output_lens] * n if isinstance(output_lens, int) else [int(x) for x in output_lens]
    if n < 1 or len(lens) != n or min(lens) < 0:
        raise ValueError(f"need n >= 1 and n output lengths >= 0, got n={n}, output_lens={output_lens}")
    note = _recorder(record)
    pool.allocate(0, prompt_len)
    note(pool, f"sample 0 holds the {prompt_len}-token prompt")
    run = DecodeRun()
    for sample in range(1, n):
        pool.fork(0, sample)
        run.forks += 1
        note(pool, f"sample {sample} forks sample 0: shares its blocks")
    run.end_step(pool)
    for sample in (s for s in range(n) if lens[s] == 0):
        pool.free(sample)
        note(pool, f"sample {sample} wants no tokens: freed")
    for step in range(1, max(lens) + 1):
        live = [s for s in range(n) if lens[s] >= step]
        for sample in live:
            note(pool, f"step {step}: sample {sample} appends a token -> {append_one(pool, sample)}")
        run.end_step(pool)
        for sample in (s for s in live if lens[s] == step):
            released = pool.free(sample)
            note(pool, f"step {step}: sample {sample} is done -> frees {blocks_phrase(released)}")
    return run


# -- beam search ---------------------------------------------------------------------------
def toy_logits(seed: int = 0, vocab_size: int = 8, spread: float = 4.0) -> Callable[[tuple], list[float]]:
    """A toy language model: next-token logits drawn at random, a pure function of the prefix.

    The same ``(seed, tokens)`` always gives the same ``vocab_size`` logits, uniform in
    ``[0, spread)``; a larger ``spread`` makes the distributions peakier.
    """
    def logits(tokens: tuple) -> list[float]:
        rng = random.Random(f"{seed}/{','.join(map(str, tokens))}")
        return [spread * rng.random() for _ in range(vocab_size)]
    return logits


def log_softmax(logits: Sequence[float]) -> list[float]:
    values = [float(x) for x in logits]
    top = max(values)
    log_sum = top + math.log(sum(math.exp(x - top) for x in values))
    return [x - log_sum for x in values]


def top_candidates(beams: list[Beam], logits_fn, beam_width: int) -> list[tuple[int, int, float]]:
    """The ``beam_width`` best continuations ``(parent index, token, score)``, best first.

    A candidate's score is its parent's plus the token's log-prob; ties go to the lower parent
    index, then the lower token id.
    """
    candidates = []
    for parent, beam in enumerate(beams):
        for token, logprob in enumerate(log_softmax(logits_fn(beam.tokens))):
            candidates.append((beam.score + logprob, parent, token))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(parent, token, score) for score, parent, token in candidates[:beam_width]]


def start_beams(pool, prompt_len: int, record=None) -> list[Beam]:
    """Allocate the prompt as sequence 0: the one beam a search starts from."""
    pool.allocate(0, prompt_len)
    _recorder(record)(pool, f"beam 0 holds the {prompt_len}-token prompt")
    return [Beam(0, (), 0.0)]


def beam_search_step(pool, beams: list[Beam], logits_fn, beam_width: int, new_ids: Iterator[int],
                     record=None, step: int = 0) -> list[Beam]:
    """One step: keep the best ``beam_width`` candidates, then free, fork and append.

    1. parents with no kept candidate are freed;
    2. a parent's first kept candidate continues in the parent's sequence; each further one
       forks the parent into a new sequence (id from ``new_ids``);
    3. every kept beam appends its new token (copy-on-write happens inside ``append``).

    Freeing before appending keeps a step's copy pairs valid for ``copy_blocks``: a block freed
    this step may become a copy's destination, but never also a source.
    """
    note = _recorder(record)
    kept = top_candidates(beams, logits_fn, beam_width)
    parents = {parent for parent, _, _ in kept}
    for index, beam in enumerate(beams):
        if index not in parents:
            released = pool.free(beam.seq_id)
            note(pool, f"step {step}: beam {beam.seq_id} falls out -> frees {blocks_phrase(released)}")
    new_beams, continued = [], set()
    for parent, token, score in kept:
        seq_id = beams[parent].seq_id
        if parent in continued:
            child = next(new_ids)
            pool.fork(seq_id, child)
            note(pool, f"step {step}: beam {child} forks beam {seq_id}: shares its blocks")
            seq_id = child
        continued.add(parent)
        new_beams.append(Beam(seq_id, beams[parent].tokens + (token,), score))
    for beam in new_beams:
        what = append_one(pool, beam.seq_id)
        note(pool, f"step {step}: beam {beam.seq_id} appends token {beam.tokens[-1]} -> {what}")
    return new_beams


def beam_search(pool, prompt_len: int, beam_width: int, steps: int, logits_fn=None, seed: int = 0,
                record=None) -> DecodeRun:
    """Beam search for ``steps`` tokens on ``pool``; every sequence is freed at the end.

    ``logits_fn(tokens) -> logits`` scores the next token of a beam that generated ``tokens``
    (default: :func:`toy_logits` with ``seed``). Returns the run: final beams best first,
    blocks in use after every step, copy-on-write pairs.
    """
    if beam_width < 1 or steps < 0:
        raise ValueError(f"need beam_width >= 1 and steps >= 0, got {beam_width}, {steps}")
    logits_fn = toy_logits(seed) if logits_fn is None else logits_fn
    note = _recorder(record)
    beams = start_beams(pool, prompt_len, record)
    run, new_ids = DecodeRun(), itertools.count(1)
    run.end_step(pool)
    for step in range(1, steps + 1):
        old_ids = {beam.seq_id for beam in beams}
        beams = beam_search_step(pool, beams, logits_fn, beam_width, new_ids, record, step)
        run.forks += sum(beam.seq_id not in old_ids for beam in beams)
        run.end_step(pool)
    run.beams = beams
    for beam in beams:
        pool.free(beam.seq_id)
        note(pool, f"done: beam {beam.seq_id} (score {beam.score:.2f}) is freed")
    return run


# -- memory: with sharing vs without -------------------------------------------------------
def independent_sequences(pool, prompt_len: int, k: int, gen_len: int, record=None) -> DecodeRun:
    """The baseline without sharing: ``k`` sequences, each with its own copy of the prompt."""
    note = _recorder(record)
    for seq in range(k):
        pool.allocate(seq, prompt_len)
        note(pool, f"sequence {seq} holds its own copy of the {prompt_len}-token prompt")
    run = DecodeRun()
    run.end_step(pool)
    for step in range(1, gen_len + 1):
        for seq in range(k):
            note(pool, f"step {step}: sequence {seq} appends a token -> {append_one(pool, seq)}")
        run.end_step(pool)
    for seq in range(k):
        pool.free(seq)
    return run


def sharing_ratio_formula(prompt_len: float, gen_len: float, k: int) -> float:
    """Memory with sharing / without, counted in tokens: (P + kL) / (k(P + L)).

    With sharing the prompt is stored once and each of the ``k`` sequences adds its ``L``
    generated tokens; without, each sequence stores ``P + L``. It falls from 1 (no prompt) to
    1/k (no generated tokens); beam search, whose beams also share generated prefixes, can do
    better than this.
    """
    return (prompt_len + k * gen_len) / (k * (prompt_len + gen_len))


def prompt_ratio_for(sharing_ratio: float, k: int) -> float:
    """The prompt/generation length ratio P/L at which the formula equals ``sharing_ratio``.

    (r + k) / (k(r + 1)) = s  gives  r = k(1 - s) / (ks - 1), for 1/k < s <= 1.
    """
    if not 1 / k < sharing_ratio <= 1:
        raise ValueError(f"with k={k} the ratio lies in ({1 / k:.3f}, 1], got {sharing_ratio}")
    return k * (1 - sharing_ratio) / (k * sharing_ratio - 1)


@dataclass(frozen=True)
class SharingMemory:
    """Blocks ``k`` sequences of one prompt hold when generation ends, with sharing and without.

    "Without" is ``k`` independent sequences of ``prompt_len + gen_len`` tokens on the same
    paged allocator (what a non-sharing engine stores, without any over-reservation), so
    the ratio isolates what sharing saves. Both are measured on a real pool, in whole blocks.
    """

    mode: str
    prompt_len: int
    gen_len: int
    k: int
    block_size: int
    shared_blocks: int        # in use at the end of generation, with sharing
    shared_peak: int          # the most in use at any step, with sharing
    unshared_blocks: int      # in use at the end of generation, k independent sequences
    copies: int               # copy-on-write block copies made

    @property
    def ratio(self) -> float:
        return self.shared_blocks / self.unshared_blocks

    @property
    def formula(self) -> float:
        return sharing_ratio_formula(self.prompt_len, self.gen_len, self.k)


def sharing_memory(prompt_len: int, gen_len: int, k: int, block_size: int = 16, mode: str = "beam",
                   seed: int = 0, logits_fn=None, pool_factory=BlockPool) -> SharingMemory:
    """Measure, on fresh pools, the blocks held with sharing (beam search of width ``k``, or
    ``k`` parallel samples) and without (``k`` independent copies). ``pool_factory(num_blocks,
    block_size)`` makes the pools: pass your own to measure it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    num_blocks = k * blocks_needed(prompt_len + gen_len, block_size) + k
    shared_pool = pool_factory(num_blocks, block_size)
    if mode == "beam":
        shared = beam_search(shared_pool, prompt_len, k, gen_len, logits_fn=logits_fn, seed=seed)
    else:
        shared = parallel_sampling(shared_pool, prompt_len, k, gen_len)
    unshared = independent_sequences(pool_factory(num_blocks, block_size), prompt_len, k, gen_len)
    return SharingMemory(mode, prompt_len, gen_len, k, block_size, shared.final_blocks, shared.peak_blocks,
                         unshared.final_blocks, shared.num_copies)


def sharing_sweep(prompt_lens, gen_lens, k: int = 4, block_size: int = 16, modes=MODES,
                  seed: int = 0) -> list[SharingMemory]:
    """:func:`sharing_memory` for every (mode, prompt length, generation length)."""
    return [sharing_memory(p, g, k, block_size, mode, seed)
            for mode in modes for p in prompt_lens for g in gen_lens]
