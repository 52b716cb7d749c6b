"""The paged KV cache tensors, and the batched slot mapping that addresses them.

Layout, per layer, one tensor for K and one for V::

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

All layers' K live in one tensor ``[num_layers, num_blocks, ...]`` (and V in another), so an
operation on blocks of every layer, such as copying blocks for copy-on-write, is one launch
per tensor; ``cache.k[layer]`` is the (contiguous) layer view the attention kernels read.

Physical slot ``s`` is ``k_cache[layer].view(-1, num_kv_heads, head_dim)[s]``: block
``s // block_size``, offset ``s % block_size``. A token's K (all its KV heads) is one
contiguous run of ``num_kv_heads * head_dim`` elements, so writing a token is one
contiguous store, and a block of tokens is one contiguous ``block_size * num_kv_heads *
head_dim`` run that attention kernels read with wide loads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.paging.block_pool import check_count
from kvlab.quantization import MODEL_DTYPES, QUANTIZED_DTYPES, kv_cache_format

PAD_SLOT = -1  # a slot-mapping entry that writes nothing (padding tokens)


@dataclass
class KVCache:
    """K and V of every layer: ``k[layer]`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    A quantised cache (``kv_cache_dtype`` "fp8" or "int8", chapter 9) holds ``k``/``v`` in that
    format and one float32 scale per (slot, KV head) beside them: ``k_scale[layer]`` is
    ``[num_blocks, block_size, num_kv_heads]``, so one (block, offset) finds a token's values and
    its scales. In memory they are ``[num_blocks, num_kv_heads, block_size]``: a page's scales of
    one head lie together (64 bytes for 16 slots), which is how an attention kernel reads them,
    one head at a time; ``k_scale[layer]`` is that tensor with its last two dimensions swapped.
    """

    k: torch.Tensor  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None   # [num_layers, num_blocks, block_size, num_kv_heads] float32
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def kv_cache_dtype(self) -> str:
        """"auto" (the model's dtype), "fp8" or "int8"."""
        if not self.quantized:
            return "auto"
        return QUANTIZED_DTYPES[self.k.dtype].name

    def layer(self, index: int) -> tuple:
        """``(k, v, k_scale, v_scale)`` of one layer (scales ``None`` unless quantised)."""
        if check_count("index", index) >= self.k.shape[0]:
            raise ValueError(f"index {index} is out of range: the cache has {self.k.shape[0]} layers")
        if not self.quantized:
            return self.k[index], self.v[index], None, None
        return self.k[index], self.v[index], self.k_scale[index], self.v_scale[index]

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor a block lives in, as ``[num_layers, num_blocks, ...]`` views that copy
        bytes exactly (float8 as uint8): what copy-on-write copies."""
        if not self.quantized:
            return [self.k, self.v]
        return [self.k.view(torch.uint8), self.v.view(torch.uint8), _as_stored(self.k_scale).unsqueeze(-1),
                _as_stored(self.v_scale).unsqueeze(-1)]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]

    @property
    def nbytes(self) -> int:
        scales = 2 * self.k_scale.numel() * self.k_scale.element_size() if self.quantized else 0
        return 2 * self.k.numel() * self.k.element_size() + scales


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    kv_cache_dtype: str = "auto",
) -> KVCache:
    """Allocate (uninitialised) K and V caches for every layer.

    ``kv_cache_dtype`` "auto" stores ``dtype``; "fp8" (e4m3) or "int8" store that format with
    float32 scales beside (see :mod:`kvlab.quantization`).
    """
    for name, value in [("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]:
        check_count(name, value, minimum=1)
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    fmt = kv_cache_format(kv_cache_dtype)       # checks the name
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if fmt is None and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype} is not a model dtype (float16, bfloat16, float32 or float64); a cache of "
                         "8-bit codes is kv_cache_dtype='fp8' or 'int8'")
    if fmt is None:
        return KVCache(k=torch.empty(shape, dtype=dtype, device=device),
                       v=torch.empty(shape, dtype=dtype, device=device))
    return KVCache(k=torch.empty(shape, dtype=fmt.dtype, device=device),
                   v=torch.empty(shape, dtype=fmt.dtype, device=device),
                   k_scale=per_page_and_head(torch.ones(shape[:-1], dtype=torch.float32, device=device)),
                   v_scale=per_page_and_head(torch.ones(shape[:-1], dtype=torch.float32, device=device)))


def per_page_and_head(scales: torch.Tensor) -> torch.Tensor:
    """A copy of ``scales [..., num_blocks, block_size, num_kv_heads]`` laid out as the engine keeps
    them: ``[..., num_blocks, num_kv_heads, block_size]`` in memory, seen with the last two
    dimensions swapped (a page's scales of one head together)."""
    return scales.transpose(-1, -2).contiguous().transpose(-1, -2)


def block_and_offset(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where slots live in a ``[num_blocks, block_size, ...]`` tensor, in any layout:
    ``scales[block_and_offset(slots, block_size)] = ...``."""
    return slots // block_size, slots % block_size


def _as_stored(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` in their memory order (a view): ``[..., num_kv_heads, block_size]`` for the
    engine's layout, as they are for a contiguous tensor."""
    return scales if scales.is_contiguous() else scales.transpose(-1, -2)


def batch_slot_mapping(pool, requests, pad_to: int | None = None, device="cpu") -> torch.Tensor:
    """One int64 tensor of slots for a batch's new tokens, in batch order.

    ``requests`` is a list of ``(seq_id, start, num_tokens)``: the tokens at positions
    ``start .. start + num_tokens - 1`` of each sequence. With ``pad_to``, the tensor is
    padded with :data:`PAD_SLOT` to that length (fixed shapes, e.g. for CUDA graphs).
    """
    slots: list[int] = []
    seen = set()
    for seq_id, start, num_tokens in requests:
        if seq_id in seen:     # its two rows would write (and attend) as two sequences
            raise ValueError(f"sequence {seq_id!r} appears twice in one batch: give each sequence one "
                             f"(start, num_tokens) range")
        seen.add(seq_id)
        slots += pool.slot_mapping(seq_id, start, num_tokens)
    if pad_to is not None:
        if check_count("pad_to", pad_to) < len(slots):
            raise ValueError(f"pad_to={pad_to} is shorter than the batch's {len(slots)} tokens")
        slots += [PAD_SLOT] * (pad_to - len(slots))
    return torch.tensor(slots, dtype=torch.int64, device=device)
