"""Figures of chapter 5: FlashAttention's online softmax and its tiles.

* :func:`online_softmax_frames` folds a few rows of scores into a running softmax, one tile of
  keys at a time, and keeps the state after every tile; :func:`draw_online_softmax_frame` and
  :func:`plot_online_softmax_convergence` draw it.
* :func:`draw_tile_schedule` and :func:`draw_paged_reads` draw what every program of the kernels
  in :mod:`kvlab.kernels.flash_attention` does with every tile of keys, as
  :mod:`kvlab.kernel_plan` computes it (:func:`~kvlab.kernel_plan.tile_schedule`,
  :func:`~kvlab.kernel_plan.paged_reads`, the Python twin of the kernels' ``_causal_bounds``).
* the ``plot_*`` functions draw what the GPU benchmark measured, as
  :func:`kvlab.benchmark_results.load_flash_benchmark` reads it.

Figures are built without pyplot, so nothing is drawn at import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

# The tile planning and the benchmark's reader live outside viz; re-exported here for the notebook.
from kvlab.benchmark_results import (BENCH_COLUMNS, PAGED_COLUMNS, benchmark_ratios, flash_groups,  # noqa: F401
                                     flash_rows, load_flash_benchmark)
from kvlab.kernel_plan import (FULL, MASKED, SKIPPED, TILE_STATES, PagedReads, TileSchedule,  # noqa: F401
                               causal_tile_bounds, check_int, paged_reads, tile_schedule)

TILE_COLOURS = {FULL: "#2b8a3e", MASKED: "#f59f00", SKIPPED: "#e9ecef"}
TILE_NAMES = {FULL: "computed, no mask", MASKED: "computed with a mask (diagonal or ragged end)",
              SKIPPED: "skipped: never loaded"}
ROW_COLOURS = ("#1c7ed6", "#e8590c", "#7048e8", "#2b8a3e", "#c2255c", "#0c8599")


# -- the online softmax, tile by tile -----------------------------------------------------
@dataclass(frozen=True, eq=False)
class OnlineSoftmaxFrame:
    """The running softmax of a few query rows after ``tile`` tiles of ``block_n`` keys.

    ``m`` is each row's running max, ``l`` its running sum of ``exp(s - m)``, ``alpha`` the
    factor this tile multiplied the past by (``exp(m_old - m)``), ``out`` the output so far
    (``acc / l``), ``exact`` the answer over all keys, ``mass_seen`` the share of the final
    softmax denominator the keys seen so far carry.
    """

    tile: int
    block_n: int
    scores: np.ndarray      # [rows, keys], every key (a frame shows those seen)
    m: np.ndarray           # [rows]
    l: np.ndarray           # [rows]
    alpha: np.ndarray       # [rows]
    out: np.ndarray         # [rows, head_dim]
    exact: np.ndarray       # [rows, head_dim]
    mass_seen: np.ndarray   # [rows]

    @property
    def num_keys(self) -> int:
        return self.scores.shape[1]

    @property
    def num_tiles(self) -> int:
        return -(-self.num_keys // self.block_n)

    @property
    def keys_seen(self) -> int:
        return min(self.tile * self.block_n, self.num_keys)

    @property
    def error(self) -> np.ndarray:
        """Each row's largest ``|out - exact|``."""
        return np.abs(self.out - self.exact).max(axis=1)


def _as_float64(name: str, x, dims: int) -> np.ndarray:
    try:
        array = x.detach().cpu().double().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a tensor or an array of numbers: {err}") from None
    if array.ndim != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {list(array.shape)}")
    return array


def online_softmax_frames(scores, values, block_n: int) -> list[OnlineSoftmaxFrame]:
    """Fold ``scores`` ``[rows, keys]`` (already scaled; ``-inf`` masks a key) into a running
    softmax ``block_n`` keys at a time, against ``values`` ``[keys, head_dim]``; float64.

    Returns one frame per tile. The last frame's ``out`` is ``softmax(scores) @ values``.
    """
    s_all = _as_float64("scores", scores, 2)
    v_all = _as_float64("values", values, 2)
    block_n = check_int("block_n", block_n, 1)
    rows, keys = s_all.shape
    if rows == 0 or keys == 0:
        raise ValueError(f"scores needs at least one row and one key, got shape {list(s_all.shape)}")
    if v_all.shape[0] != keys:
        raise ValueError(f"values has {v_all.shape[0]} rows, scores has {keys} keys: they must match")
    row_max = s_all.max(axis=1, keepdims=True)
    weights = np.exp(s_all - np.where(np.isfinite(row_max), row_max, 0.0))
    total = weights.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        exact = (weights @ v_all) / total[:, None]
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    acc = np.zeros((rows, v_all.shape[1]))
    frames = []
    for tile, start in enumerate(range(0, keys, block_n), start=1):
        s, v = s_all[:, start:start + block_n], v_all[start:start + block_n]
        m_new = np.maximum(m, s.max(axis=1))
        seen_any = np.isfinite(m_new)          # a row whose keys so far are all masked has nothing yet
        base = np.where(seen_any, m_new, 0.0)
        alpha = np.where(seen_any, np.exp(m - base), 1.0)
        p = np.exp(s - base[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ v
        m = m_new
        with np.errstate(invalid="ignore", divide="ignore"):
            out = acc / l[:, None]
            mass = l * np.exp(base - np.where(np.isfinite(row_max[:, 0]), row_max[:, 0], 0.0)) / total
        frames.append(OnlineSoftmaxFrame(tile, block_n, s_all, m.copy(), l.copy(), alpha, out, exact, mass))
    return frames


def format_error(error: float) -> str:
    """An error for a printed table: tiny ones (rounding) read ``< 1e-12``."""
    return "< 1e-12" if error < 1e-12 else f"{error:.2e}"


def online_softmax_table(frames: Sequence[OnlineSoftmaxFrame]) -> str:
    """Every frame's state as text, one line per tile and row (for viewers without widgets)."""
    if not frames:
        raise ValueError("online_softmax_table needs at least one frame")
    lines = [f"{'tile':>4} {'keys seen':>9} {'row':>3} {'m':>8} {'alpha':>8} {'l':>9} {'mass seen':>9} "
             f"{'max|out - exact|':>17}"]
    for frame in frames:
        for row in range(frame.m.shape[0]):
            lines.append(f"{frame.tile:>4} {frame.keys_seen:>9} {row:>3} {frame.m[row]:8.3f} {frame.alpha[row]:8.4f} "
                         f"{frame.l[row]:9.4f} {frame.mass_seen[row]:9.1%} {format_error(frame.error[row]):>17}")
    return "\n".join(lines)


def _row_colour(row: int) -> str:
    return ROW_COLOURS[row % len(ROW_COLOURS)]


def draw_online_softmax_frame(frame: OnlineSoftmaxFrame) -> Figure:
    """The scores with the tiles folded so far, then per row: the running max, the share of the
    softmax seen, and the output so far against the exact one."""
    rows, keys = frame.scores.shape
    fig = Figure(figsize=(11, 6.2), dpi=100, layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=[1, 1.25])
    ax = fig.add_subplot(grid[0, :])
    finite = frame.scores[np.isfinite(frame.scores)]
    ax.imshow(np.where(np.isfinite(frame.scores), frame.scores, np.nan), aspect="auto", cmap="viridis",
              interpolation="none", extent=(0, keys, rows, 0), vmin=finite.min(), vmax=finite.max())
    seen = frame.keys_seen
    if seen < keys:
        ax.add_patch(Rectangle((seen, 0), keys - seen, rows, facecolor="white", alpha=0.8, edgecolor="none"))
    start = (frame.tile - 1) * frame.block_n
    ax.add_patch(Rectangle((start, 0), seen - start, rows, fill=False, edgecolor="red", linewidth=2.5))
    for row in range(rows):
        best = int(np.nanargmax(np.where(np.isfinite(frame.scores[row, :seen]), frame.scores[row, :seen], -np.inf)))
        ax.plot(best + 0.5, row + 0.5, marker="*", markersize=13, color="white", markeredgecolor="black")
    for boundary in range(frame.block_n, keys, frame.block_n):
        ax.axvline(boundary, color="black", linewidth=0.6, alpha=0.5)
    ax.set_yticks(np.arange(rows) + 0.5, [f"row {r}" for r in range(rows)])
    for label, row in zip(ax.get_yticklabels(), range(rows)):
        label.set_color(_row_colour(row))
    ax.set_xlabel("key position (tiles of %d keys; red: the tile just folded in; *: the running max)" % frame.block_n)
    ax.set_title(f"Tile {frame.tile} of {frame.num_tiles}: keys 0..{seen - 1} seen", fontsize=11)

    index = np.arange(rows)
    ax_m = fig.add_subplot(grid[1, 0])
    ax_m.bar(index, frame.m, color=[_row_colour(r) for r in index], alpha=0.8)
    final_max = frame.scores.max(axis=1)
    ax_m.scatter(index, final_max, marker="_", s=900, color="black", label="max over all keys", zorder=3)
    for r in index:
        ax_m.annotate(f"α = {frame.alpha[r]:.3f}", (r, max(float(frame.m[r]), float(final_max[r]))),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax_m.set(xticks=index, xticklabels=[f"row {r}" for r in index], ylabel="running max m",
             title="running max m; α = exp(m_old − m)")
    seen_m = frame.m[np.isfinite(frame.m)]
    low = min(0.0, float(final_max.min()), *(float(x) for x in seen_m))
    high = max(0.0, float(final_max.max()))
    ax_m.set_ylim(low - 0.05 * (high - low), high + 0.45 * (high - low) + 0.1)
    ax_m.legend(loc="upper left", fontsize=8)

    ax_l = fig.add_subplot(grid[1, 1])
    ax_l.bar(index, 100 * frame.mass_seen, color=[_row_colour(r) for r in index], alpha=0.8)
    ax_l.set(xticks=index, xticklabels=[f"row {r}" for r in index], ylim=(0, 105), ylabel="%",
             title="mass seen: l·exp(m) / Σ exp(s)")

    ax_o = fig.add_subplot(grid[1, 2])
    dims = np.arange(frame.out.shape[1])
    for r in index:
        colour = _row_colour(r)
        ax_o.plot(dims, frame.exact[r], linestyle="--", color=colour, alpha=0.6)
        ax_o.plot(dims, frame.out[r], marker="o", linestyle="none", color=colour,
                  label=f"row {r}: error {format_error(frame.error[r])}")
    ax_o.set(xlabel="output dimension", title="output so far (dots), exact (dashed)", xticks=dims)
    ax_o.legend(fontsize=7, loc="best")
    for small in (ax_m, ax_l, ax_o):
        small.title.set_fontsize(10)
    return fig


def online_softmax_drawer(frames: Sequence[OnlineSoftmaxFrame]):
    """``draw(frame)`` for :func:`kvlab.viz.stepper.step_through` (every frame the same size)."""
    if not frames:
        raise ValueError("online_softmax_drawer needs at least one frame")
    return draw_online_softmax_frame


def plot_online_softmax_convergence(frames: Sequence[OnlineSoftmaxFrame]) -> Figure:
    """All tiles at once: each row's running max, softmax mass seen, and error vs the exact output."""
    if not frames:
        raise ValueError("plot_online_softmax_convergence needs at least one frame")
    tiles = np.array([f.tile for f in frames])
    rows = frames[0].m.shape[0]
    fig = Figure(figsize=(12, 3.4), dpi=100, layout="constrained")
    ax_m, ax_l, ax_e = fig.subplots(1, 3)
    final_max = frames[0].scores.max(axis=1)
    for r in range(rows):
        colour = _row_colour(r)
        ax_m.step(tiles, [f.m[r] for f in frames], where="post", color=colour, marker="o", label=f"row {r}")
        ax_m.axhline(final_max[r], color=colour, linestyle=":", linewidth=1)
        ax_l.plot(tiles, [100 * f.mass_seen[r] for f in frames], marker="o", color=colour)
        errors = np.array([f.error[r] for f in frames])
        ax_e.plot(tiles, np.maximum(errors, 1e-17), marker="o", color=colour)
    ax_m.set(title="running max m (dotted: over all keys)", xlabel="tiles folded in")
    ax_m.legend(fontsize=8)
    ax_l.set(title="softmax mass seen (%)", xlabel="tiles folded in", ylim=(0, 105))
    ax_e.set_yscale("log")
    ax_e.set(title="max |out − exact| (floored at 1e-17)", xlabel="tiles folded in")
    for ax in (ax_m, ax_l, ax_e):
        ax.set_xticks(tiles)
        ax.grid(alpha=0.3)
    return fig


# -- which program computes which tile --------------------------------------------------------
def visible_keys(len_q: int, len_k: int, causal: bool = True) -> np.ndarray:
    """``[len_q, len_k]`` booleans: which key each query attends to (bottom-right causal)."""
    check_int("len_q", len_q, 1)
    check_int("len_k", len_k, 1)
    if causal and len_q > len_k:
        raise ValueError(f"causal attention needs len_q <= len_k, got len_q {len_q} > len_k {len_k}")
    if not causal:
        return np.ones((len_q, len_k), dtype=bool)
    return np.arange(len_k)[None, :] <= np.arange(len_k - len_q, len_k)[:, None]


def _tile_legend(fig: Figure, states=TILE_STATES, extra=()) -> None:
    handles = [Patch(facecolor=TILE_COLOURS[s], edgecolor="#555555", label=TILE_NAMES[s]) for s in states]
    fig.legend(handles=handles + list(extra), loc="outside lower center", ncol=len(handles) + len(extra),
               fontsize=8, frameon=False)


def draw_tile_schedule(schedule: TileSchedule, ax, title: str | None = None) -> None:
    """Draw ``schedule`` into ``ax``: queries down, keys across, one rectangle per tile."""
    bm, bn = schedule.block_m, schedule.block_n
    for p, row in enumerate(schedule.states):
        for j, state in enumerate(row):
            ax.add_patch(Rectangle((j * bn, p * bm), bn, bm, facecolor=TILE_COLOURS[state], edgecolor="white",
                                   linewidth=1.5))
    width, height = schedule.num_key_tiles * bn, schedule.num_programs * bm
    # Where a tile hangs past the last key or query, the kernel masks (keys) or skips the store (queries).
    if width > schedule.len_k:
        ax.add_patch(Rectangle((schedule.len_k, 0), width - schedule.len_k, height, facecolor="none",
                               hatch="///", edgecolor="#868e96", linewidth=0))
    if height > schedule.len_q:
        ax.add_patch(Rectangle((0, schedule.len_q), width, height - schedule.len_q, facecolor="none",
                               hatch="\\\\\\", edgecolor="#868e96", linewidth=0))
    if schedule.causal:
        # the causal edge: query i sees keys 0 .. i + shift
        shift = schedule.len_k - schedule.len_q
        rows = np.arange(schedule.len_q + 1)
        ax.step(np.minimum(rows + shift, schedule.len_k), rows, where="post", color="black", linewidth=1.2)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(0, width + 1, bn))
    ax.set_yticks(np.arange(schedule.num_programs) * bm + bm / 2,
                  [f"program {p}" for p in range(schedule.num_programs)], fontsize=8)
    ax.tick_params(axis="x", labelsize=7, rotation=90)
    ax.set_xlabel(f"keys (tiles of {bn})")
    computed = schedule.count(FULL) + schedule.count(MASKED)
    default = (f"len_q {schedule.len_q}, len_k {schedule.len_k}, {'causal' if schedule.causal else 'not causal'}\n"
               f"{computed} of {schedule.num_programs * schedule.num_key_tiles} tiles computed "
               f"({schedule.count(MASKED)} masked)")
    ax.set_title(title if title is not None else default, fontsize=9)


def plot_tile_schedules(schedules: Sequence[TileSchedule], titles: Sequence[str] | None = None) -> Figure:
    """Several schedules side by side, one legend."""
    if not schedules:
        raise ValueError("plot_tile_schedules needs at least one schedule")
    if titles is not None and len(titles) != len(schedules):
        raise ValueError(f"titles has {len(titles)} entries for {len(schedules)} schedules")
    widths = [s.num_key_tiles * s.block_n for s in schedules]
    fig = Figure(figsize=(min(16, 2.2 + 0.045 * sum(widths) + 1.3 * len(schedules)), 5.2), dpi=100,
                 layout="constrained")
    axes = fig.subplots(1, len(schedules), squeeze=False, width_ratios=widths)[0]
    for i, (ax, schedule) in enumerate(zip(axes, schedules)):
        draw_tile_schedule(schedule, ax, None if titles is None else titles[i])
    edge = [Patch(facecolor="none", hatch="///", edgecolor="#868e96", label="past the last key / query")]
    _tile_legend(fig, extra=edge)
    return fig


# -- what paged_prefill reads -------------------------------------------------------------------
def draw_paged_reads(reads: PagedReads, title: str | None = None) -> Figure:
    """Programs down, key positions across, grouped by page; each page labelled with its block."""
    num_programs = len(reads.states)
    fig = Figure(figsize=(max(7.0, 0.2 * reads.seq_len + 3.5), 1.4 + 0.55 * num_programs), dpi=100,
                 layout="constrained")
    ax = fig.add_subplot()
    for p, row in enumerate(reads.states):
        for pos, state in enumerate(row):
            ax.add_patch(Rectangle((pos, p), 1, 1, facecolor=TILE_COLOURS[state], edgecolor="white", linewidth=0.5))
        ax.text(reads.seq_len + 0.5, p + 0.5, "blocks " + ", ".join(map(str, reads.pages[p])), va="center",
                fontsize=8)
    num_pages = -(-reads.seq_len // reads.block_size)
    for page in range(num_pages):
        left = page * reads.block_size
        ax.axvline(left, color="black", linewidth=1.2)
        ax.text(left + min(reads.block_size, reads.seq_len - left) / 2, -0.15,
                f"page {page}\nblock {reads.block_table[page]}", ha="center", va="bottom", fontsize=7)
    ax.axvline(reads.seq_len, color="black", linewidth=1.2)
    ax.axvline(reads.prefix_len, color="#c92a2a", linewidth=2.5, linestyle="--")
    ax.set_xlim(0, reads.seq_len + 7)
    ax.set_ylim(num_programs, -1.1)
    labels = []
    for p in range(num_programs):
        first = reads.prefix_len + p * reads.block_m
        last = min(first + reads.block_m, reads.seq_len) - 1
        labels.append(f"program {p}\n(queries at {first}..{last})")
    ax.set_yticks(np.arange(num_programs) + 0.5, labels, fontsize=8)
    ax.set_xticks(np.arange(0, reads.seq_len + 1, reads.block_n))
    ax.set_xlabel(f"key position (red dashed line: the first new token, after {reads.prefix_len} cached; "
                  f"ticks every tile of {reads.block_n} keys)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    _tile_legend(fig)
    return fig


# -- the GPU benchmark ------------------------------------------------------------------------
BENCH_STYLES = {"kvlab": ("#2b8a3e", "o-"), "kvlab_paged": ("#2b8a3e", "s--"), "kvlab_paged_new": ("#2b8a3e", "d-."),
                "sdpa_flash": ("#1c7ed6", "^-"), "sdpa_cudnn": ("#7048e8", "v-"), "naive": ("#868e96", "x:")}
BENCH_HATCHES = {"kvlab_paged": "///", "kvlab_paged_new": "..."}   # bars: the three kvlab kernels share a colour
PAGED_COLOURS = {"kvlab_paged": "#868e96", "kvlab_paged_new": "#2b8a3e"}
GROUP_COLOURS = ROW_COLOURS + ("#8d5524", "#495057")
def _env_title(results: dict) -> str:
    env = results.get("env", {})
    return ", ".join(f"{key} {env[key]}" for key in ("gpu", "torch", "triton", "date") if key in env)


def _seq_axis(ax, lens) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens, [f"{n // 1024}K" if n >= 1024 else str(n) for n in lens])
    ax.set_xlabel("sequence length")
    ax.grid(alpha=0.3)


def shape_label(row: dict) -> str:
    """A benchmark row as ``batch x seq_len``, e.g. ``8x1K`` (``K``: 1024)."""
    n = row["seq_len"]
    return f"{row['batch']}x{n // 1024}K" if n % 1024 == 0 else f"{row['batch']}x{n}"


def plot_flash_benchmark(results: dict) -> Figure:
    """TFLOP/s as grouped bars: one panel per head_dim, one group per shape (batch x seq_len),
    one bar per kernel (none where the kernel was not measured)."""
    panels: dict = {}                  # head_dim -> rows, by sequence length then batch
    for row in sorted(flash_rows(results), key=lambda r: (r["seq_len"], r["batch"])):
        panels.setdefault(row["head_dim"], []).append(row)
    if not panels:
        raise ValueError("results has no rows")
    panels = dict(sorted(panels.items()))
    fig = Figure(figsize=(13, 4.5), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False,
                        width_ratios=[len(rows) for rows in panels.values()])[0]
    width = 0.85 / len(BENCH_COLUMNS)
    legend = {}                        # kernel -> its bars, for the one legend below the panels
    for ax, (head_dim, rows) in zip(axes, panels.items()):
        for k, column in enumerate(BENCH_COLUMNS):
            measured = [(i, r[column]) for i, r in enumerate(rows) if r[column] is not None]
            if measured:
                x, tflops = zip(*measured)
                offset = (k - (len(BENCH_COLUMNS) - 1) / 2) * width
                legend[column] = ax.bar(np.array(x) + offset, tflops, width, color=BENCH_STYLES[column][0],
                                        hatch=BENCH_HATCHES.get(column), edgecolor="white", linewidth=0.5,
                                        label=BENCH_COLUMNS[column])
        ax.set_xticks(range(len(rows)), [shape_label(r) for r in rows])
        ax.set(title=f"head_dim {head_dim}", xlabel="batch x seq_len")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("TFLOP/s")
    fig.legend(handles=[legend[c] for c in BENCH_COLUMNS if c in legend], loc="outside lower center", ncol=3,
               fontsize=8, frameon=False)
    fig.suptitle(_env_title(results), fontsize=9)
    return fig


def extend_label(row: dict) -> str:
    """An extend row as ``batch x (cached + new) D head_dim``, e.g. ``8x(768+256) D128``."""
    return f"{row['batch']}x({row['prefix']}+{row['new']}) D{row['head_dim']}"


def plot_paged_vs_contiguous(results: dict) -> Figure:
    """``paged_prefill`` in its two modes against ``flash_attention`` on contiguous K/V: TFLOP/s and
    ratio per prefill shape, then (if ``results`` has ``extends``) the ratio per extend shape."""
    groups = flash_groups(results)
    if not groups:
        raise ValueError("results has no rows")
    extends = results.get("extends") or []
    fig = Figure(figsize=(16.5 if extends else 11, 4.8), dpi=100, layout="constrained")
    ax_abs, ax_ratio, *ax_ext = fig.subplots(1, 3 if extends else 2)
    all_lens = sorted({r["seq_len"] for rows in groups.values() for r in rows})
    # Line styles stand for the kernels, colours for the shapes: one legend under the figure.
    handles = [ax_abs.plot([], [], BENCH_STYLES[column][1], color="black", label=BENCH_COLUMNS[column])[0]
               for column in ("kvlab",) + PAGED_COLUMNS]
    for i, ((batch, heads, head_dim), rows) in enumerate(groups.items()):
        colour = GROUP_COLOURS[i % len(GROUP_COLOURS)]
        lens = [r["seq_len"] for r in rows]
        for column in ("kvlab",) + PAGED_COLUMNS:
            ax_abs.plot(lens, [r[column] for r in rows], BENCH_STYLES[column][1], color=colour)
        for column in PAGED_COLUMNS:
            ax_ratio.plot(lens, [r[column] / r["kvlab"] for r in rows], BENCH_STYLES[column][1], color=colour)
        handles.append(Patch(color=colour, label=f"batch {batch}, head_dim {head_dim}"))
    for ax in (ax_abs, ax_ratio):
        _seq_axis(ax, all_lens)
    ax_abs.set(ylabel="TFLOP/s", title="prefill: kvlab kernels")
    ax_abs.set_ylim(bottom=0)
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.set(ylabel="paged / contiguous", title="prefill: the cost of the block table")
    fig.legend(handles=handles, loc="outside lower center", ncol=5 if extends else 3, fontsize=8, frameon=False)
    if extends:
        _plot_extend_ratios(ax_ext[0], extends)
    fig.suptitle(_env_title(results), fontsize=9)
    return fig


def _plot_extend_ratios(ax, extends: list[dict]) -> None:
    """Grouped bars: per extend shape, each paged mode's TFLOP/s over the contiguous kernel's."""
    x, width = np.arange(len(extends)), 0.4
    for offset, column in zip((-width / 2, width / 2), PAGED_COLUMNS):
        bars = ax.bar(x + offset, [r[column] / r["kvlab"] for r in extends], width, color=PAGED_COLOURS[column],
                      label=BENCH_COLUMNS[column])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, [extend_label(r) for r in extends], fontsize=8, rotation=15)
    ax.set(ylabel="paged / contiguous", ylim=(0, 1.35), xlabel="batch x (cached + new tokens), head_dim",
           title="extend: new tokens after a cached prefix")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper center")


# -- memory, naive vs kernel ------------------------------------------------------------------
def plot_attention_memory(seq_lens: Sequence[int], naive_bytes: Sequence, kernel_bytes: Sequence,
                          device_label: str = "") -> Figure:
    """Measured peak memory against sequence length (log-log); ``None`` marks a length not measured."""
    if not (len(seq_lens) == len(naive_bytes) == len(kernel_bytes)) or not seq_lens:
        raise ValueError("seq_lens, naive_bytes and kernel_bytes must be non-empty and of equal length")
    fig = Figure(figsize=(6.5, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for values, style, colour, label in ((naive_bytes, "o-", "#c92a2a", "naive attention (scores in memory)"),
                                         (kernel_bytes, "s-", "#2b8a3e", "flash_attention kernel")):
        points = [(n, b) for n, b in zip(seq_lens, values) if b is not None]
        if points:
            ax.plot(*zip(*points), style, color=colour, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(list(seq_lens), [str(n) for n in seq_lens])
    ax.set_xlabel("sequence length (len_q = len_k)")
    ax.set_ylabel("peak memory allocated (bytes)")
    ax.set_title(f"Peak memory beyond the inputs{': ' + device_label if device_label else ''}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


__all__ = ["FULL", "MASKED", "SKIPPED", "TILE_COLOURS", "OnlineSoftmaxFrame", "online_softmax_frames",
           "online_softmax_table", "format_error", "draw_online_softmax_frame", "online_softmax_drawer",
           "plot_online_softmax_convergence", "causal_tile_bounds", "TileSchedule", "tile_schedule",
           "visible_keys", "draw_tile_schedule", "plot_tile_schedules", "PagedReads", "paged_reads",
           "draw_paged_reads", "load_flash_benchmark", "plot_flash_benchmark", "plot_paged_vs_contiguous",
           "shape_label", "extend_label", "benchmark_ratios", "plot_attention_memory", "BENCH_COLUMNS",
           "PAGED_COLUMNS"]
