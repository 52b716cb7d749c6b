"""rotary_write_kv: rotate a step's queries and keys (RoPE) and write K/V to the paged cache, in one launch.

In PyTorch each layer spends about a dozen kernels on RoPE (gather cos/sin, split, negate,
concatenate, multiply, add, cast, for q and for k) and one more on :func:`write_kv`. Here one
program takes one token: it rotates the token's query and key heads in place, in the fused
QKV projection's output, and copies the rotated key and the value to the token's cache slot.

The rotation is HF's "rotate half" (GPT-NeoX's) layout: dims ``i`` and ``i + head_dim / 2``
form a pair, and with ``x = (x1, x2)`` the two halves of a head::

    rotated = (x1 * cos1 - x2 * sin1,  x2 * cos2 + x1 * sin2)

where ``cos = (cos1, cos2)`` is the row of the position's table (HF's tables repeat the same
frequencies in both halves, but the kernel reads both, like :func:`kvlab.models.rope.apply_rope`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.checks import check_kv_cache_pair, check_same_device


@triton.jit
def _rotate_heads_in_place(ptr, num_heads, cos1, sin1, cos2, sin2,
                           HEADS: tl.constexpr, HALF: tl.constexpr):
    """Rotate heads ``0..num_heads-1`` of one token (``ptr`` is its first element) in place.

    Returns the rotated halves, ``[HEADS, HALF]`` each, for the caller to store elsewhere too."""
    heads = tl.arange(0, HEADS)[:, None]
    offs = heads * (2 * HALF) + tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    x1 = tl.load(ptr + offs, mask=mask).to(tl.float32)
    x2 = tl.load(ptr + offs + HALF, mask=mask).to(tl.float32)
    # The products and the sum of ``xf * cos + rotate_half(xf) * sin`` in float32, then one
    # rounding to the dtype, as apply_rope does.
    r1 = (x1 * cos1 - x2 * sin1).to(ptr.dtype.element_ty)
    r2 = (x2 * cos2 + x1 * sin2).to(ptr.dtype.element_ty)
    tl.store(ptr + offs, r1, mask=mask)
    tl.store(ptr + offs + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr,            # [num_tokens, heads, head_dim]: token rows strided, heads packed
    positions_ptr,                  # [num_tokens] int64
    cos_ptr, sin_ptr,               # [max_positions, head_dim] float32, contiguous
    k_cache_ptr, v_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,               # [num_tokens] int64, -1 = padding
    q_token_stride, k_token_stride, v_token_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,   # the head counts padded to powers of two
    HEAD_DIM: tl.constexpr,
):
    # One program per token, all of its heads: the position's cos/sin row and the slot are read
    # once and serve every head. A token is a few KB, so a finer grid would only add programs to
    # a launch whose cost, at decode sizes, is the launch itself.
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)[None, :]
    table_row = tl.load(positions_ptr + token) * HEAD_DIM
    cos1 = tl.load(cos_ptr + table_row + half)
    cos2 = tl.load(cos_ptr + table_row + HALF + half)
    sin1 = tl.load(sin_ptr + table_row + half)
    sin2 = tl.load(sin_ptr + table_row + HALF + half)

    # Padding tokens are rotated too: their q and k are the layer's output all the same.
    _rotate_heads_in_place(q_ptr + token * q_token_stride, NUM_HEADS, cos1, sin1, cos2, sin2,
                           HEADS=Q_HEADS, HALF=HALF)
    k1, k2 = _rotate_heads_in_place(k_ptr + token * k_token_stride, NUM_KV_HEADS, cos1, sin1, cos2, sin2,
                                    HEADS=KV_HEADS, HALF=HALF)

    # The cache write of write_kv: slot s starts at element s * NUM_KV_HEADS * HEAD_DIM (int64,
    # no overflow on large caches), and a padding token (slot -1) stores nothing.
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, KV_HEADS)[:, None]
    mask = heads < tl.where(slot >= 0, NUM_KV_HEADS, 0)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + half
    tl.store(k_cache_ptr + dst, k1, mask=mask)
    tl.store(k_cache_ptr + dst + HALF, k2, mask=mask)
    dims = heads * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    v = tl.load(v_ptr + token * v_token_stride + dims, mask=mask)
    tl.store(v_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + dims, v, mask=mask)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, validate: bool = True) -> None:
    """Rotate ``q`` and ``k`` in place by their tokens' positions, then write ``k`` and ``v`` to the cache.

    ``q [T, num_heads, D]``, ``k``/``v [T, num_kv_heads, D]`` may be views into one fused QKV
    projection (any token stride; within a token, heads ``D`` apart and dims contiguous).
    ``positions [T]`` int64 index ``cos``/``sin [max_positions, D]`` (the model's float32
    tables). The rotation is :func:`kvlab.models.rope.apply_rope`'s, in float32, rounded to
    the dtype. Token ``t``'s rotated key and its value then go to slot ``slot_mapping[t]`` of
    the caches, as :func:`write_kv` writes them (-1: a padding token, written nowhere; its q and
    k are rotated all the same).

    With ``validate`` (the default) every argument is checked before the launch, positions
    and slots included (one read back to the host): a rejected call writes nothing.
    """
    if validate:
        check_rotary_write_kv_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
        q.stride(0), k.stride(0), v.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        Q_HEADS=triton.next_power_of_2(num_heads), KV_HEADS=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim)


def check_rotary_write_kv_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """Raise TypeError/ValueError naming the first argument of rotary_write_kv that breaks a rule."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache_pair(k_cache, v_cache)
    if k_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"k_cache must be float32, float16 or bfloat16, got {k_cache.dtype}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 2 (the kernel splits heads in halves), "
                         f"got the cache's {head_dim}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, the cache has {k_cache.dtype}")
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [num_tokens, num_heads, {head_dim}] (the cache's head_dim), "
                         f"got {list(q.shape)}")
    num_tokens = q.shape[0]
    for name, t in (("k", k), ("v", v)):
        if list(t.shape) != [num_tokens, num_kv_heads, head_dim]:
            raise ValueError(f"{name} must have shape [{num_tokens}, {num_kv_heads}, {head_dim}] to match q "
                             f"and the cache, got {list(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be contiguous within a token (strides [*, {head_dim}, 1]), "
                             f"got strides {list(t.stride())}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
        if t.shape != (num_tokens,) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{num_tokens}] tensor (one per token), "
                             f"got shape {list(t.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (the model's tables), got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != head_dim or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [max_positions, {head_dim}] table, "
                             f"got shape {list(t.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {list(cos.shape)} and sin {list(sin.shape)} must have the same shape")
    check_same_device(q=q, k=k, v=v, positions=positions, cos=cos, sin=sin, k_cache=k_cache,
                      v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    # Positions and slots come back to the host together: one synchronization for both checks.
    host = torch.cat((positions, slot_mapping)).cpu()
    host_positions, host_slots = host[:num_tokens], host[num_tokens:]
    max_positions, num_slots = cos.shape[0], num_blocks * block_size
    bad = (host_positions < 0) | (host_positions >= max_positions)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"positions[{i}] = {int(host_positions[i])} is out of range 0..{max_positions - 1} "
                         f"of the cos/sin tables")
    bad = (host_slots < -1) | (host_slots >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"slot_mapping[{i}] = {int(host_slots[i])} is out of range: slots are -1 "
                         f"(padding) or 0..{num_slots - 1}")
    real = host_slots[host_slots >= 0]
    if real.numel() != torch.unique(real).numel():
        raise ValueError("slot_mapping names a slot twice: two tokens would race for one slot")
