"""The seed article's ``PagedAttentionCache``, kept to compare with the course's write path.

The class below follows the article's code line for line (comments translated), with a
``dtype`` and a ``device`` argument added so it also runs without a GPU. Its idea is right:
fixed-size blocks, a free list, one block table per request, a token at position ``pos``
stored in block ``table[pos // block_size]`` at offset ``pos % block_size``. What it does
differently from a serving engine:

* it writes **one token per Python call**, each call two small copies (K, then V). An engine
  computes a whole batch of new tokens at once and scatters them with one kernel launch per
  layer, addressed by a slot mapping (:func:`kvlab.kernels.write_kv`);
* one tensor ``[num_blocks, block_size, 2, num_layers, num_heads, head_dim]`` holds every
  layer, so a token's K and V of all layers are written together. A model produces layer
  ``l``'s K/V inside layer ``l``'s forward pass, which is why engines keep one
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache per layer, for K and for V;
* ``free_blocks.pop(0)`` shifts the whole Python list: O(num_blocks) per allocation
  (:class:`kvlab.paging.BlockPool` uses a deque);
* nothing is checked: an empty free list raises IndexError from ``pop``, and the caller must
  pass the right ``token_pos``, since the class does not track sequence lengths.
"""
from __future__ import annotations

import torch


class SeedPagedAttentionCache:
    """The article's paged KV cache: allocate a request, append tokens one by one, release."""

    def __init__(self, num_blocks, block_size, num_layers, num_heads, head_dim,
                 dtype=torch.float16, device="cpu"):
        self.block_size = block_size
        self.num_blocks = num_blocks
        # The physical block pool: K/V storage for every block, allocated up front.
        self.kv_cache = torch.zeros(
            num_blocks, block_size, 2, num_layers, num_heads, head_dim,
            dtype=dtype, device=device,
        )
        self.free_blocks = list(range(num_blocks))  # free block ids
        self.block_tables = {}  # request id -> its block table

    def allocate_request(self, request_id):
        """Give a new request its first block."""
        block_id = self.free_blocks.pop(0)
        self.block_tables[request_id] = [block_id]

    def append_token(self, request_id, token_pos, k_val, v_val):
        """Write one token's K/V (``[num_layers, num_heads, head_dim]`` each), taking a new block if needed."""
        logical_block_idx = token_pos // self.block_size
        offset_in_block = token_pos % self.block_size

        # The logical block does not exist yet: take a new physical block.
        if logical_block_idx >= len(self.block_tables[request_id]):
            new_block = self.free_blocks.pop(0)
            self.block_tables[request_id].append(new_block)

        physical_block = self.block_tables[request_id][logical_block_idx]
        self.kv_cache[physical_block, offset_in_block, 0] = k_val  # K
        self.kv_cache[physical_block, offset_in_block, 1] = v_val  # V

    def release_request(self, request_id):
        """Return all of a request's blocks to the free list."""
        for block_id in self.block_tables[request_id]:
            self.free_blocks.append(block_id)
        del self.block_tables[request_id]

    # -- added for the course: views in kvlab's per-layer layout, to compare contents ------
    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K as a ``[num_blocks, block_size, num_heads, head_dim]`` view."""
        return self.kv_cache[:, :, 0, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V as a ``[num_blocks, block_size, num_heads, head_dim]`` view."""
        return self.kv_cache[:, :, 1, layer]


def append_tokens_one_by_one(cache: SeedPagedAttentionCache, request_id, keys: torch.Tensor,
                             values: torch.Tensor, start: int = 0) -> None:
    """The article's write path for many tokens: one ``append_token`` call per token.

    ``keys``/``values`` are ``[num_tokens, num_layers, num_heads, head_dim]``; token ``i`` goes
    to position ``start + i``.
    """
    for i in range(keys.shape[0]):
        cache.append_token(request_id, start + i, keys[i], values[i])
