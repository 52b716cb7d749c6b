"""Graded tests of chapter 1: ``pytest tests/graded -m ch01 --impl=exercises``.

kvlab.accounting and kvlab.workloads.allocation are the reference answers.
"""
import random

import pytest

from kvlab import accounting as acc
from kvlab.workloads.allocation import last_block_waste

pytestmark = pytest.mark.ch01

DTYPES = ("fp32", "bf16", "fp8")
SEQ_LENS = (1, 512, 2048, 8192, 32768, 131072)


def check_cases(fn, cases):
    """``fn(*args) == want`` for each ``(args, want)`` of ``cases``."""
    for args, want in cases:
        got = fn(*args)
        assert got == want, f"{fn.__name__}{args} = {got}, expected {want}"


# -- kv_bytes_per_token -----------------------------------------------------------------------
@pytest.mark.ch01
@pytest.mark.task("kv_bytes_per_token")
def test_kv_bytes_per_token_of_the_presets(ch01):
    for spec in acc.PRESETS.values():
        for dtype in DTYPES:
            args = (spec.num_layers, spec.num_kv_heads, spec.head_dim, acc.DTYPE_BYTES[dtype])
            got, want = ch01.kv_bytes_per_token(*args), acc.kv_bytes_per_token(spec, dtype)
            assert got == want, f"{spec.name} in {dtype}: kv_bytes_per_token{args} = {got}, expected {want}"


@pytest.mark.ch01
@pytest.mark.task("kv_bytes_per_token")
def test_kv_bytes_per_token_of_random_shapes(ch01):
    rng = random.Random(1)
    for _ in range(200):
        layers, kv_heads, head_dim = rng.randint(1, 128), rng.randint(1, 64), rng.choice([32, 64, 80, 128, 256])
        dtype = rng.choice(DTYPES)
        spec = acc.ModelSpec("random", num_layers=layers, num_heads=kv_heads, num_kv_heads=kv_heads,
                             head_dim=head_dim, hidden_size=kv_heads * head_dim, intermediate_size=1, vocab_size=1)
        args = (layers, kv_heads, head_dim, acc.DTYPE_BYTES[dtype])
        got, want = ch01.kv_bytes_per_token(*args), acc.kv_bytes_per_token(spec, dtype)
        assert got == want, f"kv_bytes_per_token{args} = {got}, expected {want}"


# -- max_sequences ----------------------------------------------------------------------------
def _max_sequences_cases():
    """``(label, args, want)`` for every preset, GPU, length and utilisation; ``want`` is None
    where the weights do not fit (kvlab's answer raises ValueError)."""
    for spec in acc.PRESETS.values():
        for gpu in acc.GPUS:
            for seq_len in SEQ_LENS:
                for util in (0.5, 0.9, 1.0):
                    args = (acc.GPUS[gpu], acc.weight_bytes(spec), acc.kv_bytes_per_token(spec), seq_len, util)
                    try:
                        want = acc.max_sequences(spec, gpu, seq_len, gpu_memory_utilization=util)
                    except ValueError:
                        want = None
                    yield f"{spec.name} on {gpu}", args, want


@pytest.mark.ch01
@pytest.mark.task("max_sequences")
def test_max_sequences_when_the_weights_fit(ch01):
    fits = [case for case in _max_sequences_cases() if case[2] is not None]
    assert len(fits) > 100
    for label, args, want in fits:
        got = ch01.max_sequences(*args)
        assert got == want, f"{label}: max_sequences{args} = {got}, expected {want}"


@pytest.mark.ch01
@pytest.mark.task("max_sequences")
def test_max_sequences_raises_when_the_weights_do_not_fit(ch01):
    too_big = [(label, args) for label, args, want in _max_sequences_cases() if want is None]
    assert len(too_big) > 10
    for label, args in too_big:
        try:
            got = ch01.max_sequences(*args)
        except ValueError:
            continue
        pytest.fail(f"{label}: max_sequences{args} returned {got}; the weights do not fit, expected ValueError")


@pytest.mark.ch01
@pytest.mark.task("max_sequences")
def test_max_sequences_small_numbers(ch01):
    cases = [((100, 40, 2, 10, 0.9), 2), ((100, 40, 2, 10, 1.0), 3), ((1000, 0, 1, 1000, 1.0), 1),
             ((1000, 0, 1, 1001, 1.0), 0), ((1000, 899, 1, 1, 0.9), 1)]
    check_cases(ch01.max_sequences, cases)


# -- paged_waste ------------------------------------------------------------------------------
@pytest.mark.ch01
@pytest.mark.task("paged_waste")
def test_paged_waste_edge_cases(ch01):
    cases = [(([1, 16, 17], 16), 30), (([], 16), 0), (([0, 0], 16), 0), (([32, 64], 16), 0),
             (([5, 7], 1), 0), (([1], 256), 255)]
    check_cases(ch01.paged_waste, cases)


@pytest.mark.ch01
@pytest.mark.task("paged_waste")
def test_paged_waste_random_batches(ch01):
    rng = random.Random(2)
    for _ in range(300):
        block_size = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256])
        lens = [rng.randint(0, 5000) for _ in range(rng.randint(0, 40))]
        got, want = ch01.paged_waste(list(lens), block_size), last_block_waste(lens, block_size)
        assert got == want, f"paged_waste({lens}, {block_size}) = {got}, expected {want}"


@pytest.mark.ch01
@pytest.mark.task("max_sequences")
def test_max_sequences_budget_edges_and_type(ch01):
    # int() truncates the budget (round() would not): 0.75 * 10 = 7.5 -> 7 bytes; 0.5 * 103 = 51.5 -> 51
    check_cases(ch01.max_sequences, [((10, 0, 1, 1, 0.75), 7), ((103, 0, 1, 1, 0.5), 51), ((103, 1, 5, 10, 0.5), 1)])
    got = ch01.max_sequences(100, 40, 2, 10, 0.9)
    assert type(got) is int, f"max_sequences(100, 40, 2, 10, 0.9) returned {got!r}, a {type(got).__name__}: return an int"
    # a budget of exactly 0 bytes is not positive: the weights leave nothing for the KV cache
    for args in ((100, 90, 1, 1, 0.9), (1000, 1000, 1, 1, 1.0)):
        try:
            got = ch01.max_sequences(*args)
        except ValueError:
            continue
        pytest.fail(f"max_sequences{args} returned {got}; the KV budget is 0 bytes (not positive), expected ValueError")
