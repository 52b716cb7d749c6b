"""Step through a list of precomputed frames: a widget, and a static strip for plain renderers.

Both take ``frames`` (any objects) and ``draw(frame) -> matplotlib Figure``. The frames are
computed beforehand by tested pure functions (e.g. :func:`kvlab.workloads.allocator_trace.replay`); the
widget only redraws the one the slider points at.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D


def _close(fig) -> None:
    """Forget ``fig`` if pyplot is tracking it, so drawn frames don't pile up."""
    import matplotlib.pyplot as plt

    plt.close(fig)


def step_through(frames: Sequence, draw: Callable[[object], Figure], title: str | None = None,
                 interval_ms: int = 700):
    """A Play button and a slider over ``frames``; moving either redraws ``draw(frames[i])``.

    Returns the widget box (display it, or leave it as a cell's last expression). With the
    environment variable ``KVLAB_NO_WIDGETS=1`` (a frontend without widgets), it returns
    :func:`frames_strip`'s static figure of a few frames instead.
    """
    if not frames:
        raise ValueError("step_through needs at least one frame")
    if os.environ.get("KVLAB_NO_WIDGETS") == "1":
        return frames_strip(frames, draw)
    import ipywidgets as widgets
    from IPython.display import display

    last = len(frames) - 1
    play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval_ms, description="play")
    slider = widgets.IntSlider(value=0, min=0, max=last, step=1, description="frame",
                               continuous_update=True, layout=widgets.Layout(width="420px"))
    widgets.jslink((play, "value"), (slider, "value"))
    out = widgets.Output()

    def render(change=None) -> None:
        index = slider.value if change is None else change["new"]
        fig = draw(frames[index])
        with out:
            out.clear_output(wait=True)
            display(fig)
        _close(fig)

    slider.observe(render, names="value")
    render()
    header = [widgets.HTML(f"<b>{title}</b>")] if title else []
    return widgets.VBox(header + [widgets.HBox([play, slider]), out])


def figure_pixels(fig: Figure, dpi: int = 100) -> np.ndarray:
    """Render ``fig`` off-screen; returns its RGBA pixels ``[height, width, 4]``."""
    canvas = FigureCanvasAgg(fig)
    fig.set_dpi(dpi)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()


def pick_indices(num_frames: int, count: int = 4) -> list[int]:
    """``count`` frame indices spread evenly from the first frame to the last."""
    if num_frames <= count:
        return list(range(num_frames))
    return sorted({round(i * (num_frames - 1) / (count - 1)) for i in range(count)})


def frames_strip(frames: Sequence, draw: Callable[[object], Figure], indices: Sequence[int] | None = None,
                 dpi: int = 80) -> Figure:
    """A few frames drawn one above the other in one static figure (no widgets needed).

    ``indices`` defaults to four frames spread over the sequence. Each frame keeps its own
    figure's look: it is rendered to pixels and stacked at the same resolution.
    """
    indices = pick_indices(len(frames)) if indices is None else list(indices)
    if not indices:
        raise ValueError("frames_strip needs at least one frame index")
    images = []
    for i in indices:
        fig = draw(frames[i])
        images.append(figure_pixels(fig, dpi))
        _close(fig)
    width = max(img.shape[1] for img in images)
    height = sum(img.shape[0] for img in images)
    strip = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    top = height
    for img in images:
        h, w = img.shape[:2]
        top -= h
        ax = strip.add_axes((0, top / height, w / width, h / height))
        ax.imshow(img, interpolation="none")
        ax.set_axis_off()
        if top > 0:  # a rule between frames
            strip.add_artist(Line2D([0, 1], [top / height] * 2, transform=strip.transFigure, color="#888888"))
    return strip
