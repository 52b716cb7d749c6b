"""The chunked-prefill scheduler, step by step, on a real BlockPool without a model (hypothesis).

Every step of a random trace (arrivals spread over steps, shared prefixes, parallel samples, a
pool small enough to preempt) is checked. What holds, and under which settings:

* **Any settings** (fcfs or static, a chunk cap, several partial prefills, prefix caching, the
  fairness rule on a step clock): a step computes at most ``max_num_batched_tokens`` tokens for at
  most ``max_num_seqs`` sequences; with chunking, no prefill chunk exceeds
  ``long_prefill_token_threshold``; after a step at most ``max_num_partial_prefills`` running
  sequences have more than one token left to compute (one left counts as decoding, as in the
  scheduler); no sequence is preempted and scheduled in one step. **Chunks tile**: from one
  admission to the next preemption, a sequence's ``(start, num_new)`` chunks cover ``hit .. L``
  exactly once (``hit``: its prefix-cache hit, ``L``: its length when admitted, prompt + output
  after a preemption), and only the chunk that reaches ``L`` samples. **The cache holds what a
  step reads**: a shadow of every cache slot (the token whose K/V a finished step wrote there,
  copy-on-write copies applied) shows that each scheduled sequence's positions below its start,
  prefix-cache hits included, hold its own tokens; every block that carries a hash is fully
  computed, and ``pool.seq_hashes`` covers at most a sequence's computed tokens (a hit never
  reaches into a chunk being computed). ``scheduling_policy="static"``: no admission in a step
  that starts with a running sequence past its prompt.
* **fcfs or static, no** ``prefill_priority_after``: no admission in a step that preempts; the
  running sequences are always the oldest unfinished ones in arrival order (a request's samples
  after it), since preemption takes the youngest. So the oldest always advances (first in the
  running list, it gets the budget first and is never preempted; waiting, it is admitted into
  an empty batch), which bounds when each request finishes: see :func:`finish_bound`.
* **and** ``long_prefill_token_threshold=0``: every sequence running at the start of a step is
  scheduled in it, unless the step preempts it. Decodes come before a partial prefill in the
  running list (a chunk that does not finish its prompt takes the whole budget left, so nothing
  joins behind it), and at most ``max_num_seqs <= max_num_batched_tokens`` of them decode.
  With a chunk cap this fails: :func:`test_a_capped_chunk_can_hold_back_a_younger_decode`.

Speculation: a decoding sequence that the engine gives ``k`` drafts after scheduling counts
``1 + k`` tokens, and the step stays within the budget.
"""
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvlab  # noqa: F401  (profile first)
from kvlab.engine.scheduler import Scheduler
from kvlab.paging import BlockPool, blocks_needed
from test_scheduler import Requests, check_step, drive, fake_token

PREFIXES = ([90 + i % 5 for i in range(24)], [95 + i % 3 for i in range(24)])


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    threshold: int
    partials: int
    policy: str
    chunked: bool
    caching: bool
    priority: float | None
    requests: list      # (arrival step, prompt_len, max_tokens, n, prefix index or None), arrival order

    def scheduler(self, clock) -> Scheduler:
        pool = BlockPool(self.num_blocks, self.block_size, enable_prefix_caching=self.caching)
        return Scheduler(pool, self.max_num_seqs, self.budget, enable_chunked_prefill=self.chunked,
                         long_prefill_token_threshold=self.threshold, max_num_partial_prefills=self.partials,
                         scheduling_policy=self.policy, prefill_priority_after=self.priority, clock=clock)


@st.composite
def workloads(draw, fair=st.sampled_from([None, 0, 2, 5]), threshold=None):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 5))
    gaps = st.integers(0, 3) | st.just(0)          # often in bursts
    raw = draw(st.lists(st.tuples(gaps, st.integers(1, 40), st.integers(1, 8), st.integers(1, 3),
                                  st.sampled_from([None, 0, 1])), min_size=1, max_size=8))
    requests, arrival = [], 0
    for gap, prompt_len, max_tokens, n, prefix in raw:
        arrival += gap
        requests.append((arrival, prompt_len, max_tokens, min(n, max_num_seqs), prefix))
    largest = max(p + m for _, p, m, _, _ in requests)
    least = blocks_needed(largest, block_size)               # the longest sequence fits alone
    num_blocks = draw(st.integers(least, least + least // 2 + 2))      # often short: preemption
    chunked = draw(st.booleans())
    # without chunks, a preempted sequence is recomputed in one step: the budget must hold it
    budget = draw(st.integers(max_num_seqs if chunked else max(largest, max_num_seqs), 48))
    if threshold is None:
        threshold = st.just(0) | st.integers(1, budget)
    return Workload(block_size, num_blocks, max_num_seqs, budget, draw(threshold), draw(st.integers(1, 3)),
                    draw(st.sampled_from(["fcfs", "static"])), chunked, draw(st.booleans()), draw(fair), requests)


class Shadow:
    """What each cache slot holds: the token whose K/V a finished step wrote there."""

    def __init__(self, pool: BlockPool):
        self.pool, self.slots, self.tables = pool, {}, {}

    def _clear(self, block):
        for o in range(self.pool.block_size):
            self.slots.pop(block * self.pool.block_size + o, None)

    def _slot(self, table, pos):
        return table[pos // self.pool.block_size] * self.pool.block_size + pos % self.pool.block_size

    def before_forward(self, out):
        """New blocks hold nothing yet; copy-on-write copies land; what each sequence attends to
        (its positions below ``start``) must be its own tokens."""
        bs = self.pool.block_size
        for item in out.scheduled:
            old = self.tables.get(item.seq.seq_id, item.block_table[:item.start // bs])   # admitted: its hits
            for b in set(item.block_table) - set(old):
                self._clear(b)
        for src, dst in out.blocks_to_copy:
            for o in range(bs):
                value = self.slots.get(src * bs + o)
                if value is None:
                    self.slots.pop(dst * bs + o, None)
                else:
                    self.slots[dst * bs + o] = value
        for item in out.scheduled:
            seq = item.seq
            held = [self.slots.get(self._slot(item.block_table, p)) for p in range(item.start)]
            assert held == seq.token_ids[:item.start], \
                f"seq {seq.seq_id} attends to positions 0..{item.start - 1} whose K/V is not its tokens'"

    def after_forward(self, out):
        for item in out.scheduled:
            for p in range(item.start, item.start + item.num_new - len(item.spec_token_ids)):
                self.slots[self._slot(item.block_table, p)] = item.seq.token_ids[p]
        self.tables = {s: list(t) for s, t in self.pool.block_tables.items()}
        bs = self.pool.block_size
        for b, h in enumerate(self.pool.block_hashes):
            if h is not None:
                assert all(b * bs + o in self.slots for o in range(bs)), f"block {b} is cached before it is computed"


def seq_order(reqs: Requests) -> list:
    """The sequences in arrival order: requests in order, each request's samples in index order."""
    return sorted(reqs.all, key=lambda s: (int(s.request_id[1:]), s.index))


def finish_bound(w: Workload, seqs: list, arrivals: dict) -> list[int]:
    """The step by which each sequence (in arrival order) has finished, under fcfs or static.

    ``s_k`` (``P`` prompt, ``M`` output tokens, arriving after ``a_k`` steps) becomes the oldest
    unfinished sequence once ``s_1 .. s_{k-1}`` are done, and from then on advances every step,
    by a chunk of ``min(remaining, B)`` tokens (``B``: the budget, capped by the threshold) or one
    decode. From scratch it needs ``ceil(P / B)`` steps for its prompt, whose last chunk samples
    its first token, then ``M - 1`` decodes; recomputing after a preemption with ``g`` tokens out
    takes ``ceil((P + g) / B) + M - 1 - g <= ceil(P / B) + M - 1``. So, with ``f_0 = 0``,
    ``f_k <= max(f_{k-1}, a_k) + ceil(P / B) + M - 1`` (a finished step's number, counting from 1).
    """
    b = min(w.budget, w.threshold or w.budget) if w.chunked else w.budget
    bounds, last = [], 0
    for s in seqs:
        last = max(last, arrivals[s.request_id]) + -(-s.num_prompt_tokens // b) + s.params.max_tokens - 1
        bounds.append(last)
    return bounds


def replay(w: Workload, *, fcfs_checks: bool, all_advance: bool) -> tuple[Scheduler, Requests]:
    """Run ``w`` to the end, checking every step (see the module docstring)."""
    clock = [0]
    sched = w.scheduler(lambda: clock[0])
    pool, reqs, shadow = sched.pool, Requests(sched), Shadow(sched.pool)
    arrivals, arrived = list(w.requests), {}
    segment = {}            # seq_id -> [tokens covered so far, length L when admitted]
    finished_at = {}
    step = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            arrival, prompt_len, max_tokens, n, prefix = arrivals.pop(0)
            seq = reqs.add(prompt_len, max_tokens, n, prefix=() if prefix is None else PREFIXES[prefix][:prompt_len])
            arrived[seq.request_id] = arrival
        assert step < 3000, "the scheduler made no progress"
        running = list(sched.running)
        hits = {s.seq_id: len(pool.computed_blocks(s.token_ids, s.cache_salt)) * w.block_size for s in sched.waiting}
        started_past_prompt = any(s.num_computed_tokens >= s.num_prompt_tokens for s in running)
        out = sched.schedule()
        step += 1
        clock[0] = step
        check_step(sched, out)
        scheduled = {id(item.seq) for item in out.scheduled}
        preempted = {id(s) for s in out.preempted}
        admitted = {id(item) for item in out.scheduled if item.seq.seq_id not in shadow.tables}
        assert not out.finished, "every sequence fits the cache alone: none may fail"
        assert not scheduled & preempted, "a sequence was preempted and scheduled again in one step"
        if out.preempted and w.priority is None:
            assert not admitted, "an admission in a step that had to preempt"

        for item in out.scheduled:
            seq = item.seq
            assert len(pool.seq_hashes.get(seq.seq_id, ())) * w.block_size <= item.start, \
                "a block is registered before its K/V is computed"
            if item.is_prefill and w.threshold and w.chunked:      # the cap splits prompts: chunked only
                assert item.num_new <= w.threshold
            if id(item) in admitted:
                assert item.start % w.block_size == 0 and item.start <= hits[seq.seq_id]
                assert item.start == (pool.num_cached_tokens.get(seq.seq_id, 0) if w.caching else 0)
                segment[seq.seq_id] = [item.start, seq.num_tokens]
            covered, length = segment[seq.seq_id]
            assert item.start == covered, f"seq {seq.seq_id}: a chunk starts at {item.start}, not {covered}"
            if covered < length:          # still computing what it had when admitted
                assert item.start + item.num_new <= length, "a chunk runs past the sequence"
                assert item.samples == (item.start + item.num_new == length)
            else:
                assert item.num_new == 1 and item.samples
            segment[seq.seq_id][0] = item.start + item.num_new
        for s in out.preempted:
            del segment[s.seq_id]

        if w.policy == "static" and started_past_prompt:
            assert not admitted, "static batching admitted a request while the batch decodes"
        if all_advance:
            left_behind = [s for s in running if id(s) not in scheduled | preempted]
            assert not left_behind, f"running sequences not scheduled in step {step}: {left_behind}"

        shadow.before_forward(out)
        sched.update(out, [fake_token(s) for s in out.sample_seqs])
        shadow.after_forward(out)
        for s in out.scheduled:
            if s.seq.is_finished:
                finished_at[s.seq.seq_id] = step
            for f in s.forks:
                segment[f.seq_id] = list(segment[s.seq.seq_id])
                if f.is_finished:
                    finished_at[f.seq_id] = step
        for s in sched.running:
            assert len(pool.seq_hashes.get(s.seq_id, ())) * w.block_size <= s.num_computed_tokens
        partial = [s for s in sched.running if s.num_computed_tokens < s.num_tokens - 1]
        assert len(partial) <= w.partials, f"{len(partial)} prompts part-way through"
        if fcfs_checks:
            order = [s for s in seq_order(reqs) if not s.is_finished]
            live = [s for s in order if s in sched.running or s in sched.waiting]
            assert sched.running == live[:len(sched.running)], "a younger sequence runs while an older one waits"

    for s in reqs.all:
        assert s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens, s.error
    assert pool.num_free_blocks == pool.num_blocks and not pool.block_tables
    if fcfs_checks:
        seqs = seq_order(reqs)
        for s, bound in zip(seqs, finish_bound(w, seqs, arrived)):
            assert finished_at[s.seq_id] <= bound, f"seq {s.seq_id} finished at step {finished_at[s.seq_id]} > {bound}"
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {any((s.num_cached_tokens or 0) > 0 for s in reqs.all)}")
    return sched, reqs


@given(workloads())
@settings(max_examples=250, deadline=None)
def test_every_step_keeps_the_budgets_chunks_and_cache_straight(w):
    replay(w, fcfs_checks=False, all_advance=False)


@given(workloads(fair=st.none()))
@settings(max_examples=200, deadline=None)
def test_fcfs_runs_the_oldest_and_no_request_starves(w):
    replay(w, fcfs_checks=True, all_advance=False)


@given(workloads(fair=st.none(), threshold=st.just(0)))
@settings(max_examples=200, deadline=None)
def test_without_a_chunk_cap_every_running_sequence_advances(w):
    replay(w, fcfs_checks=True, all_advance=True)


def test_a_capped_chunk_can_hold_back_a_younger_decode():
    """Running sequences go oldest first: a capped chunk of an older prompt takes its share
    before the younger decodes. When a request's samples join after its prompt, the decodes may
    need more than is left, and the youngest waits a step (vLLM v1 does the same)."""
    pool = BlockPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=4, long_prefill_token_threshold=2)
    reqs = Requests(sched)
    long = reqs.add(20, 2)
    forked = reqs.add(2, 3, n=3)
    out = sched.schedule()
    assert [(s.seq, s.num_new) for s in out.scheduled] == [(long, 2), (forked, 2)]
    sched.update(out, [fake_token(s) for s in out.sample_seqs])
    assert len(sched.running) == 4                        # long, forked and its two samples
    out = sched.schedule()
    assert [s.num_new for s in out.scheduled] == [2, 1, 1] and sched.running[3] not in out.sample_seqs
    sched.update(out, [fake_token(s) for s in out.sample_seqs])
    drive(sched)
    assert all(s.num_output_tokens == s.params.max_tokens for s in reqs.all)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 8), st.data())
@settings(max_examples=60, deadline=None)
def test_speculating_sequences_count_k_plus_one_against_the_budget(max_num_seqs, k, extra, data):
    """The engine gives every decoding sequence k drafts (padded with -1) after scheduling."""
    budget = max_num_seqs + k + extra
    pool = BlockPool(num_blocks=200, block_size=4)
    sched = Scheduler(pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_lookahead_tokens=k)
    reqs = Requests(sched)
    for prompt_len in data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=6)):
        reqs.add(prompt_len, data.draw(st.integers(1, 6)))
    while sched.has_unfinished():
        out = sched.schedule()
        for item in out.scheduled:
            if not item.is_prefill:
                sched.add_draft_tokens(out, item, [-1] * k)
        assert out.num_batched_tokens <= budget
        sched.update(out, [fake_token(s) for s in out.sample_seqs])
    assert all(s.num_output_tokens == s.params.max_tokens for s in reqs.all)
