"""FlashAttention-2 forward: attention without ever writing the score matrix down.

For one query ``q``, attention is ``softmax(q @ K.T * sm_scale) @ V``. Done naively, every query
row produces ``len_k`` scores that go to memory and come back for the softmax and again for
the product with ``V``. FlashAttention keeps them on chip: one program owns ``BLOCK_M`` query
rows, keeps their output accumulator in registers, and streams K and V past them in tiles of
``BLOCK_N`` keys. After each tile it folds the tile's scores into a *running* softmax (the
online softmax): a running max ``m`` and a running sum ``l`` per row, and an accumulator that
is rescaled whenever the max grows. Only the output (and, if asked, the log-sum-exp of each
row) is ever written.

Two kernels run that same loop and differ only in where a tile of K/V comes from:

* :func:`flash_attention`: K and V are ordinary tensors, one sequence after another
  (``[batch, heads, len, head_dim]``, or packed ``[total_tokens, heads, head_dim]`` with
  ``cu_seqlens``).
* :func:`paged_prefill`: K and V live in the paged cache; each key's slot is found through the
  sequence's block table. This is the engine's prefill/extend attention: new tokens attend to
  the cached prefix and to themselves. Handed the step's own K/V (``k_new``/``v_new``), it
  reads the new tokens' keys from them as whole tiles and only the prefix through the table.
  Over a quantised cache (fp8, int8) it reads the codes and dequantises in registers; on an
  H200, chunks of many tokens over such a cache go to :mod:`kvlab.kernels.paged_prefill_ws` instead, the
  same loop written in Gluon with warps of its own for the dequantising.

Causal attention is bottom-right aligned: a sequence's ``len_q`` queries are its *last*
``len_q`` positions, so query ``i`` sees keys ``0 .. len_k - len_q + i`` (prefill, decode and
extending a cached prefix are one rule). See :func:`kvlab.reference.attention_ref`.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvlab.quantization import kv_cache_format

# The tile sizes are planned without Triton, in kvlab.kernel_plan (re-exported here); its
# causal_tile_bounds is the Python twin of _causal_bounds below.
from kvlab.kernel_plan import SHARED_MEMORY_BUDGET, tile_config  # noqa: F401
from kvlab.kernel_plan import WS_CAPABILITY, WS_HEAD_DIMS, warp_specialized_extend
from kvlab.kernel_plan import launch_config as _launch_config
# The argument checks live in kvlab.kernels.attention_checks (on helpers of kvlab.kernels.checks);
# re-exported here.
from kvlab.kernels.attention_checks import check_flash_attention_args, check_paged_prefill_args  # noqa: F401
from kvlab.kernels.checks import grid_length  # noqa: F401

LOG2_E = 1.4426950408889634  # scores are scaled by log2(e) so the kernels can use exp2


# -- the loop body both kernels share ---------------------------------------------------
@triton.jit
def _attend_tile(acc, m_i, l_i, q, k, v, offs_m, offs_n, len_k, causal_shift, qk_scale,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 k_scale=None, v_scale=None, KV_QUANT: tl.constexpr = False):
    """Fold one tile of keys (``k``, ``v``: [BLOCK_N, HEAD_DIM]) into the running softmax of the
    program's queries (``q``: [BLOCK_M, HEAD_DIM]). ``offs_m``/``offs_n`` are the positions of the
    rows and keys within their sequence. Returns the updated ``(acc, m_i, l_i)``.

    ``KV_QUANT``: ``k``/``v`` are fp8 or int8 codes and ``k_scale``/``v_scale`` [BLOCK_N] their
    keys' scales. A key's scale multiplies its whole column of scores, and a value's scale its
    column of ``p``: applied there, after the dot and before the second, the codes go into the
    tensor cores as they are (exact in q's dtype) and no dequantised tile is ever formed."""
    if KV_QUANT:   # (by way of float32: fp8 -> bfloat16 directly takes more instructions on sm_90)
        k = k.to(tl.float32).to(q.dtype)
        v = v.to(tl.float32).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)            # [BLOCK_M, BLOCK_N]
    if KV_QUANT:
        s = s * k_scale[None, :]
    if MASKED:
        # Only the tiles that cross the end of the keys or the causal diagonal pay for a mask.
        visible = offs_n[None, :] < len_k
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
        s = tl.where(visible, s, float("-inf"))
    # Scores in base 2, with the softmax scale folded in: 2 ** (x * log2(e)) == e ** x, and
    # exp2(s * qk_scale - m) is one fused multiply-add and the fast hardware exponential.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    # The online-softmax rescale, the heart of FlashAttention. acc and l_i are sums of
    # exp2(score - m_i) over the keys seen so far, measured against the old running max m_i.
    # Measured against the new max m_new, each of those terms is smaller by the same factor
    # alpha = exp2(m_i - m_new) <= 1, so one multiplication re-bases the whole past; then this
    # tile's terms are added against m_new. Nothing seen earlier has to be recomputed, and no
    # exponent ever exceeds 0, so nothing overflows. On the first tile m_i = -inf and alpha = 0.
    # (m_new is finite from the first tile on: key 0 is in it, and every query sees key 0.)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_QUANT:
        p = p * v_scale[None, :]
    # p is cast to V's dtype so the second product runs on the tensor cores like the first; the
    # rescaled accumulator goes into the MMA as its addend, and stays float32.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _causal_bounds(start_m, len_q, len_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Which keys the queries ``start_m .. start_m + BLOCK_M - 1`` need, as two ranges of tiles:
    ``[0, full_end)`` is seen by every one of them (no mask), ``[full_end, end)`` by some of them
    (masked). Causal query ``i`` sees keys ``0 .. i + shift`` with ``shift = len_k - len_q``."""
    if CAUSAL:
        shift = len_k - len_q
        full_end = start_m + shift + 1                          # the block's first query sees this many
        end = tl.minimum(start_m + BLOCK_M + shift, len_k)      # its last query sees this many
    else:
        shift = 0
        full_end = len_k
        end = len_k
    # Whole tiles only in the unmasked range; the rest (the diagonal, the ragged end) is masked.
    # Tiles past `end` are never loaded: that is the causal saving, about half the work.
    full_end = (full_end // BLOCK_N) * BLOCK_N
    return full_end, end, shift


# -- contiguous K/V ----------------------------------------------------------------------
@triton.jit
def _load_tile(desc, seq, head, row, VARLEN: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``ROWS`` token rows of one head, from ``row`` on, as [ROWS, HEAD_DIM].

    ``desc`` is a tensor descriptor: on Hopper and later GPUs the copy engine (TMA) fetches
    the whole tile into shared memory by itself, with no address arithmetic in the program.
    Rows outside the tensor come back as zeros."""
    if VARLEN:   # [total_tokens, heads, head_dim]: row is the token's index in the packing
        return desc.load([row, head, 0]).reshape(ROWS, HEAD_DIM)
    else:        # [batch, heads, len, head_dim]
        return desc.load([seq, head, row, 0]).reshape(ROWS, HEAD_DIM)


@triton.jit
def _attend_keys(acc, m_i, l_i, q, offs_m, k_desc, v_desc, seq, kv_head, k_start, full_end, end, len_k, shift,
                 qk_scale, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold keys ``0 .. end - 1`` of one sequence, whole tiles from contiguous K/V (its rows
    start at ``k_start``), into the running softmax: the tiles of ``[0, full_end)`` need no
    mask, the rest are masked (see ``_causal_bounds``)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        k = _load_tile(k_desc, seq, kv_head, k_start + start_n, VARLEN, BLOCK_N, HEAD_DIM)
        v = _load_tile(v_desc, seq, kv_head, k_start + start_n, VARLEN, BLOCK_N, HEAD_DIM)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift, qk_scale,
                                     MASKED=False, CAUSAL=CAUSAL, DOT_PRECISION=DOT_PRECISION)
    for start_n in range(full_end, end, BLOCK_N):
        k = _load_tile(k_desc, seq, kv_head, k_start + start_n, VARLEN, BLOCK_N, HEAD_DIM)
        v = _load_tile(v_desc, seq, kv_head, k_start + start_n, VARLEN, BLOCK_N, HEAD_DIM)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift, qk_scale,
                                     MASKED=True, CAUSAL=CAUSAL, DOT_PRECISION=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def flash_attention_kernel(
    q_desc, k_desc, v_desc,               # tensor descriptors of q, k, v (see _load_tile)
    out_ptr, lse_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,   # [batch + 1] int32 row offsets (packed form only)
    len_q, len_k,                         # every sequence's lengths (batched form only)
    # Strides of (batch, token, head) of out and lse; head_dim is contiguous. In the packed
    # form the batch stride is 0: cu_seqlens say where a sequence's rows start.
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt, stride_lh,
    group,                                # num_heads // num_kv_heads: query heads per KV head
    qk_scale,                             # sm_scale * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, RETURN_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One program: BLOCK_M queries of one head of one sequence.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // group               # grouped-query attention: a KV head serves `group` query heads
    if VARLEN:
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        len_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        k_start = tl.load(cu_seqlens_k_ptr + seq)
        len_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:                  # the grid is sized for the longest sequence
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # The program's queries stay in registers for the whole loop.
    q = _load_tile(q_desc, seq, head, q_start + start_m, VARLEN, BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running max of each row's scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)       # running sum of exp2(score - m_i) * v

    # Tiles every query sees in full first, with no masks at all; then the tiles on the causal
    # diagonal or past the last key, masked.
    full_end, end, shift = _causal_bounds(start_m, len_q, len_k, BLOCK_M, BLOCK_N, CAUSAL)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, offs_m, k_desc, v_desc, seq, kv_head, k_start, full_end, end,
                                 len_k, shift, qk_scale, CAUSAL, VARLEN, BLOCK_N, HEAD_DIM, DOT_PRECISION)

    # The softmax's denominator is applied once, at the end, not to every tile.
    out = acc / l_i[:, None]
    seq = seq.to(tl.int64)
    out_ptrs = out_ptr + seq * stride_ob + (q_start + offs_m[:, None]).to(tl.int64) * stride_ot \
        + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < len_q)
    if RETURN_LSE:
        # log(sum_j e^{x_j}) = ln 2 * (m + log2(l)): m and l are in base 2. A backward pass (or
        # merging partial results, chapter 6) needs exactly this one float per row.
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453   # ln 2
        lse_ptrs = lse_ptr + seq * stride_lb + (q_start + offs_m).to(tl.int64) * stride_lt + head * stride_lh
        tl.store(lse_ptrs, lse, mask=offs_m < len_q)


# -- K/V in the paged cache ----------------------------------------------------------------
@triton.jit
def _tile_pages(table_ptr, start_n, len_k, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block-table entries of the keys ``start_n .. start_n + BLOCK_N - 1`` (0 past ``len_k``):
    one per page when the tile is whole pages, else one per key."""
    if BLOCK_N % BLOCK_SIZE == 0 and (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0:
        index = start_n // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        return tl.load(table_ptr + index, mask=index * BLOCK_SIZE < len_k, other=0)
    else:
        pos = start_n + tl.arange(0, BLOCK_N)
        return tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos < len_k, other=0)


@triton.jit
def _load_paged_kv(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, pages, start_n, len_k, kv_head,
                   scale_strides, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, KV_QUANT: tl.constexpr):
    """K and V of the keys ``start_n .. start_n + BLOCK_N - 1`` of one sequence, whose table entries
    ``pages`` are (from ``_tile_pages``): key ``pos`` lives in slot ``page * BLOCK_SIZE + pos % BLOCK_SIZE``.
    Returns ``(k, v, k_scale, v_scale)``; the scales (one per key) only with ``KV_QUANT``, else 1.0."""
    pos = start_n + tl.arange(0, BLOCK_N)
    in_seq = pos < len_k
    if BLOCK_N % BLOCK_SIZE == 0 and (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0:
        # The tile is whole pages: one table read per page, handed to the page's keys (on an
        # H200 5-10% faster than a read per key).
        # (start_n is a multiple of the page size here, so a key's place in its page is known at
        # compile time: no modulo per key.)
        PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
        page = tl.reshape(tl.broadcast_to(pages[:, None], (PAGES, BLOCK_SIZE)), (BLOCK_N,)).to(tl.int64)
        in_page = tl.arange(0, BLOCK_N) % BLOCK_SIZE
    else:
        page = pages.to(tl.int64)
        in_page = pos % BLOCK_SIZE
    slot = page * BLOCK_SIZE + in_page
    # A slot holds all KV heads of one token; this head's row is HEAD_DIM contiguous elements.
    offs = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        # Masked, not just ignored: a slot past the keys' end may hold anything, NaN included,
        # and 0 * NaN would leak into the output through the p @ v product.
        k = tl.load(k_cache_ptr + offs, mask=in_seq[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=in_seq[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + offs)
        v = tl.load(v_cache_ptr + offs)
    if KV_QUANT:
        # A slot's scales sit at the same (block, offset) as its values, one per KV head; the
        # strides (block, offset, head) find them in either layout (kvlab.paging.kv_cache).
        rows = page * scale_strides[0] + in_page * scale_strides[1] + kv_head * scale_strides[2]
        if MASKED:
            k_scale = tl.load(k_scale_ptr + rows, mask=in_seq, other=0.0)
            v_scale = tl.load(v_scale_ptr + rows, mask=in_seq, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + rows)
            v_scale = tl.load(v_scale_ptr + rows)
        return k, v, k_scale, v_scale
    else:
        return k, v, 1.0, 1.0       # unused (Triton 3.6 cannot return None from a jit function)


@triton.jit
def _attend_paged_keys(acc, m_i, l_i, q, offs_m, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, scale_strides,
                       table_ptr, kv_head, full_end, end, len_k, shift, qk_scale, CAUSAL: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr):
    """``_attend_keys`` for keys in the paged cache: the same two ranges of tiles, each tile's
    keys found through the block table (``len_k``: the keys that exist)."""
    offs_n = tl.arange(0, BLOCK_N)
    # In the long unmasked range the table entries are read one tile ahead. Read at the top of
    # the iteration that uses them, they sit on the critical path: table read, then address, then
    # the gather of K/V, with nothing to overlap. Carried over from the previous iteration, the
    # gather can start at once (on an H200 this took extends from 0.72-0.85 to 0.88-0.97 of the
    # contiguous kernel). The masked tiles, one or two, read their own.
    pages = _tile_pages(table_ptr, 0, len_k, BLOCK_SIZE, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        next_pages = _tile_pages(table_ptr, start_n + BLOCK_N, len_k, BLOCK_SIZE, BLOCK_N)
        k, v, ks, vs = _load_paged_kv(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, pages, start_n, len_k,
                                      kv_head, scale_strides, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, False,
                                      KV_QUANT)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift, qk_scale,
                                     MASKED=False, CAUSAL=CAUSAL, DOT_PRECISION=DOT_PRECISION,
                                     k_scale=ks, v_scale=vs, KV_QUANT=KV_QUANT)
        pages = next_pages
    for start_n in range(full_end, end, BLOCK_N):
        k, v, ks, vs = _load_paged_kv(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                      _tile_pages(table_ptr, start_n, len_k, BLOCK_SIZE, BLOCK_N), start_n, len_k,
                                      kv_head, scale_strides, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, True,
                                      KV_QUANT)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift, qk_scale,
                                     MASKED=True, CAUSAL=CAUSAL, DOT_PRECISION=DOT_PRECISION,
                                     k_scale=ks, v_scale=vs, KV_QUANT=KV_QUANT)
    return acc, m_i, l_i


@triton.jit
def _attend_prefix(acc, m_i, l_i, q, offs_m, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, scale_strides,
                   table_ptr, kv_head,
                   prefix_len, qk_scale, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   KV_QUANT: tl.constexpr):
    """Fold a cached prefix of ``prefix_len`` keys, read through the block table, into the running
    softmax. Every new token sees all of it: whole tiles unmasked, then at most one ragged tile."""
    offs_n = tl.arange(0, BLOCK_N)
    full_end = (prefix_len // BLOCK_N) * BLOCK_N
    pages = _tile_pages(table_ptr, 0, prefix_len, BLOCK_SIZE, BLOCK_N)    # read a tile ahead, as above
    for start_n in range(0, full_end, BLOCK_N):
        next_pages = _tile_pages(table_ptr, start_n + BLOCK_N, prefix_len, BLOCK_SIZE, BLOCK_N)
        k, v, ks, vs = _load_paged_kv(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, pages, start_n,
                                      prefix_len, kv_head, scale_strides, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                      BLOCK_N, False, KV_QUANT)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, prefix_len, 0, qk_scale,
                                     MASKED=False, CAUSAL=False, DOT_PRECISION=DOT_PRECISION,
                                     k_scale=ks, v_scale=vs, KV_QUANT=KV_QUANT)
        pages = next_pages
    if full_end < prefix_len:
        k, v, ks, vs = _load_paged_kv(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, pages, full_end,
                                      prefix_len, kv_head, scale_strides, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                      BLOCK_N, True, KV_QUANT)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, full_end + offs_n, prefix_len, 0, qk_scale,
                                     MASKED=True, CAUSAL=False, DOT_PRECISION=DOT_PRECISION,
                                     k_scale=ks, v_scale=vs, KV_QUANT=KV_QUANT)
    return acc, m_i, l_i


@triton.jit
def paged_prefill_kernel(
    q_desc,                                     # descriptor of q [total_q, num_heads, HEAD_DIM]
    k_new_desc, v_new_desc,                     # NEW_KV: descriptors of the new tokens' K/V, packed like q
    k_cache_ptr, v_cache_ptr, out_ptr,          # caches [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    k_scale_ptr, v_scale_ptr,                   # KV_QUANT: [num_blocks, BLOCK_SIZE, num_kv_heads] float32, else None
    # KV_QUANT: the scales' strides (K's = V's), constants: one compile per layout, no multiplies
    scale_block_stride: tl.constexpr, scale_slot_stride: tl.constexpr, scale_head_stride: tl.constexpr,
    block_tables_ptr,                           # [batch, max_blocks] int32
    seq_lens_ptr,                               # [batch] int32: cached tokens, the new ones included
    cu_query_lens_ptr,                          # [batch + 1] int32: where each sequence's queries start
    stride_ot, stride_oh,
    stride_table,                               # block_tables.stride(0)
    group, qk_scale,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NEW_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr = False,             # the cache holds fp8/int8 codes, a scale per (slot, KV head)
):
    # One program: BLOCK_M new tokens of one head of one sequence.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    kv_head = head // group
    q_start = tl.load(cu_query_lens_ptr + seq)
    len_q = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:
        return
    # The new tokens are the last len_q of the sequence's seq_len.
    seq_len = tl.load(seq_lens_ptr + seq)
    table_ptr = block_tables_ptr + seq * stride_table
    scale_strides = (scale_block_stride, scale_slot_stride, scale_head_stride)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_tile(q_desc, seq, head, q_start + start_m, True, BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # A tile of BLOCK_N keys may span several pages (or part of one): each key finds its page.
    # Walking keys rather than whole pages keeps BLOCK_N a choice for the tensor cores, free of
    # the page size (16-token pages would make 16-key tiles, thin for an MMA; 5-token pages
    # could not be a tile at all). The price: a tile of scattered rows cannot go to the TMA copy
    # engine as one piece, so each key's address is computed and its row gathered; with the
    # table read a tile ahead, an extend runs at about 0.9 of the contiguous kernel on an H200
    # (benchmarks/RESULTS.md).
    if NEW_KV:
        # The step's own keys are at hand, contiguous, as the caller computed them: only the
        # cached prefix goes through the block table. Every new token sees the whole prefix (no
        # causal mask; only its ragged last tile is masked), and the new tokens attend causally
        # to each other, tiles straight from k_new/v_new. A plain prefill reads no page at all.
        acc, m_i, l_i = _attend_prefix(acc, m_i, l_i, q, offs_m, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                       scale_strides, table_ptr, kv_head, seq_len - len_q, qk_scale, BLOCK_SIZE,
                                       NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, KV_QUANT)
        full_end, end, shift = _causal_bounds(start_m, len_q, len_q, BLOCK_M, BLOCK_N, True)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, offs_m, k_new_desc, v_new_desc, seq, kv_head, q_start,
                                     full_end, end, len_q, shift, qk_scale, True, True, BLOCK_N, HEAD_DIM,
                                     DOT_PRECISION)
    else:
        # Every key through the block table, the causal shift being the cached prefix's length.
        full_end, end, shift = _causal_bounds(start_m, len_q, seq_len, BLOCK_M, BLOCK_N, True)
        acc, m_i, l_i = _attend_paged_keys(acc, m_i, l_i, q, offs_m, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                           v_scale_ptr, scale_strides, table_ptr, kv_head, full_end, end, seq_len, shift,
                                           qk_scale, True, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION,
                                           KV_QUANT)

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + (q_start + offs_m[:, None]).to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < len_q)


# -- launchers -----------------------------------------------------------------------------
def _tile_descriptor(t: torch.Tensor, rows: int, varlen: bool):
    """A tensor descriptor of ``t`` whose tiles are ``rows`` tokens of one head (see ``_load_tile``).

    The copy engine wants 16-byte aligned addresses and strides; a view that has neither is
    copied first (a fresh tensor has both)."""
    block = [rows, 1, t.shape[-1]] if varlen else [1, 1, rows, t.shape[-1]]
    size = t.element_size()
    if t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]):
        t = t.contiguous()
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=1)
def _has_gluon() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.language import warp_specialize  # noqa: F401
    except ImportError:
        return False
    return True


def _takes_warp_specialized(asked: bool | None, q, k_cache, k_scale, k_new, out, max_seq_len,
                            max_query_len) -> bool:
    """Whether ``paged_prefill`` hands the step to ``paged_prefill_ws`` (see its docstring)."""
    if asked is False:
        return False
    why_not = None
    if k_scale is None:
        why_not = "the cache is not quantised (no k_scale)"
    elif not q.is_cuda or _capability(q.device) != WS_CAPABILITY or not _has_gluon():
        why_not = "it needs an sm_90 GPU and Triton's Gluon (Triton 3.6 or later)"
    elif q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in WS_HEAD_DIMS:
        why_not = f"it takes float16/bfloat16 q of head_dim {WS_HEAD_DIMS}, got {q.dtype}, {q.shape[-1]}"
    elif k_new is not None or q.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        why_not = "it reads every key through the table (no k_new) and head_dim-contiguous q and out"
    if asked:
        if why_not is not None:
            raise ValueError(f"warp_specialized=True: paged_prefill_ws cannot run this step: {why_not}")
        return True
    return why_not is None and warp_specialized_extend(kv_cache_format(k_cache.dtype).name, q.shape[-1],
                                                       max_seq_len, max_query_len, _capability(q.device))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact products ("ieee"), not TF32's 10-bit mantissas, so float32 is the
    # accurate reference path. float16/bfloat16 run on the tensor cores either way.
    return "ieee" if dtype == torch.float32 else "tf32"


def flash_attention(q, k, v, causal: bool = True, sm_scale: float | None = None, cu_seqlens_q=None,
                    cu_seqlens_k=None, return_lse: bool = False, *, max_seqlen_q: int | None = None,
                    out: torch.Tensor | None = None, validate: bool = True, block_m: int | None = None,
                    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """Softmax attention, FlashAttention-2 style; returns ``out`` (and the log-sum-exp if asked).

    Batched form: ``q`` ``[batch, num_heads, len_q, head_dim]``, ``k``/``v`` ``[batch,
    num_kv_heads, len_k, head_dim]``. Packed form (sequences of different lengths): ``q``
    ``[total_q, num_heads, head_dim]``, ``k``/``v`` ``[total_k, num_kv_heads, head_dim]``, and
    int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``[batch + 1]``: sequence ``b``'s rows are
    ``cu[b] .. cu[b + 1] - 1``. ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    With ``causal`` query ``i`` of a sequence sees keys ``0 .. len_k - len_q + i``.

    ``out`` (optional) receives the result (``q``'s shape and dtype); the log-sum-exp (natural
    log, float32) is ``[batch, num_heads, len_q]`` or ``[num_heads, total_q]``. ``validate``
    checks every argument before the launch (in the packed form with one read back to the host,
    of a check kernel's statistics of ``cu_seqlens``, which also size the grid: see
    :mod:`kvlab.kernels.attention_checks`); unchecked, ``max_seqlen_q`` spares the one read the
    packed grid needs. ``block_m``, ``block_n``, ``num_warps``, ``num_stages`` override :func:`tile_config`.
    """
    longest_q = None
    if validate:
        longest_q = check_flash_attention_args(q, k, v, causal, sm_scale, cu_seqlens_q, cu_seqlens_k, out,
                                               max_seqlen_q=max_seqlen_q)
    varlen = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if varlen:
        batch, num_heads, len_q, len_k = cu_seqlens_q.numel() - 1, q.shape[1], 0, 0
        if max_seqlen_q is None:   # the grid needs it: from the checks' read, or a read of its own
            max_seqlen_q = (longest_q if longest_q is not None
                            else grid_length(cu_seqlens_q[1:] - cu_seqlens_q[:-1], None, "max_seqlen_q", False))
        lse = torch.empty((num_heads, q.shape[0]), dtype=torch.float32, device=q.device) if return_lse else None
        # (batch, token, head) strides: the batch stride is 0, rows are found through cu_seqlens.
        strides = [(0, out.stride(0), out.stride(1)), (0, 1, q.shape[0]) if return_lse else (0, 0, 0)]
    else:
        batch, num_heads, len_q, _ = q.shape
        len_k = k.shape[2]
        max_seqlen_q = len_q
        lse = torch.empty((batch, num_heads, len_q), dtype=torch.float32, device=q.device) if return_lse else None
        strides = [(out.stride(0), out.stride(2), out.stride(1)),
                   (num_heads * len_q, 1, len_q) if return_lse else (0, 0, 0)]
    cfg = _launch_config(head_dim, max_seqlen_q, block_m, block_n, num_warps, num_stages, q.element_size(),
                         max_len_k=len_k or None)
    if batch > 0 and max_seqlen_q > 0:
        grid = (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), num_heads, batch)
        descs = [_tile_descriptor(t, rows, varlen) for t, rows in ((q, cfg["BLOCK_M"]), (k, cfg["BLOCK_N"]),
                                                                    (v, cfg["BLOCK_N"]))]
        flash_attention_kernel[grid](
            *descs, out, lse, cu_seqlens_q, cu_seqlens_k, len_q, len_k, *[s for st in strides for s in st],
            num_heads // k.shape[1], sm_scale * LOG2_E,
            HEAD_DIM=head_dim, CAUSAL=bool(causal), VARLEN=varlen, RETURN_LSE=return_lse,
            DOT_PRECISION=_dot_precision(q.dtype), **cfg)
    return (out, lse) if return_lse else out


def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale: float | None = None, *,
                  k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                  max_query_len: int | None = None, cu_query_lens: torch.Tensor | None = None,
                  max_seq_len: int | None = None, out: torch.Tensor | None = None, validate: bool = True, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  warp_specialized: bool | None = None) -> torch.Tensor:
    """Causal attention of a step's new tokens to their sequences' paged K/V (prefill and extend).

    ``q`` ``[total_q, num_heads, head_dim]`` packs every sequence's new tokens in batch order;
    ``k_cache``/``v_cache`` are one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    already holding the new tokens' K/V (``write_kv`` runs first). ``block_tables`` int32
    ``[batch, max_blocks]``, ``seq_lens`` int32 ``[batch]`` (tokens cached, new ones included),
    ``query_lens`` int32 ``[batch]`` (new tokens; they are the sequence's last positions).
    The engine's attention-backend signature; returns ``q``'s shape and dtype.

    ``k_new``/``v_new`` (optional, ``[total_q, num_kv_heads, head_dim]``, packed like ``q``): the
    new tokens' K/V, the very values ``write_kv`` put in the cache. Given them, the kernel reads
    the new tokens' keys from them, whole tiles at a time, and only the cached prefix through the
    block table; without them, every key goes through the table.

    A quantised cache (float8_e4m3fn or int8, :mod:`kvlab.quantization`) comes with its scales
    ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` float32: the kernel reads
    the codes and dequantises in registers (the scales applied to the scores and to the softmax
    weights, see ``_attend_tile``). Given ``k_new``/``v_new`` as well, the new tokens attend to
    those exactly and only the prefix is dequantised; without them, to what the cache holds.

    Over a quantised cache on an sm_90 GPU, with every key through the table, a step whose longest
    sequence and longest chunk are long enough goes to :func:`kvlab.kernels.paged_prefill_ws.paged_prefill_ws`,
    whose own warps dequantise while others multiply (``max_seq_len`` must be given; the rule is
    :func:`kvlab.kernel_plan.warp_specialized_extend`). ``warp_specialized`` True asks for that
    kernel (a ValueError where it cannot run), False for this one.

    ``validate`` checks every argument before the launch, with one read back to the host (a
    check kernel's statistics of the lengths and the used block-table entries, which also give
    the grid's ``max_query_len``; see :mod:`kvlab.kernels.attention_checks`). Unchecked, ``max_query_len``
    spares the one read the grid needs, ``cu_query_lens`` (the running sum of ``query_lens`` with
    a leading 0, if the caller has it) the two small launches that compute it. ``max_seq_len``
    (the longest ``seq_lens``, if known) picks larger tiles for chunks over a long prefix.
    """
    longest_q = None
    if validate:
        longest_q, cu_query_lens = check_paged_prefill_args(
            q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, out, k_new, v_new,
            max_query_len=max_query_len, cu_query_lens=cu_query_lens, k_scale=k_scale, v_scale=v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = query_lens.shape[0]
    if max_query_len is None:      # the grid needs it: from the checks' read, or a read of its own
        max_query_len = longest_q if longest_q is not None else grid_length(query_lens, None, "max_query_len",
                                                                            False)
    if batch == 0 or num_tokens == 0 or max_query_len == 0:
        return out
    # Sequence b's queries are rows cu_query_lens[b] .. cu_query_lens[b + 1] - 1 of q (the checks
    # verified a given one, or wrote it).
    if cu_query_lens is None:
        cu_query_lens = torch.nn.functional.pad(torch.cumsum(query_lens, 0, dtype=torch.int32), (1, 0))
    tiles_given = any(x is not None for x in (block_m, block_n, num_warps, num_stages))
    if warp_specialized and tiles_given:
        raise ValueError("block_m, block_n, num_warps and num_stages set this kernel's tiles: "
                         "not with warp_specialized=True")
    if _takes_warp_specialized(False if tiles_given else warp_specialized, q, k_cache, k_scale, k_new, out,
                               max_seq_len, max_query_len):
        from kvlab.kernels.paged_prefill_ws import paged_prefill_ws

        return paged_prefill_ws(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, max_query_len, k_scale,
                                v_scale, sm_scale, out)
    cfg = _launch_config(head_dim, max_query_len, block_m, block_n, num_warps, num_stages, q.element_size(),
                         max_len_k=max_seq_len,
                         kv_cache_dtype="auto" if k_scale is None else kv_cache_format(k_cache.dtype).name)
    new_kv = k_new is not None
    q_desc = _tile_descriptor(q, cfg["BLOCK_M"], varlen=True)
    k_new_desc, v_new_desc = ((_tile_descriptor(k_new, cfg["BLOCK_N"], varlen=True),
                               _tile_descriptor(v_new, cfg["BLOCK_N"], varlen=True)) if new_kv else (None, None))
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_M"]), num_heads, batch)
    paged_prefill_kernel[grid](
        q_desc, k_new_desc, v_new_desc, k_cache, v_cache, out, k_scale, v_scale,
        *(k_scale.stride() if k_scale is not None else (0, 0, 0)), block_tables, seq_lens,
        cu_query_lens, out.stride(0), out.stride(1), block_tables.stride(0), num_heads // num_kv_heads,
        sm_scale * LOG2_E, BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, NEW_KV=new_kv,
        DOT_PRECISION=_dot_precision(q.dtype), KV_QUANT=k_scale is not None, **cfg)
    return out
