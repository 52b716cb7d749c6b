"""Figures of chapter 6, FlashDecoding: the decode grid against the SMs, the split-and-merge,
the pages each split reads, and the GPU benchmark's bandwidths.

What a figure shows is computed first by a pure function (tested on its own), then drawn. The
planning functions (:func:`grid_fill`, :func:`split_token_ranges`, ``choose_num_splits``) are
:mod:`kvlab.kernel_plan`'s and the benchmark's reader :mod:`kvlab.benchmark_results`'s, both
re-exported here: this module imports neither Triton nor :mod:`kvlab.kernels`.

* :func:`grid_fill` -> :func:`draw_grid_fills`, :func:`plot_grid_efficiency`: how many SMs
  the programs of one decode launch keep busy, without and with splits;
* :func:`merge_steps` -> :func:`draw_merge_step`: partial softmax results of each split,
  merged one after the other, against the exact attention output;
* :func:`pages_per_split` -> :func:`draw_split_pages`: which physical pages each split
  program reads through the block table;
* :func:`read_decode_benchmark` -> :func:`plot_decode_bandwidth`, :func:`plot_split_speedup`,
  :func:`benchmark_table`: the numbers of ``benchmarks/bench_paged_decode.py``.

Every figure is a :class:`matplotlib.figure.Figure` built without pyplot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.patheffects import withStroke

# The planning and the benchmark's reader live outside viz (no Triton import here); re-exported for the notebook.
from kvlab.benchmark_results import DecodeBenchmark, decode_benchmark, ratio, read_decode_benchmark  # noqa: F401
from kvlab.kernel_plan import (GPU_BLOCK_N, H200_SMS, GridFill, grid_fill, pages_read,  # noqa: F401
                               predicted_speedup, sm_loads, split_token_ranges, tokens_per_split)
from kvlab.viz.page_map import FREE_EDGE, FREE_FACE, tint

GPU_TILE = GPU_BLOCK_N  # paged_decode's tokens per tile on a GPU, kvlab.kernel_plan.GPU_BLOCK_N
SM_COLUMNS = 12     # SMs per row in the grid pictures
IDLE_FACE = "#e9ecef"
SPLIT_PALETTE = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]  # grey means "not read"


def split_colour(split: int) -> tuple:
    """The colour of split ``split`` in every figure of the chapter."""
    return SPLIT_PALETTE[split % len(SPLIT_PALETTE)]


# -- the launch grid against the SMs -------------------------------------------------------
def _format_tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def draw_grid_fills(rows, title: str = "") -> Figure:
    """SMs as squares, one panel per :class:`GridFill`; ``rows`` is a list of lists (one figure row each).

    A square's colour is the share of the launch's time its SM spends reading (its tokens /
    the busiest SM's tokens); grey SMs have nothing to do.
    """
    rows = [list(row) for row in rows]
    if not rows or not all(rows):
        raise ValueError("rows must be a non-empty list of non-empty lists of GridFill")
    columns = max(len(row) for row in rows)
    grid_rows = max(-(-fill.num_sms // SM_COLUMNS) for row in rows for fill in row)
    fig = Figure(figsize=(4.3 * columns, (0.26 * grid_rows + 0.9) * len(rows) + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(len(rows), columns, squeeze=False)
    cmap = colormaps["Blues"]
    for r, row in enumerate(rows):
        for c in range(columns):
            ax = axes[r][c]
            ax.set_axis_off()
            if c >= len(row):
                continue
            fill = row[c]
            for sm, tokens in enumerate(fill.sm_tokens):
                y, x = divmod(sm, SM_COLUMNS)
                share = tokens / fill.critical_tokens
                face = cmap(0.25 + 0.75 * share) if tokens else IDLE_FACE
                ax.add_patch(Rectangle((x, -y), 0.9, 0.9, facecolor=face, edgecolor="white" if tokens else "#ced4da",
                                       linewidth=0.5))
            ax.set_xlim(-0.1, SM_COLUMNS)
            ax.set_ylim(-grid_rows + 0.9, 1.0)
            ax.set_aspect("equal")
            splits = "no split" if fill.num_splits == 1 else f"{fill.num_splits} splits"
            ax.set_title(f"batch {fill.batch}, {_format_tokens(fill.seq_len)} tokens, {splits}\n"
                         f"{fill.programs} programs, {fill.busy_sms}/{fill.num_sms} SMs busy, "
                         f"efficiency {fill.efficiency:.0%}", fontsize=8.5)
    handles = [Patch(facecolor=IDLE_FACE, edgecolor="#ced4da", label="idle SM"),
               Patch(facecolor=cmap(0.6), label="busy SM (darker: busy longer)")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_grid_efficiency(batches=(1, 4, 32), seq_lens=(1024, 4096, 16384, 32768, 65536, 131072),
                         num_kv_heads: int = 8, num_sms: int = H200_SMS, block_n: int = GPU_TILE) -> Figure:
    """The grid model over context lengths: efficiency without and with splits, and their ratio."""
    if not batches or not seq_lens:
        raise ValueError("batches and seq_lens must not be empty")
    fig = Figure(figsize=(10, 3.6), dpi=100, layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, batch in enumerate(batches):
        colour = colormaps["tab10"].colors[i % 10]
        plain = [grid_fill(batch, n, num_kv_heads, 1, num_sms, block_n).efficiency for n in seq_lens]
        split = [grid_fill(batch, n, num_kv_heads, None, num_sms, block_n).efficiency for n in seq_lens]
        left.plot(seq_lens, [100 * e for e in plain], "--o", color=colour, mfc="white",
                  label=f"batch {batch}, no split")
        left.plot(seq_lens, [100 * e for e in split], "-o", color=colour, label=f"batch {batch}, split")
        right.plot(seq_lens, [s / p for s, p in zip(split, plain)], "-o", color=colour, label=f"batch {batch}")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seq_lens, [_format_tokens(n) for n in seq_lens])
        ax.set_xlabel("tokens per sequence")
        ax.grid(alpha=0.3)
    left.set(ylabel="SM streaming capacity used (%)", ylim=(0, 105),
             title=f"grid model: {num_kv_heads} KV heads, {num_sms} SMs")
    right.set(ylabel="split / no split", title="predicted speedup of splitting (merge cost left out)")
    right.set_ylim(bottom=0)
    left.legend(fontsize=7, ncols=2)
    right.legend(fontsize=8)
    return fig


# -- the split and the merge, step by step -------------------------------------------------
@dataclass(frozen=True, eq=False)
class MergeStep:
    """Softmax attention of one query over ``scores``/``values``, split, with ``merged`` splits merged."""

    merged: int                 # splits merged so far (1 .. num_splits)
    ranges: tuple               # (start, end) of every split
    scores: np.ndarray          # [n] the query's scores q.k * scale
    split_max: np.ndarray       # [num_splits] m_g (-inf: empty split)
    split_lse: np.ndarray       # [num_splits] lse_g = m_g + log l_g (-inf: empty split)
    partial_outputs: np.ndarray  # [num_splits, D] each split's normalised output
    output: np.ndarray          # [D] merge of splits 0 .. merged - 1
    exact: np.ndarray           # [D] softmax(scores) @ values
    errors: np.ndarray          # [num_splits] max |merge of the first k splits - exact|, k = 1 .. num_splits

    @property
    def num_splits(self) -> int:
        return len(self.ranges)

    @property
    def weights(self) -> np.ndarray:
        """exp(lse_g - max lse) / sum of them, over the merged splits."""
        lse = self.split_lse[:self.merged]
        w = np.exp(lse - lse.max())
        return w / w.sum()


def merge_steps(scores, values, num_splits: int, block_n: int = 1) -> list[MergeStep]:
    """One frame per split merged: float64 partial results and the running merge.

    ``scores`` is ``[n]`` (one query's scaled scores), ``values`` ``[n, D]``. The splits are
    those of :func:`split_token_ranges` (``block_n`` tokens per tile).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    values = torch.as_tensor(values, dtype=torch.float64)
    if scores.dim() != 1 or values.dim() != 2 or values.shape[0] != scores.shape[0]:
        raise ValueError(f"scores must be [n] and values [n, D], got {list(scores.shape)} and {list(values.shape)}")
    ranges = split_token_ranges(scores.shape[0], num_splits, block_n)
    exact = torch.softmax(scores, 0) @ values
    m = torch.full((num_splits,), -math.inf, dtype=torch.float64)
    lse = m.clone()
    partial = torch.zeros(num_splits, values.shape[1], dtype=torch.float64)
    for g, (start, end) in enumerate(ranges):
        if start == end:
            continue
        s = scores[start:end]
        m[g] = s.max()
        p = torch.exp(s - m[g])
        lse[g] = m[g] + torch.log(p.sum())
        partial[g] = p @ values[start:end] / p.sum()
    outputs = []
    for k in range(1, num_splits + 1):
        w = torch.exp(lse[:k] - lse[:k].max())
        outputs.append((w @ partial[:k]) / w.sum())
    errors = np.array([float((o - exact).abs().max()) for o in outputs])
    common = dict(ranges=tuple(ranges), scores=scores.numpy(), split_max=m.numpy(), split_lse=lse.numpy(),
                  partial_outputs=partial.numpy(), exact=exact.numpy(), errors=errors)
    return [MergeStep(merged=k, output=outputs[k - 1].numpy(), **common) for k in range(1, num_splits + 1)]


def draw_merge_step(step: MergeStep, dims: int = 12) -> Figure:
    """Scores by split, the merge weights, the output so far against the exact one, and the error."""
    fig = Figure(figsize=(13, 3.3), dpi=100, layout="constrained")
    ax_scores, ax_weights, ax_out, ax_err = fig.subplots(1, 4, width_ratios=[2.2, 1, 1.6, 1.4])
    positions = np.arange(len(step.scores))
    for g, (start, end) in enumerate(step.ranges):
        if start == end:
            continue
        done = g < step.merged
        colour = split_colour(g) if done else tint(split_colour(g), 0.7)
        ax_scores.bar(positions[start:end], step.scores[start:end], width=0.85, color=colour)
        if done:
            ax_scores.hlines([step.split_max[g], step.split_lse[g]], start - 0.5, end - 0.5, colors=["black", colour],
                             linestyles=["-", "--"], linewidth=1.2)
    marks = np.concatenate([step.scores, step.split_lse[np.isfinite(step.split_lse)], [0.0]])
    pad = 0.08 * (marks.max() - marks.min() or 1.0)
    ax_scores.set(title=f"scores by split ({step.merged} of {step.num_splits} merged)\n"
                        "solid: m_g, dashed: lse_g", xlabel="token position",
                  ylim=(marks.min() - pad, marks.max() + pad))      # the same in every frame
    ax_scores.title.set_fontsize(9)
    ax_scores.axhline(0, color="#adb5bd", linewidth=0.6)

    weights = step.weights
    ax_weights.bar(np.arange(step.merged), weights, color=[split_colour(g) for g in range(step.merged)])
    ax_weights.set(xlim=(-0.6, step.num_splits - 0.4), ylim=(0, 1.05), xticks=range(step.num_splits),
                   xlabel="split g", title="weights exp(lse_g - max lse),\nnormalised over the merged splits")
    ax_weights.title.set_fontsize(9)

    shown = min(dims, step.exact.shape[0])
    x = np.arange(shown)
    ax_out.bar(x, step.output[:shown], width=0.7, color="#748ffc",
               label=f"merge of {step.merged} split{'s' if step.merged > 1 else ''}")
    ax_out.scatter(x, step.exact[:shown], marker="_", s=160, color="black", linewidths=2, label="exact softmax")
    low = min(step.exact[:shown].min(), step.partial_outputs[:, :shown].min())
    high = max(step.exact[:shown].max(), step.partial_outputs[:, :shown].max())
    pad = 0.1 * (high - low or 1.0)
    ax_out.set(ylim=(low - pad, high + pad), xticks=x[::2], xlabel="output dimension",
               title="output (first dimensions)")
    ax_out.title.set_fontsize(9)
    ax_out.legend(fontsize=7, loc="lower right")

    floor = 1e-17
    ks = np.arange(1, step.num_splits + 1)
    errors = np.maximum(step.errors, floor)
    ax_err.plot(ks[:step.merged], errors[:step.merged], color="black", marker="o")
    ax_err.set_yscale("log")
    ax_err.set(xticks=ks, xlim=(0.6, step.num_splits + 0.4), xlabel="splits merged",
               ylim=(floor / 3, max(errors.max() * 3, 1.0)),
               title="max |merged - exact| (float64)")
    ax_err.title.set_fontsize(9)
    ax_err.grid(alpha=0.3)
    return fig


# -- which pages each split reads ----------------------------------------------------------
@dataclass(frozen=True)
class SplitPages:
    """The split ranges of one sequence and the pages of its block table they read."""

    seq_id: object
    seq_len: int
    block_size: int
    block_table: tuple
    tokens_per_split: int
    ranges: tuple           # (start, end) of every split

    @property
    def pages(self) -> tuple:
        """Physical pages each split reads, in logical order."""
        return tuple(tuple(pages_read(self.block_table, start, end, self.block_size)) for start, end in self.ranges)

    def token_split(self, pos: int) -> int:
        """The split that reads token position ``pos``."""
        for g, (start, end) in enumerate(self.ranges):
            if start <= pos < end:
                return g
        raise ValueError(f"position {pos} is outside the sequence's {self.seq_len} tokens")


def pages_per_split(pool, num_splits: int, block_n: int, seq_ids=None, *,
                    per_sequence: bool = False) -> list[SplitPages]:
    """:class:`SplitPages` of ``seq_ids`` (default: every sequence of ``pool``), as one decode launch.

    ``per_sequence=True`` cuts each sequence by its own length, as ``decode_split_kernel``
    does: these are the ranges the kernel reads. The default, ``False``, gives every sequence
    the split length of the longest of them: one length shared by the launch, as a kernel that
    computes it on the host would use.
    """
    seq_ids = list(pool.block_tables) if seq_ids is None else list(seq_ids)
    if not seq_ids:
        raise ValueError("pages_per_split needs at least one sequence")
    for seq in seq_ids:
        if seq not in pool.block_tables:
            raise ValueError(f"seq_ids: {seq!r} is not in the pool")
    lens = {seq: int(pool.seq_lens[seq]) for seq in seq_ids}
    longest = max(lens.values())
    cut_from = {seq: n if per_sequence else longest for seq, n in lens.items()}
    return [SplitPages(seq, lens[seq], int(pool.block_size), tuple(int(b) for b in pool.block_tables[seq]),
                       tokens_per_split(cut_from[seq], num_splits, block_n),
                       tuple(split_token_ranges(lens[seq], num_splits, block_n, cut_from[seq])))
            for seq in seq_ids]


def _striped_square(ax, x: float, y: float, slot_splits, label: str, fontsize: float, edge) -> None:
    """A page at (x, y): one vertical stripe per token slot, in its split's colour (pale: empty slot)."""
    size, n = 0.9, len(slot_splits)
    for i, split in enumerate(slot_splits):
        face = "white" if split is None else split_colour(split)
        ax.add_patch(Rectangle((x + size * i / n, y), size / n, size, facecolor=face, edgecolor="none"))
    ax.add_patch(Rectangle((x, y), size, size, facecolor="none", edgecolor=edge, linewidth=1.1))
    ax.text(x + size / 2, y + size / 2, label, ha="center", va="center", fontsize=fontsize,
            path_effects=[withStroke(linewidth=2.2, foreground="white")])


def _slot_splits(layout: SplitPages, logical: int) -> list:
    first = logical * layout.block_size
    return [layout.token_split(p) if p < layout.seq_len else None for p in range(first, first + layout.block_size)]


def draw_split_pages(pool, layouts, title: str = "", columns: int = 16) -> Figure:
    """Physical pages (left) and block tables (right), every token slot coloured by the split that reads it.

    Pages of sequences not in ``layouts`` are drawn hatched grey, free ones light grey.
    """
    layouts = list(layouts)
    if not layouts:
        raise ValueError("layouts must hold at least one SplitPages")
    owner = {}
    for layout in layouts:
        for logical, block in enumerate(layout.block_table):
            owner[block] = (layout, logical)
    others = {int(b) for seq, table in pool.block_tables.items() for b in table} - set(owner)
    num_blocks = int(pool.num_blocks)
    columns = min(columns, num_blocks)
    grid_rows = -(-num_blocks // columns)
    table_cols = max(len(layout.block_table) for layout in layouts)
    cell = 0.38
    label_w = 1.6
    width = cell * (columns + table_cols) + label_w + 1.0
    height = cell * max(grid_rows, len(layouts) + 1) + 1.5
    fig = Figure(figsize=(width, height), dpi=100)
    left_w = cell * columns / width
    grid_ax = fig.add_axes((0.2 / width, 0.35 / height, left_w, 1 - 1.3 / height))
    table_ax = fig.add_axes((0.2 / width + left_w + (label_w + 0.4) / width, 0.35 / height,
                             cell * table_cols / width, 1 - 1.3 / height))
    rows_shown = max(grid_rows, len(layouts) + 1)
    for ax, cols in ((grid_ax, columns), (table_ax, table_cols)):
        ax.set_xlim(-0.05, cols - 0.05)
        ax.set_ylim(0.95 - rows_shown, 0.95)
        ax.set_axis_off()
    for block in range(num_blocks):
        row, col = divmod(block, columns)
        if block in owner:
            layout, logical = owner[block]
            _striped_square(grid_ax, col, -row, _slot_splits(layout, logical), str(block), 7.5, "black")
        else:
            grid_ax.add_patch(Rectangle((col, -row), 0.9, 0.9, facecolor=FREE_FACE, edgecolor=FREE_EDGE,
                                        hatch="////" if block in others else None, linewidth=0.8))
            grid_ax.text(col + 0.45, -row + 0.45, str(block), ha="center", va="center", fontsize=7.5, color="#9a9a9a")
    grid_ax.set_title("physical pages (stripes: token slots)", fontsize=9, loc="left")
    for col in range(table_cols):
        table_ax.text(col + 0.45, 0.25, str(col), ha="center", va="center", fontsize=7, color="#777777")
    table_ax.text(-0.2, 0.25, "logical block:", ha="right", va="center", fontsize=7, color="#777777")
    for row, layout in enumerate(layouts, start=1):
        used = [(g, pages) for g, pages in enumerate(layout.pages) if pages]
        table_ax.text(-0.2, -row + 0.45, f"seq {layout.seq_id} ({layout.seq_len} tok)", ha="right", va="center",
                      fontsize=8, fontweight="bold")
        for logical, block in enumerate(layout.block_table):
            _striped_square(table_ax, logical, -row, _slot_splits(layout, logical), str(block), 7.5, "black")
        if len(used) < len(layout.ranges):
            table_ax.text(len(layout.block_table) + 0.1, -row + 0.45,
                          f"{len(layout.ranges) - len(used)} empty split(s)", va="center", fontsize=7, color="#777777")
    table_ax.set_title("block tables (logical -> physical page)", fontsize=9, loc="left")
    splits = max(len(layout.ranges) for layout in layouts)
    handles = [Patch(facecolor=split_colour(g), label=f"split {g}") for g in range(splits)]
    if others:
        handles.append(Patch(facecolor=FREE_FACE, edgecolor=FREE_EDGE, hatch="////", label="another sequence"))
    fig.legend(handles=handles, loc="lower left", ncols=min(len(handles), 6), fontsize=7.5, frameon=False,
               bbox_to_anchor=(0.1 / width, 0.0))
    heading = title or "Pages read by each split"
    sizes = [layout.tokens_per_split for layout in layouts]
    if len(set(sizes)) == 1:
        cut = f"{splits} splits of up to {sizes[0]} tokens"
    else:       # each sequence cut by its own length, as the kernel does
        cut = (f"{splits} splits, each sequence cut by its own length (tokens per split: "
               + ", ".join(f"{layout.seq_id} {size}" for layout, size in zip(layouts, sizes)) + ")")
    fig.text(0.2 / width, 1 - 0.1 / height, f"{heading}\n{cut}, block size {layouts[0].block_size}",
             ha="left", va="top", fontsize=10)
    return fig


# -- the GPU benchmark -----------------------------------------------------------------------
BENCH_SERIES = (
    ("split_TBps", "paged_decode, split", "#1c7ed6"),
    ("non_split_TBps", "paged_decode, 1 split", "#74c0fc"),
    ("cudnn_contig_TBps", "SDPA cuDNN, contiguous KV", "#2b8a3e"),
    ("flash_contig_TBps", "SDPA flash, contiguous KV", "#8ce99a"),
    ("gather_sdpa_TBps", "gather pages, then SDPA flash", "#e8590c"),
)


def benchmark_table(bench: DecodeBenchmark, num_kv_heads: int = 8, block_n: int = GPU_TILE) -> str:
    """The benchmark as text: bandwidths, split's ratios to its peers and the ceiling, the grid model's prediction."""
    num_sms = int(bench.env.get("sms", H200_SMS))

    def cell(value: float, fmt: str, width: int, suffix: str = "") -> str:
        return ("n/a" if math.isnan(value) else format(value, fmt) + suffix).rjust(width)

    lines = [f"{'batch':>5} {'tokens':>7} | {'split':>6} {'1 split':>7} {'cuDNN':>6} {'flash':>6} {'gather':>6} TB/s | "
             f"{'split/1 split':>13} {'split/gather':>12} {'split/cuDNN':>11} {'of ceiling':>10} | grid model"]
    for row in bench.rows:
        model = predicted_speedup(row["batch"], row["seq_len"], num_kv_heads, num_sms, block_n)
        split = row["split_TBps"]
        lines.append(
            f"{row['batch']:>5} {row['seq_len']:>7} | {cell(split, '.2f', 6)} {cell(row['non_split_TBps'], '.2f', 7)} "
            f"{cell(row['cudnn_contig_TBps'], '.2f', 6)} {cell(row['flash_contig_TBps'], '.2f', 6)} "
            f"{cell(row['gather_sdpa_TBps'], '.2f', 6)}      | {cell(bench.speedup(row), '.1f', 13, 'x')} "
            f"{cell(ratio(split, row['gather_sdpa_TBps']), '.1f', 12, 'x')} "
            f"{cell(ratio(split, row['cudnn_contig_TBps']), '.2f', 11, 'x')} "
            f"{cell(ratio(split, bench.copy_ceiling_TBps), '.0%', 10)} | {model:.1f}x")
    return "\n".join(lines)


def _case_label(row: dict) -> str:
    return f"B{row['batch']}\n{_format_tokens(row['seq_len'])}"


def plot_decode_bandwidth(bench: DecodeBenchmark) -> Figure:
    """Effective KV bandwidth (K and V bytes / time) per (batch, seq_len), every peer, and the copy ceiling."""
    rows = bench.rows
    fig = Figure(figsize=(max(7.0, 1.25 * len(rows) + 2.5), 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(BENCH_SERIES)
    x = np.arange(len(rows))
    for i, (key, label, colour) in enumerate(BENCH_SERIES):
        values = np.array([r[key] for r in rows])
        offsets = x - 0.4 + width * (i + 0.5)
        ax.bar(offsets, np.nan_to_num(values), width=width, color=colour, label=label)
        for xi, value in zip(offsets, values):
            if math.isnan(value):
                ax.text(xi, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=7, color=colour)
    ax.axhline(bench.copy_ceiling_TBps, color="black", linestyle="--", linewidth=1,
               label=f"copy ceiling ({bench.copy_ceiling_TBps:.2f} TB/s)")
    ax.set_xticks(x, [_case_label(r) for r in rows])
    highest = np.nanmax([r[key] for r in rows for key, _, _ in BENCH_SERIES] + [bench.copy_ceiling_TBps])
    ax.set_ylim(0, highest * 1.08)
    ax.set_ylabel("effective KV bandwidth (TB/s)")
    gpu = bench.env.get("gpu", "GPU")
    ax.set_title(f"Decode attention, one new token per sequence: {gpu}", fontsize=10)
    fig.legend(fontsize=7.5, ncols=3, loc="outside lower center", frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_split_speedup(bench: DecodeBenchmark, num_kv_heads: int = 8, block_n: int = GPU_TILE) -> Figure:
    """Measured split / non-split speedup per (batch, seq_len), beside the grid model's prediction."""
    rows = bench.rows
    num_sms = int(bench.env.get("sms", H200_SMS))
    measured = [bench.speedup(r) for r in rows]
    predicted = [predicted_speedup(r["batch"], r["seq_len"], num_kv_heads, num_sms, block_n) for r in rows]
    fig = Figure(figsize=(max(6.0, 1.0 * len(rows) + 2.5), 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(rows))
    heights = [0.0 if math.isnan(m) else m - 1 for m in measured]   # bars grow from 1x, up or down
    bars = ax.bar(x, heights, bottom=1, width=0.6, color="#1c7ed6", label="measured: split / 1 split")
    ax.bar_label(bars, labels=["n/a" if math.isnan(m) else f"{m:.1f}x" for m in measured], fontsize=8, padding=2)
    ax.scatter(x, predicted, marker="D", color="#e8590c", zorder=3, label=f"grid model ({num_sms} SMs)")
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set_yscale("log", base=2)
    shown = [v for v in measured + predicted if not math.isnan(v)]
    low, high = min(shown + [1.0]) / 1.6, max(shown + [1.0]) * 1.6
    ticks = [2.0 ** k for k in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)]
    ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(low, high)
    ax.set_xticks(x, [_case_label(r) for r in rows])
    ax.set_ylabel("speedup (log scale)")
    ax.set_title("What splitting the KV length buys", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig
