"""Page maps: a picture of a block pool.

:func:`kvlab.paging.snapshot.page_map_frame` copies what a pool holds at one moment: who owns
each physical block, how full it is, the block tables. :func:`draw_page_map` draws such a frame: the physical
blocks as a grid on the left, the block tables on the right, both coloured by sequence.

A "pool" is anything with ``num_blocks``, ``block_size``, ``block_tables`` (seq id -> list
of block ids) and ``seq_lens`` (seq id -> tokens): :class:`kvlab.paging.BlockPool`, or
your own.
"""
from __future__ import annotations

import operator
from functools import partial
from typing import Callable

from matplotlib import colormaps
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.patheffects import withStroke

from kvlab.paging.snapshot import PageMapFrame, frame_problems, page_map_frame, tokens_in_block  # noqa: F401

CELL = 0.36            # inches per block square
GRID_COLUMNS = 16      # physical blocks per row
TABLE_COLUMNS = 16     # logical blocks shown per block table, at most
MAX_TABLE_ROWS = 12    # sequences shown; the rest are counted
FREE_FACE, FREE_EDGE = "#f3f3f3", "#c4c4c4"
CACHED_FACE, CACHED_EDGE = "#fbf1cf", "#c9a227"   # free, but its KV is still cached (evictable)


# -- colours -------------------------------------------------------------------------------
# tab10 without its grey (grey means free), then darker tones of tab20b: 18 distinct colours.
PALETTE = ([c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]
           + [colormaps["tab20b"].colors[i] for i in (0, 4, 8, 12, 16, 2, 6, 10, 14)])
_named_seqs: dict = {}  # non-integer seq ids -> palette slot, in the order they were first drawn


def seq_colour(seq_id) -> tuple:
    """The colour of a sequence: the same id always gets the same colour.

    Integer ids pick palette entry ``id % 18``; other ids (names) take the next entry the first
    time they are drawn, so a handful of named sequences never share a colour.
    """
    try:
        key = operator.index(seq_id)
    except TypeError:
        key = _named_seqs.setdefault(seq_id, len(_named_seqs))
    return PALETTE[key % len(PALETTE)]


def tint(colour, amount: float = 0.85) -> tuple:
    """``colour`` mixed with white."""
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def text_colour(colour) -> tuple:
    """``colour``, darkened when it is too light to read as text on white."""
    r, g, b = to_rgb(colour)
    scale = 0.55 if 0.3 * r + 0.59 * g + 0.11 * b > 0.6 else 1.0
    return (r * scale, g * scale, b * scale)


# -- drawing -------------------------------------------------------------------------------
def _block_square(ax, x: float, y: float, owner, fill: float, label: str, fontsize: float,
                  refs: int = 1, cached: bool = False) -> None:
    """One block at (x, y): pale when owned, its filled part solid from the bottom up.

    A block shared by ``refs`` > 1 sequences gets a thick border and an "xN" badge; a block
    carrying a prefix-cache hash gets a gold corner, and a free one that is still cached is
    drawn gold (reusable until evicted).
    """
    size = 0.9
    if owner is None:
        face, edge = (CACHED_FACE, CACHED_EDGE) if cached else (FREE_FACE, FREE_EDGE)
        ax.add_patch(Rectangle((x, y), size, size, facecolor=face, edgecolor=edge, linewidth=0.8))
        ax.text(x + size / 2, y + size / 2, label, ha="center", va="center", fontsize=fontsize, color="#9a9a9a")
        return
    colour = seq_colour(owner)
    ax.add_patch(Rectangle((x, y), size, size, facecolor=tint(colour), edgecolor="none"))
    ax.add_patch(Rectangle((x, y), size, size * fill, facecolor=colour, edgecolor="none"))
    ax.add_patch(Rectangle((x, y), size, size, facecolor="none", edgecolor="black" if refs > 1 else text_colour(colour),
                           linewidth=2.4 if refs > 1 else 1.2))
    ax.text(x + size / 2, y + size / 2, label, ha="center", va="center", fontsize=fontsize, color="black",
            path_effects=[withStroke(linewidth=2.2, foreground="white")])
    if cached:
        ax.add_patch(Rectangle((x, y + size * 0.72), size * 0.18, size * 0.18, facecolor=CACHED_EDGE, edgecolor="none"))
    if refs > 1:
        ax.text(x + size * 0.97, y + size * 0.97, f"x{refs}", ha="right", va="top", fontsize=fontsize * 0.75,
                color="black", fontweight="bold", path_effects=[withStroke(linewidth=1.8, foreground="white")])


def _draw_blocks(ax, frame: PageMapFrame, columns: int) -> None:
    fontsize = 7 if frame.num_blocks > 100 else 8
    for block in range(frame.num_blocks):
        row, col = divmod(block, columns)
        _block_square(ax, col, -row, frame.owners[block], frame.fills[block], str(block), fontsize,
                      refs=frame.holders(block), cached=bool(frame.cached and frame.cached[block]))
    ax.set_title("physical blocks (solid part = filled slots)", fontsize=9, loc="left")


def _draw_tables(ax, frame: PageMapFrame, columns: int) -> None:
    seqs = list(frame.block_tables)
    for col in range(columns):
        ax.text(col + 0.45, 0.25, str(col), ha="center", va="center", fontsize=7, color="#777777")
    ax.text(-0.2, 0.25, "logical block:", ha="right", va="center", fontsize=7, color="#777777")
    for row, seq in enumerate(seqs[:MAX_TABLE_ROWS]):
        y = -1 - row
        table, seq_len = frame.block_tables[seq], frame.seq_lens[seq]
        ax.text(-0.2, y + 0.45, f"seq {seq} ({seq_len} tok)", ha="right", va="center", fontsize=8,
                color=text_colour(seq_colour(seq)), fontweight="bold")
        shown = table if len(table) <= columns else table[:columns - 1]
        for logical, block in enumerate(shown):
            fill = tokens_in_block(seq_len, logical, frame.block_size) / frame.block_size
            _block_square(ax, logical, y, seq, fill, str(block), 7.5, refs=frame.holders(block),
                          cached=bool(frame.cached and frame.cached[block]))
        if len(shown) < len(table):
            ax.text(columns - 0.55, y + 0.45, f"+{len(table) - len(shown)}", ha="center", va="center",
                    fontsize=8)
        if not table:
            ax.text(0, y + 0.45, "(no blocks)", va="center", fontsize=8, color="#777777")
    if len(seqs) > MAX_TABLE_ROWS:
        ax.text(0, -1 - MAX_TABLE_ROWS + 0.45, f"... and {len(seqs) - MAX_TABLE_ROWS} more sequences",
                va="center", fontsize=8)
    if not seqs:
        ax.text(0, -0.55, "(no sequences)", va="center", fontsize=8, color="#777777")
    ax.set_title("block tables (logical -> physical block)", fontsize=9, loc="left")


def _place_axes(fig, left_in, bottom_in, width_in, height_in, fig_w, fig_h, x_range, y_range):
    ax = fig.add_axes((left_in / fig_w, bottom_in / fig_h, width_in / fig_w, height_in / fig_h))
    ax.set_xlim(*x_range)
    ax.set_ylim(*y_range)
    ax.set_axis_off()
    return ax


def draw_page_map(frame: PageMapFrame, fig: Figure | None = None, min_sequences: int = 0) -> Figure:
    """Draw ``frame``: physical blocks on the left, block tables on the right.

    Squares are coloured by owning sequence (one colour per seq id, everywhere), solid in
    proportion to the slots filled, grey when free. Pass ``fig`` to draw into an existing
    figure (it is cleared and resized); ``min_sequences`` reserves table rows so that the
    frames of one run all get the same size (see :func:`page_map_drawer`).
    """
    columns = min(GRID_COLUMNS, frame.num_blocks)
    table_columns = min(TABLE_COLUMNS, frame.num_blocks)  # fixed per pool, so frames line up
    grid_rows = -(-frame.num_blocks // columns)
    num_rows = max(1, min_sequences, len(frame.block_tables))
    table_rows = 1 + min(num_rows, MAX_TABLE_ROWS + 1)  # header + sequences (+ "more")
    label_w, gap, margin, top, bottom = 1.5, 0.5, 0.2, 0.85, 0.15
    grid_w, grid_h = columns * CELL, grid_rows * CELL
    table_span = max(table_columns, 10)  # room for the panel's title
    table_w, table_h = table_span * CELL, table_rows * CELL
    fig_w = margin + grid_w + gap + label_w + table_w + margin
    fig_h = top + max(grid_h, table_h) + bottom
    if fig is None:
        fig = Figure(figsize=(fig_w, fig_h), dpi=100)
    else:
        fig.clear()
        fig.set_size_inches(fig_w, fig_h)
    panel_top = fig_h - top
    grid_ax = _place_axes(fig, margin, panel_top - grid_h, grid_w, grid_h, fig_w, fig_h,
                          (-0.05, columns - 0.05), (0.95 - grid_rows, 0.95))
    table_ax = _place_axes(fig, margin + grid_w + gap + label_w, panel_top - table_h, table_w, table_h,
                           fig_w, fig_h, (-0.05, table_span - 0.05), (0.95 - table_rows, 0.95))
    _draw_blocks(grid_ax, frame, columns)
    _draw_tables(table_ax, frame, table_columns)
    summary = (f"{frame.num_used} used, {frame.num_free} free of {frame.num_blocks} blocks"
               f"  |  {frame.num_stored_tokens} tokens stored in {frame.num_used * frame.block_size} slots"
               f"  |  block_size {frame.block_size}")
    heading = f"{frame.title}\n{summary}" if frame.title else summary
    fig.text(margin / fig_w, 1 - 0.08 / fig_h, heading, ha="left", va="top", fontsize=10)
    if problems := frame_problems(frame):
        fig.text(1 - margin / fig_w, 1 - 0.08 / fig_h, f"{len(problems)} problem(s): {problems[0]}",
                 ha="right", va="top", fontsize=8, color="#c00000")
    return fig


def page_map_drawer(frames) -> Callable[[PageMapFrame], Figure]:
    """``draw_page_map`` with room for the most sequences any of ``frames`` has: same-size figures."""
    most = max((len(frame.block_tables) for frame in frames), default=0)
    return partial(draw_page_map, min_sequences=most)


def show_page_map(pool, title: str = "") -> Figure:
    """Snapshot ``pool`` and draw it: ``show_page_map(pool)`` as a notebook cell's last line."""
    return draw_page_map(page_map_frame(pool, title))
