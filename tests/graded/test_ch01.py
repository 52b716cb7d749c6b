"""Graded tests of chapter 1: ``pytest tests/graded -m ch01 --impl=exercises``.

kvlab.accounting and kvlab.allocation_sim are the reference answers.
"""
import random

import pytest

from kvlab import accounting as acc
from kvlab.allocation_sim import last_block_waste

pytestmark = pytest.mark.ch01

DTYPES = ("fp32", "bf16", "fp8")
SEQ_LENS = (1, 512, 2048, 8192, 32768, 131072)


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
    for spec in acc.PRESETS.values():
        for gpu in acc.GPUS:
            for seq_len in SEQ_LENS:
                for util in (0.5, 0.9, 1.0):
                    args = (acc.GPUS[gpu], acc.weight_bytes(spec), acc.kv_bytes_per_token(spec), seq_len, util)
                    yield f"{spec.name} on {gpu}", args, (spec, gpu, seq_len, util)


@pytest.mark.ch01
@pytest.mark.task("max_sequences")
def test_max_sequences_when_the_weights_fit(ch01):
    checked = 0
    for label, args, (spec, gpu, seq_len, util) in _max_sequences_cases():
        try:
            want = acc.max_sequences(spec, gpu, seq_len, gpu_memory_utilization=util)
        except ValueError:
            continue
        got = ch01.max_sequences(*args)
        assert got == want, f"{label}: max_sequences{args} = {got}, expected {want}"
        checked += 1
    assert checked > 100


@pytest.mark.ch01
@pytest.mark.task("max_sequences")
def test_max_sequences_raises_when_the_weights_do_not_fit(ch01):
    checked = 0
    for label, args, (spec, gpu, seq_len, util) in _max_sequences_cases():
        try:
            acc.max_sequences(spec, gpu, seq_len, gpu_memory_utilization=util)
            continue
        except ValueError:
            pass
        try:
            got = ch01.max_sequences(*args)
        except ValueError:
            checked += 1
            continue
        pytest.fail(f"{label}: max_sequences{args} returned {got}; the weights do not fit, expected ValueError")
    assert checked > 10


@pytest.mark.ch01
@pytest.mark.task("max_sequences")
def test_max_sequences_small_numbers(ch01):
    cases = [((100, 40, 2, 10, 0.9), 2), ((100, 40, 2, 10, 1.0), 3), ((1000, 0, 1, 1000, 1.0), 1),
             ((1000, 0, 1, 1001, 1.0), 0), ((1000, 899, 1, 1, 0.9), 1)]
    for args, want in cases:
        got = ch01.max_sequences(*args)
        assert got == want, f"max_sequences{args} = {got}, expected {want}"


# -- paged_waste ------------------------------------------------------------------------------
@pytest.mark.ch01
@pytest.mark.task("paged_waste")
def test_paged_waste_edge_cases(ch01):
    cases = [(([1, 16, 17], 16), 30), (([], 16), 0), (([0, 0], 16), 0), (([32, 64], 16), 0),
             (([5, 7], 1), 0), (([1], 256), 255)]
    for args, want in cases:
        got = ch01.paged_waste(*args)
        assert got == want, f"paged_waste{args} = {got}, expected {want}"


@pytest.mark.ch01
@pytest.mark.task("paged_waste")
def test_paged_waste_random_batches(ch01):
    rng = random.Random(2)
    for _ in range(300):
        block_size = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256])
        lens = [rng.randint(0, 5000) for _ in range(rng.randint(0, 40))]
        got, want = ch01.paged_waste(list(lens), block_size), last_block_waste(lens, block_size)
        assert got == want, f"paged_waste({lens}, {block_size}) = {got}, expected {want}"
