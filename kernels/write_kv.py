"""write_kv: scatter a batch of new tokens' K and V into the paged cache in one launch.

This is vLLM's "reshape_and_cache". Token ``t`` of the batch goes to physical slot
``slot_mapping[t]`` (see :mod:`kvlab.paging.kv_cache` for the layout); a slot of -1 marks a
padding token and writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.checks import check_write_kv_args  # (checks.py: shared helpers, write_kv's and copy_blocks')


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr,            # [num_tokens, num_kv_heads, head_dim], rows may be strided
    k_cache_ptr, v_cache_ptr,      # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,              # [num_tokens] int64
    key_token_stride, value_token_stride,
    ROW: tl.constexpr,             # num_kv_heads * head_dim: one token's K (or V), contiguous
    BLOCK: tl.constexpr,           # elements one program copies
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_mapping_ptr + token)
    # A padding token (slot -1) copies zero elements: no load, no store.
    row_len = tl.where(slot >= 0, ROW, 0)
    mask = cols < row_len
    k = tl.load(key_ptr + token * key_token_stride + cols, mask=mask)
    v = tl.load(value_ptr + token * value_token_stride + cols, mask=mask)
    # Slot s starts at element s * ROW of the flattened cache: slots are int64, so the
    # offset cannot overflow on caches of more than 2**31 elements.
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, validate: bool = True) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches.

    With ``validate`` (the default) every argument is checked before the launch, slot indices
    included (a check kernel finds the smallest and largest slot and any slot named twice; the
    host reads those three numbers back): a rejected call writes nothing.
    """
    if validate:
        check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = key.shape[1] * key.shape[2]
    block = min(triton.next_power_of_2(row), 2048)
    grid = (num_tokens, triton.cdiv(row, block))
    write_kv_kernel[grid](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                          ROW=row, BLOCK=block)

