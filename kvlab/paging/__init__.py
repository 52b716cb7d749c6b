"""Paged KV-cache bookkeeping: blocks, block tables, slot mappings. No kernels here."""
from kvlab.paging.block_pool import BlockPool, blocks_needed, slot_mapping
from kvlab.paging.kv_cache import PAD_SLOT, KVCache, allocate_kv_cache, batch_slot_mapping

__all__ = ["BlockPool", "blocks_needed", "slot_mapping", "PAD_SLOT", "KVCache", "allocate_kv_cache",
           "batch_slot_mapping"]
