"""Prefix caching: workloads on the real BlockPool, eviction order, tenant salts, tree frames."""
import time

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab.paging import BlockPool  # noqa: E402
from kvlab.paging.prefix_hash import hash_blocks, root_hash  # noqa: E402
from kvlab.workloads.prefix import (  # noqa: E402
    PrefixEvent,
    Request,
    admit,
    apply_prefix_event,
    cached_prefix,
    chat_workload,
    compare,
    comparison_table,
    finish,
    grow,
    pool_size_sweep,
    run_workload,
    scripted_scenario,
    sequence_tokens,
    system_prompt_workload,
    with_salts,
)
from kvlab.viz.prefix_tree import (  # noqa: E402
    HashLinks,
    TreeNode,
    draw_prefix_frame,
    merge_chains,
    plot_blocks_over_time,
    plot_hit_rates,
    plot_pool_sweep,
    prefix_frame,
    prefix_frame_drawer,
    prefix_frame_problems,
    replay_scenario,
    show_prefix_tree,
    tree_layout,
    tree_nodes,
)

SMALL_SYSTEM = dict(num_requests=30, system_tokens=256, question_tokens=(5, 60), answer_tokens=(3, 12))
SMALL_CHAT = dict(num_conversations=4, turns=4, system_tokens=64, user_tokens=(5, 30), answer_tokens=(5, 40))


def check_hits_hold_the_prompt_prefix(requests, result):
    """Every reused block was computed, at the same logical position, for a sequence whose
    tokens up to that block equal this prompt's, under the same salt."""
    by_id = {r.req_id: r for r in requests}
    bs = result.block_size
    for r, stats in zip(requests, result.requests):
        assert stats.cached_tokens == len(stats.hit_sources) * bs
        for j, (writer, logical) in enumerate(stats.hit_sources):
            source = by_id[writer]
            assert logical == j, f"request {r.req_id}'s block {j} came from block {logical} of {writer}"
            assert sequence_tokens(source)[:(j + 1) * bs] == r.prompt[:(j + 1) * bs], \
                f"request {r.req_id} reused block {j} of request {writer}, whose tokens differ"
            assert source.salt == r.salt, \
                f"request {r.req_id} (salt {r.salt!r}) reused a block of {writer} (salt {source.salt!r})"


def check_consistent(result):
    for stats in result.requests:
        assert 0 <= stats.cached_tokens <= max(stats.prompt_tokens - 1, 0)
        assert stats.cached_tokens % result.block_size == 0
        assert stats.admitted <= stats.finished
    assert result.cached_tokens == sum(s.cached_tokens for s in result.requests) <= result.prompt_tokens
    assert all(0 <= u <= result.num_blocks for u in result.used_blocks)
    assert all(u + e <= result.num_blocks for u, e in zip(result.used_blocks, result.evictable_blocks))


# -- workloads ---------------------------------------------------------------------------------
def test_workloads_are_deterministic_and_shaped_as_described():
    a, b = system_prompt_workload(**SMALL_SYSTEM, seed=3), system_prompt_workload(**SMALL_SYSTEM, seed=3)
    assert a == b and a != system_prompt_workload(**SMALL_SYSTEM, seed=4)
    system = a[0].prompt[:256]
    assert all(r.prompt[:256] == system and 5 <= len(r.prompt) - 256 <= 60 for r in a)
    assert all(3 <= len(r.output) <= 12 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    chat = chat_workload(**SMALL_CHAT)
    assert chat == chat_workload(**SMALL_CHAT)
    for r in chat:
        if r.after is not None:
            previous = chat[r.after]
            assert r.prompt[:len(sequence_tokens(previous))] == sequence_tokens(previous), \
                "a turn's prompt starts with the previous turn's prompt and answer"
            assert len(r.prompt) > len(sequence_tokens(previous))


def test_run_is_deterministic_and_fast():
    requests = system_prompt_workload()
    start = time.perf_counter()
    first = run_workload(requests, num_blocks=2048)
    elapsed = time.perf_counter() - start
    assert first == run_workload(requests, num_blocks=2048)
    assert elapsed < 2.0, f"the 100-request workload took {elapsed:.2f} s"


@pytest.mark.parametrize("workload,kwargs,blocks", [(system_prompt_workload, SMALL_SYSTEM, 200),
                                                    (chat_workload, SMALL_CHAT, 200)])
def test_comparison_numbers_are_consistent(workload, kwargs, blocks):
    requests = workload(**kwargs)
    c = compare("w", requests, num_blocks=blocks, block_size=8, max_running=4)
    for result in (c.cached, c.uncached):
        check_consistent(result)
    assert c.uncached.cached_tokens == 0 and c.uncached.evictions == 0
    assert c.cached.prompt_tokens == c.uncached.prompt_tokens == sum(len(r.prompt) for r in requests)
    assert c.prefill_tokens_saved == c.cached.cached_tokens > 0
    assert c.blocks_saved == c.uncached.peak_blocks - c.cached.peak_blocks >= 0
    assert c.cached.hit_rate == pytest.approx(c.cached.cached_tokens / c.cached.prompt_tokens)
    check_hits_hold_the_prompt_prefix(requests, c.cached)
    table = comparison_table([c])
    assert table.splitlines()[0].startswith("workload") and f"{c.cached.hit_rate:.1%}" in table


def test_the_system_prompt_is_computed_once():
    requests = system_prompt_workload(**SMALL_SYSTEM)
    result = run_workload(requests, num_blocks=400, block_size=16, max_running=4)
    assert result.requests[0].cached_tokens == 0
    assert all(s.cached_tokens == 256 for s in result.requests[1:]), "every later request reuses the 16 blocks"


def test_chat_turns_reuse_their_history():
    requests = chat_workload(**SMALL_CHAT)
    result = run_workload(requests, num_blocks=400, block_size=8, max_running=4)
    for r, stats in zip(requests, result.requests):
        if r.after is not None:
            history = len(sequence_tokens(requests[r.after]))
            assert stats.cached_tokens == history // 8 * 8, "a turn reuses every full block of the history"


def test_memory_pressure_evicts_least_recently_used():
    requests = chat_workload(**SMALL_CHAT)
    sizes = [40, 60, 400]
    tight, medium, roomy = pool_size_sweep(requests, sizes, block_size=8, max_running=4)
    assert tight.evictions > medium.evictions > 0 == roomy.evictions
    assert tight.hit_rate < medium.hit_rate < roomy.hit_rate
    for result in (tight, medium):
        check_consistent(result)
        check_hits_hold_the_prompt_prefix(requests, result)
    system = system_prompt_workload(**SMALL_SYSTEM)
    squeezed, spacious = pool_size_sweep(system, [60, 400], block_size=8, max_running=4)
    assert squeezed.evictions > 0
    assert squeezed.hit_rate == spacious.hit_rate, "LRU, tail first, keeps the shared system prompt"


def test_request_that_never_fits_is_refused():
    with pytest.raises(ValueError, match="never fit"):
        run_workload([Request(0, tuple(range(40)), (1,))], num_blocks=4, block_size=8)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 60), block_size=st.sampled_from([2, 4, 8]),
       tenants=st.integers(1, 3))
def test_random_workloads_keep_hits_honest(seed, num_blocks, block_size, tenants):
    requests = chat_workload(num_conversations=3, turns=3, system_tokens=12, user_tokens=(1, 12),
                             answer_tokens=(1, 10), think_steps=(0, 3), seed=seed)
    requests = with_salts(requests, [f"t{i}" for i in range(tenants)])
    needed = max(-(-(len(r.prompt) + len(r.output)) // block_size) for r in requests)
    result = run_workload(requests, max(num_blocks, needed), block_size, max_running=3)
    check_consistent(result)
    check_hits_hold_the_prompt_prefix(requests, result)


# -- tenants ---------------------------------------------------------------------------------------
def test_tenants_never_share_a_block():
    requests = with_salts(system_prompt_workload(**SMALL_SYSTEM), ["tenant-a", "tenant-b"])
    assert [r.salt for r in requests[:4]] == ["tenant-a", "tenant-b", "tenant-a", "tenant-b"]
    result = run_workload(requests, num_blocks=400, block_size=16, max_running=4)
    check_hits_hold_the_prompt_prefix(requests, result)       # includes: same salt
    assert [s.cached_tokens for s in result.requests[:2]] == [0, 0], "each tenant computes the system prompt once"
    assert all(s.cached_tokens == 256 for s in result.requests[2:])
    chat = with_salts(chat_workload(**SMALL_CHAT), ["a", "b"])
    assert all(r.salt == chat[r.after].salt for r in chat if r.after is not None), "a conversation keeps its tenant"


def test_salted_prompt_finds_nothing_from_another_tenant():
    pool = BlockPool(16, 4, enable_prefix_caching=True)
    prompt = list(range(1, 14))
    admit(pool, "a", prompt, salt="tenant-a")
    assert cached_prefix(pool, prompt, salt="tenant-b") == []
    assert admit(pool, "b", prompt, salt="tenant-b").hits == ()
    assert admit(pool, "c", prompt, salt="tenant-a").hits == tuple(pool.block_table("a")[:3])
    assert set(pool.seq_hashes["a"]).isdisjoint(pool.seq_hashes["b"])


# -- eviction order, on the real pool -----------------------------------------------------------
def test_released_cached_blocks_queue_tail_first_and_least_recently_freed_first():
    pool = BlockPool(12, 2, enable_prefix_caching=True)
    admit(pool, "a", [1, 2, 3, 4, 5, 6])          # blocks 0, 1, 2 (all full, all cached)
    admit(pool, "b", [7, 8, 9, 10, 11])           # blocks 3, 4 cached; 5 partial
    assert finish(pool, "a").released == (0, 1, 2)
    assert finish(pool, "b").released == (3, 4, 5)
    assert list(pool.evictable) == [2, 1, 0, 4, 3], "tail before head; a (freed first) before b"
    assert list(pool.free_blocks) == list(range(6, 12)) + [5], "the never-cached partial block joins the free list"


def test_never_cached_free_blocks_go_before_any_cached_one():
    pool = BlockPool(6, 2, enable_prefix_caching=True)
    admit(pool, "a", [1, 2, 3, 4])
    finish(pool, "a")                              # evictable [1, 0]; free [2, 3, 4, 5]
    taken = admit(pool, "b", [9, 9, 8, 8, 7, 7, 6, 6])
    assert taken.new == (2, 3, 4, 5) and taken.evicted == ()
    more = grow(pool, "b", [5])
    assert more.new == (1,) and more.evicted == (1,), "the least recently freed cached block (a's tail) goes first"
    assert pool.block_hashes[1] is None and len(pool.cached_blocks) == 5
    finish(pool, "b")
    assert admit(pool, "c", [1, 2, 3]).hits == (0,), "a's head survived"


def test_eviction_makes_descendants_unreachable_without_touching_them():
    pool = BlockPool(7, 2, enable_prefix_caching=True)
    h12, h34, h56 = hash_blocks([1, 2, 3, 4, 5, 6], 2)
    admit(pool, "a", [1, 2, 3])                    # [0, 1]: block 0 cached
    admit(pool, "b", [1, 2, 3, 4, 5])              # hits 0; block 2 = [3, 4] cached under h34
    grow(pool, "a", [4])                           # a's block 1 = [3, 4] too: h34 already names block 2
    grow(pool, "a", [5, 6])                        # a's block 4 = [5, 6]: cached under h56, a child of h34
    finish(pool, "b")                              # block 2 evictable
    assert admit(pool, "d", [9] * 7).evicted == (2,)
    assert pool.block_hashes[4] == h56 and pool.cached_blocks[h56] == 4, "no cascade: the child keeps its hash"
    assert h34 not in pool.cached_blocks
    assert cached_prefix(pool, [1, 2, 3, 4, 5, 6, 7]) == [0], "but no lookup reaches it: its parent's hash is gone"
    finish(pool, "a")
    finish(pool, "d")
    c = admit(pool, "c", [1, 2, 3, 4, 5])          # recomputes [3, 4]: h34 names c's block now ...
    assert c.hits == (0,) and c.evicted == ()
    assert cached_prefix(pool, [1, 2, 3, 4, 5, 6, 7]) == [0, c.new[0], 4], \
        "... so the old child is reachable again, and its KV is still right: its hash names its content"


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(8, 2, enable_prefix_caching=True)
    admit(pool, "a", [1, 2, 3, 4, 5])
    admit(pool, "b", [1, 2, 3])
    finish(pool, "a")
    before = (dict(pool.cached_blocks), list(pool.evictable))
    assert pool.reset_prefix_cache() is False
    assert (dict(pool.cached_blocks), list(pool.evictable)) == before, "a refused reset changes nothing"
    finish(pool, "b")
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and not pool.evictable and all(h is None for h in pool.block_hashes)
    assert sorted(pool.free_blocks) == list(range(8))
    assert admit(pool, "c", [1, 2, 3, 4, 5]).hits == ()


# -- the scripted scenario and its frames ----------------------------------------------------------
def test_scenario_frames_are_consistent():
    frames = replay_scenario(scripted_scenario())
    assert len(frames) == len(scripted_scenario()) + 1
    for frame in frames:
        assert prefix_frame_problems(frame) == [], frame.title
        for h, block in frame.cached_blocks.items():
            assert frame.block_hashes[block] == h, f"{frame.title}: the cache maps a hash to block {block}"


def test_scenario_tells_its_story():
    titles = [f.title for f in replay_scenario(scripted_scenario())[1:]]
    assert titles[0] == "A arrives (13 tokens): no hit; new 0, 1, 2, 3"
    assert titles[1] == "B arrives (11 tokens): hit 0, 1 (8 tokens cached); new 4"
    assert titles[2] == "A grows by 3: fits in its last block; full, now cached: 3"
    assert titles[4].startswith("C arrives (18 tokens): hit 0, 1, 2, 3")
    assert titles[7].endswith("evicted 3, 2"), "D evicts the least recently freed blocks, tail first"
    assert titles[9].startswith("E arrives (13 tokens): hit 0, 1 (8 tokens cached)"), "the system prompt survived"
    assert "no hit" in titles[10] and "tenant-b" in titles[10]


def test_tree_parents_match_the_hash_chain():
    frames = replay_scenario(scripted_scenario())
    for frame in frames:
        nodes = {n.key: n for n in frame.nodes}
        for node in frame.nodes:
            if node.state == "root":
                assert node.key in (root_hash(None), root_hash("tenant-b"))
            elif node.state != "evicted":
                assert frame.block_hashes[node.blocks[0]] == node.key
                assert node.parent in nodes
    # the parents read off seq_hashes equal those rebuilt from each live sequence's tokens
    pool = BlockPool(10, 4, enable_prefix_caching=True)
    links = HashLinks()
    for event in scripted_scenario()[:3]:
        apply_prefix_event(pool, event)
        links.observe(pool)
    for seq, tokens in pool.seq_tokens.items():
        chain = [root_hash(pool.seq_salts[seq])] + hash_blocks(tokens, 4, pool.seq_salts[seq])
        assert all(links.parents[h] == parent for parent, h in zip(chain, chain[1:]))


def test_frame_states():
    frames = replay_scenario(scripted_scenario())
    states = lambda frame: {n.label: n.state for n in frame.nodes}  # noqa: E731
    assert states(frames[2]) == {"root": "root", "0": "hit", "1": "hit", "2": "in use"}
    assert states(frames[4])["2"] == states(frames[4])["3"] == "evictable"
    assert states(frames[8])["2 ×"] == "evicted" and states(frames[8])["3"] == "cached now"


def test_tree_layout_centres_parents():
    r = b"r"
    nodes = [TreeNode(r, None, (), "root", "root"), TreeNode(b"a", r, (0,), "in use", "0"),
             TreeNode(b"b", b"a", (1,), "in use", "1"), TreeNode(b"c", b"a", (2,), "evictable", "2"),
             TreeNode(b"d", r, (3,), "in use", "3")]
    layout = tree_layout(nodes)
    assert layout[b"b"] == (2, 0) and layout[b"c"] == (2, 1) and layout[b"d"] == (1, 2)
    assert layout[b"a"] == (1, 0.5) and layout[r] == (0, 1.25)


def test_merge_chains_makes_a_radix_tree():
    requests = chat_workload(**SMALL_CHAT)
    pool = BlockPool(400, 8, enable_prefix_caching=True)
    links = HashLinks()
    for r in requests:
        admit(pool, r.req_id, r.prompt)
        links.observe(pool)
        grow(pool, r.req_id, r.output)
        links.observe(pool)
        finish(pool, r.req_id)
    nodes = tree_nodes(pool.block_hashes, pool.ref_counts, links, cached_before=set(pool.cached_blocks))
    merged = merge_chains(nodes)
    assert sum(len(n.blocks) for n in merged) == len(pool.cached_blocks)
    assert len(merged) == 1 + 1 + 4, "root, the shared system prompt, one chain per conversation"
    assert isinstance(show_prefix_tree(pool, links, merge=True), Figure)


def test_figures():
    frames = replay_scenario(scripted_scenario())
    draw = prefix_frame_drawer(frames)
    sizes = {tuple(draw(frames[i]).get_size_inches().round(2)) for i in (0, 5, 11)}
    assert len(sizes) == 1, "frames of one scenario get one figure size"
    assert isinstance(draw_prefix_frame(frames[3]), Figure)
    comparisons = [compare("s", system_prompt_workload(**SMALL_SYSTEM), 200, 8, 4)]
    for fig in (plot_hit_rates(comparisons), plot_blocks_over_time(comparisons),
                plot_pool_sweep({"s": ([60, 200], pool_size_sweep(system_prompt_workload(**SMALL_SYSTEM),
                                                                   [60, 200], 8, 4))})):
        assert isinstance(fig, Figure)


def test_prefix_frame_reports_a_broken_cache_map():
    pool = BlockPool(6, 2, enable_prefix_caching=True)
    admit(pool, "a", [1, 2, 3, 4, 5])
    links = HashLinks().observe(pool)
    pool.block_hashes[1] = None                    # break it: the map still names block 1
    problems = prefix_frame_problems(prefix_frame(pool, links))
    assert any("which carries no hash" in p for p in problems)


def test_unknown_event_kind():
    with pytest.raises(ValueError, match="unknown event kind"):
        apply_prefix_event(BlockPool(4, 2, enable_prefix_caching=True), PrefixEvent("jump", "a"))
