"""Chapter 5's frames and figures: the online softmax step by step, tile schedules, paged reads,
benchmark plots. The tile schedule is checked against brute force and against the kernels' own
``_causal_bounds``, run as a Triton kernel."""
import itertools
import json

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab import profile  # noqa: E402
from kvlab.kernels.flash_attention import _causal_bounds  # noqa: E402
from kvlab.viz.flash import (  # noqa: E402
    BENCH_COLUMNS,
    FULL,
    MASKED,
    SKIPPED,
    benchmark_ratios,
    causal_tile_bounds,
    draw_online_softmax_frame,
    draw_paged_reads,
    extend_label,
    format_error,
    load_flash_benchmark,
    online_softmax_drawer,
    online_softmax_frames,
    online_softmax_table,
    paged_reads,
    plot_attention_memory,
    plot_flash_benchmark,
    plot_online_softmax_convergence,
    plot_paged_vs_contiguous,
    plot_tile_schedules,
    shape_label,
    tile_schedule,
    visible_keys,
)
from kvlab.viz.stepper import frames_strip, step_through  # noqa: E402


def softmax_out(scores, values):
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (weights @ values) / weights.sum(axis=1, keepdims=True)


@pytest.fixture
def demo():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, 30))
    scores[0, 25] += 6          # a late maximum: the past gets rescaled
    values = rng.normal(size=(30, 4))
    return scores, values


# -- online softmax frames -----------------------------------------------------------------
def test_each_frame_is_the_softmax_of_the_keys_seen(demo):
    scores, values = demo
    frames = online_softmax_frames(scores, values, block_n=8)
    assert [f.tile for f in frames] == [1, 2, 3, 4] and [f.keys_seen for f in frames] == [8, 16, 24, 30]
    for f in frames:
        seen = f.keys_seen
        np.testing.assert_allclose(f.out, softmax_out(scores[:, :seen], values[:seen]), rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(f.m, scores[:, :seen].max(axis=1))
        np.testing.assert_allclose(f.l, np.exp(scores[:, :seen] - f.m[:, None]).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose(frames[-1].out, softmax_out(scores, values), rtol=1e-12, atol=1e-12)
    assert float(frames[-1].error.max()) < 1e-12
    np.testing.assert_allclose(frames[-1].mass_seen, 1.0)


def test_alpha_rescales_only_when_the_max_grows(demo):
    scores, values = demo
    frames = online_softmax_frames(scores, values, block_n=8)
    assert np.all(frames[0].alpha == 0.0), "the first tile has no past to rescale"
    for before, after in zip(frames, frames[1:]):
        np.testing.assert_allclose(after.alpha, np.exp(before.m - after.m))
        assert np.all((after.alpha < 1) == (after.m > before.m))
    masses = np.array([f.mass_seen for f in frames])
    assert np.all(np.diff(masses, axis=0) >= -1e-12)
    assert frames[3].alpha[0] < 1e-2, "row 0's late maximum (tile 4) rescales its past"


def test_masked_keys_and_a_row_that_has_seen_nothing_yet():
    scores = np.array([[-np.inf, -np.inf, 1.0, 2.0], [0.5, -np.inf, 0.0, 1.0]])
    values = np.arange(8.0).reshape(4, 2)
    frames = online_softmax_frames(scores, values, block_n=2)
    assert np.isnan(frames[0].out[0]).all() and frames[0].l[0] == 0
    assert np.isfinite(frames[0].out[1]).all()
    finite = np.where(np.isfinite(scores), scores, -1e300)
    np.testing.assert_allclose(frames[1].out, softmax_out(finite, values), rtol=1e-12)


def test_one_tile_bigger_than_all_keys(demo):
    scores, values = demo
    frames = online_softmax_frames(torch.tensor(scores), torch.tensor(values), block_n=64)
    assert len(frames) == 1 and frames[0].num_tiles == 1
    np.testing.assert_allclose(frames[0].out, softmax_out(scores, values), rtol=1e-12)


@pytest.mark.parametrize("scores,values,block_n,error", [
    (np.zeros((2, 4)), np.zeros((3, 2)), 2, ValueError),     # values rows != keys
    (np.zeros(4), np.zeros((4, 2)), 2, ValueError),          # scores not 2-D
    (np.zeros((2, 4)), np.zeros((4, 2)), 0, ValueError),
    (np.zeros((2, 4)), np.zeros((4, 2)), 2.0, TypeError),
    (np.zeros((0, 4)), np.zeros((4, 2)), 2, ValueError),
    ([["a"]], np.zeros((1, 1)), 1, TypeError),
])
def test_online_softmax_frames_refuses_bad_input(scores, values, block_n, error):
    with pytest.raises(error):
        online_softmax_frames(scores, values, block_n)


def test_table_has_a_line_per_tile_and_row(demo):
    frames = online_softmax_frames(*demo, block_n=8)
    lines = online_softmax_table(frames).splitlines()
    assert len(lines) == 1 + 4 * 3
    assert lines[-1].endswith("< 1e-12")
    assert format_error(0.5) == "5.00e-01" and format_error(1e-15) == "< 1e-12"
    with pytest.raises(ValueError):
        online_softmax_table([])


def test_frame_figures(demo):
    frames = online_softmax_frames(*demo, block_n=8)
    draw = online_softmax_drawer(frames)
    assert isinstance(draw(frames[1]), Figure)
    assert isinstance(draw_online_softmax_frame(frames[-1]), Figure)
    assert len(plot_online_softmax_convergence(frames).axes) == 3
    assert isinstance(frames_strip(frames, draw, indices=[0, 3], dpi=40), Figure)
    assert step_through(frames, draw) is not None
    for fn in (online_softmax_drawer, plot_online_softmax_convergence):
        with pytest.raises(ValueError):
            fn([])


# -- tile schedules ------------------------------------------------------------------------
SHAPES = [(lq, lk, bm, bn, causal) for lq, lk, bm, bn, causal in
          itertools.product((1, 7, 16, 33, 40), (1, 16, 40, 100), (16, 32), (16, 8), (True, False))
          if not (causal and lq > lk)]


@pytest.mark.parametrize("len_q,len_k,block_m,block_n,causal", SHAPES)
def test_schedule_agrees_with_brute_force(len_q, len_k, block_m, block_n, causal):
    seen = visible_keys(len_q, len_k, causal)
    schedule = tile_schedule(len_q, len_k, block_m, block_n, causal)
    assert schedule.num_programs == -(-len_q // block_m) and schedule.num_key_tiles == -(-len_k // block_n)
    for p, j in itertools.product(range(schedule.num_programs), range(schedule.num_key_tiles)):
        block = seen[p * block_m:(p + 1) * block_m, j * block_n:(j + 1) * block_n]
        state = schedule.states[p][j]
        if state == FULL:
            assert block.all() and block.shape[1] == block_n, (p, j)
        elif state == SKIPPED:
            assert not block.any(), (p, j)
        else:
            assert state == MASKED and block.any(), (p, j)
    # the full/masked split is as late as whole tiles allow: the tile after the last full one needs a mask
    for p, row in enumerate(schedule.states):
        if MASKED in row:
            j = row.index(MASKED)
            block = seen[p * block_m:(p + 1) * block_m, j * block_n:(j + 1) * block_n]
            assert not block.all() or block.shape[1] < block_n


@triton.jit
def _bounds_probe(out_ptr, len_q, len_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    pid = tl.program_id(0)
    full_end, end, _ = _causal_bounds(pid * BLOCK_M, len_q, len_k, BLOCK_M, BLOCK_N, CAUSAL)
    tl.store(out_ptr + 2 * pid, full_end)
    tl.store(out_ptr + 2 * pid + 1, end)


@pytest.mark.parametrize("len_q,len_k,block_m,block_n,causal",
                         [(40, 100, 16, 16, True), (33, 33, 32, 16, True), (7, 40, 16, 32, True),
                          (33, 40, 16, 16, False), (1, 17, 16, 16, True)])
def test_bounds_are_the_kernels_own(len_q, len_k, block_m, block_n, causal):
    programs = -(-len_q // block_m)
    out = torch.full((2 * programs,), -1, dtype=torch.int32, device=profile.DEVICE)
    _bounds_probe[(programs,)](out, len_q, len_k, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    want = [x for p in range(programs) for x in causal_tile_bounds(p * block_m, len_q, len_k, block_m, block_n,
                                                                    causal)]
    assert out.tolist() == want


def test_causal_skips_about_half_of_a_long_prefill():
    schedule = tile_schedule(4096, 4096, 128, 64, causal=True)
    assert schedule.count(MASKED) == 2 * 32             # 32 programs, each with 2 diagonal tiles of 64 keys
    assert abs(schedule.computed_share - 0.5) < 0.02
    assert tile_schedule(100, 100, 16, 16, causal=False).computed_share == 1.0


@pytest.mark.parametrize("args,error", [
    ((16, 10, 20, 16, 16), ValueError),       # start_m past the queries
    ((0, 30, 20, 16, 16), ValueError),        # causal, more queries than keys
    ((0, 0, 20, 16, 16), ValueError),
    ((0, 10, 20, 0, 16), ValueError),
    ((0, 10, 20, 16, 16.0), TypeError),
    ((True, 10, 20, 16, 16), TypeError),
])
def test_causal_tile_bounds_refuses_bad_input(args, error):
    with pytest.raises(error):
        causal_tile_bounds(*args)


def test_schedule_errors_and_counts():
    schedule = tile_schedule(40, 100, 16, 16)
    assert schedule.count(FULL) + schedule.count(MASKED) + schedule.count(SKIPPED) == 3 * 7
    with pytest.raises(ValueError):
        schedule.count("half")
    with pytest.raises(ValueError):
        tile_schedule(0, 10, 16, 16)
    with pytest.raises(ValueError):
        visible_keys(10, 5, causal=True)


def test_schedule_figure():
    fig = plot_tile_schedules([tile_schedule(100, 100, 16, 16), tile_schedule(40, 100, 16, 16, causal=False)],
                              titles=["a", "b"])
    assert [ax.get_title() for ax in fig.axes] == ["a", "b"]
    with pytest.raises(ValueError):
        plot_tile_schedules([])
    with pytest.raises(ValueError):
        plot_tile_schedules([tile_schedule(10, 10, 16, 16)], titles=["a", "b"])


# -- paged reads ---------------------------------------------------------------------------
def test_paged_reads_follow_the_block_table():
    table = [11, 3, 8, 0, 6, 2, 9, 5]
    reads = paged_reads(table, block_size=8, seq_len=64, query_len=43, block_m=16, block_n=16)
    assert reads.prefix_len == 21 and len(reads.states) == 3
    # program 0: queries at 21..36 see keys up to 36; its masked tile 32..47 is loaded whole
    assert reads.states[0][:16] == (FULL,) * 16
    assert reads.states[0][16:48] == (MASKED,) * 32 and reads.states[0][48:] == (SKIPPED,) * 16
    assert reads.pages[0] == (11, 3, 8, 0, 6, 2)
    assert reads.pages[-1] == tuple(table)
    assert paged_reads(torch.tensor(table, dtype=torch.int32), 8, 64, 43, 16, 16) == reads
    for p, row in enumerate(reads.states):
        loaded = [pos for pos, state in enumerate(row) if state != SKIPPED]
        assert reads.pages[p] == tuple(dict.fromkeys(table[pos // 8] for pos in loaded))


def test_paged_reads_states_match_the_contiguous_schedule():
    reads = paged_reads(list(range(10)), block_size=5, seq_len=50, query_len=50, block_m=16, block_n=16)
    schedule = tile_schedule(50, 50, 16, 16)
    for p, row in enumerate(reads.states):
        for pos, state in enumerate(row):
            assert state == schedule.states[p][pos // 16]


@pytest.mark.parametrize("kwargs,error", [
    (dict(block_table=[0], block_size=8, seq_len=9, query_len=1), ValueError),   # table too short
    (dict(block_table=[0, 1], block_size=8, seq_len=9, query_len=10), ValueError),
    (dict(block_table=[0, -1], block_size=8, seq_len=9, query_len=1), ValueError),
    (dict(block_table=[0, 1], block_size=8.0, seq_len=9, query_len=1), TypeError),
])
def test_paged_reads_refuses_bad_input(kwargs, error):
    with pytest.raises(error):
        paged_reads(block_m=16, block_n=16, **kwargs)


def test_paged_reads_figure():
    reads = paged_reads([4, 1, 7, 2, 0], 8, 40, 19, 16, 16)
    assert isinstance(draw_paged_reads(reads, title="t"), Figure)


# -- benchmark results -----------------------------------------------------------------------
def bench_rows():
    rows = []
    for head_dim, seq_len in itertools.product((64, 128), (1024, 4096)):
        rows.append({"batch": 1, "seq_len": seq_len, "heads": 32, "head_dim": head_dim, "kvlab": 100.0,
                     "kvlab_paged": 80.0, "kvlab_paged_new": 90.0, "sdpa_flash": 200.0, "sdpa_cudnn": 300.0,
                     "naive": 10.0 if seq_len == 1024 else None})
    return {"env": {"gpu": "test GPU", "torch": "0", "triton": "0", "date": "today"}, "rows": rows}


def extend_rows():
    return [{"batch": 8, "prefix": 768, "new": 256, "head_dim": 128, "kvlab": 400.0, "kvlab_paged": 300.0,
             "kvlab_paged_new": 320.0, "paged_vs_contiguous": 0.75, "paged_new_vs_contiguous": 0.8,
             "err_paged": 0.0, "err_paged_new": 0.0},
            {"batch": 4, "prefix": 3072, "new": 1024, "head_dim": 64, "kvlab": 200.0, "kvlab_paged": 170.0,
             "kvlab_paged_new": 150.0, "paged_vs_contiguous": 0.85, "paged_new_vs_contiguous": 0.75,
             "err_paged": 0.0, "err_paged_new": 0.0}]


def write_json(tmp_path, results):
    path = tmp_path / "flash_attention.json"
    path.write_text(json.dumps(results))
    return path


def test_benchmark_json(tmp_path):
    assert load_flash_benchmark(tmp_path / "missing.json") is None
    results = load_flash_benchmark(write_json(tmp_path, bench_rows()))     # no extends: still fine
    assert "extends" not in results
    assert len(plot_flash_benchmark(results).axes) == 2
    fig = plot_paged_vs_contiguous(results)
    assert len(fig.axes) == 2
    ax_abs, ax_ratio = fig.axes

    def curves(ax):                       # the lines drawn over the rows' lengths
        return sorted(tuple(line.get_ydata()) for line in ax.lines if list(line.get_xdata()) == [1024, 4096])

    # per shape: contiguous and both paged modes in TFLOP/s; both paged modes as a ratio
    assert curves(ax_abs) == [(80.0, 80.0)] * 2 + [(90.0, 90.0)] * 2 + [(100.0, 100.0)] * 2
    assert curves(ax_ratio) == [(0.8, 0.8)] * 2 + [(0.9, 0.9)] * 2
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {BENCH_COLUMNS["kvlab_paged"], BENCH_COLUMNS["kvlab_paged_new"]} <= set(legend)
    ratios = benchmark_ratios(results)
    assert len(ratios) == 4
    assert ratios[0]["cudnn_vs_flash"] == 1.5 and ratios[0]["kvlab_vs_flash"] == 0.5
    assert ratios[0]["paged_vs_contiguous"] == 0.8 and ratios[0]["paged_new_vs_contiguous"] == 0.9


def test_benchmark_bars():
    results = bench_rows()                  # head_dim 64 and 128, each at 1 x 1K and 1 x 4K
    results["rows"] += [dict(results["rows"][0], batch=2, kvlab=111.0),            # 2 x 1K, head_dim 64
                        dict(results["rows"][0], batch=8, seq_len=512, kvlab=123.0)]
    fig = plot_flash_benchmark(results)
    assert fig.get_size_inches()[0] <= 15
    assert [ax.get_title() for ax in fig.axes] == ["head_dim 64", "head_dim 128"]      # one panel per head_dim
    ax64, ax128 = fig.axes
    assert ax64.get_subplotspec().get_gridspec().get_width_ratios() == [4, 2]         # as wide as its rows
    # one bar group per shape, by sequence length then batch
    assert [t.get_text() for t in ax64.get_xticklabels()] == ["8x512", "1x1K", "2x1K", "1x4K"]
    assert [t.get_text() for t in ax128.get_xticklabels()] == ["1x1K", "1x4K"]

    def bars(ax, group):                     # kernel label -> heights of its bars in bar group `group`
        return {c.get_label(): [b.get_height() for b in c if round(b.get_x() + b.get_width() / 2) == group]
                for c in ax.containers}

    row = results["rows"][-2]                # 2 x 1K
    assert bars(ax64, 2) == {label: [row[column]] for column, label in BENCH_COLUMNS.items()}
    lefts = [b.get_x() for c in ax64.containers for b in c if round(b.get_x() + b.get_width() / 2) == 2]
    assert all(a < b for a, b in zip(lefts, lefts[1:]))      # side by side, in BENCH_COLUMNS order
    assert bars(ax128, 1)[BENCH_COLUMNS["naive"]] == []      # naive is None at 4K: no bar
    assert bars(ax128, 1)[BENCH_COLUMNS["sdpa_cudnn"]] == [300.0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(BENCH_COLUMNS.values())
    assert [shape_label({"batch": 8, "seq_len": n}) for n in (1024, 16384, 512, 1536)] == \
        ["8x1K", "8x16K", "8x512", "8x1536"]


def test_benchmark_json_with_extends(tmp_path):
    results = load_flash_benchmark(write_json(tmp_path, dict(bench_rows(), extends=extend_rows())))
    assert extend_label(results["extends"][0]) == "8x(768+256) D128"
    fig = plot_paged_vs_contiguous(results)
    assert len(fig.axes) == 3
    ax_ext = fig.axes[2]
    assert [t.get_text() for t in ax_ext.get_xticklabels()] == ["8x(768+256) D128", "4x(3072+1024) D64"]
    # grouped bars: every key through the table, then new K/V given, for each extend
    every_key, new_given = ax_ext.containers
    np.testing.assert_allclose([bar.get_height() for bar in every_key], [0.75, 0.85])
    np.testing.assert_allclose([bar.get_height() for bar in new_given], [0.8, 0.75])
    assert all(a.get_x() < b.get_x() for a, b in zip(every_key, new_given))
    assert [t.get_text() for t in ax_ext.get_legend().get_texts()] == [BENCH_COLUMNS["kvlab_paged"],
                                                                       BENCH_COLUMNS["kvlab_paged_new"]]


def test_benchmark_json_with_a_missing_column(tmp_path):
    broken = bench_rows()
    del broken["rows"][1]["sdpa_cudnn"]
    path = write_json(tmp_path, broken)
    with pytest.raises(ValueError, match=r"rows\[1\] lacks sdpa_cudnn"):
        load_flash_benchmark(path)
    broken = bench_rows()
    del broken["rows"][3]["kvlab_paged_new"]
    with pytest.raises(ValueError, match=r"rows\[3\] lacks kvlab_paged_new"):
        load_flash_benchmark(write_json(tmp_path, broken))
    path.write_text("[]")
    with pytest.raises(ValueError):
        load_flash_benchmark(path)
    with pytest.raises(TypeError):
        plot_flash_benchmark([])


def broken_extends():
    missing = extend_rows()
    del missing[1]["kvlab_paged_new"], missing[1]["prefix"]
    return [({"batch": 8}, r"extends must be a list of rows, got dict"),
            ([extend_rows()[0], [1, 2]], r"extends\[1\] must be a dict, got list"),
            (missing, r"extends\[1\] lacks prefix, kvlab_paged_new")]


@pytest.mark.parametrize("extends,message", broken_extends())
def test_benchmark_json_refuses_malformed_extends(tmp_path, extends, message):
    with pytest.raises(ValueError, match=message):
        load_flash_benchmark(write_json(tmp_path, dict(bench_rows(), extends=extends)))


def test_memory_figure():
    fig = plot_attention_memory([128, 256], [1000, None], [10, 20], device_label="cpu")
    assert isinstance(fig, Figure)
    with pytest.raises(ValueError):
        plot_attention_memory([128], [1, 2], [1])
