"""Figures of chapter 8, continuous batching and chunked prefill.

What a figure shows is computed first by a pure function (tested on its own), then drawn:

* :func:`gantt_rows` -> :func:`draw_gantt`, :func:`compare_gantts`: each request's life, step by
  step (waiting, prompt chunks, decodes, preemptions), from a recorded run
  (:func:`record_schedule` on a real engine, :func:`replay` on a trace);
* :func:`schedule_frames` -> :func:`draw_schedule_frame`, :func:`schedule_stepper`: one step at a
  time: the token budget filled, where the step sits in the run, the page map after it;
  :func:`describe_step` and :func:`seed_timeline` say the same in words;
* :func:`latency_curves` -> :func:`plot_latency_cdfs`: TTFT and ITL distributions, from the GPU
  benchmark (:func:`read_serving_benchmark`) or a replay;
* :func:`tradeoff_points` -> :func:`plot_budget_tradeoff`: ITL p99 against TTFT and throughput,
  one point per token budget;
* :func:`plot_token_gaps`: every gap between two tokens of a request, over time.

The recording and replay functions are :mod:`kvlab.workloads.batching`'s, re-exported here.
Every figure is a :class:`matplotlib.figure.Figure` built without pyplot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from kvlab.benchmark_results import ServingBenchmark, read_serving_benchmark  # noqa: F401
from kvlab.viz.page_map import draw_page_map, seq_colour, text_colour, tint
from kvlab.viz.stepper import frames_strip, step_through
from kvlab.workloads.batching import (DEFAULT_COST_MODEL, ScheduleRun, ScheduleStep, Scheduled,  # noqa: F401
                                      record_schedule, replay)

WAITING_FACE, UNUSED_FACE, PREEMPT = "#dcdcdc", "#f1f1f1", "#d62728"
NO_GPU = ("No GPU measurement here: benchmarks/results/serving.json is written on a GPU by "
          "`python benchmarks/bench_serving.py --out benchmarks/results`.")


def missing_gpu_note(bench, what: str = "rows") -> str | None:
    """Why ``what`` of the serving benchmark cannot be drawn (None: it can)."""
    return NO_GPU if bench is None else bench.why_missing(what)


# -- words -----------------------------------------------------------------------------------------
def _span(s: Scheduled) -> str:
    what = "recompute" if s.recompute else "prompt"
    if s.start == 0 and s.num_new == s.total:
        return f"{s.request_id} {what} {s.num_new} (whole)"
    part = "last chunk" if s.samples else "chunk"
    return f"{s.request_id} {what} {s.start}-{s.start + s.num_new - 1} of {s.total} ({s.num_new}, {part})"


def describe_step(step: ScheduleStep) -> str:
    """One line: the budget used, who decoded, which prompt chunks ran, who waited or was preempted."""
    decodes = " ".join(s.request_id for s in step.decodes) or "-"
    prefills = ", ".join(_span(s) for s in step.prefills) or "-"
    parts = [f"step {step.index}: {step.tokens}/{step.budget} tokens", f"decode {decodes}", f"prefill {prefills}"]
    if step.waiting:
        parts.append("waiting " + " ".join(step.waiting))
    if step.preempted:
        parts.append("PREEMPTED " + " ".join(step.preempted))
    if step.finished:
        parts.append("done " + " ".join(step.finished))
    return " | ".join(parts)


def seed_timeline(steps, budget: int | None = None) -> list[str]:
    """The steps written as the seed article writes its timeline:
    ``t=2: [prefill_chunk r6 512 + decode_batch=32]``, with the budget filled."""
    lines = []
    for step in steps:
        parts = [f"prefill_chunk {s.request_id} {s.num_new}" if s.num_new < s.total else
                 f"prefill {s.request_id} {s.num_new}" for s in step.prefills]
        if step.decodes:
            parts.append(f"decode_batch={len(step.decodes)}")
        b = budget or step.budget
        lines.append(f"t={step.index + 1}: [{' + '.join(parts)}]".ljust(52) + f" {step.tokens:>5}/{b} tokens"
                     f" ({step.tokens / b:.0%})")
    return lines


# -- the Gantt chart -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GanttSegment:
    """A stretch of one request's life: ``state`` from ``x0`` to ``x1`` (steps or seconds)."""

    x0: float
    x1: float
    state: str          # "waiting", "prefill" (a chunk), "decode"
    tokens: int = 0     # tokens computed (prefill chunks)


@dataclass(frozen=True)
class GanttRow:
    request_id: str
    colour_key: object         # its request id: its colour in every figure (page maps too)
    arrival: float
    segments: tuple
    preempted_at: tuple = ()   # x of the steps that preempted it
    first_token: float | None = None
    finish: float | None = None
    token_times: tuple = ()


def gantt_rows(run: ScheduleRun) -> list[GanttRow]:
    """Per request (arrival order): merged stretches of waiting and decoding, one segment per
    prompt chunk, its preemptions, first token and end."""
    cells: dict[str, list] = {t.request_id: [] for t in run.timings}
    preempted: dict[str, list] = {rid: [] for rid in cells}
    for step in run.steps:
        for s in step.scheduled:
            cells.setdefault(s.request_id, []).append(
                GanttSegment(step.start, step.end, "prefill", s.num_new) if s.prefill else
                GanttSegment(step.start, step.end, "decode"))
        for rid in step.waiting:
            cells.setdefault(rid, []).append(GanttSegment(step.start, step.end, "waiting"))
        for rid in step.preempted:
            preempted.setdefault(rid, []).append(step.start)
    rows = []
    for t in run.timings:
        merged: list[GanttSegment] = []
        for c in cells.get(t.request_id, []):
            last = merged[-1] if merged else None
            if last and c.state != "prefill" and last.state == c.state and math.isclose(last.x1, c.x0):
                merged[-1] = GanttSegment(last.x0, c.x1, c.state)
            else:
                merged.append(c)
        rows.append(GanttRow(t.request_id, t.request_id, t.arrival, tuple(merged),
                             tuple(preempted.get(t.request_id, ())), t.first_token, t.finish, tuple(t.token_times)))
    return rows


def _draw_rows(ax, rows, label_chunks: bool, x_unit: str, span: float, ticks: bool) -> None:
    for y, row in enumerate(rows):
        colour = seq_colour(row.colour_key)
        for seg in row.segments:
            width = seg.x1 - seg.x0
            if seg.state == "waiting":
                ax.add_patch(Rectangle((seg.x0, y - 0.12), width, 0.24, facecolor=WAITING_FACE, edgecolor="none"))
            elif seg.state == "decode":
                ax.add_patch(Rectangle((seg.x0, y - 0.32), width, 0.64, facecolor=colour, edgecolor="none"))
            else:
                ax.add_patch(Rectangle((seg.x0, y - 0.38), width, 0.76, facecolor=tint(colour, 0.55),
                                       edgecolor=text_colour(colour), linewidth=0.8, hatch="///"))
                if label_chunks and width >= 0.025 * span:
                    ax.text(seg.x0 + width / 2, y, str(seg.tokens), ha="center", va="center", fontsize=6.5,
                            clip_on=True)
        if ticks and row.token_times:
            ax.vlines(row.token_times, y - 0.32, y + 0.32, color="white", linewidth=0.5)
        ax.plot([row.arrival] * 2, [y - 0.42, y + 0.42], color="#333333", linewidth=1.2)
        if row.first_token is not None:
            ax.plot([row.first_token], [y], marker="o", color="black", markersize=3.5, linestyle="none")
        for x in row.preempted_at:
            ax.plot([x], [y], marker="X", color=PREEMPT, markersize=8, linestyle="none")


def _legend(ax) -> None:
    handles = [Patch(facecolor=WAITING_FACE, label="waiting (arrived, not scheduled)"),
               Patch(facecolor=tint(seq_colour(0), 0.55), edgecolor=text_colour(seq_colour(0)), hatch="///",
                     label="prompt chunk (tokens)"),
               Patch(facecolor=seq_colour(0), label="decode"),
               Line2D([], [], marker="|", color="#333333", linestyle="none", markersize=9, label="arrival"),
               Line2D([], [], marker="o", color="black", linestyle="none", label="first token"),
               Line2D([], [], marker="X", color=PREEMPT, linestyle="none", label="preempted")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def draw_gantt(run: ScheduleRun, title: str = "", ax=None, x_unit: str = "step", window=None,
               label_chunks: bool | None = None, cursor: tuple | None = None, legend: bool = True) -> Figure:
    """Requests (rows, in arrival order) against steps or seconds (``x_unit``): waiting (grey),
    prompt chunks (hatched, with their tokens), decoding (solid; in seconds, a white tick per
    token). ``window``: (x0, x1) to show; ``cursor``: (x0, x1) of a step to mark."""
    rows = gantt_rows(run)
    if ax is None:
        fig = Figure(figsize=(11, 0.32 * len(rows) + 1.3), dpi=100, layout="constrained")
        ax = fig.subplots()
    fig = ax.figure
    if label_chunks is None:
        label_chunks = len(run.steps) <= 80 if window is None else True
    end = max((s.end for s in run.steps), default=1.0)
    window = window or (0, end)
    _draw_rows(ax, rows, label_chunks, x_unit, window[1] - window[0], ticks=x_unit != "step")
    ax.set_xlim(*window)
    ax.set_ylim(len(rows) - 0.5, -0.6)
    ax.set_yticks(range(len(rows)), [r.request_id for r in rows], fontsize=8)
    for tick, row in zip(ax.get_yticklabels(), rows):
        tick.set_color(text_colour(seq_colour(row.colour_key)))
    if cursor is not None:
        ax.axvspan(*cursor, color="#ffd54f", alpha=0.35, zorder=0)
    ax.set_xlabel("step" if x_unit == "step" else "time (s)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    if legend:
        _legend(ax)
    return fig


def run_caption(name: str, run: ScheduleRun, x_unit: str = "step") -> str:
    """A title line: steps, the run's length, mean TTFT and the batch slots used."""
    s = run.summary()
    unit = "steps" if x_unit == "step" else "s"
    return (f"{name}: {len(run.steps)} steps, all done at {run.duration:.3g} {unit}, "
            f"mean TTFT {np.mean([t.ttft for t in run.timings if t.ttft is not None]):.3g} {unit} "
            f"(p99 {s.ttft_p99:.3g}), batch slots used {run.occupancy():.0%}")


def compare_gantts(runs: dict, x_unit: str = "step", window=None) -> Figure:
    """One Gantt chart per run (``name -> ScheduleRun``), stacked on a shared axis."""
    heights = [0.3 * len(r.timings) + 0.9 for r in runs.values()]
    fig = Figure(figsize=(11, sum(heights) + 0.4), dpi=100, layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    end = max(r.duration for r in runs.values())
    for i, (ax, (name, run)) in enumerate(zip(axes, runs.items())):
        draw_gantt(run, run_caption(name, run, x_unit), ax=ax, x_unit=x_unit, window=window or (0, end), legend=i == 0)
    return fig


# -- one step at a time -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetSegment:
    label: str
    tokens: int
    kind: str              # "decode", "prefill" or "unused"
    colour_key: object = None


def budget_segments(step: ScheduleStep) -> list[BudgetSegment]:
    """The token budget of ``step`` in packed order: each decode's token, each chunk, then what is unused."""
    segs = [BudgetSegment(s.request_id if not s.prefill else f"{s.request_id} +{s.num_new}", s.num_new,
                          "prefill" if s.prefill else "decode", s.request_id) for s in step.scheduled]
    if step.budget > step.tokens:
        segs.append(BudgetSegment(f"unused {step.budget - step.tokens}", step.budget - step.tokens, "unused"))
    return segs


@dataclass(frozen=True)
class ScheduleFrame:
    """What the step-through draws for one step: the step, and the whole run's Gantt rows."""

    step: ScheduleStep
    run: ScheduleRun
    caption: str


def schedule_frames(run: ScheduleRun) -> list[ScheduleFrame]:
    """One frame per recorded step, captioned by :func:`describe_step`."""
    return [ScheduleFrame(step, run, describe_step(step)) for step in run.steps]


def _draw_budget(ax, step: ScheduleStep) -> None:
    x = 0
    for seg in budget_segments(step):
        if seg.kind == "unused":
            ax.add_patch(Rectangle((x, 0), seg.tokens, 1, facecolor=UNUSED_FACE, edgecolor="#bbbbbb"))
        else:
            colour = seq_colour(seg.colour_key)
            decode = seg.kind == "decode"
            ax.add_patch(Rectangle((x, 0), seg.tokens, 1, facecolor=colour if decode else tint(colour, 0.55),
                                   edgecolor="white" if decode else text_colour(colour), linewidth=0.6,
                                   hatch=None if decode else "///"))
        if seg.tokens >= step.budget * 0.06:
            ax.text(x + seg.tokens / 2, 0.5, seg.label, ha="center", va="center", fontsize=8)
        x += seg.tokens
    ax.set_xlim(0, step.budget)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("tokens of the step's budget (max_num_batched_tokens)", fontsize=8)
    n_dec, n_pre = len(step.decodes), len(step.prefills)
    parts = [f"{n_dec} decode{'s' * (n_dec != 1)}"] if n_dec else []
    if n_pre:
        parts.append(f"{step.prefill_tokens} prompt tokens in {n_pre} chunk{'s' * (n_pre != 1)}")
    if step.preempted:
        parts.append(f"preempted {' '.join(step.preempted)}")
    ax.set_title(f"step {step.index}: {step.tokens} of {step.budget} tokens: " + ", ".join(parts), fontsize=9,
                 loc="left")


def _budget_figure(frame: ScheduleFrame) -> Figure:
    fig = Figure(figsize=(11, 1.25), dpi=100, layout="constrained")
    _draw_budget(fig.subplots(), frame.step)
    return fig


def draw_schedule_frame(frame: ScheduleFrame, dpi: int = 80) -> Figure:
    """The budget bar of the step, the run's Gantt chart with the step marked, and the page map
    after the step (when the run recorded page maps), stacked."""
    parts = [_budget_figure(frame),
             draw_gantt(frame.run, frame.caption if len(frame.caption) < 150 else frame.caption[:147] + "...",
                        cursor=(frame.step.start, frame.step.end))]
    if frame.step.page_map is not None:
        parts.append(draw_page_map(frame.step.page_map))
    return frames_strip(parts, lambda fig: fig, indices=range(len(parts)), dpi=dpi)


def schedule_stepper(run: ScheduleRun, title: str | None = None):
    """A slider over the run's steps; it only redraws the chosen frame."""
    return step_through(schedule_frames(run), draw_schedule_frame, title=title)


# -- latency distributions --------------------------------------------------------------------------
PERCENTS = np.concatenate([np.arange(1, 100), [99.5, 99.9]])


@dataclass(frozen=True)
class LatencyCurve:
    """TTFT and ITL quantiles of one configuration: ``percents`` -> seconds."""

    name: str
    source: str               # "GPU" or "replay"
    ttft_percents: tuple
    ttft: tuple
    itl_percents: tuple
    itl: tuple


def latency_curve(name: str, ttfts, itls, source: str = "replay") -> LatencyCurve:
    """Quantiles of raw TTFTs and ITLs (seconds) at :data:`PERCENTS`."""
    def q(values):
        values = [v for v in values if v is not None and not math.isnan(v)]
        return tuple(np.percentile(values, PERCENTS).tolist()) if values else tuple([math.nan] * len(PERCENTS))

    return LatencyCurve(name, source, tuple(PERCENTS.tolist()), q(ttfts), tuple(PERCENTS.tolist()), q(itls))


def latency_curves(source) -> list[LatencyCurve]:
    """Curves of a :class:`ServingBenchmark` (rows with ``ttft_s`` and ``itl_quantiles_s``: the
    ITL percentiles 1..99 the file holds) or of ``{name: ScheduleRun}``."""
    if isinstance(source, ServingBenchmark):
        curves = []
        for row in source.rows:
            if "ttft_s" not in row or "itl_quantiles_s" not in row:
                continue
            c = latency_curve(row["name"], row["ttft_s"], [], "GPU")
            itl = row["itl_quantiles_s"][1:100]
            curves.append(LatencyCurve(c.name, "GPU", c.ttft_percents, c.ttft, tuple(range(1, 100)), tuple(itl)))
        return curves
    return [latency_curve(name, [t.ttft for t in run.timings], [g for t in run.timings for g in t.itls])
            for name, run in source.items()]


def plot_latency_cdfs(curves, title: str = "") -> Figure:
    """TTFT (left) and ITL (right) distributions: the share of requests (of token gaps) at or
    below a latency, on a logit axis that spreads the tail (p90, p99, p99.9). One colour per
    configuration; GPU curves solid, replays dashed."""
    fig = Figure(figsize=(11, 3.9), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    names = list(dict.fromkeys(c.name for c in curves))      # one colour per configuration
    for c in curves:
        style = {"color": seq_colour(names.index(c.name)), "linestyle": "-" if c.source == "GPU" else "--",
                 "label": f"{c.name} ({c.source})"}
        axes[0].plot(np.array(c.ttft) * 1e3, np.array(c.ttft_percents) / 100, **style)
        axes[1].plot(np.array(c.itl) * 1e3, np.array(c.itl_percents) / 100, **style)
    for ax, what in zip(axes, ("TTFT", "ITL (gap between two tokens of a request)")):
        ax.set_xscale("log")
        ax.set_yscale("logit")
        ax.set_ylim(0.01, 0.999)
        ax.set_yticks([0.01, 0.1, 0.5, 0.9, 0.99, 0.999], ["1%", "10%", "50%", "90%", "99%", "99.9%"])
        ax.minorticks_off()
        for p in (0.5, 0.99):
            ax.axhline(p, color="#999999", linewidth=0.7, linestyle=":")
        ax.set(xlabel=f"{what.split(' ')[0]} (ms)", ylabel="share at or below")
        ax.set_title(what, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_token_gaps(runs: dict, window=None) -> Figure:
    """Every gap between two consecutive tokens of a request (y, log) at the time of the later
    token (x), one panel per run: a step that carries a long prefill shows as a column of dots
    high above the rest, one per request that was decoding."""
    fig = Figure(figsize=(11, 1.9 * len(runs) + 0.5), dpi=100, layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, (name, run) in zip(axes, runs.items()):
        xs = [x for t in run.timings for x in t.token_times[1:]]
        gaps = [g * 1e3 for t in run.timings for g in t.itls]
        worst = max(gaps, default=math.nan)
        ax.scatter(xs, gaps, s=6, color="#1f77b4", alpha=0.6)
        ax.set_yscale("log")
        ax.set_title(f"{name}: longest gap {worst:.0f} ms", fontsize=9, loc="left")
        ax.set_ylabel("gap (ms)")
        ax.grid(alpha=0.3)
        if window:
            ax.set_xlim(*window)
    axes[-1].set_xlabel("time (s)")
    return fig


# -- the budget trade-off ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TradeoffPoint:
    name: str
    source: str                 # "GPU" or "replay"
    budget: int | None          # max_num_batched_tokens of a chunked run; None: whole prompts
    itl_p99: float
    itl_max: float
    ttft_p50: float
    ttft_p99: float
    throughput: float           # total tokens/s


def _budget(settings: dict | None) -> int | None:
    settings = settings or {}
    if settings.get("enable_chunked_prefill", True) and "max_num_batched_tokens" in settings:
        return int(settings["max_num_batched_tokens"])
    return None


def _plain(name: str, settings: dict | None) -> bool:
    """Not static, not the fairness rule: one point of the budget sweep."""
    settings = settings or {}
    return name != "static" and settings.get("scheduling_policy", "fcfs") != "static" and \
        settings.get("prefill_priority_after") is None


def tradeoff_points(source, capacities: dict | None = None) -> list[TradeoffPoint]:
    """The budget sweep's points (static and fairness runs left out) of a
    :class:`ServingBenchmark`'s rows or of ``{name: ScheduleRun}``. ``capacities``: name -> total
    tokens/s at saturation, to use as the throughput instead of the trace's (which is the
    offered load whenever the engine keeps up)."""
    points = []
    if isinstance(source, ServingBenchmark):
        for row in source.rows:
            if row.get("static") or not _plain(row["name"], row.get("settings")):
                continue
            quantiles = row.get("itl_quantiles_s")
            points.append(TradeoffPoint(row["name"], "GPU", _budget(row.get("settings")), row["itl_p99"],
                                        quantiles[100] if quantiles else math.nan, row["ttft_p50"], row["ttft_p99"],
                                        row["total_throughput"]))
        return points
    for name, run in source.items():
        if not _plain(name, run.settings):
            continue
        s = run.summary()
        throughput = (capacities or {}).get(name, s.total_throughput)
        worst = max((g for t in run.timings for g in t.itls), default=math.nan)
        points.append(TradeoffPoint(name, "replay", _budget(run.settings), s.itl_p99, worst, s.ttft_p50, s.ttft_p99,
                                    throughput))
    return points


def plot_budget_tradeoff(points, throughput_label: str = "total tokens/s") -> Figure:
    """Against the token budget (x, log): ITL p99 and the worst ITL, TTFT p50 and p99, and
    throughput. Whole prompts (no chunking) as horizontal lines; GPU points solid, replays hollow."""
    fig = Figure(figsize=(12, 3.8), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    panels = ((axes[0], (("itl_p99", "ITL p99", "#1f77b4"), ("itl_max", "worst ITL", "#d62728")), 1e3, "ms"),
              (axes[1], (("ttft_p50", "TTFT p50", "#1f77b4"), ("ttft_p99", "TTFT p99", "#d62728")), 1e3, "ms"),
              (axes[2], (("throughput", throughput_label, "#2ca02c"),), 1.0, throughput_label))
    for source, marker, fill, style in (("GPU", "o", "full", "-"), ("replay", "s", "none", "--")):
        pts = sorted((p for p in points if p.source == source and p.budget is not None), key=lambda p: p.budget)
        whole = next((p for p in points if p.source == source and p.budget is None), None)
        for ax, series, scale, _ in panels:
            for key, label, colour in series:
                if pts:
                    ax.plot([p.budget for p in pts], [getattr(p, key) * scale for p in pts], marker=marker,
                            fillstyle=fill, linestyle=style, color=colour, label=f"{label}, chunks ({source})")
                if whole is not None and not math.isnan(getattr(whole, key)):
                    ax.axhline(getattr(whole, key) * scale, color=colour, linestyle=":", linewidth=1.2,
                               label=f"{label}, whole prompts ({source})")
    titles = ("decodes: smaller budgets, shorter gaps", "first tokens: smaller budgets, later",
              "throughput: smaller budgets, more steps")
    budgets = sorted({p.budget for p in points if p.budget is not None})
    for (ax, _, _, unit), title in zip(panels, titles):
        ax.set_xscale("log", base=2)
        if budgets:
            ax.set_xticks(budgets, [f"{b:,}" if b < 1024 else f"{b // 1024}K" for b in budgets], fontsize=7.5)
            ax.minorticks_off()
        ax.set(xlabel="token budget (max_num_batched_tokens)", ylabel=unit, title=title)
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6.5)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    return fig
