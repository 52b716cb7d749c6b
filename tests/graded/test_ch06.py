"""Graded tests of chapter 6: ``pytest tests/graded -m ch06 --impl=exercises``."""
import math
import random

import pytest
import torch

from helpers import random_span
from kvlab import profile

pytestmark = pytest.mark.ch06


# -- split_ranges ----------------------------------------------------------------------------
def kernel_positions(seq_len, max_seq_len, num_splits, block_n):
    """The positions each split program reads, found by brute force and by walking the kernel's loops."""
    per_split = block_n
    while per_split * num_splits < max_seq_len:      # the shortest whole-tile split length that covers the batch
        per_split += block_n
    reads = []
    for split in range(num_splits):
        start, positions = split * per_split, []
        end = min(start + per_split, seq_len)
        for tile in range(start, end, block_n):
            positions.extend(p for p in range(tile, tile + block_n) if p < end)
        reads.append(positions)
    return reads


@pytest.mark.task("split_ranges")
@pytest.mark.parametrize("args,want", [
    ((70, 3, 16), [(0, 32), (32, 64), (64, 70)]),          # ceil(70 / 3) = 24 tokens, rounded up to 2 tiles
    ((64, 4, 16), [(0, 16), (16, 32), (32, 48), (48, 64)]),
    ((20, 4, 16, 100), [(0, 20), (20, 20), (20, 20), (20, 20)]),   # the batch's longest has 100 tokens
    ((1, 2, 16), [(0, 1), (1, 1)]),
    ((33, 1, 16), [(0, 33)]),
])
def test_split_ranges_worked_examples(ch06, args, want):
    got = ch06.split_ranges(*args)
    assert [tuple(r) for r in got] == want, f"split_ranges{args} = {got}, expected {want}"


@pytest.mark.task("split_ranges")
def test_split_ranges_random_against_the_kernel_loops(ch06):
    rng = random.Random(0)
    for _ in range(400):
        max_seq_len = rng.randint(1, 3000)
        seq_len = rng.choice([max_seq_len, rng.randint(1, max_seq_len)])
        num_splits, block_n = rng.randint(1, 40), rng.choice([1, 3, 16, 64])
        got = [tuple(r) for r in ch06.split_ranges(seq_len, num_splits, block_n, max_seq_len)]
        reads = kernel_positions(seq_len, max_seq_len, num_splits, block_n)
        want = [(p[0], p[-1] + 1) if p else (seq_len, seq_len) for p in reads]
        assert got == want, (f"split_ranges({seq_len}, {num_splits}, {block_n}, max_seq_len={max_seq_len}) = "
                             f"{got}, expected {want}")


@pytest.mark.task("split_ranges")
def test_split_pages_worked_example(ch06):
    table = [9, 4, 7, 1, 6]
    got = ch06.split_pages(table, 6, 13, 4)
    assert list(got) == [4, 7, 1], f"split_pages({table}, start=6, end=13, block_size=4) = {got}, expected [4, 7, 1]"
    assert list(ch06.split_pages(table, 5, 5, 4)) == [], "an empty range reads no page"


@pytest.mark.task("split_ranges")
def test_split_pages_random(ch06):
    rng = random.Random(1)
    for _ in range(300):
        table, block_size, start, end = random_span(rng, [1, 3, 4, 16], 200, 12)
        want = []
        for pos in range(start, end):
            if not want or want[-1] != table[pos // block_size]:
                want.append(table[pos // block_size])
        got = ch06.split_pages(table, start, end, block_size)
        assert list(got) == want, f"split_pages({table}, {start}, {end}, {block_size}) = {got}, expected {want}"


@pytest.mark.task("split_ranges")
def test_bad_arguments_are_refused(ch06):
    for call, error in [
        (lambda: ch06.split_ranges(0, 2, 16), ValueError),
        (lambda: ch06.split_ranges(10, 0, 16), ValueError),
        (lambda: ch06.split_ranges(10, 2, 0), ValueError),
        (lambda: ch06.split_ranges(50, 2, 16, max_seq_len=40), ValueError),   # tokens 40.. would be skipped
        (lambda: ch06.split_ranges(10.0, 2, 16), TypeError),
        (lambda: ch06.split_ranges(10, "2", 16), TypeError),
        (lambda: ch06.split_ranges(10, 2, 16, max_seq_len=20.0), TypeError),   # max_seq_len is a count too
        (lambda: ch06.split_pages([0, 1], 3, 2, 4), ValueError),
        (lambda: ch06.split_pages([0, 1], 4, 9, 4), ValueError),
        (lambda: ch06.split_pages([0, 1], -1, 2, 4), ValueError),
    ]:
        with pytest.raises(error):
            call()


# -- merge_splits ----------------------------------------------------------------------------
def split_attention(num_rows, num_splits, head_dim, seed, offset=0.0, empty_splits=1):
    """Partial outputs and lse of random rows split at random places, and the exact float64 output.

    Each row has ``empty_splits`` splits that hold no token (lse -inf, partial output NaN).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    partial = torch.empty(num_rows, num_splits, head_dim, dtype=torch.float64)
    lse = torch.empty(num_rows, num_splits, dtype=torch.float64)
    exact = torch.empty(num_rows, head_dim, dtype=torch.float64)
    for row in range(num_rows):
        n = rng.randint(num_splits, 60)
        scores = 3 * torch.randn(n, generator=gen, dtype=torch.float64) + offset
        values = torch.randn(n, head_dim, generator=gen, dtype=torch.float64)
        exact[row] = torch.softmax(scores, 0) @ values
        empty = set(rng.sample(range(num_splits), empty_splits))
        cuts = sorted(rng.sample(range(1, n), num_splits - empty_splits - 1))
        bounds = iter(zip([0] + cuts, cuts + [n]))
        for g in range(num_splits):
            if g in empty:
                partial[row, g], lse[row, g] = float("nan"), -math.inf
                continue
            start, end = next(bounds)
            s = scores[start:end]
            m = s.max()
            p = torch.exp(s - m)
            partial[row, g] = p @ values[start:end] / p.sum()
            lse[row, g] = m + torch.log(p.sum())
    return partial, lse, exact


def assert_close(got, want, tolerance, what):
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)}, expected {list(want.shape)}"
    assert not bool(got.isnan().any()), f"{what}: the result holds NaN (an empty split leaked in?)"
    error = (got.double() - want).abs().max().item()
    assert error < tolerance, f"{what}: max |error| {error:.3g} vs exact softmax attention (tolerance {tolerance:g})"


@pytest.mark.task("merge_splits")
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_merge_equals_full_softmax_attention(ch06, num_splits):
    partial, lse, exact = split_attention(8, num_splits, 16, seed=num_splits, empty_splits=0)
    got = ch06.merge_splits(partial, lse)
    assert got.dtype == torch.float64, f"float64 in, {got.dtype} out"
    assert_close(got, exact, 1e-12, f"{num_splits} splits, float64")


@pytest.mark.task("merge_splits")
def test_merge_keeps_leading_dimensions(ch06):
    partial, lse, exact = split_attention(6, 4, 8, seed=7, empty_splits=0)
    got = ch06.merge_splits(partial.view(2, 3, 4, 8), lse.view(2, 3, 4))
    assert_close(got, exact.view(2, 3, 8), 1e-12, "[batch 2, heads 3, splits 4, head_dim 8]")


@pytest.mark.task("merge_splits")
def test_empty_splits_weigh_nothing(ch06):
    partial, lse, exact = split_attention(8, 6, 16, seed=11, empty_splits=2)
    assert_close(ch06.merge_splits(partial, lse), exact, 1e-12, "2 empty splits of 6 (lse -inf, partial NaN)")


@pytest.mark.task("merge_splits")
def test_large_scores_do_not_overflow(ch06):
    # exp(lse) overflows (float64 past ~709, float32 past ~88): subtract each row's largest lse first.
    # float32 keeps lse near 500 to ~3e-5, hence the looser tolerance there.
    partial, lse, exact = split_attention(8, 4, 16, seed=3, offset=3000.0)
    assert_close(ch06.merge_splits(partial, lse), exact, 1e-10, "scores near 3000, float64")
    partial, lse, exact = split_attention(8, 4, 16, seed=4, offset=500.0)
    got = ch06.merge_splits(partial.float(), lse.float())
    assert got.dtype == torch.float32, f"float32 in, {got.dtype} out"
    assert_close(got, exact, 1e-3, "scores near 500, float32")


@pytest.mark.task("merge_splits")
def test_each_row_subtracts_its_own_largest_lse(ch06):
    # rows whose scores sit thousands apart, some far below 0: one max shared by all rows, or a max
    # that counts an empty split's lse as 0, underflows every weight of some row (and 0 / 0 is NaN)
    rows = [split_attention(3, 4, 16, seed=40 + i, offset=offset) for i, offset in enumerate((0.0, 2000.0, -2000.0))]
    partial, lse, exact = (torch.cat(parts) for parts in zip(*rows))
    assert_close(ch06.merge_splits(partial, lse), exact, 1e-10,
                 "rows with scores near 0, 2000 and -2000 (each row's largest lse is its own), float64")


@pytest.mark.task("merge_splits")
def test_float16_partials_are_merged_in_float32(ch06):
    # float16 spaces numbers near 100 by 0.06: weights exp(lse - max) computed in float16 are off by
    # several percent; the merge must run in float32 at least, whatever the partials' dtype
    partial, lse, exact = split_attention(8, 4, 16, seed=50, offset=100.0)
    got = ch06.merge_splits(partial.half(), lse.float())
    assert got.dtype == torch.float16, f"float16 partials in, {got.dtype} out"
    assert_close(got, exact, 2e-3, "float16 partials, float32 lse near 100")


@pytest.mark.task("merge_splits")
def test_merge_output_dtype_and_bad_shapes(ch06):
    partial, lse, exact = split_attention(4, 3, 8, seed=5)
    got = ch06.merge_splits(partial.half(), lse.float())
    assert got.dtype == torch.float16, f"float16 partials in, {got.dtype} out"
    assert_close(got, exact, 2e-3, "float16 partials")
    with pytest.raises(ValueError):
        ch06.merge_splits(partial, lse[:, :2])
    with pytest.raises(TypeError):
        ch06.merge_splits(partial.numpy(), lse)


# -- merge_kernel ----------------------------------------------------------------------------
@pytest.mark.task("merge_kernel")
@pytest.mark.parametrize("num_splits,empty_splits,offset,tolerance", [(1, 0, 0.0, 1e-5), (5, 2, 0.0, 1e-5),
                                                                     (8, 3, 500.0, 1e-3), (5, 1, -500.0, 1e-3)])
def test_merge_kernel_matches_exact(ch06, num_splits, empty_splits, offset, tolerance):
    partial, lse, exact = split_attention(6, num_splits, 32, seed=20 + num_splits, offset=offset,
                                          empty_splits=empty_splits)
    # kvlab.check grades on the CPU interpreter; plain pytest on a GPU machine compiles natively.
    got = ch06.merge_with_kernel(partial.float().to(profile.DEVICE), lse.float().to(profile.DEVICE))
    assert_close(got.cpu(), exact, tolerance, f"{num_splits} splits, {empty_splits} empty, scores offset {offset:g}")


@pytest.mark.task("merge_kernel")
def test_merge_kernel_casts_to_the_output_dtype(ch06):
    partial, lse, exact = split_attention(4, 3, 16, seed=30)
    got = ch06.merge_with_kernel(partial.float().to(profile.DEVICE), lse.float().to(profile.DEVICE),
                                 dtype=torch.float16)
    assert got.dtype == torch.float16, f"asked for float16, got {got.dtype}"
    assert_close(got.cpu(), exact, 2e-3, "float16 output")
