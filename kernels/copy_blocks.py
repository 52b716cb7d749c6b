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

from kvlab.kernels.checks import check_copy_blocks_args  # (checks.py: shared helpers, write_kv's and copy_blocks')


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

