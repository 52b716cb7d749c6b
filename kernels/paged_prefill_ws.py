"""paged_prefill_ws: prefill/extend attention over a quantised cache, with warps that dequantise
while others multiply (Hopper, written in Gluon).

Over an fp8 or int8 cache, :func:`kvlab.kernels.flash_attention.paged_prefill` converts every
tile of codes in the warps that then run the products: load the codes, convert them, store them
to shared memory again as 16-bit numbers, wait for every warp, multiply. The tensor cores sit
idle while the conversion runs, and a long chunk over the cache takes 1.8-1.9x bf16's time on an
H200 (head_dim 128).

This kernel gives the conversion warps of its own (warp specialisation, FlashAttention-3's
producer/consumer split). One program, 128 queries of one head, holds three groups of warps:

* the **dequantising warps** (4) copy each tile's codes and scales from the paged cache into a
  staging area (``cp.async``, two sub-tiles of 64 keys ahead), convert them, and write them into
  a ring of ``STAGES`` tiles in shared memory, where the tensor cores read them;
* two **attending warpgroups** (4 warps each, 64 queries each) run FlashAttention's loop on
  the ring: ``q @ k.T``, the online softmax, ``p @ v``.

Two barriers per stage of the ring pass each tile along: ``ready`` (the dequantising warps have
written it) and ``empty`` (both warpgroups are done with it). The cache's scales are powers of
two (:mod:`kvlab.quantization`), so every code times its scale is an fp16 number: the
dequantising warps write K's and V's values into the ring exactly, and the attending warpgroups
run the very loop they would over an fp16 cache. With scales of any value, a key's scale had to
multiply its column of scores after ``q @ k.T`` instead (rounding ``code * scale`` to 16 bits
moves large scores by whole units, which the exponential magnifies: 0.15 of the output's largest
value on the tests' ragged cases, against 0.005), a load and a multiply in the attending loop.

Each warpgroup's chain (wait for the tile, ``q @ k.T``, softmax, ``p @ v``) is serial; the two
warpgroups hide each other's softmax. FlashAttention-3 also overlaps a warpgroup's softmax with its
own ``p @ v``: compiled by Triton 3.6, that overlap survives ptxas only with ``p`` in shared memory,
and measured 10-15% slower than this loop (benchmarks/RESULTS.md, 2026-12-04, second session).

Shared memory is this kernel's scarce resource, more than the tensor cores: they read every tile
from it, as in bf16, and the dequantising warps add their own traffic (codes in, fp16 out).
Their register layout is chosen so that none of it meets a bank conflict (``_dequantise``); with
8 lanes along one row, every store to the ring met a two-way conflict and the kernel took 5-8%
longer (Nsight Compute, RESULTS.md, 2026-12-04, third session).

The row sums come from the tensor cores as well (``p @ ones``, ``_attend_tiles``): 64 additions
a thread and tile fewer in the softmax, 1-3% off a long chunk's time (3% at head_dim 64).

At head_dim 64 a tile's products take half the time and its softmax the same, so the attending
loop leaves the dequantising warps less room: the kernel took 1.22-1.25x bf16's time there. Two
changes of the cache's format brought it to 1.08x (and the long chunks at head_dim 128 to
0.92-1.00x; RESULTS.md, 2026-12-04, ninth and tenth sessions). The powers of two took the scales out of the
attending loop (1.12x). And the scales' layout: a program reads the 16 scales of a page for one
head, which a ``[block, slot, KV head]`` tensor spreads ``4 * num_kv_heads`` bytes apart, a
32-byte read each; copying them alone, with no code converted, cost 0.10 (eighth session). The
engine keeps them per page and head (:class:`kvlab.paging.kv_cache.KVCache`), 64 contiguous bytes,
and the kernel finds them through their strides. Changes to the attending loop had not moved it:
taking turns on the tensor cores, a third or a fourth warpgroup, the row maximum as a tree, a share
of the exponentials as a polynomial on the FMA units (FlashAttention-4's trick), or a loop with 30%
fewer instructions that skips the row maxima and the rescale wherever a bound proves them unneeded
(FlashAttention-4's conditional rescale). Neither had more dequantising warps (RESULTS.md,
2026-12-04, fourth to seventh sessions).

Gluon is Triton's lower-level language: the program says which warps do what, how each tensor
is laid out across threads, and when to wait. It has no CPU interpreter, so this kernel only
runs on a GPU (sm_90); ``paged_prefill`` takes it where :func:`kvlab.kernel_plan.warp_specialized_extend`
says it pays, and its own Triton kernel everywhere else.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                warpgroup_mma_wait)

from kvlab.kernels.dequant import INT8_TO_FP16_PTX

LOG2_E = 1.4426950408889634
# Measured on an H200 (benchmarks/RESULTS.md, 2026-12-03 and 2026-12-04): a ring of 4 tiles, the
# codes copied 2 sub-tiles of 64 keys ahead, 4 dequantising warps; registers shared out as 200 a
# thread for the attending warpgroups and 96 for the dequantising warps. The attending warpgroups
# take 64 keys a tile at head_dim 128 and 128 at head_dim 64 (half the bytes a key).
BLOCK_M, SUB_N, STAGES, DEPTH, CONVERT_WARPS, ATTEND_REGS, CONVERT_REGS = 128, 64, 4, 2, 4, 200, 96
BLOCK_N = {128: 64, 64: 128}


# -- the dequantising warps ------------------------------------------------------------------
@gluon.jit
def _tile_pages(table_ptr, start_n, limit, rows, BLOCK_SIZE: gl.constexpr):
    pos = start_n + rows
    return gl.load(table_ptr + pos // BLOCK_SIZE, mask=pos < limit, other=0)


@gluon.jit
def _copy_tile(codes_k, codes_v, scales_k, scales_v, slot, pages, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
               kv_head, limit, start_n, rows, cols, SCALE_STRIDE_BLOCK: gl.constexpr, SCALE_STRIDE_SLOT: gl.constexpr,
               SCALE_STRIDE_HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    """Start copying the codes and scales of keys ``start_n ..`` (their table entries ``pages``) into
    staging ``slot``; keys at or past ``limit`` come as zeros (never a NaN past the end)."""
    pos = start_n + rows
    valid = pos < limit
    page = pages.to(gl.int64)
    row = (page * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
    offs = row[:, None] * HEAD_DIM + cols[None, :]
    # Kept per page and head (the engine's layout), a page's 16 scales of this head are 64
    # contiguous bytes: two 32-byte reads, not the 16 of a [block, slot, KV head] layout.
    scale_offs = page * SCALE_STRIDE_BLOCK + (pos % BLOCK_SIZE) * SCALE_STRIDE_SLOT + kv_head * SCALE_STRIDE_HEAD
    async_copy.async_copy_global_to_shared(codes_k.index(slot), k_cache_ptr + offs, mask=valid[:, None])
    async_copy.async_copy_global_to_shared(codes_v.index(slot), v_cache_ptr + offs, mask=valid[:, None])
    async_copy.async_copy_global_to_shared(scales_k.index(slot), k_scale_ptr + scale_offs, mask=valid)
    async_copy.async_copy_global_to_shared(scales_v.index(slot), v_scale_ptr + scale_offs, mask=valid)
    async_copy.commit_group()


@gluon.jit
def _to_float16(codes, INT8: gl.constexpr):
    """Codes to fp16, exactly (every e4m3 and int8 value is an fp16 number). e4m3: the hardware's
    conversion, two codes an instruction. int8: ``INT8_TO_FP16_PTX`` (kernels/dequant.py), five
    instructions for four codes where a plain conversion takes one or more a code."""
    if INT8:
        return gl.inline_asm_elementwise(INT8_TO_FP16_PTX, "=r,=r,r", [codes], dtype=gl.float16, is_pure=True, pack=4)
    else:
        return codes.to(gl.float16)


@gluon.jit
def _dequantise(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, kv_head, seq_len, n_tiles,
                k_ring, v_ring, ready, empty,
                BLOCK_SIZE: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
                BLOCK_N: gl.constexpr, SUB_N: gl.constexpr, STAGES: gl.constexpr, DEPTH: gl.constexpr,
                NUM_WARPS: gl.constexpr, INT8: gl.constexpr, STAGING: gl.constexpr, SCALE_STRIDE_BLOCK: gl.constexpr,
                SCALE_STRIDE_SLOT: gl.constexpr, SCALE_STRIDE_HEAD: gl.constexpr):
    """Fill the ring with tiles 0 .. n_tiles - 1, each as BLOCK_N // SUB_N sub-tiles of SUB_N keys:
    K's and V's values, ``code * scale``, as fp16 (exact: the scales are powers of two)."""
    # A thread copies 16 codes of a row at once and reads back exactly the bytes it copied, so
    # waiting for its own copies is enough. Shared memory serves a 16-byte access 8 lanes at a
    # time, and those 8 lanes must hit 8 different groups of banks: here they hold 64 columns of
    # two consecutive rows, which the ring's 128-byte swizzle puts in different banks (8 lanes
    # along one row of 128 columns wrote both its halves into the same banks: two-way conflicts,
    # measured), and which STAGING keeps apart too (``_staging_layout``).
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    rows = gl.arange(0, SUB_N, layout=row_layout)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    plain_1d: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    codes_k = gl.allocate_shared_memory(k_cache_ptr.dtype.element_ty, [DEPTH, SUB_N, HEAD_DIM], STAGING)
    codes_v = gl.allocate_shared_memory(v_cache_ptr.dtype.element_ty, [DEPTH, SUB_N, HEAD_DIM], STAGING)
    scales_k = gl.allocate_shared_memory(gl.float32, [DEPTH, SUB_N], plain_1d)
    scales_v = gl.allocate_shared_memory(gl.float32, [DEPTH, SUB_N], plain_1d)
    SUBS: gl.constexpr = BLOCK_N // SUB_N
    limit = gl.minimum(seq_len, n_tiles * BLOCK_N)

    # The first DEPTH sub-tiles' copies leave at once; each table entry is read a sub-tile ahead.
    pages = _tile_pages(table_ptr, 0, limit, rows, BLOCK_SIZE)
    for t in gl.static_range(DEPTH):
        next_pages = _tile_pages(table_ptr, (t + 1) * SUB_N, limit, rows, BLOCK_SIZE)
        _copy_tile(codes_k, codes_v, scales_k, scales_v, t, pages, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                   kv_head, limit, t * SUB_N, rows, cols, SCALE_STRIDE_BLOCK, SCALE_STRIDE_SLOT, SCALE_STRIDE_HEAD,
                   BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        pages = next_pages
    for j in range(n_tiles):
        stage = j % STAGES
        for h in gl.static_range(SUBS):
            sub = j * SUBS + h
            slot = sub % DEPTH
            async_copy.wait_group(DEPTH - 1)               # this sub-tile's copies have landed
            # A code times its power-of-two scale is an fp16 number (kvlab.quantization): the
            # products are exact, and the attending warps take K and V as they would an fp16 cache.
            k_scale = scales_k.index(slot).load(row_layout).to(gl.float16)
            v_scale = scales_v.index(slot).load(row_layout).to(gl.float16)
            k = _to_float16(codes_k.index(slot).load(layout), INT8) * k_scale[:, None]
            v = _to_float16(codes_v.index(slot).load(layout), INT8) * v_scale[:, None]
            # The slot's contents are in registers now: refill it with sub-tile sub + DEPTH.
            next_pages = _tile_pages(table_ptr, (sub + DEPTH + 1) * SUB_N, limit, rows, BLOCK_SIZE)
            _copy_tile(codes_k, codes_v, scales_k, scales_v, slot, pages, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                       v_scale_ptr, kv_head, limit, (sub + DEPTH) * SUB_N, rows, cols, SCALE_STRIDE_BLOCK,
                       SCALE_STRIDE_SLOT, SCALE_STRIDE_HEAD, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            pages = next_pages
            if h == 0:   # wait for both warpgroups to be done with the stage's last tile
                mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            k_ring.index(stage).slice(h * SUB_N, SUB_N).store(k)
            v_ring.index(stage).slice(h * SUB_N, SUB_N).store(v)
        fence_async_shared()                               # make the stores visible to the tensor cores' reads
        mbarrier.arrive(ready.index(stage))                # hand the tile over
    async_copy.wait_group(0)


# -- the attending warpgroups ----------------------------------------------------------------
@gluon.jit
def _attend_tiles(acc, m_i, l_i, q, offs_m, k_ring, v_ring, ones, ready, empty, j_start, j_end,
                  seq_len, shift, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, l_layout: gl.constexpr):
    """FlashAttention's loop over ring tiles ``j_start .. j_end - 1`` (``_attend_tile`` of
    flash_attention.py, with the products as Hopper's warpgroup MMAs).

    The row sums ``l_i`` come from the tensor cores too: ``p @ ones`` (8 columns of ones, every
    column of the result the row sum) is accumulated and rescaled exactly as ``acc = p @ v`` is, so
    the output is divided by the sum of the very fp16 probabilities that ``p @ v`` multiplied."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero = gl.zeros([q.shape[0], BLOCK_N], gl.float32, layout=s_layout)
    for j in range(j_start, j_end):
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_ring.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if MASKED:
            pos = j * BLOCK_N + offs_n
            visible = (pos[None, :] < seq_len) & (pos[None, :] <= offs_m[:, None] + shift)
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
        p = p.to(gl.float16)
        acc = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)),
                            v_ring.index(stage), acc, is_async=True)
        l_i = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)),
                            ones.permute((1, 0)), l_i, is_async=True)
        acc, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_i))
        mbarrier.arrive(empty.index(stage))
        m_i = m_new
    return acc, m_i, l_i


@gluon.jit
def _attend(q_ptr, out_ptr, q_start, start_m, len_q, head, stride_qt, stride_qh, stride_ot, stride_oh, seq_len,
            n_tiles, qk_scale, k_ring, v_ring, ones, ready, empty,
            HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: queries ``start_m .. start_m + ROWS - 1`` of the sequence over every tile of the ring."""
    # The MMAs' accumulator layouts: 4 warps down the rows, 16 rows each.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    rows = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    q_ptrs = q_ptr + (q_start + rows[:, None]).to(gl.int64) * stride_qt + head * stride_qh + cols[None, :]
    q = gl.load(q_ptrs, mask=rows[:, None] < len_q, other=0.0).to(gl.float16)
    q = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))  # stays in registers

    offs_m = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS, 8], gl.float32, layout=l_layout)     # p @ ones: 8 copies of each row sum
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    # Tiles every one of these queries sees in full, unmasked; then the causal diagonal and the
    # ragged end, masked. Both warpgroups take every tile (the ring's stages are released by
    # both): the first one's last tile may be all masked, and adds nothing.
    shift = seq_len - len_q
    n_full = gl.minimum((start_m + shift + 1) // BLOCK_N, n_tiles)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, offs_m, k_ring, v_ring, ones, ready, empty, 0,
                                  n_full, seq_len, shift, qk_scale, False, BLOCK_N, STAGES, s_layout, o_layout, l_layout)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, offs_m, k_ring, v_ring, ones, ready, empty, n_full,
                                  n_tiles, seq_len, shift, qk_scale, True, BLOCK_N, STAGES, s_layout, o_layout, l_layout)
    l_i = gl.max(l_i, 1)                                        # its columns are equal: take any
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    out = gl.convert_layout(out.to(out_ptr.dtype.element_ty), io_layout)
    out_ptrs = out_ptr + (q_start + rows[:, None]).to(gl.int64) * stride_ot + head * stride_oh + cols[None, :]
    gl.store(out_ptrs, out, mask=rows[:, None] < len_q)


@gluon.jit
def paged_prefill_ws_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,   # q/out [total_q, num_heads, HEAD_DIM]; codes [blocks, BLOCK_SIZE, kv_heads, HEAD_DIM]
    k_scale_ptr, v_scale_ptr,                   # [blocks, BLOCK_SIZE, kv_heads] float32, powers of two
    block_tables_ptr, seq_lens_ptr, cu_query_lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table, group, qk_scale,
    BLOCK_SIZE: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, SUB_N: gl.constexpr, STAGES: gl.constexpr, DEPTH: gl.constexpr,
    CONVERT_WARPS: gl.constexpr, ATTEND_REGS: gl.constexpr, CONVERT_REGS: gl.constexpr, INT8: gl.constexpr,
    STAGING: gl.constexpr,
    # the scales' strides (K's = V's), as constants: one compile per layout
    SCALE_STRIDE_BLOCK: gl.constexpr, SCALE_STRIDE_SLOT: gl.constexpr, SCALE_STRIDE_HEAD: gl.constexpr,
):
    # One program: BLOCK_M new tokens of one head of one sequence (the grid of paged_prefill_kernel).
    pid_m = gl.program_id(0)
    head = gl.program_id(1)
    seq = gl.program_id(2).to(gl.int64)
    q_start = gl.load(cu_query_lens_ptr + seq)
    len_q = gl.load(cu_query_lens_ptr + seq + 1) - q_start
    start_m = pid_m * BLOCK_M
    if start_m < len_q:
        seq_len = gl.load(seq_lens_ptr + seq)
        # the keys any of the block's queries sees (its last query sees the most)
        n_tiles = gl.cdiv(gl.minimum(start_m + BLOCK_M + seq_len - len_q, seq_len), BLOCK_N)

        # The ring: K's and V's values as fp16, laid out as the warpgroup MMAs read them.
        k_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16))
        v_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)     # the dequantising warps arrive once
            mbarrier.init(empty.index(i), count=2)     # both attending warpgroups do
        # A tile of ones for the row sums' product (p @ ones), written once and fenced for the tensor cores.
        fill: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        ones = gl.allocate_shared_memory(gl.float16, [8, BLOCK_N],
                                         gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], gl.float16),
                                         gl.full([8, BLOCK_N], 1.0, gl.float16, layout=fill))
        fence_async_shared()

        ROWS: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            # the kernel's own warps: the first 64 queries
            (_attend, (q_ptr, out_ptr, q_start, start_m, len_q, head, stride_qt, stride_qh, stride_ot, stride_oh,
                       seq_len, n_tiles, qk_scale, k_ring, v_ring, ones, ready, empty,
                       HEAD_DIM, ROWS, BLOCK_N, STAGES)),
            # a second warpgroup: the next 64
            (_attend, (q_ptr, out_ptr, q_start, start_m + ROWS, len_q, head, stride_qt, stride_qh, stride_ot,
                       stride_oh, seq_len, n_tiles, qk_scale, k_ring, v_ring, ones, ready, empty,
                       HEAD_DIM, ROWS, BLOCK_N, STAGES)),
            (_dequantise, (k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq * stride_table,
                           head // group, seq_len, n_tiles, k_ring, v_ring, ready, empty,
                           BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, SUB_N, STAGES, DEPTH, CONVERT_WARPS, INT8,
                           STAGING, SCALE_STRIDE_BLOCK, SCALE_STRIDE_SLOT, SCALE_STRIDE_HEAD)),
        ], [4, CONVERT_WARPS], [ATTEND_REGS, CONVERT_REGS])


@functools.lru_cache(maxsize=None)   # built once per shape, not at every launch (~27 us each)
def _staging_layout(rows: int, head_dim: int):
    """Shared-memory layout of a sub-tile of codes (``rows`` x ``head_dim`` bytes) in staging.

    Lanes 0-7 of a dequantising warp (one phase of a 16-byte access) copy and read 64 codes of
    each of two consecutive rows. At head_dim 64 that is both rows whole: 128 contiguous bytes,
    every bank once. At head_dim 128 it is the same half of each row, 128 bytes apart and so in
    the same 16 banks; odd rows are stored with their halves swapped instead (offset bit 7, the
    row's lowest bit, also flips column bit 6)."""
    if head_dim == 64:
        return gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
    # a linear map from byte offset to (row, column), one basis a bit of the offset
    column_bits = [[0, 1 << i] for i in range(7)]
    row_bits = [[1, 64]] + [[1 << i, 0] for i in range(1, rows.bit_length() - 1)]
    return gl.SharedLinearLayout(column_bits + row_bits)


def paged_prefill_ws(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, max_query_len: int, k_scale, v_scale,
                     sm_scale: float, out: torch.Tensor) -> torch.Tensor:
    """``paged_prefill`` over a quantised cache (every key through the block table), for an sm_90 GPU.

    Called by :func:`kvlab.kernels.flash_attention.paged_prefill`, which has checked the arguments,
    allocated ``out``, resolved ``sm_scale`` and returned early for an empty step;
    ``cu_query_lens`` is the running sum of the query lengths with a leading 0."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    batch = seq_lens.shape[0]
    grid = (triton.cdiv(max_query_len, BLOCK_M), num_heads, batch)
    paged_prefill_ws_kernel[grid](
        q, k_cache, v_cache, out, k_scale, v_scale, block_tables, seq_lens, cu_query_lens, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), num_heads // num_kv_heads, sm_scale * LOG2_E,
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N[head_dim], SUB_N=SUB_N, STAGES=STAGES, DEPTH=DEPTH, CONVERT_WARPS=CONVERT_WARPS,
        ATTEND_REGS=ATTEND_REGS, CONVERT_REGS=CONVERT_REGS, INT8=k_cache.dtype == torch.int8,
        STAGING=_staging_layout(SUB_N, head_dim), SCALE_STRIDE_BLOCK=k_scale.stride(0),
        SCALE_STRIDE_SLOT=k_scale.stride(1), SCALE_STRIDE_HEAD=k_scale.stride(2), num_warps=4)
    return out
