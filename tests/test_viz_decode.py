"""Chapter 6's pictures: split ranges, the grid model, merge steps, pages per split, benchmark plots."""
import json
import math
import random

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab.kernels.paged_decode import choose_num_splits  # noqa: E402
from kvlab.paging import BlockPool  # noqa: E402
from kvlab.viz.decode import (  # noqa: E402
    BENCH_SERIES,
    benchmark_table,
    decode_benchmark,
    draw_grid_fills,
    draw_merge_step,
    draw_split_pages,
    grid_fill,
    merge_steps,
    pages_per_split,
    pages_read,
    plot_decode_bandwidth,
    plot_grid_efficiency,
    plot_split_speedup,
    predicted_speedup,
    read_decode_benchmark,
    sm_loads,
    split_token_ranges,
    tokens_per_split,
)


# -- split ranges and pages --------------------------------------------------------------------
def test_tokens_per_split_is_the_shortest_whole_tile_cover():
    rng = random.Random(0)
    for _ in range(300):
        longest, splits, block_n = rng.randint(1, 5000), rng.randint(1, 50), rng.choice([1, 16, 64])
        size = tokens_per_split(longest, splits, block_n)
        assert size % block_n == 0 and size * splits >= longest
        assert (size - block_n) * splits < longest


def test_split_ranges_partition_the_sequence():
    rng = random.Random(1)
    for _ in range(300):
        longest = rng.randint(1, 3000)
        seq_len = rng.randint(1, longest)
        ranges = split_token_ranges(seq_len, rng.randint(1, 40), rng.choice([1, 16, 64]), longest)
        assert ranges[0][0] == 0 and ranges[-1][1] == seq_len
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(start <= end for start, end in ranges)


def test_split_ranges_examples_and_errors():
    assert split_token_ranges(70, 3, 16) == [(0, 32), (32, 64), (64, 70)]
    assert split_token_ranges(20, 3, 16, max_seq_len=100) == [(0, 20), (20, 20), (20, 20)]
    with pytest.raises(ValueError, match="max_seq_len"):
        split_token_ranges(50, 2, 16, max_seq_len=40)
    with pytest.raises(ValueError, match="num_splits"):
        split_token_ranges(50, 0, 16)
    with pytest.raises(TypeError, match="block_n"):
        split_token_ranges(50, 2, 16.0)


def test_pages_read():
    assert pages_read([9, 4, 7, 1, 6], 6, 13, 4) == [4, 7, 1]
    assert pages_read([9, 4], 3, 3, 4) == []
    with pytest.raises(ValueError, match="beyond"):
        pages_read([9, 4], 0, 9, 4)
    with pytest.raises(ValueError, match="start"):
        pages_read([9, 4], 3, 2, 4)


# -- the grid model ----------------------------------------------------------------------------
def test_sm_loads_fill_the_least_loaded_sm_first():
    assert sm_loads([5, 5, 5], 2) == [10, 5]
    assert sm_loads([4, 1, 1, 1], 2) == [4, 3]
    assert sm_loads([], 3) == [0, 0, 0]
    with pytest.raises(ValueError, match="num_sms"):
        sm_loads([1], 0)


def test_grid_fill_of_decode_on_an_h200():
    one = grid_fill(batch=1, seq_len=32768, num_kv_heads=8, num_splits=1)
    assert (one.programs, one.busy_sms, one.critical_tokens) == (8, 8, 32768)
    assert one.efficiency == pytest.approx(8 / 132)
    auto = grid_fill(batch=1, seq_len=32768, num_kv_heads=8)
    assert auto.num_splits == choose_num_splits(1, 8, 32768, 132)
    assert auto.busy_sms == 132 and auto.efficiency > 0.9
    full = grid_fill(batch=32, seq_len=32768, num_kv_heads=8, num_splits=1)
    assert full.busy_sms == 132 and full.efficiency > 0.9
    assert sum(auto.sm_tokens) == 8 * 32768 and sum(full.sm_tokens) == 32 * 8 * 32768
    assert "8 of 132 SMs busy" in one.summary()
    assert predicted_speedup(1, 32768, 8) == pytest.approx(auto.efficiency / one.efficiency)


def test_grid_fill_counts_empty_splits_as_programs():
    fill = grid_fill(batch=1, seq_len=40, num_kv_heads=2, num_splits=8, num_sms=4, block_n=16)
    assert fill.programs == 16 and fill.program_tokens.count(0) == 10
    with pytest.raises(ValueError, match="batch"):
        grid_fill(batch=0, seq_len=40, num_kv_heads=2)


def test_grid_figures():
    fills = [[grid_fill(1, 4096, 8, 1), grid_fill(1, 4096, 8)], [grid_fill(32, 4096, 8, 1)]]
    assert isinstance(draw_grid_fills(fills, title="t"), Figure)
    assert isinstance(plot_grid_efficiency(batches=(1, 32), seq_lens=(1024, 8192)), Figure)
    with pytest.raises(ValueError):
        draw_grid_fills([])


# -- the merge, step by step -------------------------------------------------------------------
def test_merge_steps_reach_the_exact_output():
    gen = torch.Generator().manual_seed(0)
    scores, values = 3 * torch.randn(50, generator=gen), torch.randn(50, 6, generator=gen)
    steps = merge_steps(scores, values, 4)
    assert [s.merged for s in steps] == [1, 2, 3, 4]
    exact = (torch.softmax(scores.double(), 0) @ values.double()).numpy()
    np.testing.assert_allclose(steps[-1].output, exact, atol=1e-13)
    assert steps[-1].errors[-1] < 1e-13 < steps[0].errors[0]
    for step in steps:
        assert step.weights.sum() == pytest.approx(1.0)
        assert step.errors[step.merged - 1] == pytest.approx(np.abs(step.output - exact).max(), abs=1e-15)


def test_merge_steps_with_an_empty_split():
    gen = torch.Generator().manual_seed(1)
    steps = merge_steps(torch.randn(20, generator=gen), torch.randn(20, 3, generator=gen), 4, block_n=8)
    assert steps[-1].ranges[-1] == (20, 20) and steps[-1].split_lse[-1] == -math.inf
    assert steps[-1].errors[-1] < 1e-13 and not np.isnan(steps[-1].output).any()
    assert isinstance(draw_merge_step(steps[1]), Figure)
    with pytest.raises(ValueError, match="values"):
        merge_steps(torch.zeros(5), torch.zeros(4, 2), 2)


# -- pages per split ---------------------------------------------------------------------------
def shuffled_pool():
    pool = BlockPool(num_blocks=40, block_size=4)
    random.Random(0).shuffle(pool.free_blocks)
    for seq, n in [("a", 37), ("b", 9), ("c", 22), ("d", 5)]:
        pool.allocate(seq, n)
    return pool


def test_pages_per_split_follow_the_block_tables():
    pool = shuffled_pool()
    layouts = pages_per_split(pool, num_splits=3, block_n=8, seq_ids=["a", "b", "c"])
    assert [layout.tokens_per_split for layout in layouts] == [16, 16, 16]
    a = layouts[0]
    table = pool.block_table("a")
    assert a.pages == (tuple(table[0:4]), tuple(table[4:8]), tuple(table[8:10]))
    assert layouts[1].ranges == ((0, 9), (9, 9), (9, 9)) and layouts[1].pages[1:] == ((), ())
    assert a.token_split(0) == 0 and a.token_split(36) == 2
    with pytest.raises(ValueError, match="outside"):
        a.token_split(37)
    with pytest.raises(ValueError, match="seq_ids"):
        pages_per_split(pool, 3, 8, seq_ids=["zz"])


def test_a_page_can_be_read_by_two_splits():
    pool = BlockPool(num_blocks=8, block_size=6)
    pool.allocate("s", 30)
    (layout,) = pages_per_split(pool, num_splits=2, block_n=8)
    assert layout.ranges == ((0, 16), (16, 30))
    assert layout.pages[0][-1] == layout.pages[1][0] == pool.block_table("s")[2]   # tokens 12..17


def test_draw_split_pages():
    pool = shuffled_pool()
    fig = draw_split_pages(pool, pages_per_split(pool, 3, 8, ["a", "c"]), title="t")
    assert isinstance(fig, Figure)
    with pytest.raises(ValueError):
        draw_split_pages(pool, [])


# -- the benchmark -----------------------------------------------------------------------------
def payload():
    rows = []
    for batch, seq_len, split, non_split in [(32, 1024, 2.0, 1.5), (1, 32768, 3.0, 0.3)]:
        row = {"batch": batch, "seq_len": seq_len, "rel_err": "1e-3", "split_us": 1.0, "split_graph_us": "-",
               "split_vs_non_split": round(split / non_split, 2)}
        row.update({key: 1.0 for key, _, _ in BENCH_SERIES})
        row.update(split_TBps=split, non_split_TBps=non_split)
        rows.append(row)
    rows[0]["cudnn_contig_TBps"] = "n/a (no kernel)"
    return {"env": {"gpu": "test GPU", "sms": 132}, "copy_ceiling_Bps": 4.0e12, "rows": rows}


def test_decode_benchmark_reads_refusals_as_nan(tmp_path):
    path = tmp_path / "paged_decode.json"
    path.write_text(json.dumps(payload()))
    bench = read_decode_benchmark(path)
    assert [(r["batch"], r["seq_len"]) for r in bench.rows] == [(1, 32768), (32, 1024)]
    assert bench.copy_ceiling_TBps == pytest.approx(4.0)
    assert math.isnan(bench.row(32, 1024)["cudnn_contig_TBps"])
    assert bench.refusals == {(32, 1024, "cudnn_contig_TBps"): "n/a (no kernel)"}
    assert bench.speedup(bench.row(1, 32768)) == pytest.approx(10.0)
    assert bench.row(8, 8) is None
    assert read_decode_benchmark(tmp_path / "missing.json") is None


def test_decode_benchmark_refuses_other_json():
    with pytest.raises(ValueError, match="rows"):
        decode_benchmark({"env": {}, "copy_ceiling_Bps": 1.0})
    bad = payload()
    del bad["rows"][1]["split_TBps"]
    with pytest.raises(ValueError, match=r"rows\[1\]"):
        decode_benchmark(bad)
    with pytest.raises(TypeError):
        decode_benchmark([])


def test_benchmark_figures():
    bench = decode_benchmark(payload())
    assert isinstance(plot_decode_bandwidth(bench), Figure)
    assert isinstance(plot_split_speedup(bench), Figure)


def test_benchmark_table_marks_refusals():
    lines = benchmark_table(decode_benchmark(payload())).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:2] == ["1", "32768"] and "10.0x" in lines[1]
    assert "n/a" in lines[2] and "nan" not in lines[2]


def test_the_grid_model_uses_the_kernels_gpu_tile():
    from kvlab.kernels.paged_decode import GPU_BLOCK_N
    from kvlab.viz.decode import GPU_TILE

    assert GPU_TILE == GPU_BLOCK_N
