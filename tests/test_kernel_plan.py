"""kvlab.kernel_plan: the launch planning of chapters 5 and 6, checked without Triton."""
import importlib
import inspect
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import brute_force_bounds
from kvlab import kernel_plan as kp
from kvlab import profile


def test_planning_imports_no_triton():
    """The planning, the benchmark readers and the chapter 5/6 figures load without Triton (on a
    GPU machine, where kvlab itself does not need the interpreter)."""
    code = ("import sys, kvlab.kernel_plan, kvlab.benchmark_results, kvlab.viz.flash, kvlab.viz.decode; "
            "print('triton' in sys.modules, 'kvlab.kernels' in sys.modules)")
    env = dict(os.environ, KVLAB_PROFILE="cpu", TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_kernels_use_the_plan():
    fa = importlib.import_module("kvlab.kernels.flash_attention")   # (the package exports the functions)
    pd = importlib.import_module("kvlab.kernels.paged_decode")

    assert pd.choose_num_splits is kp.choose_num_splits
    assert (pd.GPU_BLOCK_N, pd.INTERPRETER_BLOCK_N, pd.MAX_SPLITS) == (kp.GPU_BLOCK_N, kp.INTERPRETER_BLOCK_N,
                                                                      kp.MAX_SPLITS)
    assert fa.tile_config is kp.tile_config and fa._launch_config is kp.launch_config


def test_notebook_06_prints_only_the_split_model():
    """Notebook 06 prints the module from '# -- how many splits' to choose_num_splits: constants only,
    no graded answer (split ranges, pages) in between."""
    source = inspect.getsource(kp)
    shown = source[source.index("# -- how many splits"):source.index("def choose_num_splits")]
    assert "def " not in shown and "MIN_TOKENS_PER_SPLIT = 256" in shown


# -- tiles ---------------------------------------------------------------------------------------
def test_next_power_of_2_matches_triton():
    import triton

    assert [kp.next_power_of_2(n) for n in range(1, 3000)] == [triton.next_power_of_2(n) for n in range(1, 3000)]
    assert kp.next_power_of_2(0) == 1


def test_tile_config(monkeypatch):
    monkeypatch.setattr(profile, "INTERPRETED", True)
    assert kp.tile_config(128) == dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    monkeypatch.setattr(profile, "INTERPRETED", False)
    assert kp.tile_config(128) == dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    assert kp.tile_config(64, 1024) == dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    assert kp.tile_config(256, 4096) == dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    assert kp.tile_config(128, 1)["BLOCK_M"] == 16 and kp.tile_config(128, 1)["num_warps"] == 4
    assert kp.tile_config(128, 40)["BLOCK_M"] == 64
    # A chunk of 2K queries over a 32K prefix: big tiles; the same chunk over 4K keys, or at head_dim 64: small
    assert kp.tile_config(128, 2048, 34816)["BLOCK_M"] == 128 == kp.tile_config(128, 2048, 34816)["BLOCK_N"]
    assert kp.tile_config(128, 1024, 4096)["BLOCK_N"] == 64 == kp.tile_config(64, 2048, 34816)["BLOCK_N"]
    # Over a quantised cache: 128 x 64 at every length, 8 warps for fp8 and 4 for int8; fewer
    # than 128 queries take 4 warps
    assert kp.tile_config(128, 4096, 36864, "fp8") == dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    assert kp.tile_config(128, 4096, 36864, "int8") == dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    assert kp.tile_config(64, 1024, 4096, "fp8")["num_warps"] == 4
    assert kp.tile_config(128, 40, 4096, "fp8") == dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def test_launch_config(monkeypatch):
    monkeypatch.setattr(profile, "INTERPRETED", False)
    assert kp.launch_config(128, None, None, None, None, None, 2)["num_stages"] == 3       # bf16 fits 3
    assert kp.launch_config(128, None, None, None, None, None, 4)["num_stages"] == 1       # float32: 128 KiB a stage
    assert kp.launch_config(128, None, None, None, None, 5, 4)["num_stages"] == 5          # given: kept
    assert kp.launch_config(64, 100, 32, 16, 2, 1)["BLOCK_M"] == 32
    assert kp.launch_config(128, 512, None, None, None, None, 2, 8192, kv_cache_dtype="fp8")["BLOCK_N"] == 64
    for block_m, block_n in ((8, None), (None, 48)):
        with pytest.raises(ValueError, match="power of two"):
            kp.launch_config(64, None, block_m, block_n, None, None)


# -- FlashAttention ------------------------------------------------------------------------------
def test_causal_tile_bounds_against_brute_force():
    assert kp.causal_tile_bounds(16, 40, 100, 16, 16) == (64, 92)
    for len_q, len_k, block_m, block_n, causal in itertools.product(
            (1, 5, 16, 33), (1, 7, 16, 40), (16, 32), (16, 8), (True, False)):
        if causal and len_q > len_k:
            continue
        for start_m in range(0, len_q, block_m):
            assert kp.causal_tile_bounds(start_m, len_q, len_k, block_m, block_n, causal) == \
                brute_force_bounds(start_m, len_q, len_k, block_m, block_n, causal)


def test_causal_tile_bounds_checks_its_arguments():
    with pytest.raises(ValueError, match="len_q <= len_k"):
        kp.causal_tile_bounds(0, 10, 5, 16, 16)
    with pytest.raises(ValueError, match="start_m"):
        kp.causal_tile_bounds(16, 10, 20, 16, 16)
    with pytest.raises(TypeError, match="block_n must be an int, got float"):
        kp.causal_tile_bounds(0, 10, 20, 16, 16.0)
    with pytest.raises(TypeError, match="len_q must be an int, got bool"):
        kp.causal_tile_bounds(0, True, 20, 16, 16)
    assert kp.causal_tile_bounds(np.int64(0), np.int32(10), 20, 16, 16) == (0, 20)   # NumPy's ints are ints


def test_tile_schedule_and_paged_reads():
    schedule = kp.tile_schedule(64, 64, 16, 16)
    assert schedule.count(kp.MASKED) == 4 and schedule.count(kp.FULL) == 6 and schedule.count(kp.SKIPPED) == 6
    assert schedule.computed_share == 10 / 16
    assert kp.tile_schedule(64, 64, 16, 16, causal=False).computed_share == 1.0
    reads = kp.paged_reads([7, 3, 9, 1], 4, 14, 6, 4, 4)     # 8 cached tokens, 6 new; 4 pages of 4
    assert reads.prefix_len == 8
    assert reads.pages == ((7, 3, 9), (7, 3, 9, 1))
    assert reads.states[0][:8] == (kp.FULL,) * 8 and reads.states[0][-2:] == (kp.SKIPPED,) * 2
    with pytest.raises(ValueError, match="too few"):
        kp.paged_reads([7], 4, 14, 6, 4, 4)


# -- FlashDecoding -------------------------------------------------------------------------------
def test_split_token_ranges_are_the_kernels_loops():
    for seq_len, num_splits, block_n in itertools.product((1, 15, 16, 17, 100, 257), (1, 2, 3, 7), (1, 16, 64)):
        ranges = kp.split_token_ranges(seq_len, num_splits, block_n)
        size = kp.tokens_per_split(seq_len, num_splits, block_n)
        assert size % block_n == 0 and size * num_splits >= seq_len
        assert ranges[0][0] == 0 and ranges[-1][1] == seq_len
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))       # contiguous, in order
    assert kp.split_token_ranges(20, 4, 16) == [(0, 16), (16, 20), (20, 20), (20, 20)]
    assert kp.split_token_ranges(20, 2, 16, max_seq_len=64) == [(0, 20), (20, 20)]
    with pytest.raises(ValueError, match="max_seq_len"):
        kp.split_token_ranges(20, 2, 16, max_seq_len=10)
    assert kp.pages_read([5, 6, 7], 3, 9, 4) == [5, 6, 7] and kp.pages_read([5, 6, 7], 4, 4, 4) == []


def test_choose_num_splits_on_an_h200():
    for batch, max_seq_len, want in ((32, 32768, 1), (16, 32768, 2), (1, 32768, 32), (1, 1024, 4), (1, 300, 1)):
        assert kp.choose_num_splits(batch, 8, max_seq_len, kp.H200_SMS) == want


def test_a_quantised_cache_plans_four_programs_an_sm():
    """decode_streams_kernel's 2-warp programs, four an SM: twice the programs fit in one wave, so a
    batch that filled the GPU with one split now takes two, and one long sequence twice the splits."""
    for batch, max_seq_len, want in ((32, 32768, 2), (1, 131072, 64), (8, 8192, 8), (32, 1024, 2), (1, 300, 1)):
        assert kp.choose_num_splits(batch, 8, max_seq_len, kp.H200_SMS, quantised=True) == want
    # the defaults are the launch's: 2 x 32-key tiles; given ones win
    assert kp.choose_num_splits(32, 8, 32768, kp.H200_SMS, quantised=True, programs_per_sm=2) == 1


def test_grid_fill():
    plain = kp.grid_fill(1, 32768, 8, 1)
    assert plain.programs == 8 and plain.busy_sms == 8 and plain.efficiency == pytest.approx(8 / 132)
    split = kp.grid_fill(1, 32768, 8)
    assert split.num_splits == kp.choose_num_splits(1, 8, 32768, 132) and split.programs == 8 * split.num_splits
    assert kp.predicted_speedup(1, 32768, 8) == pytest.approx(split.efficiency / plain.efficiency)
    assert kp.sm_loads([5, 3, 1, 1], 2) == [5, 5]        # 5 | 3, then 1 and 1 to the lighter SM
