"""Figures of chapter 3: shared blocks, copy-on-write, and what sharing saves.

* :func:`draw_shared_tables`: the block tables of forked sequences side by side, each entry
  linked to the physical block it names; a shared block carries its reference count;
* :func:`plot_sharing_ratio`: measured memory with sharing / without, against the formula
  (P + kL) / (k(P + L)) and the seed article's "30%";
* :func:`plot_blocks_per_step`: blocks in use at every decoding step, one line per run.

Each returns a :class:`matplotlib.figure.Figure` built without pyplot: nothing is drawn at import.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.patheffects import withStroke

from kvlab.paging.snapshot import PageMapFrame, tokens_in_block
from kvlab.viz.page_map import FREE_EDGE, FREE_FACE, text_colour, tint, seq_colour
from kvlab.workloads.beam_search import prompt_ratio_for, sharing_ratio_formula

CELL = 0.42               # inches per block square
SHARED_FACE = "#495057"   # a physical block held by several sequences
TABLES_Y, BLOCKS_Y = 3.4, 0.0
LABEL_W = 2.2             # room for the row labels, in block widths
MODE_STYLE = {"parallel": ("o", "#1c7ed6", "parallel sampling (measured)"),
              "beam": ("^", "#e8590c", "beam search (measured)")}


def _refs(frame: PageMapFrame, block: int) -> int:
    return frame.ref_counts[block] if frame.ref_counts else frame.holders(block)


def _square(ax, x: float, y: float, face, fill_colour, fill: float, label: str, edge="black",
            shared: bool = False, badge: str = "") -> None:
    """A block square at (x, y), solid from the bottom up to ``fill``; a shared one has a thick border."""
    size = 0.9
    ax.add_patch(Rectangle((x, y), size, size, facecolor=face, edgecolor="none"))
    if fill > 0:
        ax.add_patch(Rectangle((x, y), size, size * fill, facecolor=fill_colour, edgecolor="none"))
    ax.add_patch(Rectangle((x, y), size, size, facecolor="none", edgecolor="black" if shared else edge,
                           linewidth=2.6 if shared else 1.0))
    ax.text(x + size / 2, y + size / 2, label, ha="center", va="center", fontsize=8,
            path_effects=[withStroke(linewidth=2.2, foreground="white")])
    if badge:
        ax.text(x + size / 2, y + size + 0.08, badge, ha="center", va="bottom", fontsize=8, fontweight="bold")


def draw_shared_tables(frame: PageMapFrame, copies=(), title: str | None = None) -> Figure:
    """Block tables side by side (top) over the physical blocks they point into (bottom).

    Every table entry is linked to its physical block by a line in the sequence's colour; a
    block that several tables name is drawn dark with a thick border and "xN", its reference
    count. ``copies`` (e.g. ``pool.pending_copies``) are drawn as arrows from ``src`` to
    ``dst`` under the blocks. Meant for small pools (up to ~40 blocks).
    """
    seqs = list(frame.block_tables)
    starts, x = {}, 0.0
    for seq in seqs:
        starts[seq] = x
        x += max(len(frame.block_tables[seq]), 2) + 1   # a gap after each table
    tables_w = max(x - 1, 1)
    blocks_w = frame.num_blocks
    width = max(tables_w, blocks_w)
    table_x0, block_x0 = (width - tables_w) / 2, (width - blocks_w) / 2

    heading = title if title is not None else frame.title
    header_lines = 1 + bool(heading) + bool(copies)
    fig_h = 2.5 + 0.3 * bool(copies) + 0.2 * header_lines
    fig = Figure(figsize=((width + LABEL_W + 0.6) * CELL + 0.3, fig_h), dpi=100)
    ax = fig.add_axes((0.01, 0.01, 0.98, 1 - (0.15 + 0.2 * header_lines) / fig_h))
    ax.set_xlim(-LABEL_W - 0.3, width + 0.3)
    ax.set_ylim(BLOCKS_Y - 0.2 - 0.7 * bool(copies), TABLES_Y + 1.6)
    ax.set_axis_off()

    for block in range(frame.num_blocks):
        bx, refs, owner = block_x0 + block, _refs(frame, block), frame.owners[block]
        if owner is None:
            _square(ax, bx, BLOCKS_Y, FREE_FACE, FREE_FACE, 0, str(block), edge=FREE_EDGE)
        elif refs > 1:
            _square(ax, bx, BLOCKS_Y, tint(SHARED_FACE, 0.6), SHARED_FACE, frame.fills[block], str(block),
                    shared=True, badge=f"x{refs}")
        else:
            colour = seq_colour(owner)
            _square(ax, bx, BLOCKS_Y, tint(colour), colour, frame.fills[block], str(block),
                    edge=text_colour(colour))
    for seq in seqs:
        colour, table, seq_len = seq_colour(seq), frame.block_tables[seq], frame.seq_lens[seq]
        sx = table_x0 + starts[seq]
        ax.text(sx, TABLES_Y + 1.05, f"seq {seq}\n{seq_len} tok", ha="left", va="bottom", fontsize=8,
                fontweight="bold", color=text_colour(colour))
        for logical, block in enumerate(table):
            fill = tokens_in_block(seq_len, logical, frame.block_size) / frame.block_size
            refs = _refs(frame, block)
            _square(ax, sx + logical, TABLES_Y, tint(colour), colour, fill, str(block), edge=text_colour(colour),
                    shared=refs > 1)
            if 0 <= block < frame.num_blocks:
                ax.plot([sx + logical + 0.45, block_x0 + block + 0.45], [TABLES_Y - 0.02, BLOCKS_Y + 0.92],
                        color=colour, linewidth=1.6 if refs > 1 else 1.1, alpha=0.8, zorder=0)
    for src, dst in copies:
        ax.add_patch(FancyArrowPatch((block_x0 + src + 0.45, BLOCKS_Y - 0.05), (block_x0 + dst + 0.45, BLOCKS_Y - 0.05),
                                     connectionstyle="arc3,rad=0.45", arrowstyle="-|>", mutation_scale=12,
                                     color="#c92a2a", linewidth=1.5))
        ax.text(block_x0 + (src + dst) / 2 + 0.45, BLOCKS_Y - 0.3 - 0.12 * abs(dst - src), f"copy {src} -> {dst}",
                ha="center", va="top", fontsize=7.5, color="#c92a2a")
    ax.text(-LABEL_W, TABLES_Y + 0.45, "block\ntables", fontsize=8, color="#666666", va="center")
    ax.text(-LABEL_W, BLOCKS_Y + 0.45, "physical\nblocks", fontsize=8, color="#666666", va="center")
    legend = "dark, thick border, xN: a block held by N sequences (reference count N)"
    if copies:
        legend += "\nred arrow: a pending copy-on-write copy, src -> dst"
    fig.text(0.01, 0.99, (heading + "\n" if heading else "") + legend, ha="left", va="top", fontsize=9)
    return fig


def plot_sharing_ratio(measurements, claim: float = 0.30, claim_k: int = 4) -> Figure:
    """Memory with sharing / without against the prompt-to-generation ratio P/L.

    ``measurements`` are :class:`kvlab.workloads.beam_search.SharingMemory` results (any modes, one or
    more k). Lines: the formula (P + kL) / (k(P + L)) for each k and its floor 1/k; points:
    the measured block ratios; the seed's claim is the horizontal line at ``claim``, and the
    P/L where the formula reaches it at ``claim_k`` is marked.
    """
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    ratios = [m.prompt_len / m.gen_len for m in measurements]
    r = np.logspace(np.log10(min(ratios) / 2), np.log10(max(ratios) * 2), 200)
    for k in sorted({m.k for m in measurements}):
        ax.plot(r, sharing_ratio_formula(r, 1.0, k), color="black", linewidth=1.5,
                label=f"formula (P + kL) / (k(P + L)), k = {k}")
        ax.axhline(1 / k, color="#868e96", linestyle=":", linewidth=1)
        ax.text(r[0], 1 / k - 0.015, f" 1/k: one copy of everything, k = {k}", fontsize=8, color="#868e96", va="top")
    for mode, (marker, colour, label) in MODE_STYLE.items():
        points = [(m.prompt_len / m.gen_len, m.ratio) for m in measurements if m.mode == mode]
        if points:
            xs, ys = zip(*points)
            ax.scatter(xs, ys, marker=marker, s=46, color=colour, label=label, zorder=3, alpha=0.85,
                       edgecolor="white", linewidth=0.6)
    ax.axhline(claim, color="#c92a2a", linestyle="--", linewidth=1.2,
               label=f"seed article: beam width {claim_k} costs ~{claim:.0%}")
    at = prompt_ratio_for(claim, claim_k)
    ax.axvline(at, color="#c92a2a", linestyle=":", linewidth=1.2)
    ax.annotate(f"formula = {claim:.0%} only at P = {at:.0f} L", xy=(at, claim), xytext=(at * 1.6, claim + 0.25),
                ha="left", fontsize=9, color="#c92a2a", arrowprops=dict(arrowstyle="->", color="#c92a2a"))
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("prompt length / generated length  (P / L)")
    ax.set_ylabel("blocks with sharing / without")
    block_sizes = sorted({m.block_size for m in measurements})
    ax.set_title(f"What sharing saves, measured on the block pool (block size {', '.join(map(str, block_sizes))})",
                 fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper right")
    return fig


def plot_blocks_per_step(runs: dict, title: str = "Blocks in use while generating") -> Figure:
    """One line per :class:`kvlab.workloads.beam_search.DecodeRun`: blocks in use after each step."""
    fig = Figure(figsize=(7.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    for name, run in runs.items():
        ax.plot(range(len(run.blocks_per_step)), run.blocks_per_step, label=name, linewidth=1.8)
    ax.set_xlabel("decoding step (0: after the prompt)")
    ax.set_ylabel("blocks in use")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
