"""Argument checks shared by the kernels' launchers: they run before any launch."""
from __future__ import annotations

import torch


def check_kv_cache_pair(k_cache, v_cache) -> tuple[int, int, int, int]:
    """Check a K/V cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {t.dim()} dims")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {list(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{list(v_cache.shape)} {v_cache.dtype} must match")
    return tuple(k_cache.shape)


def check_same_device(**tensors: torch.Tensor) -> None:
    """All tensors on one device, else a ValueError naming the odd one out."""
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}, {first_name} is on {first.device}")


def grid_length(lengths: torch.Tensor, hint: int | None, name: str, check: bool) -> int:
    """The longest of ``lengths``, which sizes a launch's grid.

    ``hint`` (the caller knows it) spares the read back to the host; with ``check`` it is still
    read and compared: a hint that is too short would leave work undone, silently.
    """
    if hint is not None and not check:
        return hint
    longest = int(lengths.max()) if lengths.numel() else 0
    if hint is not None and hint < longest:
        raise ValueError(f"{name} = {hint} is shorter than the longest length it stands for, {longest}: "
                         "the rows or tokens past it would never be computed")
    return longest if hint is None else hint
