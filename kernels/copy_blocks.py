"""copy_blocks: copy whole cache blocks, for every layer, in one launch per cache tensor.

Copy-on-write records ``(src, dst)`` pairs while the scheduler plans a step; before the
model runs, every pair is copied so that ``dst`` holds what ``src`` holds, in K and in V of
every layer. A block of one layer is one contiguous run of ``block_size * num_kv_heads *
head_dim`` elements, so a copy is a straight streaming read and write.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.checks import check_same_device


@triton.jit
def copy_blocks_kernel(
    cache_ptr,            # [num_layers, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    pairs_ptr,            # [num_pairs, 2] int64: (src, dst) block ids
    layer_stride,         # elements per layer: num_blocks * BLOCK_NUMEL
    BLOCK_NUMEL: tl.constexpr,  # elements of one block of one layer
    CHUNK: tl.constexpr,        # elements one program copies
):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < BLOCK_NUMEL
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    layer_ptr = cache_ptr + layer * layer_stride
    block = tl.load(layer_ptr + src * BLOCK_NUMEL + offsets, mask=mask)
    tl.store(layer_ptr + dst * BLOCK_NUMEL + offsets, block, mask=mask)


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor, *, validate: bool = True) -> None:
    """For every ``(src, dst)`` row of ``block_mapping``, ``cache[:, dst] = cache[:, src]``.

    ``caches`` are the cache tensors to copy in (typically ``[kv_cache.k, kv_cache.v]``), each
    ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` or a single layer
    ``[num_blocks, ...]``. One launch per tensor covers all layers and all pairs.
    """
    if validate:
        check_copy_blocks_args(caches, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    for cache in caches:
        layers = cache if cache.dim() == 5 else cache.unsqueeze(0)
        block_numel = layers[0, 0].numel()
        chunk = min(triton.next_power_of_2(block_numel), 4096)
        grid = (block_mapping.shape[0], layers.shape[0], triton.cdiv(block_numel, chunk))
        copy_blocks_kernel[grid](layers, block_mapping, layers[0].numel(), BLOCK_NUMEL=block_numel, CHUNK=chunk)


def check_copy_blocks_args(caches, block_mapping) -> None:
    """Raise TypeError/ValueError naming the first argument of copy_blocks that breaks a rule."""
    if not isinstance(caches, (list, tuple)) or not caches:
        raise TypeError("caches must be a non-empty list of cache tensors")
    for i, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"caches[{i}] must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dim() not in (4, 5) or not cache.is_contiguous():
            raise ValueError(f"caches[{i}] must be a contiguous [num_layers,] num_blocks, block_size, "
                             f"num_kv_heads, head_dim tensor, got shape {list(cache.shape)}")
        if cache.shape[-4] != caches[0].shape[-4]:
            raise ValueError(f"caches[{i}] has {cache.shape[-4]} blocks, caches[0] has {caches[0].shape[-4]}")
    if not isinstance(block_mapping, torch.Tensor):
        raise TypeError(f"block_mapping must be a torch.Tensor, got {type(block_mapping).__name__}")
    if block_mapping.dtype != torch.int64:
        raise TypeError(f"block_mapping must be int64, got {block_mapping.dtype}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2 or not block_mapping.is_contiguous():
        raise ValueError(f"block_mapping must be a contiguous [num_pairs, 2] tensor of (src, dst), "
                         f"got shape {list(block_mapping.shape)}")
    check_same_device(block_mapping=block_mapping, **{f"caches[{i}]": c for i, c in enumerate(caches)})
    if block_mapping.numel() == 0:
        return
    num_blocks = caches[0].shape[-4]
    bad = (block_mapping < 0) | (block_mapping >= num_blocks)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_mapping[{row}, {col}] = {int(block_mapping[row, col])} is out of range "
                         f"0..{num_blocks - 1}")
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("block_mapping copies into one dst block twice")
    if bool(torch.isin(dst, src).any()):
        raise ValueError("block_mapping uses a block as both a src and a dst: the copies would race")
