"""Figures of chapter 1: KV bytes per token, GPU capacity, contiguous vs paged allocation.

Each function returns a :class:`matplotlib.figure.Figure` built without pyplot, so nothing
is drawn at import and no global figure state is touched.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvlab import accounting as acc
from kvlab.workloads.allocation import FREE, HOLE, RESERVED, STORED

# slot states of a memory map, and the colours used for them everywhere in this chapter
STATE_COLORS = {STORED: "#2b8a3e", RESERVED: "#f59f00", HOLE: "#e03131", FREE: "#e9ecef"}
STATE_NAMES = {STORED: "stored tokens", RESERVED: "reserved, unused (internal)",
               HOLE: "hole too small (external)", FREE: "free"}
POLICY_COLORS = {"contiguous-max": "#868e96", "contiguous-request": "#1c7ed6", "paged": "#2b8a3e"}


def plot_kv_bytes_per_token(models=tuple(acc.PRESETS), dtypes=("bf16", "fp8")) -> Figure:
    """Horizontal bars: KV cache bytes per token of each model, one bar per dtype."""
    specs = [acc.get_spec(m) for m in models]
    fig = Figure(figsize=(8, 0.55 * len(specs) * len(dtypes) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    height = 0.8 / len(dtypes)
    for j, dtype in enumerate(dtypes):
        kib = [acc.kv_bytes_per_token(s, dtype) / 2**10 for s in specs]
        y = np.arange(len(specs)) + j * height
        bars = ax.barh(y, kib, height=height, label=dtype)
        ax.bar_label(bars, labels=[f"{v:,.0f} KiB" for v in kib], padding=3, fontsize=8)
    ax.set_yticks(np.arange(len(specs)) + height * (len(dtypes) - 1) / 2,
                  [f"{s.name} ({s.attention}, {s.num_kv_heads} KV heads)" for s in specs])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=ax.get_xlim()[1] * 4)  # room for the labels
    ax.set_xlabel("KV cache per token, all layers (KiB, log scale)")
    ax.legend(title="KV dtype", loc="lower right")
    ax.set_title("KV bytes per token = 2 x layers x KV heads x head_dim x bytes", fontsize=11)
    return fig


def plot_capacity(models, gpu: str, context_lens=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
                  gpu_memory_utilization: float = 0.9, weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> Figure:
    """Sequences that fit on one ``gpu`` vs context length (log-log), one line per model."""
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    skipped = []
    for model in models:
        spec = acc.get_spec(model)
        try:
            seqs = [acc.max_sequences(spec, gpu, n, gpu_memory_utilization, weight_dtype, kv_dtype)
                    for n in context_lens]
        except ValueError:  # the weights alone do not fit
            skipped.append(spec.name)
            continue
        lens, seqs = np.array(context_lens), np.array(seqs, dtype=float)
        seqs[seqs == 0] = np.nan  # not even one sequence fits: nothing to draw on a log axis
        limit = spec.max_position_embeddings or lens[-1]
        inside = lens <= limit
        line, = ax.plot(lens[inside], seqs[inside], marker="o", label=spec.name)
        beyond = lens >= lens[inside][-1] if inside.any() else lens > 0
        ax.plot(lens[beyond], seqs[beyond], marker="o", ls="--", mfc="white", color=line.get_color(), zorder=1.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(context_lens, [f"{n // 1024}K" for n in context_lens])
    ax.axhline(1, color="black", lw=0.8, ls=":")
    ax.plot([], [], ls="--", marker="o", mfc="white", color="gray", label="beyond the model's context")
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("sequences that fit in the KV budget")
    title = (f"{gpu}: {acc.format_bytes(acc.GPUS[gpu])}, utilization {gpu_memory_utilization:g}, "
             f"weights in {weight_dtype}, KV in {kv_dtype}")
    if skipped:
        title += f"\nweights do not fit: {', '.join(skipped)}"
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(True, which="major", alpha=0.3)
    return fig


def plot_trace_lengths(trace) -> Figure:
    """Histograms of a trace's prompt and output lengths on log-spaced bins."""
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot()
    bins = np.geomspace(1, trace.max_model_len, 40)
    for lens, label, color in ((trace.prompt_lens, "prompt", "#1c7ed6"), (trace.output_lens, "output", "#e8590c")):
        ax.hist(lens, bins=bins, alpha=0.55, color=color,
                label=f"{label}: mean {lens.mean():.0f}, median {np.median(lens):.0f}, p99 {np.percentile(lens, 99):.0f}")
    ax.set_xscale("log")
    ax.set_xlabel("tokens (log scale)")
    ax.set_ylabel("requests")
    ax.legend(fontsize=8)
    ax.set_title(f"{len(trace)} requests, lognormal lengths, max_model_len {trace.max_model_len}", fontsize=10)
    return fig


def plot_memory_over_time(results: dict) -> Figure:
    """For each policy, where the budget goes at every step: stored, internal, external, free."""
    fig = Figure(figsize=(9, 2.2 * len(results) + 0.6), layout="constrained")
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
    last = max(r.steps for r in results.values())
    for ax, (policy, r) in zip(axes, results.items()):
        steps = np.arange(r.steps)
        free = r.budget_tokens - r.reserved - r.external
        parts = [r.stored, r.internal, r.external, free]
        ax.stackplot(steps, *(p / r.budget_tokens for p in parts),
                     colors=[STATE_COLORS[s] for s in (STORED, RESERVED, HOLE, FREE)])
        s = r.summary()
        ax.set_title(f"{policy}: utilisation {s.utilisation:.1%} while busy, "
                     f"{s.mean_running:.0f} running on average, done at step {r.steps}", fontsize=10)
        ax.set_ylim(0, 1)
        ax.set_xlim(0, last)
        ax.set_ylabel("share of budget")
    axes[-1].set_xlabel("step (one decode iteration)")
    fig.legend(handles=_state_handles((STORED, RESERVED, HOLE, FREE)), loc="outside lower center", ncols=4)
    return fig


def plot_policy_summary(results: dict) -> Figure:
    """Left: how the budget is used while busy. Right: concurrency and throughput."""
    summaries = [r.summary() for r in results.values()]
    names = [s.policy for s in summaries]
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax_mem, ax_run = fig.subplots(1, 2)
    left = np.zeros(len(names))
    for state, values in ((STORED, [s.utilisation for s in summaries]),
                          (RESERVED, [s.internal_frag for s in summaries]),
                          (HOLE, [s.external_frag for s in summaries])):
        bars = ax_mem.barh(names, values, left=left, color=STATE_COLORS[state], label=STATE_NAMES[state])
        ax_mem.bar_label(bars, labels=[f"{v:.0%}" if v >= 0.04 else "" for v in values], label_type="center")
        left += values
    ax_mem.set_xlim(0, 1)
    ax_mem.invert_yaxis()
    ax_mem.set_xlabel("share of the KV budget (mean over busy steps)")
    ax_mem.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2, fontsize=8)

    y = np.arange(len(names))
    for offset, key, label in ((-0.2, "mean_running", "mean running"), (0.2, "throughput", "tokens / step")):
        values = [getattr(s, key) for s in summaries]
        bars = ax_run.barh(y + offset, values, height=0.4, label=label)
        ax_run.bar_label(bars, labels=[f"{v:.1f}" for v in values], padding=3, fontsize=8)
    ax_run.set_yticks(y, names)
    ax_run.invert_yaxis()
    ax_run.set_xlim(right=ax_run.get_xlim()[1] * 1.15)
    ax_run.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2, fontsize=8)
    ax_run.set_xlabel("requests / tokens")
    return fig


def plot_memory_maps(maps: dict, row_slots: int = 1024, step: int | None = None) -> Figure:
    """Each policy's slot map as an image: ``row_slots`` slots per row, address left to right."""
    cmap = ListedColormap([STATE_COLORS[s] for s in (FREE, STORED, RESERVED, HOLE)])
    fig = Figure(figsize=(9, 1.2 + 1.9 * len(maps)), layout="constrained")
    axes = fig.subplots(len(maps), 1, squeeze=False)[:, 0]
    for ax, (policy, slots) in zip(axes, maps.items()):
        rows = -(-len(slots) // row_slots)
        grid = np.full(rows * row_slots, -1, dtype=np.int8)
        grid[:len(slots)] = slots
        image = np.ma.masked_less(grid.reshape(rows, row_slots), 0)
        ax.imshow(image, cmap=cmap, vmin=-0.5, vmax=3.5, aspect="auto", interpolation="nearest")
        counts = np.bincount(slots, minlength=4) / len(slots)
        ax.set_title(f"{policy}: stored {counts[STORED]:.0%}, internal {counts[RESERVED]:.0%}, "
                     f"holes {counts[HOLE]:.0%}, free {counts[FREE]:.0%}", fontsize=10)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_ylabel(f"{rows} rows of\n{row_slots} slots", fontsize=8)
    if step is not None:
        fig.suptitle(f"KV budget after step {step}", fontsize=11)
    fig.legend(handles=_state_handles((STORED, RESERVED, HOLE, FREE)), loc="outside lower center", ncols=4)
    return fig


def plot_block_size_sweep(rows) -> Figure:
    """Last-block waste and block-table size per sequence against block size (claim 5)."""
    sizes = [r.block_size for r in rows]
    fig = Figure(figsize=(7.5, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(sizes, [100 * r.waste_frac for r in rows], marker="o", color=STATE_COLORS[RESERVED],
            label="last-block waste (% of budget)")
    ax.plot(sizes, [100 * r.utilisation for r in rows], marker="s", color=STATE_COLORS[STORED],
            label="utilisation (% of budget)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_ylim(0, 100)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("% of the KV budget")
    twin = ax.twinx()
    twin.plot(sizes, [r.table_entries for r in rows], marker="^", color="#5f3dc4", ls="--",
              label="block-table entries per sequence")
    twin.set_yscale("log")
    twin.set_ylabel("block-table entries per sequence (log)")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="center right", fontsize=8)
    ax.set_title("Small blocks waste little memory but make long block tables", fontsize=10)
    return fig


def _state_handles(states):
    return [Patch(color=STATE_COLORS[s], label=STATE_NAMES[s]) for s in states]
