"""Kernel planning without Triton: the plain arithmetic behind the course's attention launches.

Everything a launcher decides before it launches, and everything a figure needs to know
about what each program of a launch will do, is computed here, in plain Python: no Triton,
no GPU. The launchers in :mod:`kvlab.kernels` import their tile constants and planning
functions from this module, :mod:`kvlab.viz` draws what it computes, and the tests check it
without compiling or interpreting a kernel.

* **tiles**: :data:`GPU_BLOCK_N`, :data:`INTERPRETER_BLOCK_N`, :func:`tile_config`,
  :func:`launch_config`; :func:`warp_specialized_extend`, which prefill kernel a quantised cache takes;
* **FlashAttention** (chapter 5): :func:`causal_tile_bounds`, the Python twin of the kernels'
  ``_causal_bounds``; :func:`tile_schedule` and :func:`paged_reads`, what every program does
  with every tile of keys;
* **FlashDecoding** (chapter 6): :func:`split_token_ranges`, the ranges ``decode_split_kernel``
  cuts; :func:`choose_num_splits`, ``paged_decode``'s split count; :func:`grid_fill`, the
  programs of one decode launch spread over the SMs.
"""
from __future__ import annotations

import functools
import heapq
import numbers
from dataclasses import dataclass
from typing import Sequence

from kvlab import profile
from kvlab.validation import check_count


@functools.lru_cache(maxsize=None)
def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (4 elsewhere: the interpreter's stand-in)."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def check_int(name: str, value, minimum: int = 0) -> int:
    """:func:`kvlab.validation.check_count` that also takes NumPy's integers (returned as ``int``)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    return check_count(name, value, minimum=minimum)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), as ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# -- tiles ------------------------------------------------------------------------------------
GPU_BLOCK_N = 128           # tokens per tile on a GPU (an H200 sweep: benchmarks/tune_attention.py)
INTERPRETER_BLOCK_N = 16    # small tiles, so the interpreter's short sequences still cross several
SHARED_MEMORY_BUDGET = 200 * 1024   # bytes of K/V stages; an H100/H200 SM has 227 KiB for one program


def tile_config(head_dim: int, max_len_q: int | None = None, max_len_k: int | None = None,
                kv_cache_dtype: str = "auto") -> dict:
    """``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages`` for this machine and head size.

    On a GPU: the configs that won a sweep on an H200 (``benchmarks/tune_attention.py``).
    Long sequences take 128 x 128 tiles, which reuse each loaded tile the most; short ones
    (up to 2K queries) take 64 x 64 tiles, which give the SMs more, shorter programs (causal
    programs near the start of a sequence have little to do). Short queries over a long cached
    prefix (``max_len_k`` >= 8K keys: a chunk of a long prompt) give every program many keys
    again, so they take the 128 x 128 tiles too (measured for ``head_dim`` 128; at 64 the small
    tiles stayed as fast). ``head_dim`` 256 takes smaller
    tiles so they still fit in shared memory. Over a quantised cache (``kv_cache_dtype`` "fp8"
    or "int8": codes converted in registers before the products) 128 x 64 tiles won at every
    extend shape of an H200 sweep (``benchmarks/sweep_quantized.py``; compiled with 128 x 128
    tiles the kernel needs 255 registers and spills), with 8 warps for fp8 and 4 for int8, and
    4 whenever fewer than 128 queries remain. In the interpreter, 16 x 16 tiles let the short
    sequences it can run in seconds still cross several tiles, so the loop, the causal
    diagonal and the ragged end all run. ``BLOCK_M`` shrinks for short queries (a decode step
    has one), never below 16, the smallest ``tl.dot``.
    """
    long = (max_len_q is None or max_len_q > 2048
            or (max_len_k is not None and max_len_k >= 8192 and head_dim > 64))
    if profile.INTERPRETED:
        cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    elif head_dim <= 128 and kv_cache_dtype != "auto":
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8 if kv_cache_dtype == "fp8" and head_dim > 64 else 4,
                   num_stages=3)
    elif head_dim <= 128 and long:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=4 if head_dim <= 64 else 8, num_stages=3)
    elif head_dim <= 128:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    if max_len_q is not None:
        cfg["BLOCK_M"] = max(16, min(cfg["BLOCK_M"], next_power_of_2(max(max_len_q, 1))))
        # Too few rows to share among 8 warps: below 64 (bf16), below 128 (a quantised cache)
        rows_for_8_warps = 64 if kv_cache_dtype == "auto" else 128
        if cfg["BLOCK_M"] < rows_for_8_warps and not profile.INTERPRETED:
            cfg["num_warps"] = 4
    return cfg


# Prefill/extend over a quantised cache on an H200: kernels/paged_prefill_ws.py, whose own warps
# dequantise while two warpgroups multiply, takes fp8 extends over a 3K-32K prefix from 1.8-1.9x to
# 0.92-0.99x bf16's time (int8 to 0.99-1.05x), 8 chunks of 256 over 768 cached tokens from 1.8x to
# 1.00x, head_dim 64 from 1.65x to 1.08x (power-of-two scales kept per page and head). Its programs take 128 queries and read every key the
# last of them sees: steps of a few queries a sequence (32 or fewer: 1.2-1.7x against Triton's
# 0.9-1.3x) or of 256 keys or fewer (1.2-1.45x against 1.07-1.2x) stay on the Triton kernel
# (benchmarks/RESULTS.md, 2026-12-04; the crossover was measured before the kernel's shared-memory
# stores lost their bank conflicts, third session, which made it 5-8% faster on long chunks).
WS_MIN_SEQ_LEN = 512        # the longest sequence of the step, from which the warp-specialised kernel pays
WS_MIN_QUERY_LEN = 128      # the longest chunk of new tokens: a full program of queries
WS_HEAD_DIMS = (64, 128)
WS_CAPABILITY = (9, 0)      # Hopper's warpgroup MMAs; sm_100 has other tensor-core instructions


def warp_specialized_extend(kv_cache_dtype: str, head_dim: int, max_seq_len: int | None, max_query_len: int,
                            capability: tuple[int, int] | None) -> bool:
    """Whether ``paged_prefill`` takes ``paged_prefill_ws`` (every key through the block table):
    over an fp8/int8 cache, on an sm_90 GPU (``capability``; ``None`` off a GPU), for
    ``head_dim`` 64 or 128 and steps whose longest sequence (``max_seq_len``, when the caller knows
    it) reaches :data:`WS_MIN_SEQ_LEN` tokens and whose longest chunk of new tokens
    (``max_query_len``) reaches :data:`WS_MIN_QUERY_LEN`."""
    return (kv_cache_dtype in ("fp8", "int8") and head_dim in WS_HEAD_DIMS and capability == WS_CAPABILITY
            and max_seq_len is not None and max_seq_len >= WS_MIN_SEQ_LEN and max_query_len >= WS_MIN_QUERY_LEN)


def launch_config(head_dim, max_len_q, block_m, block_n, num_warps, num_stages, element_size=2,
                  max_len_k=None, kv_cache_dtype="auto") -> dict:
    """:func:`tile_config` with the caller's overrides (``None``: keep), checked; ``num_stages``
    left to the config shrinks until the K/V stages fit :data:`SHARED_MEMORY_BUDGET`."""
    cfg = tile_config(head_dim, max_len_q, max_len_k, kv_cache_dtype)
    for key, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", num_warps),
                       ("num_stages", num_stages)):
        if value is not None:
            cfg[key] = value
    for key in ("BLOCK_M", "BLOCK_N"):
        if cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"{key.lower()} must be a power of two >= 16 (tl.dot's smallest tile), got {cfg[key]}")
    if num_stages is None:
        # Each stage in flight holds a K and a V tile in shared memory: fewer stages for float32
        # or wide tiles, so the program still fits on an SM.
        # (A rough bound that held on an H200: bf16 128 x 128 tiles of head_dim 128 fit 3 stages.)
        per_stage = 2 * cfg["BLOCK_N"] * head_dim * element_size
        while cfg["num_stages"] > 1 and cfg["num_stages"] * per_stage > SHARED_MEMORY_BUDGET:
            cfg["num_stages"] -= 1
    return cfg


# -- FlashAttention: which program computes which tile ---------------------------------------
FULL, MASKED, SKIPPED = "full", "masked", "skipped"
TILE_STATES = (FULL, MASKED, SKIPPED)


def causal_tile_bounds(start_m: int, len_q: int, len_k: int, block_m: int, block_n: int,
                       causal: bool = True) -> tuple[int, int]:
    """The keys the queries ``start_m .. start_m + block_m - 1`` need, as the kernels see them.

    Returns ``(full_end, end)``: tiles of ``block_n`` keys starting below ``full_end`` (a
    multiple of ``block_n``) are seen whole by every one of those queries and run without a
    mask; the tiles from ``full_end`` up to ``end`` run with one; keys from ``end`` on are never
    loaded. Causal attention is bottom-right aligned: query ``i`` sees keys ``0 .. i + len_k -
    len_q``. (The kernels' ``_causal_bounds`` computes the same on the GPU; a test runs both.)
    """
    for name, value, minimum in (("start_m", start_m, 0), ("len_q", len_q, 1), ("len_k", len_k, 1),
                                 ("block_m", block_m, 1), ("block_n", block_n, 1)):
        check_int(name, value, minimum)
    if start_m >= len_q:
        raise ValueError(f"start_m must be below len_q ({len_q}), got {start_m}")
    if causal and len_q > len_k:
        raise ValueError(f"causal attention needs len_q <= len_k, got len_q {len_q} > len_k {len_k}")
    if causal:
        shift = len_k - len_q
        full_end = start_m + shift + 1                     # the block's first query sees this many keys
        end = min(start_m + block_m + shift, len_k)        # its last query sees this many
    else:
        full_end = end = len_k
    return full_end // block_n * block_n, end


@dataclass(frozen=True)
class TileSchedule:
    """``states[p][j]``: what program ``p`` (queries ``p * block_m ..``) does with key tile ``j``."""

    len_q: int
    len_k: int
    block_m: int
    block_n: int
    causal: bool
    states: tuple[tuple[str, ...], ...]

    @property
    def num_programs(self) -> int:
        return len(self.states)

    @property
    def num_key_tiles(self) -> int:
        return len(self.states[0])

    def count(self, state: str) -> int:
        if state not in TILE_STATES:
            raise ValueError(f"state must be one of {TILE_STATES}, got {state!r}")
        return sum(row.count(state) for row in self.states)

    @property
    def computed_share(self) -> float:
        """Tiles computed (with or without a mask) / all tiles of the grid."""
        return (self.count(FULL) + self.count(MASKED)) / (self.num_programs * self.num_key_tiles)


def tile_schedule(len_q: int, len_k: int, block_m: int, block_n: int, causal: bool = True) -> TileSchedule:
    """What every program of one head does with every key tile (see :func:`causal_tile_bounds`)."""
    for name, value in (("len_q", len_q), ("len_k", len_k), ("block_m", block_m), ("block_n", block_n)):
        check_int(name, value, 1)
    num_key_tiles = -(-len_k // block_n)
    states = []
    for start_m in range(0, len_q, block_m):
        full_end, end = causal_tile_bounds(start_m, len_q, len_k, block_m, block_n, causal)
        states.append(tuple(FULL if j * block_n < full_end else MASKED if j * block_n < end else SKIPPED
                            for j in range(num_key_tiles)))
    return TileSchedule(len_q, len_k, block_m, block_n, bool(causal), tuple(states))


@dataclass(frozen=True)
class PagedReads:
    """What each program of ``paged_prefill`` does with each key position of one sequence.

    ``states[p][pos]`` is FULL (an unmasked tile), MASKED (loaded in a masked tile) or SKIPPED
    (never loaded); ``pages[p]`` lists the physical blocks program ``p`` reads, in order.
    """

    block_table: tuple[int, ...]
    block_size: int
    seq_len: int
    query_len: int
    block_m: int
    block_n: int
    states: tuple[tuple[str, ...], ...]
    pages: tuple[tuple[int, ...], ...]

    @property
    def prefix_len(self) -> int:
        """Tokens cached before this step: the new tokens are positions ``prefix_len ..``."""
        return self.seq_len - self.query_len


def paged_reads(block_table: Sequence[int], block_size: int, seq_len: int, query_len: int,
                block_m: int, block_n: int) -> PagedReads:
    """The keys and pages each program of ``paged_prefill`` reads for one sequence.

    The sequence holds ``seq_len`` tokens in the blocks of ``block_table`` (its last
    ``query_len`` are the new ones, the queries). A tile of ``block_n`` keys is loaded whole up
    to the sequence's end, so a masked tile reads every page it touches, even keys the mask
    then hides.
    """
    block_size = check_int("block_size", block_size, 1)
    seq_len = check_int("seq_len", seq_len, 1)
    query_len = check_int("query_len", query_len, 1)
    if query_len > seq_len:
        raise ValueError(f"query_len ({query_len}) must be <= seq_len ({seq_len}): the new tokens are cached too")
    if hasattr(block_table, "tolist"):                  # a tensor or an array row
        block_table = block_table.tolist()
    table = tuple(check_int("block_table entry", b, 0) for b in block_table)
    if len(table) * block_size < seq_len:
        raise ValueError(f"block_table has {len(table)} blocks of {block_size}: too few for {seq_len} tokens")
    states, pages = [], []
    for start_m in range(0, query_len, block_m):
        full_end, end = causal_tile_bounds(start_m, query_len, seq_len, block_m, block_n, causal=True)
        loaded_end = min(-(-end // block_n) * block_n, seq_len)   # a masked tile loads up to the sequence's end
        states.append(tuple(FULL if pos < full_end else MASKED if pos < loaded_end else SKIPPED
                            for pos in range(seq_len)))
        pages.append(tuple(dict.fromkeys(table[pos // block_size] for pos in range(loaded_end))))
    return PagedReads(table, block_size, seq_len, query_len, block_m, block_n, tuple(states), tuple(pages))


# -- FlashDecoding: which tokens a split reads ---------------------------------------------
def tokens_per_split(max_seq_len: int, num_splits: int, block_n: int) -> int:
    """Tokens of each split: ceil(max_seq_len / num_splits), rounded up to whole tiles of ``block_n``.

    ``decode_split_kernel`` computes it for each sequence from that sequence's own length
    (``max_seq_len = seq_len``), so a sequence of fewer tiles than splits leaves its last
    splits empty. Given a batch's longest sequence instead, it is the one split length a kernel
    that shares it across the launch would use.
    """
    check_int("max_seq_len", max_seq_len, 1)
    check_int("num_splits", num_splits, 1)
    check_int("block_n", block_n, 1)
    return -(-(-(-max_seq_len // num_splits)) // block_n) * block_n


def split_token_ranges(seq_len: int, num_splits: int, block_n: int,
                       max_seq_len: int | None = None) -> list[tuple[int, int]]:
    """Token range ``[start, end)`` that each split program reads of one sequence.

    Split ``g`` covers ``[g * tokens_per_split, (g + 1) * tokens_per_split)`` cut at
    ``seq_len``; an empty split is ``(seq_len, seq_len)``. ``max_seq_len`` is the length the
    splits are cut from: by default ``seq_len``, as ``decode_split_kernel`` cuts each sequence;
    a larger one (the batch's longest sequence) gives the ranges of one split length shared by
    the whole launch.
    """
    check_int("seq_len", seq_len, 1)
    max_seq_len = seq_len if max_seq_len is None else check_int("max_seq_len", max_seq_len, 1)
    if max_seq_len < seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) must be >= seq_len ({seq_len}): the splits "
                         "would not cover the sequence")
    size = tokens_per_split(max_seq_len, num_splits, block_n)
    return [(min(g * size, seq_len), min((g + 1) * size, seq_len)) for g in range(num_splits)]


def pages_read(block_table, start: int, end: int, block_size: int) -> list[int]:
    """Physical pages holding positions ``start .. end - 1``, in logical order."""
    check_int("block_size", block_size, 1)
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start {start}, end {end}")
    if end > len(block_table) * block_size:
        raise ValueError(f"position {end - 1} is beyond the table's {len(block_table)} blocks of {block_size}")
    if start == end:
        return []
    return [int(b) for b in block_table[start // block_size:(end - 1) // block_size + 1]]


# -- how many splits ---------------------------------------------------------------------------
# `benchmarks/bench_paged_decode.py --sweep` timed every split count at batch x context from 1x32K
# to 32x32K on an H200 (132 SMs, 8 KV heads). At every shape the best count made about 256
# programs, two per SM, all running at once; 128 programs (one per SM) ran 10-30% slower, and so
# did ~512 (a second wave of programs), even where the model below counts the same time for it.
# The costs are in "tokens one program streams meanwhile" (roughly 15-30 ns per 128-dim bf16 token).
MIN_TOKENS_PER_SPLIT = 256  # no split shorter than this: too little to stream for what it costs
PROGRAMS_PER_SM = 2         # programs an SM streams at once, one computing while the other waits for memory
QUANT_STREAMS = 2           # a quantised cache: decode_streams_kernel's streams (warps) a program
QUANT_STREAM_N = 32         # ... and keys a stream takes an iteration (an H200 sweep)
QUANT_PROGRAMS_PER_SM = 4   # ... four such programs an SM (3 stages: 50 KB of shared memory each, the limit)
MAX_WAVES = 1               # split counts whose programs need more waves lost in the sweep: not tried
PROGRAM_START_TOKENS = 128  # a program's start: load q and the first tiles before streaming (~2 us)
MERGE_LAUNCH_TOKENS = 256   # the merge kernel's launch and run (~4 us)
MERGE_TOKENS_PER_SPLIT = 8  # each split adds one partial output to write and merge
MAX_SPLITS = 128            # the merge holds a row's partial outputs in registers


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *,
                      block_n: int | None = None, programs_per_sm: int | None = None, quantised: bool = False) -> int:
    """The split count with the shortest estimated decode time.

    ``block_n`` and ``programs_per_sm`` default to ``paged_decode``'s launch on a GPU: 128-key
    tiles and two programs an SM for a 16-bit cache, and for a ``quantised`` one
    ``decode_streams_kernel``'s 2 x 32 keys and four programs an SM.

    Decode streams K/V from memory: a program's time is about the tokens it reads. The
    ``batch * num_kv_heads * splits`` programs run ``num_sms * programs_per_sm`` at a time, in
    waves, so a launch lasts about ``waves * (tokens per program + its start)``: splitting pays
    while it fills slots that would idle. The candidates: one split, and for 1 .. MAX_WAVES
    waves the most splits whose programs fit in them (the more splits, the shorter each), cut
    to whole tiles of ``block_n`` tokens as the kernel cuts them, none shorter than
    ``MIN_TOKENS_PER_SPLIT``. Two splits or more also pay for the merge: a launch, and a little
    per split. So a batch that fills the slots already stays whole (on an H200, 32 sequences x
    8 KV heads = 256 programs for 264 slots), and one long sequence is cut in as many splits as
    fill them (8 KV heads x 32 splits).
    """
    if block_n is None:
        block_n = QUANT_STREAMS * QUANT_STREAM_N if quantised else GPU_BLOCK_N
    if programs_per_sm is None:
        programs_per_sm = quant_programs_per_sm() if quantised else PROGRAMS_PER_SM
    programs = batch * num_kv_heads
    slots = num_sms * programs_per_sm                   # programs that run at the same time: one wave
    most = max(1, min(max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))
    candidates = [1] + [min(most, max(1, waves * slots // programs)) for waves in range(1, MAX_WAVES + 1)]
    best, best_time = 1, None
    for splits in candidates:
        tokens = -(-max_seq_len // splits)              # one split's tokens, rounded up to whole tiles
        tokens = -(-tokens // block_n) * block_n
        splits = -(-max_seq_len // tokens)              # the fewest splits of that length: none empty
        time = -(-programs * splits // slots) * (tokens + PROGRAM_START_TOKENS)
        if splits > 1:
            time += MERGE_LAUNCH_TOKENS + splits * MERGE_TOKENS_PER_SPLIT
        if best_time is None or time < best_time:
            best, best_time = splits, time
    return best


def quant_programs_per_sm(streams: int = QUANT_STREAMS) -> int:
    """How many ``decode_streams_kernel`` programs of ``streams`` warps an SM runs at once: as many
    warps as the four 2-warp programs measured, at least one program."""
    return max(1, QUANT_PROGRAMS_PER_SM * QUANT_STREAMS // streams)


# -- FlashDecoding: the launch grid against the SMs ----------------------------------------
H200_SMS = 132      # streaming multiprocessors of an NVIDIA H200


@dataclass(frozen=True)
class GridFill:
    """One decode launch of ``batch`` sequences of ``seq_len`` tokens, spread over ``num_sms`` SMs.

    Model: every SM streams K/V at the same rate, and each program goes to the SM with the
    least work so far, in launch order (the hardware hands out programs as SMs free up). The
    launch then lasts as long as its busiest SM.
    """

    batch: int
    seq_len: int
    num_kv_heads: int
    num_splits: int
    num_sms: int
    program_tokens: tuple   # tokens each program reads, launch order (sequence, KV head, split)
    sm_tokens: tuple        # tokens each SM reads

    @property
    def programs(self) -> int:
        return len(self.program_tokens)

    @property
    def busy_sms(self) -> int:
        return sum(t > 0 for t in self.sm_tokens)

    @property
    def critical_tokens(self) -> int:
        """Tokens read by the busiest SM: the launch's length in this model."""
        return max(self.sm_tokens)

    @property
    def efficiency(self) -> float:
        """Share of the GPU's streaming capacity used: the perfectly balanced time / the actual."""
        return sum(self.sm_tokens) / self.num_sms / self.critical_tokens

    def summary(self) -> str:
        splits = "1 split" if self.num_splits == 1 else f"{self.num_splits} splits"
        return (f"batch {self.batch} x {self.num_kv_heads} KV heads x {splits} = {self.programs} programs: "
                f"{self.busy_sms} of {self.num_sms} SMs busy, efficiency {self.efficiency:.0%}")


def sm_loads(program_tokens, num_sms: int) -> list[int]:
    """Tokens per SM when each program, in order, goes to the least-loaded SM (lowest index on ties)."""
    check_int("num_sms", num_sms, 1)
    heap = [(0, sm) for sm in range(num_sms)]
    loads = [0] * num_sms
    for tokens in program_tokens:
        load, sm = heapq.heappop(heap)
        loads[sm] = load + int(tokens)
        heapq.heappush(heap, (loads[sm], sm))
    return loads


def grid_fill(batch: int, seq_len: int, num_kv_heads: int, num_splits: int | None = None,
              num_sms: int = H200_SMS, block_n: int = GPU_BLOCK_N) -> GridFill:
    """The programs of one decode launch and the SMs they keep busy (see :class:`GridFill`).

    ``num_splits=None`` picks the split count as ``paged_decode`` does (:func:`choose_num_splits`).
    """
    check_int("batch", batch, 1)
    check_int("seq_len", seq_len, 1)
    check_int("num_kv_heads", num_kv_heads, 1)
    check_int("num_sms", num_sms, 1)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, seq_len, num_sms)
    split_tokens = [end - start for start, end in split_token_ranges(seq_len, num_splits, block_n)]
    programs = tuple(split_tokens * (batch * num_kv_heads))
    return GridFill(batch, seq_len, num_kv_heads, num_splits, num_sms, programs, tuple(sm_loads(programs, num_sms)))


def predicted_speedup(batch: int, seq_len: int, num_kv_heads: int, num_sms: int = H200_SMS,
                      block_n: int = GPU_BLOCK_N) -> float:
    """The grid model's gain from splitting: efficiency with ``paged_decode``'s split count over one split."""
    return (grid_fill(batch, seq_len, num_kv_heads, None, num_sms, block_n).efficiency
            / grid_fill(batch, seq_len, num_kv_heads, 1, num_sms, block_n).efficiency)


__all__ = ["GPU_BLOCK_N", "INTERPRETER_BLOCK_N", "SHARED_MEMORY_BUDGET", "tile_config", "launch_config",
           "next_power_of_2", "check_int", "FULL", "MASKED", "SKIPPED", "TILE_STATES", "causal_tile_bounds",
           "TileSchedule", "tile_schedule", "PagedReads", "paged_reads", "tokens_per_split", "split_token_ranges",
           "pages_read", "MIN_TOKENS_PER_SPLIT", "PROGRAMS_PER_SM", "QUANT_STREAMS", "QUANT_STREAM_N",
           "QUANT_PROGRAMS_PER_SM", "quant_programs_per_sm", "MAX_WAVES", "PROGRAM_START_TOKENS",
           "MERGE_LAUNCH_TOKENS", "MERGE_TOKENS_PER_SPLIT", "MAX_SPLITS", "choose_num_splits", "H200_SMS",
           "GridFill", "sm_loads", "grid_fill", "predicted_speedup"]
