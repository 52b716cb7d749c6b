"""write_kv: scatter a batch of new tokens' K and V into the paged cache in one launch.

This is vLLM's "reshape_and_cache". Token ``t`` of the batch goes to physical slot
``slot_mapping[t]`` (see :mod:`kvlab.paging.kv_cache` for the layout); a slot of -1 marks a
padding token and writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.checks import check_kv_cache_pair, check_same_device


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
    included (which reads ``slot_mapping`` back to the host): a rejected call writes nothing.
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


def check_write_kv_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Raise TypeError/ValueError naming the first argument of write_kv that breaks a rule."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache_pair(k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}] to match the "
                             f"cache, got {list(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, the cache has {k_cache.dtype}")
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be contiguous within a token (strides [*, {head_dim}, 1]), "
                             f"got strides {list(t.stride())}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, value has {value.shape[0]}")
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape [{key.shape[0]}] (one slot per token), "
                         f"got {list(slot_mapping.shape)}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if slot_mapping.numel():
        num_slots = num_blocks * block_size
        bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"slot_mapping[{i}] = {int(slot_mapping[i])} is out of range: slots are -1 "
                             f"(padding) or 0..{num_slots - 1}")
        real = slot_mapping[slot_mapping >= 0]
        if real.numel() != torch.unique(real).numel():
            raise ValueError("slot_mapping names a slot twice: two tokens would race for one slot")
