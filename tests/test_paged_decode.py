"""paged_decode (FlashDecoding) against paged_attention_ref: ragged batches, scattered pages,
GQA groups, split counts, the merge formula, and bad input refused before launch."""
import math

import pytest
import torch

from kvlab import profile
from kvlab.kernels.paged_decode import choose_num_splits, paged_decode
from kvlab.reference import paged_attention_ref

DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"


def paged_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random caches with every sequence's pages scattered over the pool; q one token each."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(blocks) + 1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), seq_lens


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if BIG else []))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim,block_size", [(32, 16), (64, 5)] + ([(128, 16)] if BIG else []))
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_paged_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    lens = [1, block_size - 1, block_size, block_size + 1, 37] + ([4099, 70_000] if BIG else [70])
    q, k_cache, v_cache, tables, seq_lens = paged_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, dtype=torch.float64)
    out = torch.full_like(q, float("nan"))                # poisoned: every element must be written
    paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=num_splits, out=out)
    assert not bool(out.isnan().any())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(out, ref) < tolerance


def test_more_splits_than_a_short_sequence_has_tiles():
    """Splits past the end of a short sequence hold nothing and must weigh nothing."""
    q, k_cache, v_cache, tables, seq_lens = paged_batch([3, 40], 4, 2, 32, 16, torch.float32, seed=1)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, [3, 40], dtype=torch.float64)
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=8, block_n=16)
    assert relative_error(out, ref) < 1e-5


def test_merge_formula_by_hand():
    """SEED_CLAIMS 13: out = sum_g exp(m_g - m*) l_g out_g / sum_g exp(m_g - m*) l_g."""
    gen = torch.Generator().manual_seed(2)
    scores, values = torch.randn(12, generator=gen, dtype=torch.float64), torch.randn(12, 5, generator=gen,
                                                                                       dtype=torch.float64)
    exact = scores.softmax(0) @ values
    parts = [(s.max(), torch.exp(s - s.max()).sum(), torch.softmax(s, 0) @ v)
             for s, v in zip(scores.split(4), values.split(4))]
    m_star = max(m for m, _, _ in parts)
    weights = [torch.exp(m - m_star) * l for m, l, _ in parts]
    merged = sum(w * o for w, (_, _, o) in zip(weights, parts)) / sum(weights)
    torch.testing.assert_close(merged, exact)


def test_choose_num_splits():
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 33
    assert choose_num_splits(batch=32, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    assert choose_num_splits(batch=8, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 5
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 2
    assert choose_num_splits(batch=64, num_kv_heads=8, max_seq_len=1 << 17, num_sms=132) == 1


def _args():
    return paged_batch([5, 20], 4, 2, 32, 16, torch.float32, seed=3)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.__setitem__(0, a[0][:, :3]), ValueError, "not a multiple"),
    (lambda a: a.__setitem__(0, a[0].to(torch.float16)), TypeError, "q has dtype"),
    (lambda a: a.__setitem__(4, torch.tensor([5, 60], dtype=torch.int32, device=DEVICE)), ValueError,
     r"seq_lens\[1\] = 60 must be in 1..48"),
    (lambda a: a.__setitem__(4, torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)), ValueError, r"seq_lens\[0\] = 0"),
    (lambda a: a[3].__setitem__((1, 1), 999), ValueError, r"block_tables\[1, 1\] = 999 is out of range"),
    (lambda a: a.__setitem__(3, a[3].long()), TypeError, "block_tables must be an int32"),
    (lambda a: a.__setitem__(4, torch.tensor([5, 20], dtype=torch.int32, device="meta")), ValueError,
     "seq_lens is on meta"),
])
def test_bad_input_is_refused_before_launch(change, error, match):
    args = list(_args())
    change(args)
    out = torch.full_like(args[0], float("nan"))
    with pytest.raises(error, match=match):
        paged_decode(*args, out=out)
    assert bool(out.isnan().all())


def test_unused_table_entries_are_not_checked():
    """Padding entries past a sequence's blocks may hold anything."""
    q, k_cache, v_cache, tables, seq_lens = _args()
    tables[0, 1:] = -7
    ref = paged_attention_ref(q, k_cache, v_cache, tables.clamp(min=0), [5, 20], dtype=torch.float64)
    assert relative_error(paged_decode(q, k_cache, v_cache, tables, seq_lens), ref) < 1e-5
    assert math.isfinite(relative_error(paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=2), ref))


def test_strided_q_short_hints_and_bad_tiles():
    """A transposed q reads right; a too-short max_seq_len, a strided out, a bad block_n are refused."""
    q, k_cache, v_cache, tables, seq_lens = paged_batch([40, 70], 8, 2, 32, 16, torch.float32, seed=4)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, [40, 70], dtype=torch.float64)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)           # same values, other strides
    assert relative_error(paged_decode(strided, k_cache, v_cache, tables, seq_lens), ref) < 1e-5
    with pytest.raises(ValueError, match="max_seq_len = 10"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, max_seq_len=10)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, out=torch.empty_like(strided))
    with pytest.raises(ValueError, match="block_n"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, block_n=24)
