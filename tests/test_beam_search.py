"""Parallel sampling and beam search on the block pool: invariants, memory, and KV content.

The content tests write every token's K/V through ``write_kv`` and apply the pool's
copy-on-write pairs with ``copy_blocks`` (Triton, interpreted on the CPU), then read each live
sequence back through its block table and compare with a shadow model: position ``p`` of a
sequence holding token ``t`` has K/V ``SHADOW[layer, t, p]``.
"""
import itertools
import random

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab import profile  # noqa: E402
from kvlab.workloads.beam_search import (  # noqa: E402
    Beam,
    beam_search,
    beam_search_step,
    independent_sequences,
    log_softmax,
    parallel_sampling,
    prompt_ratio_for,
    sharing_memory,
    sharing_ratio_formula,
    sharing_sweep,
    start_beams,
    toy_logits,
    top_candidates,
)
from kvlab.kernels import copy_blocks, write_kv  # noqa: E402
from kvlab.paging import BlockPool, allocate_kv_cache, batch_slot_mapping, blocks_needed  # noqa: E402
from kvlab.paging.snapshot import frame_problems, page_map_frame  # noqa: E402
from kvlab.reference import gather_kv  # noqa: E402
from kvlab.viz.sharing import draw_shared_tables, plot_blocks_per_step, plot_sharing_ratio  # noqa: E402

DEVICE = profile.DEVICE


def assert_consistent(frame):
    assert not frame_problems(frame), f"{frame.title}: {frame_problems(frame)}"
    for block in range(frame.num_blocks):
        assert frame.ref_counts[block] == frame.holders(block), \
            f"{frame.title}: block {block} has ref count {frame.ref_counts[block]}, held {frame.holders(block)} times"


def assert_empty(pool):
    assert pool.num_free_blocks == pool.num_blocks and not any(pool.ref_counts) and not pool.block_tables


# -- invariants ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len,n,output_lens", [(6, 3, 5), (8, 4, [3, 0, 9, 4]), (1, 2, [1, 2]), (13, 3, 1)])
def test_parallel_sampling_keeps_counts_and_frees_everything(prompt_len, n, output_lens):
    pool, frames = BlockPool(32, 4), []
    run = parallel_sampling(pool, prompt_len, n, output_lens, record=frames)
    assert_empty(pool)
    assert frames and run.forks == n - 1
    for frame in frames:
        assert_consistent(frame)
    assert max(f.num_used for f in frames) == run.peak_blocks


@pytest.mark.parametrize("prompt_len,beam_width,steps,seed", [(6, 4, 9, 0), (8, 3, 12, 1), (3, 2, 5, 2), (5, 1, 4, 3)])
def test_beam_search_keeps_counts_and_frees_everything(prompt_len, beam_width, steps, seed):
    pool, frames = BlockPool(64, 4), []
    run = beam_search(pool, prompt_len, beam_width, steps, seed=seed, record=frames)
    assert_empty(pool)
    for frame in frames:
        assert_consistent(frame)
    assert len(run.beams) == beam_width and len(run.blocks_per_step) == steps + 1
    assert all(len(b.tokens) == steps for b in run.beams)
    assert [b.score for b in run.beams] == sorted((b.score for b in run.beams), reverse=True)


def test_record_accepts_a_callback():
    titles = []
    beam_search(BlockPool(16, 4), 5, 2, 3, record=lambda frame: titles.append(frame.title))
    assert titles[0] == "beam 0 holds the 5-token prompt" and titles[-1].startswith("done:")


def test_top_candidates_and_scores():
    logits = {(): [0.0, 2.0, 1.0], (1,): [5.0, 0.0, 0.0], (2,): [0.0, 0.0, 0.0]}
    beams = [Beam(0, (1,), -0.5), Beam(1, (2,), -0.1)]
    kept = top_candidates(beams, lambda tokens: logits[tokens], 3)
    lp1, lp2 = log_softmax(logits[(1,)]), log_softmax(logits[(2,)])
    assert kept[0] == (0, 0, -0.5 + lp1[0])
    assert [(p, t) for p, t, _ in kept[1:]] == [(1, 0), (1, 1)]  # a tie goes to the lower token id
    assert kept[1][2] == pytest.approx(-0.1 + lp2[0])
    assert toy_logits(3)((1, 2)) == toy_logits(3)((1, 2)) != toy_logits(4)((1, 2))


def test_a_parent_kept_twice_is_forked_and_a_dropped_one_freed():
    pool = BlockPool(16, 4)
    beams = start_beams(pool, 6)
    # step 1: beam 0 is kept twice (one fork); step 2: all the mass is on beam 0's continuation
    beams = beam_search_step(pool, beams, lambda tokens: [3.0, 2.0, 0.0], 2, itertools.count(1), step=1)
    assert [(b.seq_id, b.tokens) for b in beams] == [(0, (0,)), (1, (1,))]
    assert pool.block_table(0) != pool.block_table(1) and pool.block_table(0)[0] == pool.block_table(1)[0]
    assert pool.ref_counts[pool.block_table(0)[0]] == 2
    favour_zero = lambda tokens: [9.0, 8.0, 0.0] if tokens == (0,) else [0.0, 0.0, 0.0]  # noqa: E731
    beams = beam_search_step(pool, beams, favour_zero, 2, itertools.count(2), step=2)
    assert [(b.seq_id, b.tokens) for b in beams] == [(0, (0, 0)), (2, (0, 1))]
    assert 1 not in pool.block_tables and set(pool.block_tables) == {0, 2}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fork", "append", "append", "free"]), st.integers(0, 7),
                          st.integers(0, 5)), max_size=40),
       st.integers(1, 5), st.integers(0, 9))
def test_random_fork_append_free_keeps_ref_counts(ops, block_size, prompt_len):
    pool = BlockPool(48, block_size)
    pool.allocate(0, prompt_len)
    next_id = itertools.count(1)
    for kind, pick, n in ops:
        live = sorted(pool.block_tables)
        if not live:
            break
        seq = live[pick % len(live)]
        if kind == "fork":
            pool.fork(seq, next(next_id))
        elif kind == "append" and pool.can_append(seq, n):
            pool.append(seq, n)
        elif kind == "free":
            pool.free(seq)
        assert_consistent(page_map_frame(pool))
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    for seq in list(pool.block_tables):
        pool.free(seq)
    assert_empty(pool)


# -- memory ----------------------------------------------------------------------------------
def parallel_blocks(prompt_len, gen_len, n, block_size):
    """Closed form for parallel sampling: full prompt blocks once, the rest once per sample."""
    shared = prompt_len // block_size
    return shared + n * (blocks_needed(prompt_len + gen_len, block_size) - shared)


@pytest.mark.parametrize("prompt_len,gen_len,k,block_size", [
    (64, 16, 4, 16), (70, 9, 4, 16), (5, 40, 3, 4), (1, 1, 2, 16), (100, 28, 4, 16), (33, 7, 6, 8)])
def test_parallel_sampling_memory_is_the_formula_up_to_block_rounding(prompt_len, gen_len, k, block_size):
    m = sharing_memory(prompt_len, gen_len, k, block_size, mode="parallel")
    assert m.shared_blocks == parallel_blocks(prompt_len, gen_len, k, block_size)
    assert m.unshared_blocks == k * blocks_needed(prompt_len + gen_len, block_size)
    assert m.shared_blocks <= m.unshared_blocks
    assert m.copies == (k - 1) * (prompt_len % block_size != 0)
    # blocks hold between 0 and block_size - 1 empty slots (+ the copied prompt tail per sample)
    slack = (k + 1) * block_size / (k * (prompt_len + gen_len))
    assert abs(m.ratio - m.formula) <= slack


@pytest.mark.parametrize("prompt_len,gen_len,k", [(7, 5, 4), (30, 12, 3), (1, 9, 2)])
def test_block_size_one_gives_the_formula_exactly(prompt_len, gen_len, k):
    m = sharing_memory(prompt_len, gen_len, k, block_size=1, mode="parallel")
    assert m.shared_blocks == prompt_len + k * gen_len and m.unshared_blocks == k * (prompt_len + gen_len)
    assert m.ratio == pytest.approx(sharing_ratio_formula(prompt_len, gen_len, k))


def test_beam_search_needs_at_most_what_parallel_sampling_needs():
    for m in sharing_sweep([16, 70, 256], [8, 40], k=4, block_size=16, modes=("beam",)):
        bound = parallel_blocks(m.prompt_len, m.gen_len, m.k, m.block_size)
        assert m.shared_blocks <= bound <= m.unshared_blocks, m
        assert m.shared_peak >= m.shared_blocks


def test_formula_facts():
    assert sharing_ratio_formula(14, 1, 4) == pytest.approx(0.30)
    assert prompt_ratio_for(0.30, 4) == pytest.approx(14)
    assert sharing_ratio_formula(0, 5, 4) == 1 and sharing_ratio_formula(5, 0, 4) == 0.25
    with pytest.raises(ValueError):
        prompt_ratio_for(0.2, 4)


def test_independent_sequences_hold_k_copies():
    pool = BlockPool(40, 4)
    run = independent_sequences(pool, 6, 3, 5)
    assert run.final_blocks == 3 * blocks_needed(11, 4) and run.num_copies == 0
    assert_empty(pool)


# -- content: copy-on-write on a real KV cache -------------------------------------------------
LAYERS, HEADS, DIM, VOCAB, MAX_POS = 2, 1, 4, 8, 32
SHADOW = torch.randn(2, LAYERS, VOCAB, MAX_POS, HEADS, DIM, generator=torch.Generator().manual_seed(0))


def write_new_tokens(pool, kv, tokens, requests):
    """Write positions ``start .. start + n - 1`` of each (seq, start, n) with their shadow K/V."""
    if not requests:
        return
    slots = batch_slot_mapping(pool, requests, device=DEVICE)
    index = [(tokens[seq][pos], pos) for seq, start, n in requests for pos in range(start, start + n)]
    tok, pos = (torch.tensor(x) for x in zip(*index))
    for layer in range(LAYERS):
        write_kv(SHADOW[0, layer, tok, pos].to(DEVICE), SHADOW[1, layer, tok, pos].to(DEVICE),
                 kv.k[layer], kv.v[layer], slots)


def apply_copies(pool, kv):
    pairs = pool.take_copies()
    if pairs:
        copy_blocks([kv.k, kv.v], torch.tensor(pairs, dtype=torch.int64, device=DEVICE))
    return pairs


def assert_content(pool, kv, tokens, when):
    for seq, table in pool.block_tables.items():
        n = pool.seq_lens[seq]
        pos = torch.arange(n)
        tok = torch.tensor(tokens[seq][:n], dtype=torch.int64)
        for layer in range(LAYERS):
            for which, cache in ((0, kv.k), (1, kv.v)):
                got = gather_kv(cache[layer], table, n).cpu()
                want = SHADOW[which, layer, tok, pos]
                if not torch.equal(got, want):
                    bad = int((got != want).flatten(1).any(1).nonzero()[0])
                    raise AssertionError(f"{when}: seq {seq} reads wrong {'KV'[which]} at position {bad} "
                                         f"(layer {layer}, block {table[bad // pool.block_size]})")


def test_beam_search_copies_keep_every_beam_equal_to_its_shadow():
    prompt_len, block_size, width, steps = 6, 4, 3, 7
    pool = BlockPool(24, block_size)
    kv = allocate_kv_cache(LAYERS, 24, block_size, HEADS, DIM, dtype=torch.float32, device=DEVICE)
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(prompt_len)]
    beams = start_beams(pool, prompt_len)
    tokens = {0: prompt}
    write_new_tokens(pool, kv, tokens, [(0, 0, prompt_len)])
    new_ids, logits_fn, copies = itertools.count(1), toy_logits(5, VOCAB), 0
    for step in range(1, steps + 1):
        beams = beam_search_step(pool, beams, logits_fn, width, new_ids, step=step)
        copies += len(apply_copies(pool, kv))      # before the forward pass writes new tokens
        tokens = {b.seq_id: prompt + list(b.tokens) for b in beams}
        write_new_tokens(pool, kv, tokens, [(b.seq_id, pool.seq_lens[b.seq_id] - 1, 1) for b in beams])
        assert_content(pool, kv, tokens, f"after step {step}")
    assert copies > 0, "the workload should exercise copy-on-write"


def test_random_forks_never_change_what_a_parent_reads():
    rng, block_size = random.Random(7), 3
    pool = BlockPool(40, block_size)
    kv = allocate_kv_cache(LAYERS, 40, block_size, HEADS, DIM, dtype=torch.float32, device=DEVICE)
    tokens = {0: [rng.randrange(VOCAB) for _ in range(5)]}
    pool.allocate(0, 5)
    write_new_tokens(pool, kv, tokens, [(0, 0, 5)])
    next_id, copies = itertools.count(1), 0
    for op in range(14):
        seq = rng.choice(sorted(pool.block_tables))
        if op % 3 == 0 and len(pool.block_tables) < 5:
            child = next(next_id)
            pool.fork(seq, child)
            tokens[child] = list(tokens[seq])
        else:
            n = rng.randint(1, 3)
            if pool.seq_lens[seq] + n > MAX_POS:
                pool.free(seq)
                del tokens[seq]
                if not pool.block_tables:
                    break
                continue
            start = pool.seq_lens[seq]
            pool.append(seq, n)
            copies += len(apply_copies(pool, kv))
            tokens[seq] += [rng.randrange(VOCAB) for _ in range(n)]
            write_new_tokens(pool, kv, tokens, [(seq, start, n)])
        assert_content(pool, kv, tokens, f"after op {op}")
    assert copies > 0


# -- figures ---------------------------------------------------------------------------------
def test_figures_draw():
    pool = BlockPool(12, 4)
    pool.allocate("p", 6)
    pool.fork("p", "c")
    pool.append("c")
    fig = draw_shared_tables(page_map_frame(pool, "cow"), copies=pool.pending_copies)
    assert isinstance(fig, Figure)
    sweep = sharing_sweep([16, 64], [16], k=4, block_size=16)
    assert isinstance(plot_sharing_ratio(sweep), Figure)
    runs = {"beam": beam_search(BlockPool(32, 4), 6, 3, 5), "independent": independent_sequences(BlockPool(32, 4), 6, 3, 5)}
    assert isinstance(plot_blocks_per_step(runs), Figure)
