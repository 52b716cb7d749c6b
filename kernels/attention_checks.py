"""Argument checks of the attention launchers: flash_attention, paged_prefill and paged_decode.

The rules, and how their values are checked (one Triton check kernel, one read), are those of
:mod:`kvlab.kernels.checks`, which holds the shared helpers and the checks of write_kv and
copy_blocks. ``read_check`` is looked up there at each call (``checks.read_check``), so a test
that wraps it to count the reads sees every launcher's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels import checks
from kvlab.kernels.checks import (
    BIG,
    SCAN,
    _check_dtypes,
    _check_head_dim,
    _check_heads,
    _check_int32_vector,
    _check_out,
    _check_rows_contiguous,
    _check_sm_scale,
    _check_supported_dtype,
    _check_tensor,
    _first,
    _min_max,
    _programs,
    check_kv_cache_pair,
    check_kv_scales,
    check_length_hint,
    check_same_device,
    remembered,
)


# -- a value helper of the paged launchers ---------------------------------------------------------
@triton.jit
def _used_entries_min_max(tables_ptr, lens_ptr, batch, max_blocks, table_stride, block_size, pid, programs):
    """Smallest and largest block-table entry that a sequence uses, in this program's share of
    the table read as one flat array: entry ``j`` of row ``b`` is used when ``j * block_size <
    lens[b]``. The padding after a sequence's blocks may hold anything: it is never read."""
    lo = tl.full([SCAN], BIG, tl.int64)
    hi = tl.full([SCAN], -BIG, tl.int64)
    for start in range(pid * SCAN, batch * max_blocks, programs * SCAN):
        flat = start + tl.arange(0, SCAN)
        row = flat // max_blocks
        col = flat % max_blocks
        inside = flat < batch * max_blocks
        length = tl.load(lens_ptr + row, mask=inside, other=0)
        used = inside & (col * block_size < length)
        entry = tl.load(tables_ptr + row * table_stride + col, mask=used, other=0).to(tl.int64)
        lo = tl.minimum(lo, tl.where(used, entry, BIG))
        hi = tl.maximum(hi, tl.where(used, entry, -BIG))
    return tl.min(lo, axis=0), tl.max(hi, axis=0)


# -- paged_decode ---------------------------------------------------------------------------------
@triton.jit
def paged_decode_check_kernel(stats_ptr, seq_lens_ptr, block_tables_ptr, batch, max_blocks, table_stride,
                              block_size):
    """Row ``pid`` of ``stats``: min and max of seq_lens, min and max of the used table entries."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    len_lo, len_hi = _min_max(seq_lens_ptr, batch, pid, programs)
    entry_lo, entry_hi = _used_entries_min_max(block_tables_ptr, seq_lens_ptr, batch, max_blocks, table_stride,
                                               block_size, pid, programs)
    row = stats_ptr + pid * 4
    tl.store(row + 0, len_lo)
    tl.store(row + 1, len_hi)
    tl.store(row + 2, entry_lo)
    tl.store(row + 3, entry_hi)


@remembered
def check_paged_decode_args(q, k_cache, v_cache, block_tables, seq_lens, num_splits=None, out=None, *,
                            sm_scale=None, max_seq_len: int | None = None, k_scale=None, v_scale=None) -> int:
    """Raise TypeError/ValueError naming the first argument of paged_decode that breaks a rule.

    Returns the longest of ``seq_lens`` (0 for an empty batch), from the one read of the checks.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache_pair(k_cache, v_cache)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be a [batch, num_heads, head_dim] tensor, got shape {list(q.shape)}")
    _check_supported_dtype("q", q)
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if not quantized and q.dtype != k_cache.dtype:
        raise TypeError(f"q has dtype {q.dtype}, the cache has {k_cache.dtype}")
    if q.shape[2] != head_dim or head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must match the cache's {head_dim} and be a power of two >= 16, "
                         f"got q with head_dim {q.shape[2]}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    batch = q.shape[0]
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or not block_tables.is_contiguous():
        raise ValueError(f"block_tables must be a contiguous [{batch}, max_blocks] tensor, "
                         f"got {list(block_tables.shape)}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must have shape [{batch}], got {list(seq_lens.shape)}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    _check_sm_scale(sm_scale)
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous tensor like q: {list(q.shape)} {q.dtype}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    if batch == 0:
        return 0
    max_blocks = block_tables.shape[1]
    len_lo, len_hi, entry_lo, entry_hi = checks.read_check(
        paged_decode_check_kernel, (min, max, min, max), _programs(batch * max(max_blocks, 1), SCAN.value),
        seq_lens, block_tables if max_blocks else seq_lens, batch, max_blocks, max_blocks, block_size)
    capacity = max_blocks * block_size
    if len_lo < 1 or len_hi > capacity:
        (i,) = _first((seq_lens < 1) | (seq_lens > capacity))
        raise ValueError(f"seq_lens[{i}] = {int(seq_lens[i])} must be in 1..{capacity} "
                         f"(block_tables holds {max_blocks} blocks of {block_size})")
    if entry_lo < 0 or entry_hi >= num_blocks:
        used = torch.arange(max_blocks, device=seq_lens.device)[None, :] * block_size < seq_lens[:, None]
        i, j = _first(used & ((block_tables < 0) | (block_tables >= num_blocks)))
        raise ValueError(f"block_tables[{i}, {j}] = {int(block_tables[i, j])} is out of range 0..{num_blocks - 1}")
    check_length_hint("max_seq_len", max_seq_len, len_hi)
    return len_hi


# -- paged_prefill --------------------------------------------------------------------------------
@triton.jit
def paged_prefill_check_kernel(stats_ptr, seq_lens_ptr, query_lens_ptr, block_tables_ptr, cu_ptr, batch,
                               max_blocks, table_stride, block_size, CU_GIVEN: tl.constexpr):
    """Row ``pid`` of ``stats``: min and max of seq_lens and of query_lens, the sum of query_lens,
    the largest ``query_lens - seq_lens``, min and max of the used table entries, and whether
    ``cu_ptr`` differs from the running sum of query_lens (if ``CU_GIVEN``).

    Without ``CU_GIVEN``, program 0 also writes that running sum (with its leading 0) to
    ``cu_ptr``: the launch needs it, and so it costs no separate launch."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    seq_lo = tl.full([SCAN], BIG, tl.int64)
    seq_hi = tl.full([SCAN], -BIG, tl.int64)
    query_lo = tl.full([SCAN], BIG, tl.int64)
    query_hi = tl.full([SCAN], -BIG, tl.int64)
    query_sum = tl.zeros([SCAN], tl.int64)
    excess = tl.full([SCAN], -BIG, tl.int64)
    cu_wrong = tl.zeros([SCAN], tl.int64)
    for start in range(pid * SCAN, batch, programs * SCAN):
        b = start + tl.arange(0, SCAN)
        inside = b < batch
        seq = tl.load(seq_lens_ptr + b, mask=inside, other=0).to(tl.int64)
        query = tl.load(query_lens_ptr + b, mask=inside, other=0).to(tl.int64)
        seq_lo = tl.minimum(seq_lo, tl.where(inside, seq, BIG))
        seq_hi = tl.maximum(seq_hi, tl.where(inside, seq, -BIG))
        query_lo = tl.minimum(query_lo, tl.where(inside, query, BIG))
        query_hi = tl.maximum(query_hi, tl.where(inside, query, -BIG))
        query_sum += query
        excess = tl.maximum(excess, tl.where(inside, query - seq, -BIG))
        if CU_GIVEN:
            # cu is the running sum with a leading 0 exactly when each step cu[b + 1] - cu[b] is
            # query_lens[b] and cu[0] is 0: a check of neighbours, no scan needed.
            step = tl.load(cu_ptr + b + 1, mask=inside, other=0) - tl.load(cu_ptr + b, mask=inside, other=0)
            cu_wrong = tl.maximum(cu_wrong, (inside & (step.to(tl.int64) != query)).to(tl.int64))
    if CU_GIVEN:
        cu_wrong = tl.maximum(cu_wrong, (tl.load(cu_ptr) != 0).to(tl.int64))
    elif pid == 0:
        tl.store(cu_ptr, 0)
        total = tl.zeros([], tl.int32)
        for start in range(0, batch, SCAN):
            b = start + tl.arange(0, SCAN)
            query = tl.load(query_lens_ptr + b, mask=b < batch, other=0)
            tl.store(cu_ptr + b + 1, total + tl.cumsum(query, axis=0), mask=b < batch)
            total += tl.sum(query, axis=0)
    entry_lo, entry_hi = _used_entries_min_max(block_tables_ptr, seq_lens_ptr, batch, max_blocks, table_stride,
                                               block_size, pid, programs)
    row = stats_ptr + pid * 9
    tl.store(row + 0, tl.min(seq_lo, axis=0))
    tl.store(row + 1, tl.max(seq_hi, axis=0))
    tl.store(row + 2, tl.min(query_lo, axis=0))
    tl.store(row + 3, tl.max(query_hi, axis=0))
    tl.store(row + 4, tl.sum(query_sum, axis=0))
    tl.store(row + 5, tl.max(excess, axis=0))
    tl.store(row + 6, entry_lo)
    tl.store(row + 7, entry_hi)
    tl.store(row + 8, tl.max(cu_wrong, axis=0))


@remembered
def check_paged_prefill_args(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, out,
                             k_new=None, v_new=None, *, max_query_len: int | None = None,
                             cu_query_lens: torch.Tensor | None = None, k_scale=None,
                             v_scale=None) -> tuple[int, torch.Tensor | None]:
    """Raise TypeError/ValueError naming the first argument of paged_prefill that breaks a rule.

    Returns ``(longest query_len, cu_query_lens)``: the given ``cu_query_lens`` once checked
    against ``query_lens``, else the running sum the check kernel wrote (None for an empty batch).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache_pair(k_cache, v_cache)
    _check_tensor("q", q, 3, "[total_q, num_heads, head_dim]")
    if check_kv_scales(k_cache, v_cache, k_scale, v_scale):   # a quantised cache holds codes, not q's dtype
        _check_supported_dtype("q", q)
    else:
        _check_dtypes(q=q, k_cache=k_cache, v_cache=v_cache)
    _check_heads(q.shape[1], num_kv_heads, "q", "k_cache")
    _check_head_dim(q.shape[2], head_dim, "k_cache")
    _check_rows_contiguous(q=q)
    _check_sm_scale(sm_scale)
    _check_out(out, q)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together: give both (the new tokens' K and V) or neither")
    if k_new is not None:
        want = [q.shape[0], num_kv_heads, head_dim]
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _check_tensor(name, t, 3, "[total_q, num_kv_heads, head_dim]")
            if list(t.shape) != want:
                raise ValueError(f"{name} must be {want} (one row of K/V per new token, packed like q), "
                                 f"got {list(t.shape)}")
        _check_dtypes(q=q, k_new=k_new, v_new=v_new)
        _check_rows_contiguous(k_new=k_new, v_new=v_new)
        check_same_device(q=q, k_new=k_new, v_new=v_new)
    if not isinstance(block_tables, torch.Tensor):
        raise TypeError(f"block_tables must be a torch.Tensor, got {type(block_tables).__name__}")
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.dim() != 2 or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be [batch, max_blocks] with contiguous rows, "
                         f"got shape {list(block_tables.shape)}")
    batch, max_blocks = block_tables.shape
    _check_int32_vector("seq_lens", seq_lens, batch, f"{batch} lengths (one per block_tables row)")
    _check_int32_vector("query_lens", query_lens, batch, f"{batch} lengths (one per block_tables row)")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                      query_lens=query_lens)
    cu_given = cu_query_lens is not None
    if cu_given and (not isinstance(cu_query_lens, torch.Tensor) or cu_query_lens.dtype != torch.int32
                     or cu_query_lens.shape != (batch + 1,) or not cu_query_lens.is_contiguous()
                     or cu_query_lens.device != query_lens.device):
        raise ValueError("cu_query_lens must be the int32 running sum of query_lens with a leading 0")
    if batch == 0:
        if q.shape[0] != 0:
            raise ValueError(f"query_lens sum to 0, q has {q.shape[0]} tokens")
        return 0, cu_query_lens
    cu = cu_query_lens if cu_given else torch.empty(batch + 1, dtype=torch.int32, device=query_lens.device)
    table = block_tables if max_blocks else seq_lens
    (seq_lo, seq_hi, query_lo, query_hi, query_sum, excess, entry_lo, entry_hi, cu_wrong) = checks.read_check(
        paged_prefill_check_kernel, (min, max, min, max, sum, max, min, max, max),
        _programs(batch * max(max_blocks, 1), SCAN.value), seq_lens, query_lens, table, cu, batch, max_blocks,
        block_tables.stride(0), block_size, CU_GIVEN=cu_given)
    for name, lens, lowest in (("query_lens", query_lens, query_lo), ("seq_lens", seq_lens, seq_lo)):
        if lowest < 0:
            (i,) = _first(lens < 0)
            raise ValueError(f"{name}[{i}] = {int(lens[i])} is negative")
    if query_sum != q.shape[0]:
        raise ValueError(f"query_lens sum to {query_sum}, q has {q.shape[0]} tokens")
    if excess > 0:
        (i,) = _first(query_lens > seq_lens)
        raise ValueError(f"query_lens[{i}] = {int(query_lens[i])} > seq_lens[{i}] = {int(seq_lens[i])}: "
                         "a sequence's new tokens are part of its cached tokens")
    capacity = max_blocks * block_size
    if seq_hi > capacity:
        (i,) = _first(seq_lens > capacity)
        raise ValueError(f"seq_lens[{i}] = {int(seq_lens[i])} is beyond block_tables' capacity of "
                         f"{max_blocks} blocks x {block_size} tokens = {capacity}")
    # Only the entries a sequence uses must name real blocks; the padding after them is never read.
    if entry_lo < 0 or entry_hi >= num_blocks:
        used = torch.arange(max_blocks, device=seq_lens.device)[None, :] * block_size < seq_lens[:, None]
        row, col = _first(used & ((block_tables < 0) | (block_tables >= num_blocks)))
        raise ValueError(f"block_tables[{row}, {col}] = {int(block_tables[row, col])} is out of range "
                         f"0..{num_blocks - 1}")
    check_length_hint("max_query_len", max_query_len, query_hi)
    if cu_wrong:
        raise ValueError("cu_query_lens must be the int32 running sum of query_lens with a leading 0")
    return query_hi, cu


# -- flash_attention --------------------------------------------------------------------------------
@triton.jit
def flash_varlen_check_kernel(stats_ptr, cu_q_ptr, cu_k_ptr, batch, CAUSAL: tl.constexpr):
    """Row ``pid`` of ``stats``: first and last entry of cu_seqlens_q, its smallest and largest
    step (the lengths), the same for cu_seqlens_k (but its largest step), and whether some
    sequence breaks the query/key rule (causal: more queries than keys; else: queries, no key)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    q_lo = tl.full([SCAN], BIG, tl.int64)
    q_hi = tl.full([SCAN], -BIG, tl.int64)
    k_lo = tl.full([SCAN], BIG, tl.int64)
    bad = tl.zeros([SCAN], tl.int64)
    for start in range(pid * SCAN, batch, programs * SCAN):
        b = start + tl.arange(0, SCAN)
        inside = b < batch
        len_q = (tl.load(cu_q_ptr + b + 1, mask=inside, other=0) - tl.load(cu_q_ptr + b, mask=inside, other=0))
        len_k = (tl.load(cu_k_ptr + b + 1, mask=inside, other=0) - tl.load(cu_k_ptr + b, mask=inside, other=0))
        len_q = len_q.to(tl.int64)
        len_k = len_k.to(tl.int64)
        q_lo = tl.minimum(q_lo, tl.where(inside, len_q, BIG))
        q_hi = tl.maximum(q_hi, tl.where(inside, len_q, -BIG))
        k_lo = tl.minimum(k_lo, tl.where(inside, len_k, BIG))
        if CAUSAL:
            broken = len_q > len_k
        else:
            broken = (len_q > 0) & (len_k == 0)
        bad = tl.maximum(bad, (inside & broken).to(tl.int64))
    row = stats_ptr + pid * 8
    tl.store(row + 0, tl.load(cu_q_ptr).to(tl.int64))
    tl.store(row + 1, tl.load(cu_q_ptr + batch).to(tl.int64))
    tl.store(row + 2, tl.min(q_lo, axis=0))
    tl.store(row + 3, tl.max(q_hi, axis=0))
    tl.store(row + 4, tl.load(cu_k_ptr).to(tl.int64))
    tl.store(row + 5, tl.load(cu_k_ptr + batch).to(tl.int64))
    tl.store(row + 6, tl.min(k_lo, axis=0))
    tl.store(row + 7, tl.max(bad, axis=0))


def _check_cu_seqlens(name, cu, first, last, step_lo, total):
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if step_lo < 0:
        (i,) = _first(cu[1:] < cu[:-1])
        raise ValueError(f"{name} must be monotonically increasing (non-decreasing): {name}[{i + 1}] = "
                         f"{int(cu[i + 1])} < {name}[{i}] = {int(cu[i])}")
    if last != total:
        raise ValueError(f"{name}[-1] = {last} must equal the number of packed tokens, {total}")


@remembered
def check_flash_attention_args(q, k, v, causal, sm_scale, cu_seqlens_q, cu_seqlens_k, out, *,
                               max_seqlen_q: int | None = None) -> int | None:
    """Raise TypeError/ValueError naming the first argument of flash_attention that breaks a rule.

    Returns the longest query length of the packed form (from the checks' one read), None in the
    batched form (which reads nothing).
    """
    if not isinstance(causal, bool):       # "no" is truthy: it would run causal attention
        raise TypeError(f"causal must be True or False, got {causal!r}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    dims, what = ((3, "[total_tokens, heads, head_dim] (packed, with cu_seqlens)") if varlen
                  else (4, "[batch, heads, len, head_dim]"))
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, dims, what)
    _check_dtypes(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    head_axis = 1
    _check_heads(q.shape[head_axis], k.shape[head_axis], "q", "k")
    _check_head_dim(q.shape[-1], k.shape[-1], "k")
    _check_rows_contiguous(q=q, k=k, v=v)
    _check_sm_scale(sm_scale)
    _check_out(out, q)
    if not varlen:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q has batch {q.shape[0]}, k has {k.shape[0]}")
        if causal and q.shape[2] > k.shape[2]:
            raise ValueError(f"causal attention needs len_q <= len_k (queries are the last len_q positions), "
                             f"got len_q {q.shape[2]} > len_k {k.shape[2]}")
        if q.shape[2] > 0 and k.shape[2] == 0:
            raise ValueError("k has len_k 0: every query needs at least one key")
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("the packed form needs both cu_seqlens_q and cu_seqlens_k")
    _check_int32_vector("cu_seqlens_q", cu_seqlens_q, None, "batch + 1 row offsets")
    _check_int32_vector("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], "batch + 1 row offsets")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have batch + 1 >= 1 entries")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    batch = cu_seqlens_q.shape[0] - 1
    q_first, q_last, q_lo, q_hi, k_first, k_last, k_lo, bad = checks.read_check(
        flash_varlen_check_kernel, (min, min, min, max, min, min, min, max), _programs(batch, SCAN.value),
        cu_seqlens_q, cu_seqlens_k, batch, CAUSAL=bool(causal))
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q_first, q_last, q_lo, q.shape[0])
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k_first, k_last, k_lo, k.shape[0])
    if bad:
        lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        (i,) = _first((lens_q > lens_k) if causal else ((lens_q > 0) & (lens_k == 0)))
        rule = ("causal attention needs len_q <= len_k" if causal else "every query needs at least one key")
        raise ValueError(f"sequence {i} has {int(lens_q[i])} queries and {int(lens_k[i])} keys: {rule}")
    longest = max(q_hi, 0)
    check_length_hint("max_seqlen_q", max_seqlen_q, longest)
    return longest
