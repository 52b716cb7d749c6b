"""Figures of chapter 7, speculative decoding: a generation step by step on the page map, and
the GPU benchmark's curves.

* :func:`speculation_frames` turns the steps :func:`kvlab.workloads.speculation.record_speculation`
  recorded into frames (draft, verify, rollback), :func:`draw_speculation_frame` draws one: the
  sequence's block table slot by slot (drafts booked, kept or rejected, then cut) and the pool's
  blocks beside the token stream; :func:`speculation_stepper` is the widget over them;
* :func:`plot_verify_cost`, :func:`plot_acceptance`, :func:`plot_tokens_per_step`,
  :func:`plot_batch_speedup` draw measurements: live ones (an ``acceptance_sweep`` dict) or
  those of :func:`kvlab.benchmark_results.read_speculative_benchmark`.

Every figure is a :class:`matplotlib.figure.Figure` built without pyplot.
"""
from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from kvlab.paging.block_pool import blocks_needed
from kvlab.viz.page_map import FREE_EDGE, FREE_FACE, seq_colour, tint
from kvlab.workloads.speculation import conditional_acceptance, expected_tokens_per_step, verify_roofline

SEQ = 0                     # the recorded sequence's colour: page maps' colour of seq 0
GREEN, RED, YELLOW, BLUE, GREY = "#43a047", "#e53935", "#ffd54f", "#1e63b4", "#bdbdbd"
SLOT_FACES = {"cached": tint(seq_colour(SEQ), 0.6), "new": seq_colour(SEQ), "draft": YELLOW,
              "accepted": GREEN, "rejected": RED, "padding": GREY, "empty": "white"}
SLOT_LABELS = {"cached": "in the cache", "new": "computed this step", "draft": "draft (booked, unverified)",
               "accepted": "draft kept", "rejected": "draft rejected", "padding": "no draft (padding)",
               "empty": "free slot"}
CHIP_FACES = {"context": "#f1f1f1", "proposed": YELLOW, "accepted": GREEN, "rejected": RED, "padding": GREY,
              "target": BLUE}
NO_GPU = ("No GPU measurement here: benchmarks/results/speculative.json is written on a GPU by "
          "`python benchmarks/bench_speculative.py --out benchmarks/results`.")


def token_piece(tokenizer):
    """``id -> text`` for one token, whitespace made visible (``·`` for a space, ``↵`` for a newline)."""
    def piece(token_id: int) -> str:
        if token_id < 0:
            return "∅"
        return tokenizer.decode([int(token_id)]).replace(" ", "·").replace("\n", "↵") or f"<{token_id}>"

    return piece


# -- frames ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecFrame:
    """One moment of a recorded step, ready to draw (plain data)."""

    step: int
    phase: str          # "prefill", "decode", "draft", "verify" or "rollback"
    caption: str
    num_blocks: int
    block_size: int
    table: tuple        # the sequence's block table at this moment
    slots: tuple        # the state of each slot of the table (keys of SLOT_FACES)
    freed: tuple        # blocks just given back to the pool
    others: tuple       # blocks other sequences hold
    context: tuple      # text pieces before the step (its tail)
    drafts: tuple       # (piece, state) per draft
    emitted: tuple      # (piece, state) per token the step appended


def _slots(table_len: int, block_size: int, start: int, states: list, filled: int) -> tuple:
    """Slot states: cached before ``start``, then ``states``, then empty up to the table's end."""
    out = ["cached"] * start + states[:filled - start]
    return tuple(out + ["empty"] * (table_len * block_size - len(out)))


def _positions(first: int, count: int) -> str:
    return f"position {first}" if count == 1 else f"positions {first}-{first + count - 1}"


def speculation_frames(steps, piece=str, context_tokens: int = 12) -> list[SpecFrame]:
    """Frames of recorded :class:`~kvlab.workloads.speculation.SpecStep` s: one per prefill or
    plain decode step, three per verification (draft, verify, rollback). ``piece`` turns a token
    id into text (see :func:`token_piece`)."""
    frames = []
    for s in steps:
        base = dict(step=s.index, num_blocks=s.num_blocks, block_size=s.block_size, others=s.other_blocks,
                    context=tuple(piece(t) for t in s.tokens_before[-context_tokens:]))
        emitted = tuple((piece(t), "accepted" if i < s.num_accepted else "target") for i, t in enumerate(s.emitted))
        if s.kind != "verify":
            what = (f"the prompt's {s.seq_len} tokens computed in one pass" if s.kind == "prefill"
                    else "no draft found: a plain decode step")
            frames.append(SpecFrame(phase=s.kind, caption=f"step {s.index} · {s.kind}: {what}; the target samples "
                                    f"one token", table=s.block_table,
                                    slots=_slots(len(s.block_table), s.block_size, s.start,
                                                 ["new"] * (s.seq_len - s.start), s.seq_len),
                                    freed=(), drafts=(), emitted=emitted, **base))
            continue
        k = len(s.drafts)
        pad = ["padding" if d < 0 else None for d in s.drafts]
        booked = ["new"] + [p or "draft" for p in pad]
        judged = ["new"] + [p or ("accepted" if i < s.num_accepted else "rejected") for i, p in enumerate(pad)]
        real = sum(d >= 0 for d in s.drafts)
        frames.append(SpecFrame(
            phase="draft", caption=f"step {s.index} · draft: {real} draft token{'s' * (real != 1)} proposed; "
            f"{k} slots booked after the last token ({_positions(s.start + 1, k)})", table=s.block_table,
            slots=_slots(len(s.block_table), s.block_size, s.start, booked, s.seq_len), freed=(),
            drafts=tuple((piece(d), p or "proposed") for d, p in zip(s.drafts, pad)), emitted=(), **base))
        target = "a bonus token" if s.num_accepted == k else "its own token in place of the first rejected"
        frames.append(SpecFrame(
            phase="verify", caption=f"step {s.index} · verify: one target forward over {k + 1} positions writes "
            f"their K/V; {s.num_accepted} of {k} kept, then {target}", table=s.block_table,
            slots=_slots(len(s.block_table), s.block_size, s.start, judged, s.seq_len), freed=(),
            drafts=tuple((piece(d), p or ("accepted" if i < s.num_accepted else "rejected"))
                         for i, (d, p) in enumerate(zip(s.drafts, pad))), emitted=emitted, **base))
        cut = len(s.rejected_positions)
        freed = s.freed_blocks
        what = (f"{cut} rejected slot{'s' * (cut != 1)} cut ({_positions(s.kept_len, cut)})" if cut
                else "nothing to cut")
        if freed:
            what += f"; block{'s' * (len(freed) > 1)} {', '.join(map(str, freed))} back to the pool"
        kept_table = s.block_table[:blocks_needed(s.kept_len, s.block_size)]
        frames.append(SpecFrame(
            phase="rollback", caption=f"step {s.index} · rollback: {what}" + (" (then the sequence finished)"
                                                                              if s.finished else ""),
            table=kept_table, slots=_slots(len(kept_table), s.block_size, s.start, judged, s.kept_len),
            freed=freed, drafts=frames[-1].drafts, emitted=emitted, **base))
    return frames


# -- drawing a frame -----------------------------------------------------------------------------
CELL = 0.17            # inches per slot
BLOCK_GAP = 0.1
GRID_CELL = 0.3
GRID_COLUMNS = 16
WIDTH = 11.0
CHAR = 0.078           # inches per character of the 9-point monospaced chips


def _draw_pool(ax, frame: SpecFrame) -> None:
    mine = set(frame.table)
    for b in range(frame.num_blocks):
        row, col = divmod(b, GRID_COLUMNS)
        face, edge, style = FREE_FACE, FREE_EDGE, "solid"
        if b in mine:
            face, edge = seq_colour(SEQ), "black"
        elif b in frame.others:
            face = tint("#7f7f7f", 0.5)
        if b in frame.freed:
            edge, style = RED, "dashed"
        ax.add_patch(Rectangle((col, -row), 0.88, 0.88, facecolor=face, edgecolor=edge, linestyle=style,
                               linewidth=2.0 if b in frame.freed else 0.8))
        ax.text(col + 0.44, -row + 0.44, str(b), ha="center", va="center", fontsize=7,
                color="white" if b in mine else "#777777")
    ax.set_title("physical blocks (blue: this sequence; red dashed: just freed)", fontsize=9, loc="left")


def _draw_table(ax, frame: SpecFrame, per_row: int) -> None:
    bs = frame.block_size
    for logical, block in enumerate(frame.table):
        row, col = divmod(logical, per_row)
        x0, y0 = col * (bs + BLOCK_GAP / CELL), -row * 2.2
        ax.text(x0 + bs / 2, y0 + 1.25, f"block {block}", ha="center", va="center", fontsize=7, color="#555555")
        for j in range(bs):
            state = frame.slots[logical * bs + j]
            ax.add_patch(Rectangle((x0 + j, y0), 1, 1, facecolor=SLOT_FACES[state], edgecolor="#555555",
                                   linewidth=0.6))
            if state in ("rejected", "padding"):
                ax.plot([x0 + j + 0.15, x0 + j + 0.85], [y0 + 0.15, y0 + 0.85], color="white", linewidth=1.2)
                ax.plot([x0 + j + 0.15, x0 + j + 0.85], [y0 + 0.85, y0 + 0.15], color="white", linewidth=1.2)
    ax.set_title(f"its block table, slot by slot ({bs} per block)", fontsize=9, loc="left")


def _chips(ax, y: float, label: str, chips, width_chars: float) -> None:
    ax.text(0, y, label, ha="left", va="center", fontsize=9, color="#444444")
    x = 10.0
    for text, state in chips:
        w = len(text) + 0.8
        if x + w > width_chars:
            ax.text(x, y, "…", ha="left", va="center", fontsize=9)
            break
        ax.add_patch(Rectangle((x, y - 0.42), w, 0.84, facecolor=CHIP_FACES[state], edgecolor="none"))
        ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=9, family="monospace",
                color="white" if state in ("accepted", "rejected", "target") else "black",
                fontweight="bold" if state == "target" else "normal")
        if state in ("rejected", "padding"):
            ax.add_line(Line2D([x + 0.2, x + w - 0.2], [y, y], color="black", linewidth=1.3))
        x += w + 0.5


def draw_speculation_frame(frame: SpecFrame) -> Figure:
    """The pool's blocks, the sequence's block table slot by slot, and the token stream
    (context in grey, drafts: kept green, rejected red and struck, the target's token blue)."""
    bs = frame.block_size
    per_row = max(1, int((WIDTH - 0.4) // (bs * CELL + BLOCK_GAP)))
    grid_rows = -(-frame.num_blocks // GRID_COLUMNS)
    table_rows = max(1, -(-len(frame.table) // per_row))
    heights = [grid_rows * GRID_CELL + 0.3, table_rows * 2.2 * CELL + 0.3, 1.2, 0.55]  # each: 0.3 in above
    top = 0.45
    fig = Figure(figsize=(WIDTH, top + sum(heights) + 0.1), dpi=100)
    total = fig.get_figheight()
    fig.text(0.2 / WIDTH, 1 - 0.1 / total, frame.caption, ha="left", va="top", fontsize=10.5, fontweight="bold")
    y = total - top
    boxes = []
    for h in heights:
        boxes.append((0.2 / WIDTH, (y - h) / total, (WIDTH - 0.4) / WIDTH, (h - 0.3) / total))
        y -= h
    pool_ax = fig.add_axes(boxes[0])
    pool_ax.set_xlim(-0.05, (WIDTH - 0.4) / GRID_CELL)
    pool_ax.set_ylim(0.95 - grid_rows, 0.95)
    table_ax = fig.add_axes(boxes[1])
    table_ax.set_xlim(-0.05, (WIDTH - 0.4) / CELL)
    table_ax.set_ylim(-2.2 * (table_rows - 1) - 0.1, 1.6)
    token_ax = fig.add_axes(boxes[2])
    width_chars = (WIDTH - 0.4) / CHAR
    token_ax.set_xlim(0, width_chars)
    token_ax.set_ylim(-3.2, 0.6)
    legend_ax = fig.add_axes(boxes[3])
    for ax in (pool_ax, table_ax, token_ax, legend_ax):
        ax.set_axis_off()
    _draw_pool(pool_ax, frame)
    _draw_table(table_ax, frame, per_row)
    _chips(token_ax, 0, "context", [(t, "context") for t in frame.context], width_chars)
    _chips(token_ax, -1.3, "drafts", frame.drafts, width_chars)
    _chips(token_ax, -2.6, "emitted", frame.emitted, width_chars)
    legend_ax.legend(handles=[Patch(facecolor=SLOT_FACES[s], edgecolor="#555555", label=SLOT_LABELS[s])
                              for s in SLOT_FACES] + [Patch(facecolor=BLUE, label="the target's token")],
                     loc="center left", ncol=4, fontsize=7.5, frameon=False)
    return fig


def speculation_stepper(frames, title: str | None = None):
    """A slider over ``frames`` (see :func:`speculation_frames`); it only redraws the chosen frame."""
    from kvlab.viz.stepper import step_through

    return step_through(frames, draw_speculation_frame, title=title)


# -- measurements ------------------------------------------------------------------------------
def missing_gpu_note(bench, section: str) -> str | None:
    """Why ``section`` of the GPU benchmark cannot be drawn (None: it can)."""
    return NO_GPU if bench is None else bench.why_missing(section)


def plot_verify_cost(bench, spec: str = "llama-3-8b") -> Figure:
    """Step time against query tokens per sequence (left) and over the 1-token step (right),
    one line per batch size, with the roofline's prediction dashed."""
    cost = bench.verify_cost
    qs = list(cost["query_tokens"])
    fig = Figure(figsize=(11, 3.8), dpi=100)
    left, right = fig.subplots(1, 2)
    for i, batch in enumerate(cost["batches"]):
        colour = seq_colour(i)
        ms = cost["step_ms"][batch]
        left.plot(qs, ms, marker="o", markersize=3, color=colour, label=f"batch {batch}")
        if 1 in qs:
            right.plot(qs, [m / ms[qs.index(1)] for m in ms], marker="o", markersize=3, color=colour,
                       label=f"batch {batch}, measured")
            roof = [verify_roofline(spec, batch, q, cost.get("context", 2048)).ms for q in qs]
            right.plot(qs, [r / roof[qs.index(1)] for r in roof], linestyle="--", color=colour, alpha=0.7,
                       label=f"batch {batch}, roofline")
    left.set(xlabel="query tokens per sequence (k + 1)", ylabel="step time (ms)")
    left.set_title(f"{cost.get('model', 'model')}, {cost.get('context', '?')} cached tokens per sequence", fontsize=10)
    right.axhline(1.0, color="#888888", linewidth=0.8)
    right.set(xlabel="query tokens per sequence (k + 1)", ylabel="time / time of a 1-token step")
    right.set_title("what verifying k drafts costs, relative to a decode step", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def plot_acceptance(curves: dict, alpha: float | None = None) -> Figure:
    """P(i-th draft kept) (left, with α^i, the independent-draft model, dashed) and
    P(i-th kept | (i − 1)-th kept) (right: flat at α under that model). ``curves``: label ->
    acceptance by position."""
    fig = Figure(figsize=(11, 3.6), dpi=100)
    left, right = fig.subplots(1, 2)
    longest = max((len(v) for v in curves.values()), default=0)
    for i, (label, shares) in enumerate(curves.items()):
        positions = range(1, len(shares) + 1)
        left.plot(positions, shares, marker="o", color=seq_colour(i), label=label)
        right.plot(positions, conditional_acceptance(shares), marker="o", color=seq_colour(i), label=label)
    if alpha is not None and longest:
        positions = range(1, longest + 1)
        left.plot(positions, [alpha ** i for i in positions], "k--", linewidth=1, label=f"α^i, α = {alpha:.2f}")
        right.axhline(alpha, color="black", linestyle="--", linewidth=1, label=f"α = {alpha:.2f}")
    left.set(xlabel="i-th draft of the step", ylabel="P(i-th draft kept)", ylim=(0, 1.02), title="kept, by position")
    right.set(xlabel="i-th draft of the step", ylabel="P(kept | previous kept)", ylim=(0, 1.02),
              title="kept, given the draft before it was kept")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def plot_tokens_per_step(sweeps: dict) -> Figure:
    """Measured tokens per verification step against k (markers) and the formula
    (1 − α^(k+1)) / (1 − α) at each sweep's α from k = 1 (dashed), with its ceiling 1 / (1 − α)
    (dotted). ``sweeps``: label -> a dict with ``k``, ``measured_tokens_per_step``, ``alpha_k1``."""
    fig = Figure(figsize=(7, 3.8), dpi=100)
    ax = fig.subplots()
    for i, (label, sweep) in enumerate(sweeps.items()):
        colour, ks, alpha = seq_colour(i), list(sweep["k"]), sweep["alpha_k1"]
        ax.plot(ks, sweep["measured_tokens_per_step"], marker="o", color=colour, label=f"{label}: measured")
        grid = range(1, max(ks) + 1)
        ax.plot(grid, [expected_tokens_per_step(alpha, k) for k in grid], "--", color=colour,
                label=f"{label}: formula, α = {alpha:.2f}")
        if alpha < 1:
            ax.axhline(1 / (1 - alpha), color=colour, linestyle=":", linewidth=1,
                       label=f"{label}: ceiling 1/(1 − α) = {1 / (1 - alpha):.2f}")
    ax.set(xlabel="drafts per step k", ylabel="tokens per verification step",
           title="tokens per step: measured vs the independent-draft formula")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def plot_batch_speedup(bench) -> Figure:
    """End-to-end speedup of each method over no speculation, against batch size."""
    sweep = bench.batch_speedup
    fig = Figure(figsize=(7, 3.8), dpi=100)
    ax = fig.subplots()
    for i, method in enumerate(m for m in ("ngram", "draft_model") if m in sweep):
        ax.plot(sweep["batch"], sweep[method], marker="o", color=seq_colour(i), label=f"{method}, tiny pair")
    predicted = sweep.get("predicted_8b")
    if isinstance(predicted, dict) and predicted.get("speedup"):
        ax.plot(predicted["batch"], predicted["speedup"], "k--", marker="s",
                label=f"8B-shaped, predicted (k = {predicted.get('k')})")
    ax.axhline(1.0, color="#888888", linewidth=0.8)
    ax.axvspan(8, max(sweep["batch"]) * 1.1, color=RED, alpha=0.06, label="seed: turn it off here (batch ≥ 8)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sweep["batch"]), [str(b) for b in sweep["batch"]])
    ax.set(xlabel="batch size", ylabel="tokens/s with / without speculation", title="speedup against batch size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    return fig
