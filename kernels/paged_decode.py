"""paged_decode: FlashDecoding, attention of one new token per sequence over its paged KV.

A decode step has one query token per sequence, so a kernel that gives each (sequence, KV
head) one program launches only ``batch * num_kv_heads`` programs: at small batch most of
the GPU idles while a few programs stream long caches. FlashDecoding also splits each
sequence's KV length into ``num_splits`` ranges:

* **stage 1** (``decode_split_kernel``): program (sequence, KV head, split) reads its range
  of the cache through the block table and computes, for every query head that shares this
  KV head (GQA: the K/V tile is read once for the whole group), the partial output over its
  range, normalised, and its log-sum-exp;
* **stage 2** (``merge_splits_kernel``): per (sequence, query head), the partial outputs are
  merged with weights ``exp(lse_g - max lse)``: that re-weights each split's softmax by its
  share of the total softmax mass.

With ``num_splits=1`` stage 1 writes the final output itself: the non-split kernel the
chapter compares against.

A quantised cache (fp8 or int8 codes, chapter 9) has its own stage 1, ``decode_streams_kernel``:
the same walk, but each warp reads its own stream of keys with its own running softmax, and the
streams are merged at the end of the program as the splits are merged in stage 2.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

# The split count and the tile sizes are planned without Triton, in kvlab.kernel_plan (re-exported here).
from kvlab.kernel_plan import (  # noqa: F401
    GPU_BLOCK_N,
    INTERPRETER_BLOCK_N,
    MAX_SPLITS,
    MAX_WAVES,
    MERGE_LAUNCH_TOKENS,
    MERGE_TOKENS_PER_SPLIT,
    MIN_TOKENS_PER_SPLIT,
    PROGRAM_START_TOKENS,
    PROGRAMS_PER_SM,
    QUANT_STREAM_N,
    QUANT_STREAMS,
    choose_num_splits,
    num_sms,
    quant_programs_per_sm,
)
from kvlab.kernels.attention_checks import check_paged_decode_args  # noqa: F401  (re-exported)
from kvlab.kernels.checks import grid_length  # noqa: F401  (re-exported)
from kvlab.kernels.dequant import codes_ptx, codes_to_dot


@triton.jit
def _split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr):
    """The keys ``[start, end)`` of this program's split of sequence ``seq``.

    Each sequence cuts its own length into num_splits ranges of whole tiles, so nothing here
    depends on the batch's longest sequence: the host launches the grid (batch, num_kv_heads,
    num_splits) without reading any length back, and a CUDA graph captured with one set of
    lengths replays right with any other. A short sequence spreads over all the splits too; when
    it has fewer tiles than splits, the last splits are empty (start >= end)."""
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    return start, tl.minimum(start + tokens_per_split, seq_len)


@triton.jit
def _write_split(out_ptr, lse_ptr, acc, m, l, row, row_mask, dims, split, num_splits, HEAD_DIM: tl.constexpr,
                 WRITE_FINAL: tl.constexpr):
    """Store a split's output ``acc / l`` (rows ``row`` of ``[batch * num_heads]``) and its log-sum-exp
    (``m`` and ``l`` in base 2)."""
    # An empty range (a split past the end of a short sequence) leaves l = 0: it must carry
    # zero weight in the merge, hence lse = -inf and a zero output.
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, l))) * 0.6931471805599453)  # base e
    if WRITE_FINAL:
        tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None])
    else:
        tl.store(out_ptr + ((row * num_splits + split)[:, None]) * HEAD_DIM + dims[None, :], out,
                 mask=row_mask[:, None])
    tl.store(lse_ptr + row * num_splits + split, lse, mask=row_mask)


@triton.jit
def decode_split_kernel(
    q_ptr,                 # [batch, num_heads, HEAD_DIM], head_dim contiguous (rows may be strided)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM], 16- or 32-bit
    block_tables_ptr,      # [batch, max_blocks] int32
    seq_lens_ptr,          # [batch] int32
    out_ptr,               # num_splits == 1: [batch, num_heads, HEAD_DIM]; else [batch, num_heads, num_splits, HEAD_DIM] fp32
    lse_ptr,               # [batch, num_heads, num_splits] fp32
    sm_scale,
    stride_qt, stride_qh,  # q's strides of a sequence (token) and of a head: q may be a view of a fused QKV
    stride_table,          # block_tables.stride(0)
    num_kv_heads, num_splits,
    GROUP: tl.constexpr,        # query heads per KV head
    GROUP_PAD: tl.constexpr,    # GROUP rounded up to 16 rows, the smallest tl.dot tile
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block (page)
    BLOCK_N: tl.constexpr,      # tokens per tile: a few pages
    WRITE_FINAL: tl.constexpr,  # one split: write the normalised output directly
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding), else "tf32" (unused for 16-bit)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)

    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)   # the query heads of this GQA group
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None], other=0.0)

    # Scores are kept in base 2: exp(x) = exp2(x * log2(e)), and log2(e) joins the softmax
    # scale, so each score costs one multiply before its exp2.
    qk_scale = sm_scale * 1.4426950408889634
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([GROUP_PAD], tl.float32)                 # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)     # running sum of exp2(score - m) * v
    row_stride = num_kv_heads * HEAD_DIM                  # elements between two token slots
    table = block_tables_ptr + seq * stride_table
    # Through the block table: logical position -> physical page. Each tile's entries are read
    # one tile ahead, so a tile's K/V addresses are known a whole iteration before its loads,
    # and Triton issues tile i+1's loads while tile i is computed (num_stages buffers). Read in
    # the same iteration, the loads wait on the table, and each tile's start only when the last
    # one's are done (on an H200 the quantised loop, then in this kernel, went from 0.81 to 0.77
    # of bf16's time at 32 x 32K).
    pos = start + tl.arange(0, BLOCK_N)
    page = tl.load(table + pos // BLOCK_SIZE, mask=pos < end, other=0)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        slot = page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = slot[:, None] * row_stride + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32)   # [GROUP_PAD, BLOCK_N]
        scores = scores * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Online softmax: a larger max rescales what was summed so far by exp2(m_old - m_new).
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        m = m_new
        next_pos = pos + BLOCK_N
        page = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < end, other=0)

    _write_split(out_ptr, lse_ptr, acc, m, l, seq * num_kv_heads * GROUP + heads, head_mask, dims, split, num_splits,
                 HEAD_DIM, WRITE_FINAL)


@triton.jit
def decode_streams_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,   # as decode_split_kernel's; the cache holds fp8 or int8 codes
    k_scale_ptr, v_scale_ptr,          # [num_blocks, BLOCK_SIZE, num_kv_heads] float32: a scale per (token, KV head)
    scale_block_stride, scale_slot_stride, scale_head_stride,    # the scales' strides, K's and V's alike
    block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    sm_scale, stride_qt, stride_qh, stride_table, num_kv_heads, num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,    # GROUP rounded up to 8 columns, the tensor cores' narrowest tile
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, WRITE_FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT_DOT: tl.constexpr,    # the dots' input type (fp16 on a GPU)
    CODES_PTX: tl.constexpr,    # "e4m3" or "int8" on a GPU (codes_to_dot)
    STREAMS: tl.constexpr,      # independent streams of keys, one a warp (launched with num_warps=STREAMS)
):
    """``decode_split_kernel`` over a quantised cache, its range read as ``STREAMS`` streams, with
    both products turned around: keys are the rows of the tensor cores' tiles, query heads the
    columns.

    Each iteration takes ``BLOCK_N`` keys: ``BLOCK_N // STREAMS`` consecutive ones for each stream.
    A stream keeps its own running max, sum and output, along a leading axis of size ``STREAMS``
    that Triton lays out one stream a warp: the softmax's reductions stay inside a warp, and ``p``
    goes from the first product into the second without crossing shared memory. So a warp never
    waits for another inside the loop, and the streams are merged once, at the end, by the rule
    the splits are merged by. (With the warps sharing each tile, as in ``decode_split_kernel``,
    every tile ends in barriers that hold each warp to the slowest: on an H200, fp8 took 0.75 of
    bf16's time that way at 32 x 32K; benchmarks/RESULTS.md.)

    Why turned around: a tensor-core tile is at least 16 rows by 8 columns. The GQA group's 4
    query heads as rows (``q @ k.T``) fill 4 of 16 rows, and the running output ``[16, HEAD_DIM]``
    is 64 float32 registers a thread to rescale every tile; as columns (``k @ q.T``, then
    ``v.T @ p``) they fill 4 of 8: half the products, half the output to rescale, and 168
    registers a thread instead of 255, so more programs fit an SM."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
    STREAM_N: tl.constexpr = BLOCK_N // STREAMS     # keys a stream takes an iteration

    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    # q transposed, [HEAD_DIM, GROUP_PAD]: the second operand of k @ q.T. fp16 dots: e4m3 and int8
    # codes become fp16 in one conversion (bf16 takes three, and the conversions, not the bytes,
    # would set the pace); a query's values fit fp16.
    q_t = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[None, :] * stride_qh + dims[:, None],
                  mask=head_mask[None, :], other=0.0).to(QUANT_DOT)
    q_t = tl.broadcast_to(q_t[None, :, :], (STREAMS, HEAD_DIM, GROUP_PAD))   # every stream's copy
    qk_scale = sm_scale * 1.4426950408889634                                  # scores in base 2
    m = tl.full([STREAMS, GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([STREAMS, GROUP_PAD], tl.float32)
    acc_t = tl.zeros([STREAMS, HEAD_DIM, GROUP_PAD], tl.float32)               # each stream's output, transposed
    row_stride = num_kv_heads * HEAD_DIM
    table = block_tables_ptr + seq * stride_table
    # Stream w takes keys w * STREAM_N .. (w + 1) * STREAM_N - 1 of each tile; the table entries
    # are read a tile ahead, as in decode_split_kernel.
    tile_keys = tl.arange(0, STREAMS)[:, None] * STREAM_N + tl.arange(0, STREAM_N)[None, :]   # [STREAMS, STREAM_N]
    pos = start + tile_keys
    page = tl.load(table + pos // BLOCK_SIZE, mask=pos < end, other=0)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tile_keys
        valid = pos < end
        slot = page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = slot[:, :, None] * row_stride + kv_head * HEAD_DIM + dims[None, None, :]
        # Dequantise in registers, never in memory. The codes convert exactly to fp16 (e4m3 and
        # int8 values are fp16 numbers); a key's scale multiplies its row of scores after the
        # dot, and a value's scale its row of probabilities before the second dot: the scales
        # touch the scores, not the 16x larger K and V tiles.
        # Each tile crosses shared memory on its way to the tensor cores. K's rows are laid out
        # as k @ q.T wants them, so its codes cross as they are, one byte each, and are converted
        # as the product reads them. v.T @ p wants V transposed, which only a 16-bit tile can be
        # on the way (ldmatrix.trans), so its codes are converted first, and cross as fp16 (PIN,
        # see codes_to_dot).
        k = codes_to_dot(tl.load(k_cache_ptr + offs, mask=valid[:, :, None], other=0.0), QUANT_DOT, CODES_PTX,
                         PIN=False)
        v = codes_to_dot(tl.load(v_cache_ptr + offs, mask=valid[:, :, None], other=0.0), QUANT_DOT, CODES_PTX,
                         PIN=True)
        scale_offs = page.to(tl.int64) * scale_block_stride + (pos % BLOCK_SIZE) * scale_slot_stride \
            + kv_head * scale_head_stride
        k_scale = tl.load(k_scale_ptr + scale_offs, mask=valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_offs, mask=valid, other=0.0)

        # [STREAMS, STREAM_N, GROUP_PAD]: scores transposed, a batched product, one stream a warp
        scores = tl.dot(k, q_t, input_precision=DOT_PRECISION).to(tl.float32)
        scores = scores * (k_scale * qk_scale)[:, :, None]
        scores = tl.where(valid[:, :, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A stream whose keys are all past the end has seen nothing: its max stays -inf, and is
        # measured against 0 so that exp2 gets no -inf - -inf (NaN).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(scores - m_ref[:, None, :])
        l = l * alpha + tl.sum(p, axis=1)
        p = p * v_scale[:, :, None]
        acc_t = acc_t * alpha[:, None, :] + tl.dot(tl.trans(v, 0, 2, 1), p.to(v.dtype),
                                                   input_precision=DOT_PRECISION).to(tl.float32)
        m = m_new
        next_pos = pos + BLOCK_N
        page = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < end, other=0)

    # The streams' merge: each stream's sums re-weighted by exp2(m_w - max_w m_w).
    m_all = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all)[None, :])
    acc = tl.trans(tl.sum(acc_t * weight[:, None, :], axis=0))
    _write_split(out_ptr, lse_ptr, acc, m_all, tl.sum(l * weight, axis=0), seq * num_kv_heads * GROUP + heads,
                 head_mask, dims, split, num_splits, HEAD_DIM, WRITE_FINAL)


@triton.jit
def merge_splits_kernel(
    partial_ptr,   # [batch * num_heads, num_splits, HEAD_DIM] fp32, each split normalised
    lse_ptr,       # [batch * num_heads, num_splits] fp32
    out_ptr,       # [batch * num_heads, HEAD_DIM]
    num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(lse_ptr + row * num_splits + splits, mask=splits < num_splits, other=float("-inf"))
    # out = sum_g exp(lse_g - lse_max) * out_g / sum_g exp(lse_g - lse_max): lse_g = m_g + log l_g,
    # so each weight is split g's softmax mass l_g * exp(m_g), scaled by a common exp(-lse_max).
    # (A sequence of length 0, a padding row of a CUDA graph's batch, has only empty splits:
    # lse_max = -inf. Measured against 0 instead, every weight is 0 and its output is 0, not NaN.)
    lse_max = tl.max(lse, axis=0)
    weights = tl.exp(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=(splits < num_splits)[:, None], other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=1024)
def _planned_splits(batch: int, num_kv_heads: int, max_seq_len: int, sms: int, block_n: int,
                    programs_per_sm: int) -> int:
    """:func:`choose_num_splits`, remembered: a default call plans the same shapes over and over."""
    return choose_num_splits(batch, num_kv_heads, max_seq_len, sms, block_n=block_n, programs_per_sm=programs_per_sm)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, num_splits=None, sm_scale=None, *,
                 max_seq_len: int | None = None, block_n: int | None = None, validate: bool = True,
                 out: torch.Tensor | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q [batch, num_heads, head_dim]`` (one token per sequence) over its cache.

    ``seq_lens[i]`` tokens of sequence ``i`` (the new one included) are read through
    ``block_tables[i]``. ``q`` may be a view (a fused QKV projection's output, say) as long as
    ``head_dim`` is contiguous. Returns ``[batch, num_heads, head_dim]`` in ``q``'s dtype (into
    ``out`` if given).

    ``num_splits=None`` picks the split count (:func:`choose_num_splits`) from the GPU's SM
    count, the batch, the KV heads and ``max_seq_len`` (read from ``seq_lens`` if not given);
    ``max_seq_len`` is used for nothing else. ``validate`` (the default) checks every argument
    first, with one read of the GPU's data for all the value checks. With ``num_splits`` given
    and ``validate=False`` the call reads nothing back and its grid depends on no length: it
    can be captured in a CUDA graph and replayed with other ``seq_lens``.

    A quantised cache (float8_e4m3fn or int8, :mod:`kvlab.quantization`) comes with its scales
    ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` float32; the kernel
    dequantises each tile in registers.
    """
    longest = None
    if validate:
        longest = check_paged_decode_args(q, k_cache, v_cache, block_tables, seq_lens, num_splits, out,
                                          sm_scale=sm_scale, max_seq_len=max_seq_len, k_scale=k_scale,
                                          v_scale=v_scale)
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if batch == 0:
        return out
    if block_n is not None and (not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot's smallest tile), got {block_n!r}")
    quantised = k_scale is not None
    # A quantised cache is read by decode_streams_kernel, one stream of keys a warp: 2 warps
    # (num_warps, if given, sets the streams), 32 keys a stream and iteration. bf16/fp32 by
    # decode_split_kernel, with 128-token tiles on a GPU (an H200 sweep, benchmarks/tune_attention.py,
    # at both long-batch and one-long-sequence shapes). In the interpreter: 2 streams, 16-key tiles.
    streams = (num_warps or QUANT_STREAMS) if quantised else 1
    if not isinstance(streams, int) or streams < 1 or streams & (streams - 1):
        raise ValueError(f"num_warps must be a power of two (a quantised cache: one stream of keys a warp), "
                         f"got {num_warps!r}")
    if block_n is None:
        block_n = (QUANT_STREAM_N if quantised else GPU_BLOCK_N) if q.is_cuda else INTERPRETER_BLOCK_N
        block_n *= streams
    if block_n % (16 * streams):
        raise ValueError(f"block_n must be a multiple of 16 x {streams} over a quantised cache ({streams} streams "
                         f"of at least 16 keys, tl.dot's smallest tile), got {block_n}")
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = longest if longest is not None else grid_length(seq_lens, None, "max_seq_len", False)
        num_splits = _planned_splits(batch, num_kv_heads, max_seq_len, num_sms(q.device), block_n,
                                     quant_programs_per_sm(streams) if quantised else PROGRAMS_PER_SM)
    if q.is_cuda:
        # bf16: 8 warps, 2 stages (3 would take 139 KB of shared memory, one program an SM). A
        # quantised cache: a warp a stream, 3 stages (two tiles loading while one is computed):
        # four 2-warp programs an SM (H200 sweeps; benchmarks/RESULTS.md, 2026-12-02 and -03).
        num_warps = streams if quantised else (num_warps or 8)
        num_stages = num_stages or (3 if quantised else 2)
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    final = num_splits == 1
    partial = out if final else torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                                            device=q.device)
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    grid = (batch, num_kv_heads, num_splits)
    rest = (block_tables, seq_lens, partial, lse, sm_scale, q.stride(0), q.stride(1), block_tables.stride(0),
            num_kv_heads, num_splits)
    # The GQA group padded to the MMA tile's narrowest side: the streams kernel's 8 columns, the
    # split kernel's 16 rows.
    group_pad = max(8 if quantised else 16, triton.next_power_of_2(group))
    shape = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
                 WRITE_FINAL=final, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if quantised:
        quant_dot = torch.float32 if q.dtype == torch.float32 else torch.float16   # the dots' type over codes
        decode_streams_kernel[grid](
            q, k_cache, v_cache, k_scale, v_scale, *k_scale.stride(), *rest, **shape, STREAMS=streams,
            CODES_PTX=codes_ptx(k_cache, quant_dot), QUANT_DOT=tl.float32 if quant_dot == torch.float32 else tl.float16,
            **launch)
    else:
        decode_split_kernel[grid](q, k_cache, v_cache, *rest, **shape, **launch)
    if not final:
        merge_splits_kernel[(batch * num_heads,)](partial, lse, out, num_splits, HEAD_DIM=head_dim,
                                                  SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out
