"""paged_decode (FlashDecoding) against paged_attention_ref: ragged batches, scattered pages,
GQA groups, split counts, the merge formula, and bad input refused before launch."""
import importlib
import math
import random

import pytest
import torch

from kvlab import profile
from kvlab.kernels import checks
from kvlab.kernels.paged_decode import (MAX_SPLITS, MIN_TOKENS_PER_SPLIT, PROGRAMS_PER_SM, choose_num_splits,
                                        decode_split_kernel, paged_decode)
from kvlab.reference import paged_attention_ref
from helpers import scattered_tables

paged_decode_module = importlib.import_module("kvlab.kernels.paged_decode")   # (the package exports the function)
DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"


def paged_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random caches with every sequence's pages scattered over the pool; q one token each."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    _, tables = scattered_tables(lens, block_size, 3, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), seq_lens


def cdiv(a, b):
    return -(-a // b)


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


@pytest.mark.parametrize("batch,max_seq_len,want", [
    (32, 32768, 1),     # 256 programs fill the 264 slots (2 per SM) already: splits only add waves and a merge
    (32, 1024, 1),
    (16, 32768, 2),     # 128 programs -> 256: one wave
    (16, 8192, 2),
    (8, 8192, 4),
    (4, 32768, 8),
    (2, 8192, 16),
    (1, 32768, 32),     # 8 programs -> 256 programs of 1024 tokens
    (1, 131072, 32),
    (1, 1024, 4),       # 4 splits of 256 tokens: the shortest allowed
    (1, 300, 1),        # two splits would be shorter than MIN_TOKENS_PER_SPLIT
])
def test_choose_num_splits_on_an_h200(batch, max_seq_len, want):
    """The counts that won benchmarks/bench_paged_decode.py --sweep on an H200 (132 SMs)."""
    assert choose_num_splits(batch, 8, max_seq_len, 132) == want


def test_choose_num_splits_fills_the_sms_of_one_long_sequence():
    for heads in (2, 4, 8):
        splits = choose_num_splits(1, heads, 131072, 132)
        assert 0.9 * 2 * 132 <= heads * splits <= 2 * 132, (heads, splits)    # one wave, two programs per SM
    assert choose_num_splits(1, 1, 131072, 132) == MAX_SPLITS


def test_choose_num_splits_rules():
    """Whatever the shape: whole waves are never split, no split is empty or shorter than the minimum."""
    rng = random.Random(0)
    for _ in range(500):
        batch, heads, sms = rng.randint(1, 64), rng.choice([1, 2, 4, 8]), rng.choice([4, 108, 132])
        longest, block_n = rng.randint(1, 200_000), rng.choice([16, 64, 128])
        splits = choose_num_splits(batch, heads, longest, sms, block_n=block_n)
        assert 1 <= splits <= MAX_SPLITS
        per_split = cdiv(cdiv(longest, splits), block_n) * block_n
        assert (splits - 1) * per_split < longest, "a split past the end of the longest sequence"
        if splits > 1:
            assert per_split >= MIN_TOKENS_PER_SPLIT
        if batch * heads % (PROGRAMS_PER_SM * sms) == 0:
            assert splits == 1, "a batch that fills whole waves gains nothing from splits"


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
    (lambda a: a.extend([None, float("nan")]), ValueError, "sm_scale must be finite and positive"),
    (lambda a: a.extend([None, float("inf")]), ValueError, "sm_scale must be finite and positive"),
    (lambda a: a.extend([None, 0.0]), ValueError, "sm_scale must be finite and positive"),
    (lambda a: a.extend([None, -0.125]), ValueError, "sm_scale must be finite and positive"),
    (lambda a: a.extend([None, True]), TypeError, "sm_scale must be a float"),
    (lambda a: a.extend([None, "0.125"]), TypeError, "sm_scale must be a float"),
    (lambda a: a.__setitem__(slice(0, 3), [t.double() for t in a[:3]]), TypeError,
     "q has dtype torch.float64; supported: float16, bfloat16, float32"),
    (lambda a: a.__setitem__(0, a[0].double()), TypeError, "q has dtype torch.float64; supported"),
    (lambda a: a.extend([2.5]), ValueError, "num_splits must be None or an int >= 1"),
    (lambda a: a[3].__setitem__((0, 0), -1), ValueError, r"block_tables\[0, 0\] = -1 is out of range 0..5"),
] + ([] if BIG else [
    (lambda a: a.__setitem__(slice(0, 3), [t.bfloat16() for t in a[:3]]), TypeError,
     "q is bfloat16, which Triton's CPU interpreter cannot compute with"),
]))
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


def test_non_float_q_is_refused():
    q, k_cache, v_cache, tables, seq_lens = _args()
    with pytest.raises(TypeError, match="q has dtype torch.int32; supported"):
        paged_decode(q.int(), k_cache.int(), v_cache.int(), tables, seq_lens)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        paged_decode(q.tolist(), k_cache, v_cache, tables, seq_lens)


def test_a_rejected_call_reads_once_and_writes_nothing(monkeypatch):
    """Every value rule of a default call comes from one check-kernel launch and one read."""
    reads = []
    real = checks.read_check
    monkeypatch.setattr(checks, "read_check", lambda *a, **k: reads.append(1) or real(*a, **k))
    q, k_cache, v_cache, tables, seq_lens = _args()
    tables[1, 1] = 9                                          # one past the last block
    caches = (k_cache.clone(), v_cache.clone())
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 9"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, out=out)
    assert len(reads) == 1 and bool(out.isnan().all())
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


def test_default_call_reads_once_and_engine_call_never(monkeypatch):
    """Default: the checks' one read also gives max_seq_len. num_splits given, validate=False: no read."""
    reads = []
    real_check, real_length = checks.read_check, paged_decode_module.grid_length
    monkeypatch.setattr(checks, "read_check", lambda *a, **k: reads.append("check") or real_check(*a, **k))
    monkeypatch.setattr(paged_decode_module, "grid_length", lambda *a, **k: reads.append("max") or real_length(*a, **k))
    q, k_cache, v_cache, tables, seq_lens = paged_batch([40, 70], 8, 2, 32, 16, torch.float32, seed=5)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, [40, 70], dtype=torch.float64)
    assert relative_error(paged_decode(q, k_cache, v_cache, tables, seq_lens), ref) < 1e-5
    assert reads == ["check"]
    reads.clear()
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=3, validate=False)
    assert reads == [] and relative_error(out, ref) < 1e-5
    paged_decode(q, k_cache, v_cache, tables, seq_lens, validate=False)       # split count from a read of its own
    assert reads == ["max"]


def test_one_grid_replays_with_other_lengths():
    """The grid (batch, kv_heads, num_splits) depends on no length: the same launch, as a CUDA graph
    would replay it, computes right for lengths longer and shorter than the first call's."""
    q, k_cache, v_cache, tables, seq_lens = paged_batch([150, 150, 150], 8, 2, 32, 16, torch.float32, seed=6)
    out = torch.full_like(q, float("nan"))
    for lens in ([150, 3, 77], [1, 149, 16], [150, 150, 150], [17, 64, 100]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=4, validate=False, out=out)
        ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, dtype=torch.float64)
        assert relative_error(out, ref) < 1e-5, lens


def test_zero_length_rows_give_zeros():
    """A padding row of a CUDA graph's batch (seq_len 0, unchecked) has only empty splits: zeros, no NaN."""
    q, k_cache, v_cache, tables, seq_lens = paged_batch([40, 70], 4, 2, 32, 16, torch.float32, seed=7)
    seq_lens[1] = 0
    for splits in (1, 3):
        out = paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=splits, validate=False)
        assert bool((out[1] == 0).all()) and not bool(out[0].isnan().any())


def test_each_split_reads_its_own_sequences_range():
    """Split g of a sequence of n tokens reads [g * t, min((g + 1) * t, n)) with t = ceil(ceil(n / S) / BLOCK_N)
    * BLOCK_N from that sequence's own n (chapter 6's split_ranges with max_seq_len = seq_len):
    each program's log-sum-exp equals the one of exactly that range, computed in float64."""
    from kvlab.viz.decode import split_token_ranges

    lens, splits, block_n, heads, kv_heads, dim = [70, 5, 33, 16], 3, 16, 4, 2, 32
    q, k_cache, v_cache, tables, seq_lens = paged_batch(lens, heads, kv_heads, dim, 16, torch.float32, seed=8)
    lse = torch.empty(len(lens), heads, splits, dtype=torch.float32, device=DEVICE)
    partial = torch.empty(len(lens), heads, splits, dim, dtype=torch.float32, device=DEVICE)
    scale = 1 / math.sqrt(dim)
    decode_split_kernel[(len(lens), kv_heads, splits)](
        q, k_cache, v_cache, tables, seq_lens, partial, lse, scale, q.stride(0), q.stride(1),
        tables.stride(0), kv_heads, splits, GROUP=heads // kv_heads, GROUP_PAD=16, HEAD_DIM=dim, BLOCK_SIZE=16, BLOCK_N=block_n,
        WRITE_FINAL=False, DOT_PRECISION="ieee")
    for b, n in enumerate(lens):
        slots = tables[b].long().cpu()[torch.arange(n) // 16] * 16 + torch.arange(n) % 16
        k = k_cache.reshape(-1, kv_heads, dim).cpu()[slots].double()           # [n, kv_heads, dim]
        for g, (start, end) in enumerate(split_token_ranges(n, splits, block_n)):
            for h in range(heads):
                scores = k[start:end, h // (heads // kv_heads)] @ q[b, h].cpu().double() * scale
                want = torch.logsumexp(scores, 0).item() if end > start else -math.inf
                assert lse[b, h, g].item() == pytest.approx(want, rel=1e-5, abs=1e-5), (n, g, h)


def test_q_may_be_a_view_of_a_fused_qkv_projection():
    """q [T, H, D] cut from a [T, (H + 2 KV) * D] projection: rows strided, read in place."""
    lens, heads, kv_heads, dim = [40, 70, 9], 8, 2, 32
    q, k_cache, v_cache, tables, seq_lens = paged_batch(lens, heads, kv_heads, dim, 16, torch.float32, seed=9)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, device=DEVICE)
    qkv[:, :heads * dim] = q.reshape(len(lens), -1)
    view = qkv[:, :heads * dim].view(len(lens), heads, dim)
    assert view.stride() == ((heads + 2 * kv_heads) * dim, dim, 1)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, dtype=torch.float64)
    for splits in (1, 2):
        assert relative_error(paged_decode(view, k_cache, v_cache, tables, seq_lens, num_splits=splits), ref) < 1e-5
