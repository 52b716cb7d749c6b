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
    choose_num_splits,
    num_sms,
)
from kvlab.kernels.attention_checks import check_paged_decode_args  # noqa: F401  (re-exported)
from kvlab.kernels.checks import grid_length  # noqa: F401  (re-exported)
from kvlab.kernels.dequant import codes_ptx, codes_to_dot


@triton.jit
def decode_split_kernel(
    q_ptr,                 # [batch, num_heads, HEAD_DIM], head_dim contiguous (rows may be strided)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    k_scale_ptr, v_scale_ptr,  # KV_QUANT: [num_blocks, BLOCK_SIZE, num_kv_heads] float32, else None
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
    KV_QUANT: tl.constexpr = False,  # the cache holds fp8/int8 values and a scale per (token, KV head)
    QUANT_DOT: tl.constexpr = tl.float32,  # KV_QUANT: the dots' input type (fp16 on a GPU)
    CODES_PTX: tl.constexpr = "",  # KV_QUANT, fp16 dots on a GPU: "e4m3" or "int8" (codes_to_dot)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # This program's range of the sequence. Each sequence cuts its own length into num_splits
    # ranges of whole tiles, so nothing here depends on the batch's longest sequence: the host
    # launches the grid (batch, num_kv_heads, num_splits) without reading any length back, and a
    # CUDA graph captured with one set of lengths replays right with any other. A short sequence
    # spreads over all the splits too; when it has fewer tiles than splits, the last splits are
    # empty (start >= end).
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)   # the query heads of this GQA group
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None], other=0.0)
    if KV_QUANT:
        # fp16 dots: e4m3 and int8 codes become fp16 in one conversion (bf16 takes three, and
        # the conversions, not the bytes, would set the pace); a query's values fit fp16.
        q = q.to(QUANT_DOT)

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
    # one's are done (on an H200, fp8 went from 0.81 to 0.77 of bf16's time at 32 x 32K).
    pos = start + tl.arange(0, BLOCK_N)
    page = tl.load(table + pos // BLOCK_SIZE, mask=pos < end, other=0)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        slot = page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = slot[:, None] * row_stride + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        if KV_QUANT:
            # Dequantise in registers, never in memory. The codes convert exactly to fp16 (e4m3
            # and int8 values are fp16 numbers); a key's scale multiplies its score column after
            # the dot, and a value's scale its probability column before the second dot. So the
            # scales touch [GROUP_PAD, BLOCK_N] tiles, not the 8x larger K and V tiles.
            k_scale = tl.load(k_scale_ptr + slot * num_kv_heads + kv_head, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + slot * num_kv_heads + kv_head, mask=valid, other=0.0)
            # Each tile crosses shared memory on its way to the tensor cores. K's rows are laid
            # out as q @ k.T wants them, so its codes cross as they are, one byte each, and are
            # converted as the product reads them. p @ v sums over keys: V's tile must be
            # transposed, which only a 16-bit tile can be on the way (ldmatrix.trans), so its
            # codes are converted first, and cross as fp16 (PIN, see codes_to_dot). Converting K
            # first too costs shared-memory traffic and space, which bound this loop: fp8 took
            # 0.98-1.00 of bf16's time at long contexts that way, against 0.73 (H200).
            k = codes_to_dot(k, QUANT_DOT, CODES_PTX, PIN=False)
            v = codes_to_dot(v, QUANT_DOT, CODES_PTX, PIN=True)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32)   # [GROUP_PAD, BLOCK_N]
        if KV_QUANT:
            scores = scores * (k_scale * qk_scale)[None, :]
        else:
            scores = scores * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Online softmax: a larger max rescales what was summed so far by exp2(m_old - m_new).
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if KV_QUANT:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        m = m_new
        next_pos = pos + BLOCK_N
        page = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < end, other=0)

    # An empty range (a split past the end of a short sequence) leaves l = 0: it must carry
    # zero weight in the merge, hence lse = -inf and a zero output.
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, l))) * 0.6931471805599453)  # base e
    row = seq * num_kv_heads * GROUP + heads
    if WRITE_FINAL:
        tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=head_mask[:, None])
    else:
        tl.store(out_ptr + ((row * num_splits + split)[:, None]) * HEAD_DIM + dims[None, :], out,
                 mask=head_mask[:, None])
    tl.store(lse_ptr + row * num_splits + split, lse, mask=head_mask)


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
def _planned_splits(batch: int, num_kv_heads: int, max_seq_len: int, sms: int, block_n: int) -> int:
    """:func:`choose_num_splits`, remembered: a default call plans the same shapes over and over."""
    return choose_num_splits(batch, num_kv_heads, max_seq_len, sms, block_n=block_n)


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
    # On a GPU: 128-token tiles (an H200 sweep, benchmarks/tune_attention.py, at both long-batch
    # and one-long-sequence shapes).
    block_n = block_n or (GPU_BLOCK_N if q.is_cuda else INTERPRETER_BLOCK_N)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = longest if longest is not None else grid_length(seq_lens, None, "max_seq_len", False)
        num_splits = _planned_splits(batch, num_kv_heads, max_seq_len, num_sms(q.device), block_n)
    if q.is_cuda:
        # 8 warps for bf16, 4 for a quantised cache (half the bytes a tile), and as many K/V
        # buffers as still leave two programs an SM: with K's codes crossing shared memory as
        # they are, 3 stages (two tiles loading while one is computed) fit in 108 KB; bf16's
        # would take 139 KB, one program an SM, so it takes 2. (H200 sweeps;
        # benchmarks/RESULTS.md, 2026-12-02.)
        num_warps = num_warps or (4 if k_scale is not None else 8)
        num_stages = num_stages or (3 if k_scale is not None else 2)
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    final = num_splits == 1
    partial = out if final else torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                                            device=q.device)
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    quant_dot = torch.float32 if q.dtype == torch.float32 else torch.float16   # the dots' type over codes
    decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, partial, lse, sm_scale,
        q.stride(0), q.stride(1), block_tables.stride(0), num_kv_heads, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, WRITE_FINAL=final,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_QUANT=k_scale is not None,
        QUANT_DOT=tl.float32 if quant_dot == torch.float32 else tl.float16, CODES_PTX=codes_ptx(k_cache, quant_dot),
        **launch)
    if not final:
        merge_splits_kernel[(batch * num_heads,)](partial, lse, out, num_splits, HEAD_DIM=head_dim,
                                                  SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out
