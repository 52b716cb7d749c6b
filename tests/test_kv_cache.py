"""Tests of the paged KV-cache tensors and of the batched slot mapping."""
from __future__ import annotations

import pytest
import torch

from kvlab.paging import PAD_SLOT, BlockPool, KVCache, allocate_kv_cache, batch_slot_mapping


# -- allocate_kv_cache ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_allocate_kv_cache_shapes_and_dtype(dtype):
    cache = allocate_kv_cache(num_layers=3, num_blocks=7, block_size=4, num_kv_heads=2, head_dim=16,
                              dtype=dtype)
    assert isinstance(cache, KVCache)
    assert len(cache.k) == len(cache.v) == 3
    for t in [*cache.k, *cache.v]:
        assert t.shape == (7, 4, 2, 16)
        assert t.dtype == dtype
        assert t.device.type == "cpu"
        assert t.is_contiguous()
    assert cache.num_layers == 3
    assert cache.num_blocks == 7
    assert cache.block_size == 4
    assert cache.num_kv_heads == 2
    assert cache.head_dim == 16
    element = torch.tensor([], dtype=dtype).element_size()
    assert cache.nbytes == 2 * 3 * 7 * 4 * 2 * 16 * element


def test_allocate_kv_cache_default_dtype_is_float16():
    cache = allocate_kv_cache(1, 2, 2, 1, 8)
    assert cache.k[0].dtype == cache.v[0].dtype == torch.float16
    assert cache.nbytes == 2 * 2 * 2 * 1 * 8 * 2


def test_allocate_kv_cache_tensors_do_not_alias():
    cache = allocate_kv_cache(num_layers=2, num_blocks=3, block_size=2, num_kv_heads=2, head_dim=4,
                              dtype=torch.float32)
    tensors = [*cache.k, *cache.v]
    assert len({t.data_ptr() for t in tensors}) == len(tensors)
    for i, t in enumerate(tensors):
        t.fill_(float(i))
    for i, t in enumerate(tensors):
        assert torch.all(t == float(i))


def test_slot_view_matches_block_and_offset():
    """Physical slot s is block s // block_size, offset s % block_size."""
    cache = allocate_kv_cache(1, 3, 4, 2, 8, dtype=torch.float32)
    k = cache.k[0]
    flat = k.view(-1, cache.num_kv_heads, cache.head_dim)
    gen = torch.Generator().manual_seed(0)
    for s in range(3 * 4):
        token = torch.randn(2, 8, generator=gen)
        flat[s] = token
        assert torch.equal(k[s // 4, s % 4], token)


def test_nbytes_sums_every_layer():
    one = allocate_kv_cache(1, 5, 8, 4, 32, dtype=torch.float32)
    four = allocate_kv_cache(4, 5, 8, 4, 32, dtype=torch.float32)
    assert four.nbytes == 4 * one.nbytes == 4 * 2 * 5 * 8 * 4 * 32 * 4


@pytest.mark.parametrize("name", ["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad, exc, match", [
    (0, ValueError, "must be >= 1"),
    (-2, ValueError, "must be >= 1"),
    (2.0, TypeError, "must be an int"),
    (True, TypeError, "must be an int"),
    ("2", TypeError, "must be an int"),
])
def test_allocate_kv_cache_validation(name, bad, exc, match):
    kwargs = dict(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8)
    kwargs[name] = bad
    with pytest.raises(exc, match=f"{name} {match}"):
        allocate_kv_cache(**kwargs)


@pytest.mark.parametrize("dtype, exc, match", [
    (torch.float8_e4m3fn, ValueError, "kv_cache_dtype='fp8'"),
    (torch.int64, ValueError, "not a model dtype"),
    ("float16", TypeError, "dtype must be a torch.dtype"),
])
def test_allocate_kv_cache_refuses_a_dtype_that_is_not_a_model_dtype(dtype, exc, match):
    with pytest.raises(exc, match=match):
        allocate_kv_cache(1, 2, 4, 2, 8, dtype=dtype)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (2, ValueError), (True, TypeError), ("0", TypeError)])
def test_a_layer_out_of_range_is_refused(bad, exc):
    with pytest.raises(exc, match="index"):
        allocate_kv_cache(2, 2, 4, 2, 8, dtype=torch.float32).layer(bad)


# -- batch_slot_mapping -----------------------------------------------------------------------
def _pool():
    pool = BlockPool(num_blocks=10, block_size=4)
    pool.allocate("a", 6)    # blocks 0, 1
    pool.allocate("b", 3)    # block 2
    pool.append("a", 3)      # a: 9 tokens, takes block 3
    pool.allocate("c", 1)    # block 4
    return pool


def test_pad_slot_is_minus_one():
    assert PAD_SLOT == -1


def test_batch_slot_mapping_order_and_values():
    pool = _pool()
    # a prefill of b, a decode step of a, c's only token, in this order
    requests = [("b", 0, 3), ("a", 8, 1), ("c", 0, 1)]
    slots = batch_slot_mapping(pool, requests)
    assert slots.dtype == torch.int64
    assert slots.device.type == "cpu"
    assert slots.tolist() == [8, 9, 10, 12, 16]
    expected = []
    for seq, start, n in requests:
        expected += pool.slot_mapping(seq, start, n)
    assert slots.tolist() == expected


def test_batch_slot_mapping_padding():
    pool = _pool()
    requests = [("a", 0, 9), ("c", 0, 1)]
    plain = batch_slot_mapping(pool, requests)
    padded = batch_slot_mapping(pool, requests, pad_to=16)
    assert padded.dtype == torch.int64
    assert padded.shape == (16,)
    assert padded[:10].tolist() == plain.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 16]
    assert padded[10:].tolist() == [PAD_SLOT] * 6
    exact = batch_slot_mapping(pool, requests, pad_to=10)
    assert exact.tolist() == plain.tolist()


def test_batch_slot_mapping_pad_to_too_short():
    pool = _pool()
    with pytest.raises(ValueError, match="pad_to=3 is shorter than the batch's 4 tokens"):
        batch_slot_mapping(pool, [("b", 0, 3), ("c", 0, 1)], pad_to=3)


@pytest.mark.parametrize("bad, exc", [(4.5, TypeError), (True, TypeError), (-1, ValueError)])
def test_batch_slot_mapping_pad_to_must_be_a_count(bad, exc):
    with pytest.raises(exc, match="pad_to"):
        batch_slot_mapping(_pool(), [("c", 0, 1)], pad_to=bad)


def test_batch_slot_mapping_empty_batch():
    pool = _pool()
    empty = batch_slot_mapping(pool, [])
    assert empty.dtype == torch.int64 and empty.shape == (0,)
    all_pad = batch_slot_mapping(pool, [], pad_to=4)
    assert all_pad.dtype == torch.int64
    assert all_pad.tolist() == [PAD_SLOT] * 4
    zero_tokens = batch_slot_mapping(pool, [("a", 9, 0)], pad_to=2)
    assert zero_tokens.tolist() == [PAD_SLOT] * 2


def test_batch_slot_mapping_propagates_pool_errors():
    pool = _pool()
    with pytest.raises(ValueError, match="beyond sequence 'b'"):
        batch_slot_mapping(pool, [("a", 0, 1), ("b", 2, 2)])
    with pytest.raises(KeyError, match="unknown sequence id 'zz'"):
        batch_slot_mapping(pool, [("zz", 0, 1)])


def test_batch_slot_mapping_addresses_distinct_slots_of_a_batch():
    pool = _pool()
    requests = [("a", 0, 9), ("b", 0, 3), ("c", 0, 1)]
    slots = batch_slot_mapping(pool, requests, pad_to=20)
    real = slots[slots != PAD_SLOT]
    assert real.numel() == 13
    assert real.unique().numel() == 13
    assert int(real.min()) >= 0 and int(real.max()) < pool.capacity
