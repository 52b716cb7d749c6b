"""The scheduler on a real BlockPool, without a model: tokens are made up, the bookkeeping is real."""
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvlab  # noqa: F401  (profile first)
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence, SequenceStatus
from kvlab.paging import BlockPool


def fake_token(seq: Sequence) -> int:
    return 1 + (seq.seq_id * 31 + seq.num_tokens) % 97


class Requests:
    """Makes requests (a Sequence per sample, the first one scheduled) with fresh ids."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.next_id, self.all = scheduler, 0, []

    def add(self, prompt_len: int, max_tokens: int, n: int = 1, prefix=()) -> Sequence:
        prompt = list(prefix) + [1 + (self.next_id + i) % 89 for i in range(prompt_len - len(prefix))]
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
        seqs = [Sequence(self.next_id + i, f"r{self.next_id}", prompt, params, index=i) for i in range(n)]
        self.next_id += n
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0])
        self.all += seqs
        return seqs[0]


def check_step(scheduler: Scheduler, out) -> None:
    """Invariants of every step."""
    pool = scheduler.pool
    assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert sum(1 + len(s.forks) for s in out.scheduled) <= scheduler.max_num_seqs
    for item in out.scheduled:
        # the pool holds exactly the tokens computed so far and this step's, and no more
        assert pool.seq_len(item.seq.seq_id) == item.start + item.num_new <= item.seq.num_tokens
        assert item.start == item.seq.num_computed_tokens
        assert item.samples == (item.start + item.num_new == item.seq.num_tokens)   # a prompt's last chunk samples
        assert item.num_new == 1 or item.is_prefill
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    held = {}
    for table in pool.block_tables.values():
        for b in table:
            held[b] = held.get(b, 0) + 1
    assert all(pool.ref_counts[b] == c for b, c in held.items())
    assert {s.seq_id for s in scheduler.running} == set(pool.block_tables)


def drive(scheduler: Scheduler, max_steps: int = 5000, on_step=None) -> list:
    outs = []
    while scheduler.has_unfinished():
        assert len(outs) < max_steps, "the scheduler made no progress"
        out = scheduler.schedule()
        check_step(scheduler, out)
        if on_step:
            on_step(out)
        scheduler.update(out, [fake_token(s) for s in out.sample_seqs])
        outs.append(out)
    return outs


def test_budgets_hold_every_step():
    pool = BlockPool(num_blocks=40, block_size=4)
    sched = Scheduler(pool, max_num_seqs=3, max_num_batched_tokens=20)
    reqs = Requests(sched)
    for i in range(10):
        reqs.add(prompt_len=1 + (i * 7) % 19, max_tokens=1 + i % 5)
    outs = drive(sched)
    assert max(len(o.scheduled) for o in outs) == 3
    assert all(s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens for s in reqs.all)
    assert pool.num_free_blocks == pool.num_blocks and not pool.block_tables


def test_admission_is_first_come_first_served():
    pool = BlockPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=16, enable_chunked_prefill=False)
    reqs = Requests(sched)
    first = [reqs.add(4, 3), reqs.add(12, 3)]      # 16 tokens: both fit the first step
    big = reqs.add(15, 3)                          # 15 > what is left of the budget
    small = reqs.add(1, 3)                         # would fit, but may not jump the queue
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == first
    assert list(sched.waiting) == [big, small]
    sched.update(out, [fake_token(s) for s in out.sample_seqs])
    out = sched.schedule()                         # 2 decode tokens + 15 > 16: still nothing new
    assert [s.seq for s in out.scheduled] == first
    with pytest.raises(RuntimeError, match="update"):
        sched.schedule()                           # a step must be recorded before the next
    sched.update(out, [fake_token(s) for s in out.sample_seqs])
    admitted = []
    drive(sched, on_step=lambda o: admitted.extend(s.seq for s in o.scheduled if s.is_prefill))
    assert admitted == [big, small]


def test_preemption_takes_the_most_recent_and_recomputes_it():
    pool = BlockPool(num_blocks=6, block_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = Requests(sched)
    a, b, c = reqs.add(4, 12), reqs.add(4, 12), reqs.add(4, 12)
    events = []

    def on_step(out):
        for s in out.preempted:
            events.append(("preempt", s, s.num_output_tokens))
        for s in out.scheduled:
            if s.is_prefill:
                events.append(("admit", s.seq, s.start, s.num_new))
        if out.preempted:
            assert not any(s.is_prefill for s in out.scheduled), "no admission in a step that preempts"
            assert sched.waiting[0] is out.preempted[-1]

    drive(sched, on_step=on_step)
    preempts = [e[1] for e in events if e[0] == "preempt"]
    assert preempts[:2] == [c, b]                   # youngest first; a, the oldest, never
    assert a not in preempts and sched.num_preemptions == len(preempts)
    # c comes back as prompt + the tokens it had generated, computed from position 0
    generated = next(e[2] for e in events if e[0] == "preempt" and e[1] is c)
    readmit = [e for e in events if e[0] == "admit" and e[1] is c][1]
    assert generated == 5 and readmit[2:] == (0, 4 + generated)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 12 for s in (a, b, c))
    assert pool.num_free_blocks == pool.num_blocks


def test_a_sequence_that_can_never_fit_fails_alone():
    pool = BlockPool(num_blocks=4, block_size=4)                 # 16 slots in all
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = Requests(sched)
    too_long = reqs.add(20, 2)                                   # its prompt alone needs 5 blocks
    grows = reqs.add(6, 30)                                      # fits at first, outgrows the cache
    fine = reqs.add(3, 2)
    drive(sched)
    assert too_long.finish_reason == "error" and "KV cache" in too_long.error
    assert grows.finish_reason == "error" and "KV cache" in grows.error and grows.num_output_tokens >= 9
    assert fine.finish_reason == "length" and fine.num_output_tokens == 2
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prompt_longer_than_the_budget_runs_only_in_chunks(chunked):
    pool = BlockPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=chunked)
    reqs = Requests(sched)
    long, short = reqs.add(19, 2), reqs.add(8, 2)
    chunks = []
    drive(sched, on_step=lambda o: chunks.extend((s.start, s.num_new) for s in o.scheduled if s.seq is long))
    if chunked:
        assert long.finish_reason == "length" and chunks[:3] == [(0, 8), (8, 8), (16, 3)]
    else:
        assert long.finish_reason == "error" and "max_num_batched_tokens" in long.error and not chunks
    assert short.finish_reason == "length"
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=4)


def test_parallel_samples_fork_after_the_prefill_and_copy_on_write():
    pool = BlockPool(num_blocks=32, block_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = Requests(sched)
    parent = reqs.add(6, 5, n=3)                                 # 6 tokens: one full block, one half
    out = sched.schedule()
    assert out.sample_seqs == reqs.all and [s.seq for s in out.scheduled] == [parent]
    sched.update(out, [fake_token(s) for s in out.sample_seqs])
    tables = {s.seq_id: pool.block_table(s.seq_id) for s in reqs.all}
    assert len({tuple(t) for t in tables.values()}) == 1          # all three share both blocks
    assert [pool.ref_counts[b] for b in tables[parent.seq_id]] == [3, 3]
    assert [s.status for s in reqs.all] == [SequenceStatus.RUNNING] * 3
    out = sched.schedule()                                       # each appends into the shared half block
    assert len(out.blocks_to_copy) == 2                          # two copy; the last holder keeps it
    assert pool.num_used_blocks == 4 < 3 * 2
    sched.update(out, [fake_token(s) for s in out.sample_seqs])
    drive(sched)
    assert all(s.num_output_tokens == 5 for s in reqs.all) and pool.num_free_blocks == pool.num_blocks


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 6))
    requests = draw(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 12), st.integers(1, 3),
                                       st.booleans()), min_size=1, max_size=10))
    largest = max(p + m for p, m, _, _ in requests)
    least = -(-largest // block_size)          # the longest sequence fits alone
    num_blocks = draw(st.integers(least, 2 * least + 1))
    chunked = draw(st.booleans())
    # without chunks, a preempted sequence is recomputed in one step: the budget must hold it
    budget = draw(st.integers(max_num_seqs if chunked else max(largest, max_num_seqs), 64))
    return block_size, max_num_seqs, requests, num_blocks, budget, draw(st.booleans()), chunked


@given(workloads())
@settings(max_examples=120, deadline=None)
def test_every_request_finishes_and_the_pool_ends_empty(workload):
    block_size, max_num_seqs, requests, num_blocks, budget, caching, chunked = workload
    pool = BlockPool(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching)
    sched = Scheduler(pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    reqs = Requests(sched)
    shared = [7] * 10
    for prompt_len, max_tokens, n, share in requests:
        reqs.add(prompt_len, max_tokens, n=min(n, max_num_seqs), prefix=shared[:prompt_len] if share else ())
    drive(sched)
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"copied blocks: {sched.num_copied_blocks > 0}")
    for s in reqs.all:
        assert s.is_finished
        # every sequence fits the cache alone, so none may fail
        assert s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens, s.error
    assert pool.num_free_blocks == pool.num_blocks and not pool.block_tables and not pool.pending_copies
