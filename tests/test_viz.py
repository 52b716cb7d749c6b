"""Page-map snapshots and figures, the step-through widget and the static strip."""
import copy
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab.paging import BlockPool  # noqa: E402
from kvlab.viz.page_map import (  # noqa: E402
    PALETTE,
    draw_page_map,
    frame_problems,
    page_map_drawer,
    page_map_frame,
    seq_colour,
    show_page_map,
)
from kvlab.viz.stepper import frames_strip, pick_indices, step_through  # noqa: E402


def duck_pool(tables, lens, num_blocks=8, block_size=4, free=None):
    """A pool-shaped object with no BlockPool behind it."""
    pool = SimpleNamespace(num_blocks=num_blocks, block_size=block_size, block_tables=tables, seq_lens=lens)
    if free is not None:
        pool.free_blocks = free
    return pool


def test_frame_owners_and_fills():
    pool = BlockPool(num_blocks=6, block_size=4)
    pool.allocate("a", 6)   # blocks 0 (full), 1 (half)
    pool.allocate("b", 1)   # block 2 (a quarter)
    frame = page_map_frame(pool, title="t")
    assert frame.owners == ("a", "a", "b", None, None, None)
    assert frame.fills == (1.0, 0.5, 0.25, 0.0, 0.0, 0.0)
    assert frame.block_tables == {"a": (0, 1), "b": (2,)}
    assert frame.seq_lens == {"a": 6, "b": 1}
    assert (frame.num_used, frame.num_free, frame.num_tokens, frame.title) == (3, 3, 7, "t")
    assert frame_problems(frame) == []


def test_frame_is_a_snapshot():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate(0, 5)
    frame = page_map_frame(pool)
    kept = copy.deepcopy(frame)
    pool.append(0, 9)
    pool.allocate(1, 3)
    pool.free(0)
    assert frame == kept


def test_frame_of_a_duck_typed_pool():
    frame = page_map_frame(duck_pool({7: [3, 1]}, {7: 5}))
    assert frame.owners[3] == 7 and frame.owners[1] == 7
    assert frame.fills[3] == 1.0 and frame.fills[1] == 0.25
    assert frame.free_blocks is None
    assert frame_problems(frame) == []


@pytest.mark.parametrize("tables, lens, free, words", [
    ({"a": [0], "b": [0]}, {"a": 1, "b": 1}, None, "held 2 times"),
    ({"a": [0, 1]}, {"a": 3}, None, "expected 1"),
    ({"a": [9]}, {"a": 1}, None, "outside"),
    ({"a": [0]}, {"a": 2}, [0, 1, 2, 3, 4, 5, 6, 7], "both free and owned"),
    ({"a": [0]}, {"a": 2}, [1, 2, 3], "leaked"),
    ({}, {}, [0, 0, 1, 2, 3, 4, 5, 6, 7], "twice"),
])
def test_frame_problems_name_each_broken_invariant(tables, lens, free, words):
    problems = frame_problems(page_map_frame(duck_pool(tables, lens, free=free)))
    assert any(words in p for p in problems), problems


def test_seq_colours_are_stable_and_distinct_for_small_ids():
    assert seq_colour(3) == seq_colour(3) and seq_colour("A") == seq_colour("A")
    assert len({seq_colour(i) for i in range(len(PALETTE))}) == len(PALETTE)


def pools_to_draw():
    empty = BlockPool(num_blocks=8, block_size=4)
    full = BlockPool(num_blocks=8, block_size=4)
    full.allocate("x", 32)
    partial = BlockPool(num_blocks=16, block_size=16)
    partial.allocate("A", 64)
    partial.allocate("B", 20)
    crowded = BlockPool(num_blocks=256, block_size=16)
    for seq in range(14):  # more sequences than rows shown, one table longer than a row
        crowded.allocate(seq, 16 * 20 if seq == 0 else 17)
    return {"empty": empty, "full": full, "partial": partial, "crowded": crowded}


@pytest.mark.parametrize("name", ["empty", "full", "partial", "crowded"])
def test_draw_page_map_returns_a_figure(name):
    fig = draw_page_map(page_map_frame(pools_to_draw()[name], title=name))
    assert isinstance(fig, Figure)
    fig.canvas.draw()


def test_draw_page_map_reuses_a_figure_and_shows_problems():
    fig = Figure()
    frame = page_map_frame(duck_pool({"a": [0], "b": [0]}, {"a": 1, "b": 1}))
    assert draw_page_map(frame, fig=fig) is fig
    assert any("problem" in t.get_text() for t in fig.texts)
    assert isinstance(show_page_map(BlockPool(4, 2)), Figure)


def test_step_through_renders_the_frame_the_slider_points_at():
    pytest.importorskip("ipywidgets")
    frames = [f"frame {i}" for i in range(5)]
    drawn = []

    def draw(frame):
        drawn.append(frame)
        return Figure()

    box = step_through(frames, draw, title="demo")
    sliders = [w for w in box.children[1].children if type(w).__name__ == "IntSlider"]
    plays = [w for w in box.children[1].children if type(w).__name__ == "Play"]
    assert len(sliders) == 1 and len(plays) == 1
    assert sliders[0].max == plays[0].max == len(frames) - 1
    assert drawn == ["frame 0"]
    sliders[0].value = 3
    assert drawn[-1] == "frame 3"
    with pytest.raises(ValueError):
        step_through([], draw)


def test_step_through_without_widgets_draws_a_static_strip(monkeypatch):
    monkeypatch.setenv("KVLAB_NO_WIDGETS", "1")
    drawn = []

    def draw(frame):
        drawn.append(frame)
        fig = Figure(figsize=(2, 1))
        fig.subplots().plot([0, frame])
        return fig

    assert isinstance(step_through(list(range(10)), draw), Figure)
    assert drawn == [0, 3, 6, 9]                     # pick_indices' four frames, first to last


def test_pick_indices():
    assert pick_indices(3) == [0, 1, 2]
    assert pick_indices(10, 4) == [0, 3, 6, 9]
    assert pick_indices(100, 1 + 1) == [0, 99]


def test_frames_strip_stacks_the_chosen_frames():
    pool = BlockPool(num_blocks=8, block_size=4)
    frames = [page_map_frame(pool)]
    for seq in range(3):
        pool.allocate(seq, 5)
        frames.append(page_map_frame(pool, title=f"after {seq}"))
    strip = frames_strip(frames, draw_page_map, indices=[0, 2, 3])
    assert isinstance(strip, Figure)
    assert len(strip.axes) == 3
    heights = [draw_page_map(frames[i]).get_size_inches()[1] for i in (0, 2, 3)]
    assert strip.get_size_inches()[1] == pytest.approx(sum(heights), abs=0.05)


def test_page_map_drawer_gives_frames_one_size():
    pool = BlockPool(num_blocks=8, block_size=4)
    frames = [page_map_frame(pool)]
    for seq in range(3):
        pool.allocate(seq, 5)
        frames.append(page_map_frame(pool))
    draw = page_map_drawer(frames)
    sizes = {tuple(draw(frame).get_size_inches()) for frame in frames}
    assert len(sizes) == 1
