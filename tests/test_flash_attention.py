"""flash_attention and paged_prefill against the float64 references.

Ragged lengths (1, around a page or tile boundary, non-powers of two), GQA, causal and not,
the log-sum-exp, scattered pages, and every refused argument. Outputs go into buffers filled
with NaN first, so a row the kernel forgets to write shows up.

Runs in Triton's interpreter on a CPU (small sizes: head_dim 16/32) and natively on a GPU
(``KVLAB_PROFILE=gpu pytest tests/test_flash_attention.py``: head_dim 64/128, longer sequences).
"""
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import profile
from kvlab.kernels.flash_attention import flash_attention, paged_prefill
from kvlab.models import backends as backends_module
from kvlab.models.backends import get_attention_backend, register_attention_backend
from kvlab.reference import attention_ref, gather_kv, paged_attention_ref

DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if BIG else [])
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
HEAD_DIMS = profile.pick(cpu=[16, 32], gpu=[64, 128])
GROUPS = [1, 4] + ([8] if BIG else [])          # query heads per KV head
SCALE = profile.pick(cpu=1, gpu=8)              # lengths grow by this on a GPU
TILES = profile.pick(cpu=[(16, 32), (32, 16)], gpu=[(64, 64), (128, 32), (32, 128)])


# -- helpers -------------------------------------------------------------------------------
def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)


def nan_like(t):
    return torch.full_like(t, float("nan"))


def assert_close(got, want, dtype):
    assert not bool(got.isnan().any()), f"{int(got.isnan().sum())} NaN in the output: a row was not written"
    err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e}"


def lse_ref(q, k, causal, sm_scale):
    """torch.logsumexp of one sequence's scaled scores, float64: q [Lq, H, D], k [Lk, Hkv, D] -> [H, Lq]."""
    group = q.shape[1] // k.shape[1]
    kf = k.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kf) * sm_scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        hidden = torch.arange(lk, device=q.device)[None, :] > torch.arange(lk - lq, lk, device=q.device)[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def assert_lse_close(got, want):
    err = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1.0))
    assert err <= 1e-3, f"log-sum-exp relative error {err:.2e}"


# -- flash_attention, batched [batch, heads, len, head_dim] --------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_batched_matches_reference(dtype, causal, group, head_dim):
    gen = torch.Generator().manual_seed(random.Random(f"{dtype}{causal}{group}{head_dim}").randrange(2**31))
    # prefill (len_q == len_k), extend (len_q < len_k), decode (len_q == 1): by parameters
    shapes = [(33, 33), (7, 40), (1, 17)]
    len_q, len_k = shapes[(group + head_dim + causal) % 3]
    len_q, len_k = (len_q if len_q == 1 else len_q * SCALE), len_k * SCALE
    batch, num_kv_heads = 2, 1 if group > 1 else 2
    num_heads = num_kv_heads * group
    q = randn(gen, batch, num_heads, len_q, head_dim, dtype=dtype)
    k = randn(gen, batch, num_kv_heads, len_k, head_dim, dtype=dtype)
    v = randn(gen, batch, num_kv_heads, len_k, head_dim, dtype=dtype)
    sm_scale = 0.3 if causal else None
    out = nan_like(q)
    got, lse = flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True, out=out)
    assert got is out and got.dtype == dtype and lse.shape == (batch, num_heads, len_q) and lse.dtype == torch.float32
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    for b in range(batch):
        qb, kb, vb = (t[b].transpose(0, 1) for t in (q, k, v))     # [len, heads, head_dim]
        want = attention_ref(qb.double(), kb.double(), vb.double(), causal=causal, sm_scale=scale,
                             dtype=torch.float64)
        assert_close(got[b].transpose(0, 1), want, dtype)
        assert_lse_close(lse[b], lse_ref(qb, kb, causal, scale))


@pytest.mark.parametrize("block_m,block_n", TILES)
def test_tiles_of_other_shapes(block_m, block_n):
    """The causal bounds hold when BLOCK_M != BLOCK_N (the diagonal cuts tiles unevenly)."""
    gen = torch.Generator().manual_seed(block_m * 1000 + block_n)
    len_q, len_k, head_dim = 37 * SCALE, 45 * SCALE, HEAD_DIMS[-1]
    q = randn(gen, 1, 2, len_q, head_dim)
    k, v = randn(gen, 1, 1, len_k, head_dim), randn(gen, 1, 1, len_k, head_dim)
    for causal in (True, False):
        got = flash_attention(q, k, v, causal=causal, out=nan_like(q), block_m=block_m, block_n=block_n)
        want = attention_ref(q[0].transpose(0, 1).double(), k[0].transpose(0, 1).double(),
                             v[0].transpose(0, 1).double(), causal=causal, dtype=torch.float64)
        assert_close(got[0].transpose(0, 1), want, torch.float32)


def test_strided_views_are_read_in_place():
    """q/k/v may be views of one fused tensor: only head_dim has to be contiguous."""
    gen = torch.Generator().manual_seed(3)
    head_dim = HEAD_DIMS[0]
    qkv = randn(gen, 2, 19, 3, 2, head_dim)                      # [batch, len, (q, k, v), heads, dim]
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))    # [batch, heads, len, dim], strided
    got = flash_attention(q, k, v, out=nan_like(q.contiguous()))
    want = flash_attention(q.contiguous(), k.contiguous(), v.contiguous())
    torch.testing.assert_close(got, want)


# -- flash_attention, packed variable-length ------------------------------------------------
def packed_batch(gen, lens_q, lens_k, num_heads, num_kv_heads, head_dim, dtype):
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    q = randn(gen, sum(lens_q), num_heads, head_dim, dtype=dtype)
    k = randn(gen, sum(lens_k), num_kv_heads, head_dim, dtype=dtype)
    v = randn(gen, sum(lens_k), num_kv_heads, head_dim, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("group", GROUPS)
def test_packed_matches_reference(dtype, causal, group):
    rng = random.Random(f"{dtype}{causal}{group}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    head_dim = HEAD_DIMS[group % len(HEAD_DIMS)]
    # lengths 1, a tile +- 1, non-powers of two, and an empty sequence in the middle
    lens_q = [1, 15, 17, 0, rng.randint(2, 40)]
    lens_q = [n if n <= 1 else n * SCALE for n in lens_q]
    if causal:   # a cached prefix of any length, 0 included
        lens_k = [n + p for n, p in zip(lens_q, [rng.randint(0, 20) * SCALE, 0, rng.randint(1, 9), 3, 16 * SCALE])]
    else:        # any number of keys, fewer than the queries included
        lens_k = [rng.randint(1, 40) * SCALE for _ in lens_q]
    num_kv_heads = 2 if group == 1 else 1
    num_heads = num_kv_heads * group
    q, k, v, cu_q, cu_k = packed_batch(gen, lens_q, lens_k, num_heads, num_kv_heads, head_dim, dtype)
    out = nan_like(q)
    got, lse = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True,
                               out=out)
    assert got is out and lse.shape == (num_heads, q.shape[0])
    scale = 1 / math.sqrt(head_dim)
    for b in range(len(lens_q)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            continue
        want = attention_ref(q[rows_q].double(), k[rows_k].double(), v[rows_k].double(), causal=causal,
                             dtype=torch.float64)
        assert_close(got[rows_q], want, dtype)
        assert_lse_close(lse[:, rows_q], lse_ref(q[rows_q], k[rows_k], causal, scale))


def test_packed_without_validation_gives_the_same_answer():
    gen = torch.Generator().manual_seed(11)
    q, k, v, cu_q, cu_k = packed_batch(gen, [5, 18], [9, 18], 2, 1, HEAD_DIMS[0], torch.float32)
    checked = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    fast = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, validate=False, max_seqlen_q=18)
    torch.testing.assert_close(fast, checked, rtol=0, atol=0)


# -- paged_prefill ---------------------------------------------------------------------------
def paged_batch(gen, seqs, block_size, num_heads, num_kv_heads, head_dim, dtype):
    """Caches holding sequences ``seqs`` = [(prefix_len, query_len)], their pages scattered.

    Every slot no sequence owns is NaN (page 0, which the tables' padding points at, spare pages,
    and the tail of each last page), so a kernel that reads one shows up. Returns the engine's
    arguments: q, k_cache, v_cache, block_tables, seq_lens, query_lens.
    """
    pages = [-(-(p + n) // block_size) for p, n in seqs]
    num_blocks = 1 + sum(pages) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    v_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    tables = torch.zeros(len(seqs), max(pages, default=0) + 1, dtype=torch.int32)
    for i, ((prefix, num_new), n_pages) in enumerate(zip(seqs, pages)):
        ids, free = free[:n_pages], free[n_pages:]
        tables[i, :n_pages] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(prefix + num_new)
        slots = torch.tensor(ids, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots.to(DEVICE)] = randn(gen, len(pos), num_kv_heads, head_dim,
                                                                           dtype=dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots.to(DEVICE)] = randn(gen, len(pos), num_kv_heads, head_dim,
                                                                           dtype=dtype)
    q = randn(gen, sum(n for _, n in seqs), num_heads, head_dim, dtype=dtype)
    seq_lens = torch.tensor([p + n for p, n in seqs], dtype=torch.int32, device=DEVICE)
    query_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), seq_lens, query_lens


def new_tokens_kv(args):
    """The new tokens' K/V, packed like q, as the engine hands them over (``k_new``/``v_new``)."""
    q, k_cache, v_cache, tables, seq_lens, query_lens = args
    rows = [(i, int(n) - int(m), int(n)) for i, (n, m) in enumerate(zip(seq_lens, query_lens))]
    return tuple(torch.cat([gather_kv(cache, tables[i], end)[start:] for i, start, end in rows])
                 for cache in (k_cache, v_cache))


def check_paged(args, dtype, sm_scale=None, new_kv=False, **kw):
    q = args[0]
    if new_kv:
        kw["k_new"], kw["v_new"] = new_tokens_kv(args)
    out = nan_like(q)
    got = paged_prefill(*args, sm_scale, out=out, **kw)
    assert got is out and got.dtype == q.dtype and got.shape == q.shape
    q, k_cache, v_cache, tables, seq_lens, query_lens = args
    want = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables.cpu(), seq_lens.cpu(),
                               query_lens.cpu(), causal=True, sm_scale=sm_scale, dtype=torch.float64)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("new_kv", [False, True], ids=["all-keys-paged", "new-keys-given"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_prefill_matches_reference(dtype, group, block_size, new_kv):
    rng = random.Random(f"{dtype}{group}{block_size}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    b = block_size
    seqs = [
        (0, 23 * SCALE),                          # a plain prefill, no prefix
        (b - 1, 1), (b, 1), (b + 1, 1),           # decode steps around a page boundary
        (0, 1),                                   # a one-token prompt
        (2 * b + 3, rng.randint(2, 19) * SCALE),  # extend a prefix that ends mid-page
        (rng.randint(1, 40) * SCALE, b + 1),      # a chunk of a long prompt
    ]
    head_dim = HEAD_DIMS[(group + block_size) % len(HEAD_DIMS)]
    num_kv_heads = 2 if group == 1 else 1
    args = paged_batch(gen, seqs, block_size, num_kv_heads * group, num_kv_heads, head_dim, dtype)
    check_paged(args, dtype, sm_scale=0.2 if block_size == 5 else None, new_kv=new_kv)


@pytest.mark.parametrize("new_kv", [False, True], ids=["all-keys-paged", "new-keys-given"])
@pytest.mark.parametrize("block_m,block_n", TILES)
def test_paged_tiles_of_other_shapes(block_m, block_n, new_kv):
    """Tiles of keys smaller and larger than a page, both walking the same scattered pages."""
    gen = torch.Generator().manual_seed(block_m + block_n)
    seqs = [(0, 37 * SCALE), (13 * SCALE, 21 * SCALE), (40 * SCALE, 1)]
    args = paged_batch(gen, seqs, 8, 4, 2, HEAD_DIMS[-1], torch.float32)
    check_paged(args, torch.float32, block_m=block_m, block_n=block_n, new_kv=new_kv)


@settings(max_examples=profile.pick(cpu=8, gpu=40), deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 30 * SCALE), st.integers(1, 20 * SCALE)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 7, 16]), group=st.sampled_from(GROUPS), seed=st.integers(0, 2**31 - 1),
       new_kv=st.booleans())
def test_paged_prefill_random_batches(seqs, block_size, group, seed, new_kv):
    gen = torch.Generator().manual_seed(seed)
    args = paged_batch(gen, seqs, block_size, group, 1, HEAD_DIMS[0], torch.float32)
    check_paged(args, torch.float32, new_kv=new_kv)


def test_given_new_keys_are_read_from_k_new_not_from_the_cache():
    """With k_new/v_new only the cached prefix goes through the block table: the new tokens'
    slots can hold NaN and nothing shows; with the slots intact both paths agree."""
    gen = torch.Generator().manual_seed(11)
    seqs = [(0, 19 * SCALE), (21 * SCALE, 9 * SCALE), (2 * SCALE, 1)]
    args = paged_batch(gen, seqs, 4, 4, 2, HEAD_DIMS[0], torch.float32)
    q, k_cache, v_cache, tables, seq_lens, query_lens = args
    k_new, v_new = new_tokens_kv(args)
    every_key_paged = paged_prefill(*args)
    for i, (prefix, num_new) in enumerate(seqs):
        pos = torch.arange(prefix, prefix + num_new)
        slots = tables[i].cpu().long()[pos // 4] * 4 + pos % 4
        for cache in (k_cache, v_cache):
            cache.view(-1, *cache.shape[2:])[slots.to(DEVICE)] = float("nan")
    got = paged_prefill(*args, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(got, every_key_paged, rtol=1e-5, atol=1e-5)


def test_paged_prefill_agrees_with_packed_flash_attention():
    """The same attention through pages and through contiguous K/V gives the same numbers."""
    gen = torch.Generator().manual_seed(5)
    seqs = [(4, 9), (0, 17), (30, 1)]
    q, k_cache, v_cache, tables, seq_lens, query_lens = paged_batch(gen, seqs, 4, 2, 2, HEAD_DIMS[0], torch.float32)
    k = torch.cat([gather_kv(k_cache, tables[i], int(seq_lens[i])) for i in range(len(seqs))])
    v = torch.cat([gather_kv(v_cache, tables[i], int(seq_lens[i])) for i in range(len(seqs))])
    cu_q = torch.tensor([0, 9, 26, 27], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 13, 30, 61], dtype=torch.int32, device=DEVICE)
    paged = paged_prefill(q, k_cache, v_cache, tables, seq_lens, query_lens)
    packed = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(paged, packed, rtol=1e-5, atol=1e-5)


def test_paged_prefill_is_an_engine_attention_backend(monkeypatch):
    # registered into a copy of the registry, which the test's end puts back
    monkeypatch.setattr(backends_module, "_REGISTRY", dict(backends_module._REGISTRY))
    gen = torch.Generator().manual_seed(8)
    q, k_cache, v_cache, tables, seq_lens, query_lens = paged_batch(gen, [(6, 3), (0, 5)], 4, 2, 1,
                                                                    HEAD_DIMS[0], torch.float32)
    register_attention_backend("flash-attention-test", paged_prefill)
    args = (q, k_cache, v_cache, tables, seq_lens, query_lens, 0.25)
    got = get_attention_backend("flash-attention-test").fn(*args)
    want = get_attention_backend("reference").fn(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_empty_batches_launch_nothing():
    head_dim = HEAD_DIMS[0]
    q = torch.empty(0, 2, head_dim, device=DEVICE)
    cache = torch.zeros(2, 4, 1, head_dim, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert paged_prefill(q, cache, cache, torch.empty(0, 1, dtype=torch.int32, device=DEVICE), empty,
                         empty).shape == q.shape
    zero = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert flash_attention(q, q, q, cu_seqlens_q=zero, cu_seqlens_k=zero).shape == q.shape


# -- refused arguments: a clear error, and nothing written ------------------------------------
def _flash_args(**overrides):
    d = HEAD_DIMS[0]
    gen = torch.Generator().manual_seed(0)
    args = dict(q=randn(gen, 5, 4, d), k=randn(gen, 8, 2, d), v=randn(gen, 8, 2, d), causal=True,
                cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE),
                cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE))
    args.update(overrides)
    return args


D0 = HEAD_DIMS[0]
FLASH_ERRORS = [
    (dict(k=torch.randn(8, 2, D0, dtype=torch.float16)), TypeError, "k has dtype torch.float16"),
    (dict(q=torch.ones(5, 4, D0, dtype=torch.int32)), TypeError, "supported: float16"),
    (dict(v=torch.randn(8, 2, D0, device="meta")), ValueError, "v is on meta"),
    (dict(q=torch.randn(5, 3, D0)), ValueError, "not a multiple of k's 2"),
    (dict(q=torch.randn(5, 4, 2 * D0)), ValueError, "q has head_dim"),
    (dict(q=torch.randn(5, 4, 24), k=torch.randn(8, 2, 24), v=torch.randn(8, 2, 24)), ValueError, "power of two"),
    (dict(v=torch.randn(7, 2, D0)), ValueError, "same shape"),
    (dict(q=torch.randn(5, 4, 2 * D0, device=DEVICE)[..., ::2]), ValueError, "contiguous in its last dim"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 2, 5], dtype=torch.int32),
          cu_seqlens_k=torch.tensor([0, 3, 4, 8], dtype=torch.int32)), ValueError, "monotonically increasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.float32)), TypeError, "cu_seqlens_k must be int32"),
    (dict(cu_seqlens_k=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, r"cu_seqlens_k\[0\] must be 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "must equal the number of packed"),
    (dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError, "cu_seqlens_k must be a contiguous"),
    (dict(cu_seqlens_k=None), ValueError, "needs both cu_seqlens_q and cu_seqlens_k"),
    (dict(cu_seqlens_k=torch.tensor([0, 1, 8], dtype=torch.int32)), ValueError,
     "sequence 0 has 2 queries and 1 keys: causal attention needs len_q <= len_k"),
    (dict(causal=False, cu_seqlens_k=torch.tensor([0, 0, 8], dtype=torch.int32)), ValueError,
     "every query needs at least one key"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32, device="meta")), ValueError,
     "cu_seqlens_q is on meta"),
    (dict(cu_seqlens_q=None, cu_seqlens_k=None), ValueError, r"\[batch, heads, len, head_dim\]"),
    (dict(cu_seqlens_q=None, cu_seqlens_k=None, q=torch.randn(1, 4, 5, D0), k=torch.randn(1, 2, 4, D0),
          v=torch.randn(1, 2, 4, D0)), ValueError, "len_q 5 > len_k 4"),
    (dict(cu_seqlens_q=None, cu_seqlens_k=None, q=torch.randn(2, 4, 3, D0), k=torch.randn(1, 2, 4, D0),
          v=torch.randn(1, 2, 4, D0)), ValueError, "q has batch 2, k has 1"),
    (dict(cu_seqlens_q=None, cu_seqlens_k=None, causal=False, q=torch.randn(1, 4, 5, D0),
          k=torch.randn(1, 2, 0, D0), v=torch.randn(1, 2, 0, D0)), ValueError, "at least one key"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale must be finite and positive"),
    (dict(sm_scale="0.1"), TypeError, "sm_scale must be a float"),
    (dict(k="keys"), TypeError, "k must be a torch.Tensor"),
]
if not BIG:   # the interpreter has no bfloat16 arithmetic
    bf16 = dict(q=torch.randn(5, 4, D0), k=torch.randn(8, 2, D0), v=torch.randn(8, 2, D0))
    FLASH_ERRORS.append(({n: t.bfloat16() for n, t in bf16.items()}, TypeError, "interpreter"))


def _on_device(overrides):
    return {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t)
            for n, t in overrides.items()}


@pytest.mark.parametrize("overrides,error,match", FLASH_ERRORS)
def test_flash_attention_refuses_bad_arguments(overrides, error, match):
    args = _flash_args(**_on_device(overrides))
    q = args["q"]
    out = torch.full(q.shape, 7.0, dtype=q.dtype, device=q.device) if q.device.type != "meta" else None
    with pytest.raises(error, match=match):
        flash_attention(**args, out=out)
    assert out is None or bool((out == 7.0).all()), "a refused call wrote to out"


@pytest.mark.parametrize("out,error,match", [
    (torch.zeros(5, 4, 2 * D0), ValueError, "out must match q"),
    (torch.zeros(5, 4, D0, dtype=torch.float16), ValueError, "out must match q"),
    (torch.zeros(5, 4, 2 * D0, device=DEVICE)[..., ::2], ValueError, "out must be contiguous in its last dim"),
    ([0.0], TypeError, "out must be a torch.Tensor"),
])
def test_a_bad_out_buffer_is_refused(out, error, match):
    out = out.to(DEVICE) if isinstance(out, torch.Tensor) else out
    with pytest.raises(error, match=match):
        flash_attention(**_flash_args(), out=out)


def _paged_args(**overrides):
    """A valid step: two sequences of (prefix, new) = (5, 2) and (0, 3) in pages of 4."""
    d = HEAD_DIMS[0]
    gen = torch.Generator().manual_seed(1)
    args = dict(q=randn(gen, 5, 4, d), k_cache=randn(gen, 6, 4, 2, d), v_cache=randn(gen, 6, 4, 2, d),
                block_tables=torch.tensor([[3, 1, 0], [5, 0, 0]], dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([7, 3], dtype=torch.int32, device=DEVICE),
                query_lens=torch.tensor([2, 3], dtype=torch.int32, device=DEVICE))
    args.update(overrides)
    return args


def _i32(*rows):
    return torch.tensor(rows, dtype=torch.int32)


PAGED_ERRORS = [
    (dict(query_lens=_i32(2, 4), seq_lens=_i32(7, 3), q=torch.randn(6, 4, D0)), ValueError,
     r"query_lens\[1\] = 4 > seq_lens\[1\] = 3"),
    (dict(block_tables=_i32([3, 6, 0], [5, 0, 0])), ValueError, r"block_tables\[0, 1\] = 6 is out of range 0..5"),
    (dict(block_tables=_i32([3, 1, 0], [-1, 0, 0])), ValueError, r"block_tables\[1, 0\] = -1 is out of range"),
    (dict(seq_lens=_i32(13, 3), query_lens=_i32(2, 3)), ValueError,
     r"seq_lens\[0\] = 13 is beyond block_tables' capacity of 3 blocks x 4 tokens = 12"),
    (dict(block_tables=torch.tensor([[3, 1, 0], [5, 0, 0]])), TypeError, "block_tables must be int32"),
    (dict(seq_lens=torch.tensor([7, 3])), TypeError, "seq_lens must be int32"),
    (dict(query_lens=_i32(2, 3, 0)), ValueError, "query_lens must be a contiguous 1-D tensor of 2 lengths"),
    (dict(query_lens=_i32(2, 2)), ValueError, "query_lens sum to 4, q has 5 tokens"),
    (dict(query_lens=_i32(-1, 6), seq_lens=_i32(7, 6)), ValueError, r"query_lens\[0\] = -1 is negative"),
    (dict(q=torch.randn(5, 4, D0, dtype=torch.float16)), TypeError, "k_cache has dtype torch.float32, q has"),
    (dict(q=torch.randn(5, 3, D0)), ValueError, "not a multiple of k_cache's 2"),
    (dict(q=torch.randn(5, 4, 2 * D0)), ValueError, "q has head_dim"),
    (dict(v_cache=torch.randn(6, 4, 1, D0)), ValueError, "must match"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int32, device="meta")), ValueError, "block_tables is on meta"),
    (dict(sm_scale=0.0), ValueError, "sm_scale must be finite and positive"),
    (dict(k_new=torch.randn(5, 2, D0)), ValueError, "k_new and v_new come together"),
    (dict(k_new=torch.randn(4, 2, D0), v_new=torch.randn(4, 2, D0)), ValueError,
     r"k_new must be \[5, 2, %d\]" % D0),
    (dict(k_new=torch.randn(5, 2, D0), v_new=torch.randn(5, 2, D0, dtype=torch.float16)), TypeError,
     "v_new has dtype torch.float16"),
    (dict(k_new=torch.randn(5, 2, 2 * D0, device=DEVICE)[..., ::2], v_new=torch.randn(5, 2, D0)), ValueError,
     "k_new must be contiguous in its last dim"),
]


@pytest.mark.parametrize("overrides,error,match", PAGED_ERRORS)
def test_paged_prefill_refuses_bad_arguments(overrides, error, match):
    args = _paged_args(**_on_device(overrides))
    q = args["q"]
    out = torch.full(q.shape, 7.0, dtype=q.dtype, device=q.device)
    with pytest.raises(error, match=match):
        paged_prefill(**args, out=out)
    assert bool((out == 7.0).all()), "a refused call wrote to out"


def test_padding_entries_past_a_sequence_are_never_checked_or_read():
    """Only the entries a sequence uses must be real blocks: the padding may hold anything."""
    args = _paged_args(block_tables=torch.tensor([[3, 1, 99], [5, -7, 1234]], dtype=torch.int32, device=DEVICE))
    got = paged_prefill(**args)
    want = paged_prefill(**_paged_args())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tile_sizes_must_suit_tl_dot():
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        flash_attention(**_flash_args(), block_n=8)


def test_too_short_grid_hints_are_refused():
    """max_seqlen_q / max_query_len / cu_query_lens spare host reads; a wrong one must not go unnoticed."""
    q = torch.randn(33, 2, 16, device=DEVICE)
    k = torch.randn(33, 2, 16, device=DEVICE)
    cu = torch.tensor([0, 33], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="max_seqlen_q = 16"):
        flash_attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16)
    k_cache = torch.randn(4, 16, 2, 16, device=DEVICE)
    tables = torch.arange(3, dtype=torch.int32, device=DEVICE)[None]
    lens = torch.tensor([33], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="max_query_len = 16"):
        paged_prefill(q, k_cache, k_cache, tables, lens, lens, max_query_len=16)
    with pytest.raises(ValueError, match="cu_query_lens"):
        paged_prefill(q, k_cache, k_cache, tables, lens, lens, cu_query_lens=torch.tensor([0, 32], dtype=torch.int32,
                                                                                           device=DEVICE))


# -- what a default call costs: one read for every value rule, none for the engine's call ------
def _count_reads(monkeypatch):
    """Record the checks' reads (read_check) and the launchers' own reads of a grid length."""
    import importlib

    from kvlab.kernels import checks

    flash_module = importlib.import_module("kvlab.kernels.flash_attention")
    reads = []
    real_check, real_length = checks.read_check, flash_module.grid_length
    monkeypatch.setattr(checks, "read_check", lambda *a, **k: reads.append("check") or real_check(*a, **k))
    monkeypatch.setattr(flash_module, "grid_length", lambda *a, **k: reads.append("length") or real_length(*a, **k))
    return reads


def test_default_calls_read_once_and_engine_calls_never(monkeypatch):
    reads = _count_reads(monkeypatch)
    args = _flash_args()
    want = flash_attention(**args)
    assert reads == ["check"], "the packed grid's max_seqlen_q comes from the checks' read"
    reads.clear()
    got = flash_attention(**args, validate=False, max_seqlen_q=3)
    assert reads == [] and torch.equal(got, want)
    args = _paged_args()
    want = paged_prefill(**args)
    assert reads == ["check"], "max_query_len and cu_query_lens come from the checks' one launch and read"
    reads.clear()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    got = paged_prefill(**args, validate=False, max_query_len=3, cu_query_lens=cu)
    assert reads == [] and torch.equal(got, want)
    assert torch.equal(paged_prefill(**args, cu_query_lens=cu), want) and reads == ["check"]


def test_a_wrong_running_sum_is_refused():
    out = torch.full((5, 4, D0), 7.0, device=DEVICE)
    for cu in ([0, 3, 5], [1, 3, 6], [0, 2, 4]):
        with pytest.raises(ValueError, match="cu_query_lens must be the int32 running sum"):
            paged_prefill(**_paged_args(), out=out, cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=DEVICE))
    assert bool((out == 7.0).all())
