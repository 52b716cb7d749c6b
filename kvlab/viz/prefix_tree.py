"""The prefix cache as a tree, beside the page map; plots of the prefix-caching workloads.

Each cached block carries a chained hash ``H(parent hash, its tokens)``, so the cached blocks
form a tree: a block's parent is the block whose hash is its parent hash, and the roots are
the salts' root hashes (one per tenant). The pool itself keeps only ``hash -> block``; the
parent links are read off its live sequences (``seq_hashes[seq]`` lists a sequence's chain)
by :class:`HashLinks`, which remembers them after the sequence is freed.

:func:`prefix_frame` snapshots a pool as a :class:`PrefixFrame` (page map + tree + cache map);
:func:`replay_scenario` applies a scripted scenario and snapshots after each event;
:func:`draw_prefix_frame` draws a frame: the page map, and the tree below it. All return
matplotlib Figures and draw nothing at import.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch, Patch

from kvlab.paging.prefix_hash import root_hash
from kvlab.paging.snapshot import PageMapFrame, frame_problems, page_map_frame
from kvlab.viz.page_map import CACHED_EDGE, CACHED_FACE, draw_page_map
from kvlab.viz.stepper import figure_pixels
from kvlab.workloads.prefix import SCENARIO_BLOCK_SIZE, SCENARIO_NUM_BLOCKS, apply_prefix_event, describe

# node states, and how they are drawn: (face, edge)
STATE_COLOURS = {
    "root": ("white", "#333333"),
    "in use": ("#c6dbef", "#2c6ca3"),
    "evictable": (CACHED_FACE, CACHED_EDGE),
    "hit": ("#a1d99b", "#238b45"),
    "cached now": ("#fdd0a2", "#d94801"),
    "evicted": ("white", "#9a9a9a"),
}
LEGEND = {
    "in use": "in use",
    "evictable": "free, still cached",
    "hit": "hit (just reused)",
    "cached now": "just computed: a miss",
    "evicted": "just evicted",
}


# -- parent links --------------------------------------------------------------------------
@dataclass
class HashLinks:
    """Parent hash of every block hash seen in a live sequence, and the salt of each root.

    Call :meth:`observe` after each change to the pool: a block's hash is registered while a
    live sequence holds it, so observing after every change sees every link.
    """

    parents: dict = field(default_factory=dict)   # block hash -> parent hash
    roots: dict = field(default_factory=dict)     # root hash -> salt

    def observe(self, pool) -> "HashLinks":
        for seq, hashes in pool.seq_hashes.items():
            root = root_hash(pool.seq_salts.get(seq))
            self.roots[root] = pool.seq_salts.get(seq)
            for parent, h in zip([root, *hashes], hashes):
                self.parents[h] = parent
        return self


# -- the tree of one moment ------------------------------------------------------------------
@dataclass(frozen=True)
class TreeNode:
    """A cached block (or a merged chain of them), a root, or a block evicted just now.

    ``key`` is the hash that children name as their parent (a merged chain's deepest hash);
    ``parent`` is the parent's key (``None`` for a root).
    """

    key: bytes
    parent: bytes | None
    blocks: tuple[int, ...]
    state: str      # one of STATE_COLOURS
    label: str


@dataclass(frozen=True)
class PrefixFrame:
    """A pool with prefix caching at one moment: page map, cache map and tree. Plain copies."""

    page: PageMapFrame
    block_hashes: tuple          # block_hashes[b]: the hash block b carries, or None
    cached_blocks: dict          # hash -> block
    nodes: tuple                 # TreeNodes: roots, cached blocks, blocks evicted by this event
    hits: tuple = ()             # blocks the event's arrival reused

    @property
    def title(self) -> str:
        return self.page.title


def _root_label(salt) -> str:
    return "root" if salt is None else f"root\n{salt}"


def tree_nodes(block_hashes, ref_counts, links: HashLinks, hits=(), cached_before=frozenset(),
               evicted=()) -> list[TreeNode]:
    """The tree's nodes: every block with a hash, the roots they hang from, and ``evicted``.

    A block is ``"hit"`` if in ``hits``, ``"cached now"`` if its hash is not in
    ``cached_before`` (hashes cached one event earlier), else ``"in use"`` (held) or
    ``"evictable"``. ``evicted`` lists ``(block, hash)`` pairs evicted by this event.
    """
    hits = set(hits)
    nodes = []
    for block, h in enumerate(block_hashes):
        if h is None:
            continue
        if block in hits:
            state = "hit"
        elif h not in cached_before:
            state = "cached now"
        else:
            state = "in use" if ref_counts[block] > 0 else "evictable"
        nodes.append(TreeNode(h, links.parents.get(h), (block,), state, str(block)))
    nodes += [TreeNode(h, links.parents.get(h), (block,), "evicted", f"{block} ×") for block, h in evicted]
    needed = {n.parent for n in nodes}
    nodes += [TreeNode(root, None, (), "root", _root_label(salt))
              for root, salt in links.roots.items() if root in needed]
    return nodes


def prefix_frame(pool, links: HashLinks, title: str = "", hits=(),
                 previous: PrefixFrame | None = None) -> PrefixFrame:
    """Snapshot ``pool`` (call ``links.observe(pool)`` first). ``previous``, the frame before
    this event, tells which blocks were cached now and which were evicted (without it: none)."""
    block_hashes = tuple(pool.block_hashes)
    cached_before = set(previous.cached_blocks) if previous else set(pool.cached_blocks)
    evicted = []
    if previous:
        evicted = [(block, h) for h, block in previous.cached_blocks.items() if h not in pool.cached_blocks]
    nodes = tree_nodes(block_hashes, pool.ref_counts, links, hits, cached_before, evicted)
    return PrefixFrame(page_map_frame(pool, title), block_hashes, dict(pool.cached_blocks), tuple(nodes), tuple(hits))


def replay_scenario(events, pool=None) -> list[PrefixFrame]:
    """Apply ``events`` (:class:`kvlab.workloads.prefix.PrefixEvent`) to ``pool`` (default: the
    scenario's fresh pool with prefix caching); a frame after each, plus one of the start."""
    if pool is None:
        from kvlab.paging import BlockPool

        pool = BlockPool(SCENARIO_NUM_BLOCKS, SCENARIO_BLOCK_SIZE, enable_prefix_caching=True)
    links = HashLinks()
    frames = [prefix_frame(pool, links, f"{pool.num_blocks} empty blocks of {pool.block_size} tokens")]
    for event in events:
        outcome = apply_prefix_event(pool, event)
        links.observe(pool)
        title = describe(event, outcome, pool.block_size)
        frames.append(prefix_frame(pool, links, title, outcome.hits, previous=frames[-1]))
    return frames


def prefix_frame_problems(frame: PrefixFrame) -> list[str]:
    """Broken invariants of a frame, in words: the page map's, plus the cache map's.

    Every ``hash -> block`` entry points to a block carrying that hash, every block with a
    hash is in the map, a freed block that carries a hash is evictable, an evictable one
    carries a hash, and every cached block hangs from a known parent.
    """
    problems = frame_problems(frame.page)
    for h, block in frame.cached_blocks.items():
        carried = frame.block_hashes[block]
        if carried != h:
            problems.append(f"the cache maps hash {h.hex()[:8]} to block {block}, which carries "
                            f"{'no hash' if carried is None else carried.hex()[:8]}")
    for block, h in enumerate(frame.block_hashes):
        if h is not None and frame.cached_blocks.get(h) != block:
            problems.append(f"block {block} carries hash {h.hex()[:8]}, which the cache does not map to it")
    evictable = set(frame.page.evictable or ())
    for block in frame.page.free_blocks or ():
        if frame.block_hashes[block] is not None:
            problems.append(f"block {block} is on the plain free list but still carries a hash")
    for block in evictable:
        if frame.block_hashes[block] is None:
            problems.append(f"block {block} is evictable but carries no hash")
    keys = {n.key for n in frame.nodes}
    for node in frame.nodes:
        if node.state != "root" and node.parent not in keys:
            problems.append(f"tree node {node.label} has no known parent")
    return problems


# -- merging chains (a radix tree) -------------------------------------------------------------
def _chain_label(blocks) -> str:
    if len(blocks) <= 3:
        return ",".join(map(str, blocks))
    return f"{blocks[0]}…{blocks[-1]}\n{len(blocks)} blocks"


def merge_chains(nodes) -> list[TreeNode]:
    """Merge every run of single-child nodes in the same state into one node (a radix tree).

    A 2,048-token system prompt is then one node of 128 blocks instead of 128 nodes.
    """
    children = defaultdict(list)
    for n in nodes:
        children[n.parent].append(n)
    by_key = {n.key: n for n in nodes}

    def continues_parent(n) -> bool:
        up = by_key.get(n.parent)
        return up is not None and up.state == n.state != "root" and len(children[up.key]) == 1

    merged = []
    for n in nodes:
        if continues_parent(n):
            continue                      # drawn as part of the run its parent starts
        run = [n]
        while len(children[run[-1].key]) == 1 and continues_parent(children[run[-1].key][0]):
            run.append(children[run[-1].key][0])
        blocks = tuple(b for m in run for b in m.blocks)
        label = n.label if len(run) == 1 else _chain_label(blocks)
        merged.append(TreeNode(run[-1].key, n.parent, blocks, n.state, label))
    return merged


# -- layout and drawing ------------------------------------------------------------------------
def tree_layout(nodes) -> dict:
    """``key -> (depth, row)``: depth from the root left to right, leaves on rows 0, 1, 2, ...
    and a parent centred on its children. Children are ordered by their first block."""
    keys = {n.key for n in nodes}
    children = defaultdict(list)
    for n in nodes:
        children[n.parent if n.parent in keys else None].append(n)
    for kids in children.values():
        kids.sort(key=lambda n: (n.state != "root", n.blocks[:1] or (-1,), n.label))
    order, depth = [], {}
    stack = [(n, 0) for n in reversed(children[None])]
    while stack:                      # depth-first, so each subtree's leaves get consecutive rows
        node, d = stack.pop()
        order.append(node)
        depth[node.key] = d
        stack.extend((k, d + 1) for k in reversed(children[node.key]))
    row, next_row = {}, 0
    for node in order:                 # leaves, in depth-first order
        if not children[node.key]:
            row[node.key] = next_row
            next_row += 1
    for node in reversed(order):       # parents after their children
        if children[node.key]:
            kid_rows = [row[k.key] for k in children[node.key]]
            row[node.key] = (kid_rows[0] + kid_rows[-1]) / 2
    return {key: (depth[key], row[key]) for key in depth}


def tree_extent(nodes) -> tuple[int, int]:
    """(levels, rows) the layout of ``nodes`` needs."""
    layout = tree_layout(nodes)
    if not layout:
        return 1, 1
    return 1 + max(d for d, _ in layout.values()), 1 + int(max(r for _, r in layout.values()))


NODE_W, NODE_H = 0.72, 0.62   # in layout units: one level wide, one row high


def draw_prefix_tree(nodes, ax, levels: int | None = None, rows: int | None = None) -> None:
    """Draw ``nodes`` into ``ax``: boxes labelled with block ids, coloured by state."""
    layout = tree_layout(nodes)
    need_levels, need_rows = tree_extent(nodes)
    levels, rows = max(levels or 0, need_levels), max(rows or 0, need_rows)
    ax.set_xlim(-0.5, levels - 0.3)
    ax.set_ylim(rows - 0.4, -0.6)
    ax.set_axis_off()
    by_key = {n.key: n for n in nodes}
    for node in nodes:
        if node.parent in layout:
            (px, py), (x, y) = layout[node.parent], layout[node.key]
            dashed = node.state == "evicted"
            ax.add_line(Line2D([px + NODE_W / 2, x - NODE_W / 2], [py, y], color="#9a9a9a" if dashed else "#555555",
                               linewidth=1.0, linestyle="--" if dashed else "-", zorder=1))
    for node in nodes:
        x, y = layout[node.key]
        face, edge = STATE_COLOURS[node.state]
        ax.add_patch(FancyBboxPatch((x - NODE_W / 2, y - NODE_H / 2), NODE_W, NODE_H,
                                    boxstyle="round,pad=0,rounding_size=0.12", facecolor=face, edgecolor=edge,
                                    linewidth=1.6 if node.state in ("hit", "cached now") else 1.0,
                                    linestyle="--" if node.state == "evicted" else "-", zorder=2))
        small = "\n" in node.label or len(node.label) > 5
        ax.text(x, y, node.label, ha="center", va="center", fontsize=6.5 if small else 8.5, zorder=3,
                color="#777777" if node.state == "evicted" else "black")
    if not by_key:
        ax.text(0, 0, "(nothing cached)", ha="left", va="center", fontsize=9, color="#777777")


def prefix_tree_figure(nodes, title: str = "", levels: int | None = None, rows: int | None = None,
                       legend: bool = True) -> Figure:
    """A figure of the tree alone; ``levels``/``rows`` reserve room so frames line up."""
    need_levels, need_rows = tree_extent(nodes)
    levels, rows = max(levels or 0, need_levels, 4), max(rows or 0, need_rows, 2)
    legend_h = 0.6 if legend else 0.0
    width, height = 0.3 + 0.8 * levels, 0.55 + 0.42 * rows + legend_h
    fig = Figure(figsize=(max(width, 5.6 if legend else 4.2), height), dpi=100)
    ax = fig.add_axes((0.02, (legend_h + 0.05) / height, 0.96, (0.42 * rows) / height))
    draw_prefix_tree(nodes, ax, levels, rows)
    fig.text(0.02, 1 - 0.08 / height, title or "prefix tree: cached blocks by parent hash", ha="left", va="top",
             fontsize=9)
    if legend:
        handles = [Patch(facecolor=STATE_COLOURS[s][0], edgecolor=STATE_COLOURS[s][1],
                         linestyle="--" if s == "evicted" else "-", label=text) for s, text in LEGEND.items()]
        fig.legend(handles=handles, loc="lower left", ncols=3, fontsize=7, frameon=False, borderaxespad=0.2)
    return fig


def one_above_the_other(figures, dpi: int = 100) -> Figure:
    """Figures rendered to pixels and stacked top to bottom, left-aligned, in one figure."""
    images = [figure_pixels(fig, dpi) for fig in figures]
    width, height = max(img.shape[1] for img in images), sum(img.shape[0] for img in images)
    canvas = np.full((height, width, 4), 255, dtype=np.uint8)
    top = 0
    for img in images:
        canvas[top:top + img.shape[0], :img.shape[1]] = img
        top += img.shape[0]
    out = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    ax = out.add_axes((0, 0, 1, 1))
    ax.imshow(canvas, interpolation="none")
    ax.set_axis_off()
    return out


def draw_prefix_frame(frame: PrefixFrame, levels: int | None = None, rows: int | None = None,
                      min_sequences: int = 0) -> Figure:
    """The page map of one frame, and its prefix tree below it."""
    page = draw_page_map(frame.page, min_sequences=min_sequences)
    tree = prefix_tree_figure(frame.nodes, levels=levels, rows=rows)
    return one_above_the_other([page, tree])


def prefix_frame_drawer(frames):
    """``draw_prefix_frame`` with room for the largest tree and most sequences of ``frames``."""
    extents = [tree_extent(f.nodes) for f in frames]
    return partial(draw_prefix_frame, levels=max(e[0] for e in extents), rows=max(e[1] for e in extents),
                   min_sequences=max(len(f.page.block_tables) for f in frames))


def show_prefix_tree(pool, links: HashLinks, title: str = "", merge: bool = False) -> Figure:
    """The live tree of ``pool`` (observes it first); ``merge=True`` merges chains (radix tree)."""
    links.observe(pool)
    nodes = tree_nodes(pool.block_hashes, pool.ref_counts, links, cached_before=set(pool.cached_blocks))
    return prefix_tree_figure(merge_chains(nodes) if merge else nodes, title, legend=not merge)


# -- workload plots ---------------------------------------------------------------------------
WITH_COLOUR, WITHOUT_COLOUR = "#2c6ca3", "#8c8c8c"


def plot_hit_rates(comparisons) -> Figure:
    """Per workload: each request's share of prompt tokens found in the cache, and the running total."""
    fig = Figure(figsize=(5.2 * len(comparisons), 3.4), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(comparisons), squeeze=False)[0]
    for ax, c in zip(axes, comparisons):
        stats = c.cached.requests
        index = np.arange(1, len(stats) + 1)
        ax.scatter(index, [100 * r.hit_rate for r in stats], s=10, color=WITH_COLOUR, label="this request")
        cumulative = np.cumsum([r.cached_tokens for r in stats]) / np.cumsum([r.prompt_tokens for r in stats])
        ax.plot(index, 100 * cumulative, color="black", linewidth=1.2, label="all requests so far")
        ax.set(title=c.name, xlabel="request (in arrival order)", ylabel="prompt tokens found in cache (%)",
               ylim=(-3, 103))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    return fig


def plot_blocks_over_time(comparisons) -> Figure:
    """Per workload: blocks held by running requests at each step, with and without the cache."""
    fig = Figure(figsize=(5.2 * len(comparisons), 3.4), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(comparisons), squeeze=False)[0]
    for ax, c in zip(axes, comparisons):
        used = np.array(c.cached.used_blocks)
        ax.plot(c.uncached.used_blocks, color=WITHOUT_COLOUR, label="in use, no prefix cache")
        ax.plot(used, color=WITH_COLOUR, label="in use, prefix cache")
        ax.fill_between(np.arange(len(used)), used, used + np.array(c.cached.evictable_blocks), color=CACHED_FACE,
                        edgecolor=CACHED_EDGE, linewidth=0.5, label="+ free but still cached")
        ax.set(title=c.name, xlabel="engine step", ylabel="blocks")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    return fig


def plot_pool_sweep(sweeps: dict) -> Figure:
    """Hit rate and evictions against pool size: ``{workload name: (sizes, [WorkloadResult])}``."""
    fig = Figure(figsize=(5.2 * len(sweeps), 3.4), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(sweeps), squeeze=False)[0]
    for ax, (name, (sizes, results)) in zip(axes, sweeps.items()):
        ax.plot(sizes, [100 * r.hit_rate for r in results], "o-", color=WITH_COLOUR, label="hit rate")
        ax.set(title=name, xlabel="pool size (blocks)", ylabel="hit rate (%)", ylim=(0, 103))
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(sizes, [r.evictions for r in results], "s--", color=CACHED_EDGE, label="evictions")
        twin.set_ylabel("evicted blocks", color=CACHED_EDGE)
        twin.set_ylim(bottom=0)
        lines = ax.get_lines() + twin.get_lines()
        ax.legend(lines, [line.get_label() for line in lines], loc="center right", fontsize=8)
    return fig
