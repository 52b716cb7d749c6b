"""Graded tests of chapter 5: ``pytest tests/graded -m ch05 --impl=exercises``."""
import itertools

import pytest
import torch

from helpers import brute_force_bounds
from kvlab import profile
from kvlab.reference import attention_ref
from kvlab.workloads.attention_memory import peak_memory

pytestmark = pytest.mark.ch05


def reference(q, k, v, causal, sm_scale=None):
    """float64 attention of one sequence, ``[num, heads, head_dim]`` in and out."""
    return attention_ref(q.double(), k.double(), v.double(), causal=causal, sm_scale=sm_scale, dtype=torch.float64)


def relative_error(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


# -- chunked_attention -------------------------------------------------------------------------
# (num_q, num_k, block_n, causal): prefill, extend, decode, chunks that don't divide the keys,
# one chunk bigger than all the keys, not causal
CHUNKED_CASES = [(37, 37, 8, True), (5, 29, 8, True), (1, 20, 7, True), (23, 41, 16, False),
                 (12, 12, 64, True), (9, 50, 1, False)]


@pytest.mark.task("chunked_attention")
@pytest.mark.parametrize("num_q,num_k,block_n,causal", CHUNKED_CASES)
def test_chunked_attention_matches_reference(ch05, num_q, num_k, block_n, causal):
    gen = torch.Generator().manual_seed(num_q * 1000 + num_k)
    q, k, v = (torch.randn(n, 16, generator=gen) for n in (num_q, num_k, num_k))
    got = ch05.chunked_attention(q, k, v, block_n, causal=causal)
    assert got.shape == (num_q, 16), f"output shape {list(got.shape)}, expected [{num_q}, 16]"
    assert not bool(got.isnan().any()), "NaN in the output"
    want = reference(q[:, None], k[:, None], v[:, None], causal)[:, 0]
    err = relative_error(got, want)
    assert err < 1e-5, (f"chunked_attention(num_q={num_q}, num_k={num_k}, block_n={block_n}, causal={causal}): "
                        f"relative error {err:.2e}")


@pytest.mark.task("chunked_attention")
def test_chunked_attention_survives_large_scores(ch05):
    # scores in the hundreds: exp() of them overflows float32 unless the running max is subtracted
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(20, 16, generator=gen) for _ in range(3))
    got = ch05.chunked_attention(q, k, v, 8, causal=True, sm_scale=60.0)
    assert bool(torch.isfinite(got).all()), "inf or NaN in the output: subtract the running max before exp"
    err = relative_error(got, reference(q[:, None], k[:, None], v[:, None], True, sm_scale=60.0)[:, 0])
    assert err < 1e-5, f"relative error {err:.2e} with sm_scale=60"


@pytest.mark.task("chunked_attention")
def test_chunked_attention_computes_in_float32(ch05):
    # bfloat16 q, k, v (ragged: 21 keys in chunks of 8): the scores, the running max and sums and the
    # output must still be float32, as the docstring promises
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 16, generator=gen).to(torch.bfloat16) for n in (6, 21, 21))
    got = ch05.chunked_attention(q, k, v, 8, causal=True)
    assert got.dtype == torch.float32, f"bfloat16 q, k, v in, {got.dtype} out: compute and return float32"
    err = relative_error(got, reference(q[:, None], k[:, None], v[:, None], True)[:, 0])
    assert err < 1e-5, f"bfloat16 q, k, v: relative error {err:.2e} (compute in float32, not in the inputs' dtype)"


@pytest.mark.task("chunked_attention")
def test_chunked_attention_never_holds_all_the_scores(ch05):
    num, head_dim, block_n = 1024, 16, 32
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(num, head_dim, generator=gen) for _ in range(3))
    peak = peak_memory(lambda: ch05.chunked_attention(q, k, v, block_n, causal=True), "cpu").bytes
    full = num * num * 4                       # one float32 score matrix
    assert peak < full // 2, (f"chunked_attention allocated {peak:,} bytes at its peak; one [{num}, {num}] "
                              f"float32 score matrix is {full:,}: hold only [num_q, block_n] scores at a time")


# -- online_softmax --------------------------------------------------------------------------
# (num_q, num_k, num_heads, num_kv_heads, causal): tiles of 16, so these cross tile boundaries,
# end ragged, put the causal diagonal inside a tile, and share KV heads (GQA)
KERNEL_CASES = [(37, 37, 2, 1, True), (5, 29, 2, 2, True), (1, 20, 4, 2, True), (23, 41, 2, 1, False),
                (16, 48, 1, 1, True)]


def run_kernel(ch05, guard, num_q, num_k, num_heads, num_kv_heads, causal, sm_scale=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_q, num_heads, 16, generator=gen).to(profile.DEVICE)
    k = torch.randn(num_k, num_kv_heads, 16, generator=gen).to(profile.DEVICE)
    v = torch.randn(num_k, num_kv_heads, 16, generator=gen).to(profile.DEVICE)
    out = guard.full(q.shape, float("nan"), device=profile.DEVICE)   # a row the kernel forgets to write stays NaN
    ch05.attention(q, k, v, causal=causal, sm_scale=sm_scale, out=out)
    guard.check()                                # nothing stored outside `out`
    return out, reference(q, k, v, causal, sm_scale)


@pytest.mark.task("online_softmax")
@pytest.mark.parametrize("num_q,num_k,num_heads,num_kv_heads,causal", KERNEL_CASES)
def test_kernel_matches_reference(ch05, guard, num_q, num_k, num_heads, num_kv_heads, causal):
    out, want = run_kernel(ch05, guard, num_q, num_k, num_heads, num_kv_heads, causal, seed=num_q + num_k)
    assert not bool(out.isnan().any()), f"{int(out.isnan().sum())} NaN in the output"
    err = relative_error(out, want)
    assert err < 1e-4, (f"attention(num_q={num_q}, num_k={num_k}, heads {num_heads}/{num_kv_heads}, "
                        f"causal={causal}): relative error {err:.2e}")


@pytest.mark.task("online_softmax")
def test_kernel_survives_large_scores(ch05, guard):
    out, want = run_kernel(ch05, guard, 20, 40, 1, 1, True, sm_scale=60.0, seed=7)
    assert bool(torch.isfinite(out).all()), "inf or NaN in the output: subtract the running max before exp"
    err = relative_error(out, want)
    assert err < 1e-4, f"relative error {err:.2e} with sm_scale=60"


# -- causal_bounds -------------------------------------------------------------------------
@pytest.mark.task("causal_bounds")
def test_causal_bounds_worked_example(ch05):
    # 40 new tokens after 60 cached: queries at positions 60..99; block 16..31 sees keys 0..76 to 0..91
    got = ch05.causal_tile_bounds(16, 40, 100, 16, 16, causal=True)
    assert tuple(got) == (64, 92), f"causal_tile_bounds(16, 40, 100, 16, 16) = {got}, expected (64, 92)"


@pytest.mark.task("causal_bounds")
def test_causal_bounds_against_brute_force(ch05):
    for len_q, len_k, block_m, block_n, causal in itertools.product(
            (1, 5, 16, 33), (1, 7, 16, 40), (16, 32), (16, 8), (True, False)):
        if causal and len_q > len_k:
            continue
        for start_m in range(0, len_q, block_m):
            got = ch05.causal_tile_bounds(start_m, len_q, len_k, block_m, block_n, causal)
            want = brute_force_bounds(start_m, len_q, len_k, block_m, block_n, causal)
            assert tuple(got) == want, (f"causal_tile_bounds(start_m={start_m}, len_q={len_q}, len_k={len_k}, "
                                        f"block_m={block_m}, block_n={block_n}, causal={causal}) = {got}, "
                                        f"expected {want}")


@pytest.mark.task("causal_bounds")
def test_causal_bounds_refuses_more_queries_than_keys(ch05):
    with pytest.raises(ValueError):
        ch05.causal_tile_bounds(0, 10, 5, 16, 16, causal=True)
