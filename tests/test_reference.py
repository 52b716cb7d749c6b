"""Tests of the PyTorch references that every kernel of the course is graded against.

``attention_ref`` is checked against ``torch.nn.functional.scaled_dot_product_attention`` in
float64; ``write_kv_ref`` / ``gather_kv`` / ``paged_attention_ref`` are checked on a ragged
batch whose blocks are scattered through a NaN-poisoned cache.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from kvlab.paging import PAD_SLOT, BlockPool, allocate_kv_cache, batch_slot_mapping
from kvlab.reference import attention_ref, gather_kv, paged_attention_ref, write_kv_ref

F64 = dict(atol=1e-12, rtol=1e-10)


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def sdpa(q, k, v, *, is_causal=False, mask=None, scale=None):
    """SDPA on ``[tokens, heads, head_dim]`` tensors, KV heads expanded to the query heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=is_causal, scale=scale,
    )
    return out[0].transpose(0, 1)


def suffix_causal_mask(num_q, num_kv):
    """Query i is the (num_kv - num_q + i)-th position: it sees keys 0 .. num_kv - num_q + i."""
    mask = torch.zeros(num_q, num_kv, dtype=torch.bool)
    for i in range(num_q):
        for j in range(num_kv):
            mask[i, j] = j <= num_kv - num_q + i
    return mask


# -- attention_ref against SDPA ---------------------------------------------------------------
NUM_KV_HEADS = 2


def _qkv(seed, num_q, num_kv, group, head_dim):
    """Random q ``[num_q, NUM_KV_HEADS * group, head_dim]`` and k, v ``[num_kv, NUM_KV_HEADS, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, num_q, NUM_KV_HEADS * group, head_dim)
    return q, randn(gen, num_kv, NUM_KV_HEADS, head_dim), randn(gen, num_kv, NUM_KV_HEADS, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("seq_len", [1, 5, 19])
def test_attention_ref_causal_prefill_matches_sdpa(seq_len, group, head_dim):
    q, k, v = _qkv(1000 * seq_len + 10 * group + head_dim, seq_len, seq_len, group, head_dim)
    out = attention_ref(q, k, v, causal=True, dtype=torch.float64)
    assert out.dtype == torch.float64
    assert out.shape == q.shape
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True), **F64)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_q, num_kv", [(1, 1), (6, 6), (3, 11), (9, 4)])
def test_attention_ref_non_causal_matches_sdpa(num_q, num_kv, group, head_dim):
    q, k, v = _qkv(7 + 1000 * num_q + 100 * num_kv + 10 * group + head_dim, num_q, num_kv, group, head_dim)
    out = attention_ref(q, k, v, causal=False, dtype=torch.float64)
    assert out.shape == q.shape
    torch.testing.assert_close(out, sdpa(q, k, v), **F64)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_q, num_kv", [(1, 1), (1, 9), (1, 20), (3, 9), (7, 20), (16, 17)])
def test_attention_ref_decode_and_extend_match_hand_built_mask(num_q, num_kv, group, head_dim):
    q, k, v = _qkv(13 + 1000 * num_q + 100 * num_kv + 10 * group + head_dim, num_q, num_kv, group, head_dim)
    out = attention_ref(q, k, v, causal=True, dtype=torch.float64)
    assert out.shape == q.shape
    torch.testing.assert_close(out, sdpa(q, k, v, mask=suffix_causal_mask(num_q, num_kv)), **F64)


@pytest.mark.parametrize("num_q, num_kv", [(1, 12), (4, 12), (12, 12)])
def test_attention_ref_each_query_attends_to_its_prefix(num_q, num_kv):
    """Row i of a causal extend equals non-causal attention over keys 0 .. num_kv - num_q + i."""
    gen = torch.Generator().manual_seed(99 + num_q)
    q = randn(gen, num_q, 8, 64)
    k = randn(gen, num_kv, 2, 64)
    v = randn(gen, num_kv, 2, 64)
    out = attention_ref(q, k, v, causal=True, dtype=torch.float64)
    for i in range(num_q):
        end = num_kv - num_q + i + 1
        row = attention_ref(q[i:i + 1], k[:end], v[:end], causal=False, dtype=torch.float64)
        torch.testing.assert_close(out[i:i + 1], row, **F64)


def test_attention_ref_decode_sees_every_key():
    gen = torch.Generator().manual_seed(5)
    q = randn(gen, 1, 4, 64)
    k = randn(gen, 10, 1, 64)
    v = randn(gen, 10, 1, 64)
    torch.testing.assert_close(attention_ref(q, k, v, causal=True, dtype=torch.float64),
                               attention_ref(q, k, v, causal=False, dtype=torch.float64), **F64)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_ref_sm_scale(causal):
    gen = torch.Generator().manual_seed(21)
    q = randn(gen, 5, 8, 64)
    k = randn(gen, 5, 2, 64)
    v = randn(gen, 5, 2, 64)
    out = attention_ref(q, k, v, causal=causal, sm_scale=0.3, dtype=torch.float64)
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=causal, scale=0.3), **F64)
    default = attention_ref(q, k, v, causal=causal, dtype=torch.float64)
    explicit = attention_ref(q, k, v, causal=causal, sm_scale=1 / math.sqrt(64), dtype=torch.float64)
    torch.testing.assert_close(default, explicit, **F64)
    assert not torch.allclose(out, default)


def test_attention_ref_gqa_head_mapping():
    """Query head h reads KV head h // (num_heads // num_kv_heads)."""
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, group = 3, 4
    q = randn(gen, 4, num_kv_heads * group, 64)
    k = randn(gen, 6, num_kv_heads, 64)
    v = randn(gen, 6, num_kv_heads, 64)
    out = attention_ref(q, k, v, causal=True, dtype=torch.float64)
    for h in range(num_kv_heads * group):
        kv = h // group
        one = attention_ref(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], causal=True, dtype=torch.float64)
        torch.testing.assert_close(out[:, h:h + 1], one, **F64)


def test_attention_ref_low_precision_inputs_computed_in_requested_dtype():
    gen = torch.Generator().manual_seed(8)
    q = randn(gen, 7, 4, 64, dtype=torch.float16)
    k = randn(gen, 7, 2, 64, dtype=torch.float16)
    v = randn(gen, 7, 2, 64, dtype=torch.float16)
    out32 = attention_ref(q, k, v)
    assert out32.dtype == torch.float32
    out64 = attention_ref(q, k, v, dtype=torch.float64)
    assert out64.dtype == torch.float64
    expected = sdpa(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out64, expected, **F64)
    torch.testing.assert_close(out32, expected.float(), atol=1e-5, rtol=1e-5)


# -- a ragged batch in a scattered, poisoned paged cache --------------------------------------
BLOCK_SIZE = 8
RAGGED_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 21]   # 21: not a power of two


def shuffled_pool(num_blocks, block_size, seed):
    """A pool whose free queue is a random permutation (made through the public API)."""
    pool = BlockPool(num_blocks=num_blocks, block_size=block_size)
    for b in range(num_blocks):
        pool.allocate(("warmup", b), 1)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    for b in order:
        pool.free(("warmup", b))
    assert list(pool.free_blocks) == order
    return pool


def build_ragged_cache(gen, lens, *, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """Write random K/V of sequences of ``lens`` tokens into a NaN-filled paged cache.

    Each sequence gets a prompt of half its tokens, then the sequences grow one token at a
    time in round robin (like decode steps), so their block tables interleave. Every write
    goes through ``batch_slot_mapping`` padded with PAD_SLOT tokens that carry junk values.
    Returns the pool, the cache tensors and each sequence's contiguous K and V.
    """
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 3
    pool = shuffled_pool(num_blocks, BLOCK_SIZE, seed)
    cache = allocate_kv_cache(1, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
    k_cache, v_cache = cache.k[0], cache.v[0]
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    keys = [randn(gen, n, num_kv_heads, head_dim, dtype=dtype) for n in lens]
    values = [randn(gen, n, num_kv_heads, head_dim, dtype=dtype) for n in lens]

    def write(requests):
        slots = batch_slot_mapping(pool, requests, pad_to=sum(n for _, _, n in requests) + 3)
        pad = (slots == PAD_SLOT).sum().item()
        key = torch.cat([keys[i][s:s + n] for i, s, n in requests] + [randn(gen, pad, num_kv_heads, head_dim,
                                                                            dtype=dtype)])
        value = torch.cat([values[i][s:s + n] for i, s, n in requests] + [randn(gen, pad, num_kv_heads, head_dim,
                                                                                dtype=dtype)])
        write_kv_ref(key, value, k_cache, v_cache, slots)

    written = [n // 2 for n in lens]
    for i, n in enumerate(written):
        pool.allocate(i, n)
    write([(i, 0, n) for i, n in enumerate(written)])
    while any(w < n for w, n in zip(written, lens)):
        step = [i for i, n in enumerate(lens) if written[i] < n]
        for i in step:
            pool.append(i, 1)
        write([(i, written[i], 1) for i in step])
        for i in step:
            written[i] += 1
    return pool, k_cache, v_cache, keys, values


def test_ragged_cache_tables_are_scattered():
    gen = torch.Generator().manual_seed(0)
    pool, *_ = build_ragged_cache(gen, RAGGED_LENS)
    tables = _tables(pool)
    assert [len(t) for t in tables] == [-(-n // BLOCK_SIZE) for n in RAGGED_LENS]
    # not the trivial layout (consecutive block ids from 0, sequence after sequence)
    assert any(t[j + 1] != t[j] + 1 for t in tables for j in range(len(t) - 1))
    assert sum(tables, []) != list(range(sum(len(t) for t in tables)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_gather_kv_round_trip(dtype):
    gen = torch.Generator().manual_seed(11)
    pool, k_cache, v_cache, keys, values = build_ragged_cache(gen, RAGGED_LENS, dtype=dtype, seed=11)
    for i, n in enumerate(RAGGED_LENS):
        table = pool.block_table(i)
        k = gather_kv(k_cache, table, n)
        v = gather_kv(v_cache, table, n)
        assert k.shape == v.shape == (n, k_cache.shape[2], k_cache.shape[3])
        assert k.dtype == dtype
        assert not torch.isnan(k).any() and not torch.isnan(v).any()
        assert torch.equal(k, keys[i])
        assert torch.equal(v, values[i])
        # a table given as a tensor reads the same
        assert torch.equal(gather_kv(k_cache, torch.tensor(table), n), keys[i])
    # exactly the tokens' slots were written: padding tokens wrote nothing
    total = sum(RAGGED_LENS)
    per_slot = k_cache.reshape(-1, k_cache.shape[2] * k_cache.shape[3])
    assert (~torch.isnan(per_slot).all(dim=1)).sum().item() == total
    assert (~torch.isnan(v_cache.reshape(per_slot.shape)).all(dim=1)).sum().item() == total


def test_gather_kv_prefix_and_padded_table():
    gen = torch.Generator().manual_seed(12)
    pool, k_cache, _, keys, _ = build_ragged_cache(gen, RAGGED_LENS, seed=12)
    i = RAGGED_LENS.index(21)
    table = pool.block_table(i)
    for n in (0, 1, BLOCK_SIZE, BLOCK_SIZE + 3, 21):
        assert torch.equal(gather_kv(k_cache, table, n), keys[i][:n])
    # a padded row of a [batch, max_blocks] tensor: the padding entries are never read
    padded = torch.tensor(table + [-1, -1])
    assert torch.equal(gather_kv(k_cache, padded, 21), keys[i])


PAGED_KV_HEADS, PAGED_HEAD_DIM = 2, 64   # the paged_attention_ref tests' cache


def _cache_for_attention(seed, group=0):
    """A generator (seeded ``seed + group``) and the ragged cache, ``PAGED_KV_HEADS`` heads of ``PAGED_HEAD_DIM``."""
    gen = torch.Generator().manual_seed(seed + group)
    cache = build_ragged_cache(gen, RAGGED_LENS, num_kv_heads=PAGED_KV_HEADS, head_dim=PAGED_HEAD_DIM, seed=seed)
    return gen, *cache


def _tables(pool, tables_as="lists"):
    """The ragged cache's block tables, as lists or as a zero-padded ``[batch, max_blocks]`` tensor."""
    tables = [pool.block_table(i) for i in range(len(RAGGED_LENS))]
    if tables_as == "lists":
        return tables
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _contiguous_expected(q, keys, values, query_lens, causal=True, sm_scale=None):
    out, start = [], 0
    for k, v, n in zip(keys, values, query_lens):
        out.append(attention_ref(q[start:start + n], k, v, causal=causal, sm_scale=sm_scale, dtype=torch.float64))
        start += n
    return torch.cat(out)


def _sdpa_expected(q, keys, values, query_lens):
    out, start = [], 0
    for k, v, n in zip(keys, values, query_lens):
        mask = suffix_causal_mask(n, k.shape[0])
        out.append(sdpa(q[start:start + n].double(), k.double(), v.double(), mask=mask))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("tables_as", ["lists", "tensor"])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_ref_decode_matches_contiguous(group, tables_as):
    gen, pool, k_cache, v_cache, keys, values = _cache_for_attention(31, group)
    tables, batch = _tables(pool, tables_as), len(RAGGED_LENS)
    seq_lens = [pool.seq_len(i) for i in range(batch)]
    assert seq_lens == RAGGED_LENS
    q = randn(gen, batch, PAGED_KV_HEADS * group, PAGED_HEAD_DIM, dtype=torch.float32)
    out = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, dtype=torch.float64)
    assert out.dtype == torch.float64 and out.shape == q.shape
    assert not torch.isnan(out).any()
    expected = _contiguous_expected(q, keys, values, [1] * batch)
    torch.testing.assert_close(out, expected, **F64)
    torch.testing.assert_close(out, _sdpa_expected(q, keys, values, [1] * batch), **F64)
    explicit = paged_attention_ref(q, k_cache, v_cache, tables, torch.tensor(seq_lens), query_lens=None,
                                   dtype=torch.float64)
    torch.testing.assert_close(explicit, out, atol=0, rtol=0)


@pytest.mark.parametrize("tables_as", ["lists", "tensor"])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_ref_extend_matches_contiguous(group, tables_as):
    gen, pool, k_cache, v_cache, keys, values = _cache_for_attention(41, group)
    tables = _tables(pool, tables_as)
    query_lens = [1, 3, BLOCK_SIZE, 2, 13]   # a full prefill, extends, a decode
    q = randn(gen, sum(query_lens), PAGED_KV_HEADS * group, PAGED_HEAD_DIM, dtype=torch.float32)
    out = paged_attention_ref(q, k_cache, v_cache, tables, RAGGED_LENS, query_lens=query_lens,
                              dtype=torch.float64)
    assert out.dtype == torch.float64 and out.shape == q.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, _contiguous_expected(q, keys, values, query_lens), **F64)
    torch.testing.assert_close(out, _sdpa_expected(q, keys, values, query_lens), **F64)


def test_paged_attention_ref_passes_causal_and_sm_scale():
    gen, pool, k_cache, v_cache, keys, values = _cache_for_attention(51)
    query_lens = [1, 2, 3, 4, 5]
    q = randn(gen, sum(query_lens), 8, PAGED_HEAD_DIM, dtype=torch.float32)
    out = paged_attention_ref(q, k_cache, v_cache, _tables(pool), RAGGED_LENS, query_lens=query_lens, causal=False,
                              sm_scale=0.25, dtype=torch.float64)
    expected = _contiguous_expected(q, keys, values, query_lens, causal=False, sm_scale=0.25)
    torch.testing.assert_close(out, expected, **F64)


def test_paged_attention_ref_default_dtype_is_float32():
    gen = torch.Generator().manual_seed(52)
    pool, k_cache, v_cache, keys, values = build_ragged_cache(gen, RAGGED_LENS, seed=52)
    tables = _tables(pool)
    q = randn(gen, len(RAGGED_LENS), 4, 16, dtype=torch.float32)
    out = paged_attention_ref(q, k_cache, v_cache, tables, RAGGED_LENS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _contiguous_expected(q, keys, values, [1] * len(RAGGED_LENS)).float(),
                               atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_empty_batch():
    cache = allocate_kv_cache(1, 2, 4, 2, 8, dtype=torch.float32)
    q = torch.empty(0, 4, 8)
    out = paged_attention_ref(q, cache.k[0], cache.v[0], [], [], dtype=torch.float64)
    assert out.shape == (0, 4, 8) and out.dtype == torch.float64


@pytest.mark.parametrize("num_q, query_lens", [
    (5, [1, 1, 1, 1, 2]),      # sums to 6
    (5, [1, 1, 1, 1, 0]),      # sums to 4
    (7, None),                 # decode means one query per sequence: 5
    (5, [1, 1, 1, 2]),         # one length short
])
def test_paged_attention_ref_rejects_query_lens_not_matching_q(num_q, query_lens):
    gen = torch.Generator().manual_seed(61)
    pool, k_cache, v_cache, *_ = build_ragged_cache(gen, RAGGED_LENS, seed=61)
    tables = _tables(pool)
    q = randn(gen, num_q, 4, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"q has {num_q} tokens, query_lens"):
        paged_attention_ref(q, k_cache, v_cache, tables, RAGGED_LENS, query_lens=query_lens)


def test_paged_attention_ref_rejects_more_queries_than_cached_tokens():
    gen = torch.Generator().manual_seed(62)
    pool, k_cache, v_cache, *_ = build_ragged_cache(gen, RAGGED_LENS, seed=62)
    tables = _tables(pool)
    query_lens = [2, 1, 1, 1, 1]   # the first sequence holds one token
    q = randn(gen, sum(query_lens), 4, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="2 queries but only 1 cached tokens"):
        paged_attention_ref(q, k_cache, v_cache, tables, RAGGED_LENS, query_lens=query_lens)
