"""Contiguous vs paged KV allocation, simulated on a request trace.

A fixed KV budget of ``budget_tokens`` slots serves a queue of requests. Each time step:

1. requests that have arrived join the waiting queue;
2. waiting requests are admitted first come, first served while memory can be reserved for
   them (the first one that does not fit blocks the ones behind it, as in vLLM);
3. every running request decodes one token (the prompt is stored when it is admitted);
4. requests that reached their output length finish and free their memory.

Three policies reserve memory differently:

``contiguous-max``
    ``max_model_len`` slots per request in one contiguous range (a static cache sized for
    the longest sequence). Waste is *internal*: reserved but never written.
``contiguous-request``
    ``prompt + max_tokens`` slots per request, contiguous, placed first fit in a linear
    address space. Sizes vary, so freed ranges leave holes: *external* fragmentation, free
    memory that exists but is split into holes too small for the next request.
``paged``
    blocks of ``block_size`` slots taken one at a time as the sequence grows (PagedAttention).
    Only the last block of each sequence is partly empty, so waste is under ``block_size``
    slots per sequence. Memory can run out mid-decode; then the most recently admitted
    request is preempted (its blocks are freed and it is recomputed later, as in vLLM).

The trace's lengths are lognormal (see :func:`make_request_trace`). Everything is deterministic given
the trace's seed, and pure Python/numpy: a few thousand steps take well under a second.

A step is one decode iteration of the whole batch. Prefill takes no extra step here, and a
step costs the same whatever the batch size (decode is bound by reading the weights at
these batch sizes), so tokens per step is a fair throughput proxy.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvlab.accounting import check_int, text_table

POLICIES = ("contiguous-max", "contiguous-request", "paged")
FREE, STORED, RESERVED, HOLE = 0, 1, 2, 3  # slot states in AllocationSimulator.memory_map()


# -- the request trace ----------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """Per-request prompt and output lengths, ``max_tokens`` and arrival step."""

    prompt_lens: np.ndarray
    output_lens: np.ndarray
    max_tokens: np.ndarray
    arrivals: np.ndarray
    max_model_len: int

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def total_lens(self) -> np.ndarray:
        return self.prompt_lens + self.output_lens


def lognormal_lengths(rng, n: int, mean: float, sigma: float) -> np.ndarray:
    """``n`` integer lengths >= 1, lognormal with the given mean and log-space spread ``sigma``."""
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2)
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def make_request_trace(num_requests: int = 1000, *, max_model_len: int = 2048, prompt_mean: float = 160,
                       output_mean: float = 340, sigma: float = 1.0, max_tokens: int | None = 1024,
                       arrival_rate: float | None = None, seed: int = 0) -> Trace:
    """A synthetic chat trace: heavy-tailed (lognormal) prompt and output lengths.

    The defaults mimic ShareGPT conversations as the PagedAttention paper reports them (mean
    prompt ~161 tokens, mean output ~338): most requests are short and a few are very long.
    ``sigma=1`` puts the median at 0.61x the mean and the 99th percentile near 6x it.

    Prompts are clipped to ``max_model_len - 1``; outputs to ``max_tokens`` (the cap a client
    sends) and to what the context has room for. ``max_tokens=None`` sets each request's
    ``max_tokens`` to its true output length (an oracle no real server has).
    ``arrival_rate`` requests per step arrive as a Poisson process; ``None`` queues them all
    at step 0 (an offline batch: the server is saturated, which is when capacity matters).
    """
    check_int("num_requests", num_requests)
    check_int("max_model_len", max_model_len, minimum=2)
    if max_tokens is not None:
        check_int("max_tokens", max_tokens)
    for name, value in (("prompt_mean", prompt_mean), ("output_mean", output_mean), ("sigma", sigma)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ValueError(f"arrival_rate must be > 0 or None, got {arrival_rate}")

    rng = np.random.default_rng(seed)
    prompts = np.minimum(lognormal_lengths(rng, num_requests, prompt_mean, sigma), max_model_len - 1)
    room = max_model_len - prompts
    cap = room if max_tokens is None else np.minimum(room, max_tokens)
    outputs = np.minimum(lognormal_lengths(rng, num_requests, output_mean, sigma), cap)
    if arrival_rate is None:
        arrivals = np.zeros(num_requests, dtype=np.int64)
    else:
        arrivals = np.floor(np.cumsum(rng.exponential(1 / arrival_rate, num_requests))).astype(np.int64)
    return Trace(prompts, outputs, outputs.copy() if max_tokens is None else cap, arrivals, max_model_len)


# -- a linear address space -----------------------------------------------------------------
class ContiguousSpace:
    """``size`` slots handed out as contiguous ranges, first fit; freed ranges merge back."""

    def __init__(self, size: int):
        self.size = size
        self.holes: list[tuple[int, int]] = [(0, size)]  # (start, length), sorted by start

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self.holes)

    def allocate(self, n: int) -> int | None:
        """Start of a range of ``n`` slots in the first hole that fits, or None."""
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                if length == n:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + n, length - n)
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.holes, (start, n))
        self.holes.insert(i, (start, n))
        if i + 1 < len(self.holes) and start + n == self.holes[i + 1][0]:  # merge with next
            self.holes[i] = (start, n + self.holes.pop(i + 1)[1])
        if i > 0 and sum(self.holes[i - 1]) == start:  # merge with previous
            prev_start, prev_len = self.holes[i - 1]
            self.holes[i - 1] = (prev_start, prev_len + self.holes.pop(i)[1])


# -- the simulator --------------------------------------------------------------------------
@dataclass(frozen=True)
class SimSummary:
    """Headline numbers of a run. Fractions are of the budget, averaged over the *busy*
    steps (requests were waiting: memory, not demand, was the limit)."""

    policy: str
    steps: int
    finished: int
    utilisation: float     # tokens stored / budget
    internal_frag: float   # reserved but unused / budget
    external_frag: float   # free but unusable by the waiting request / budget
    mean_running: float    # concurrent requests, busy steps
    max_running: int
    throughput: float      # tokens decoded per step, whole run
    preemptions: int
    recomputed_tokens: int


@dataclass
class SimResult:
    """Per-step series of a run (index = step) and its counters."""

    policy: str
    budget_tokens: int
    block_size: int
    stored: np.ndarray     # tokens held in the cache
    reserved: np.ndarray   # slots reserved (contiguous ranges, or whole blocks)
    external: np.ndarray   # free slots the blocked head-of-queue request could not use
    running: np.ndarray
    waiting: np.ndarray
    new_tokens: np.ndarray
    preemptions: int
    recomputed_tokens: int
    finished: int

    @property
    def steps(self) -> int:
        return len(self.stored)

    @property
    def utilisation(self) -> np.ndarray:
        return self.stored / self.budget_tokens

    @property
    def internal(self) -> np.ndarray:
        return self.reserved - self.stored

    @property
    def busy(self) -> np.ndarray:
        """Steps where requests waited; all steps with work when none did."""
        busy = self.waiting > 0
        return busy if busy.any() else self.running > 0

    def summary(self) -> SimSummary:
        busy, budget = self.busy, self.budget_tokens
        return SimSummary(
            policy=self.policy, steps=self.steps, finished=self.finished,
            utilisation=float(self.stored[busy].mean() / budget),
            internal_frag=float(self.internal[busy].mean() / budget),
            external_frag=float(self.external[busy].mean() / budget),
            mean_running=float(self.running[busy].mean()),
            max_running=int(self.running.max()),
            throughput=float(self.new_tokens.sum() / self.steps),
            preemptions=self.preemptions, recomputed_tokens=self.recomputed_tokens,
        )


class AllocationSimulator:
    """Steps one policy through a trace; :meth:`run` goes to the end, :meth:`step` one step."""

    def __init__(self, trace: Trace, policy: str, budget_tokens: int, *, block_size: int = 16,
                 watermark: float = 0.01, max_num_seqs: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        check_int("budget_tokens", budget_tokens)
        check_int("block_size", block_size)
        if max_num_seqs is not None:
            check_int("max_num_seqs", max_num_seqs)
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.trace, self.policy, self.budget = trace, policy, budget_tokens
        self.block_size = block_size if policy == "paged" else 1
        self.max_num_seqs = max_num_seqs
        self.num_blocks = budget_tokens // self.block_size
        self.watermark_blocks = int(watermark * self.num_blocks) if policy == "paged" else 0
        if self._need(trace.max_model_len - 1, None) + self.watermark_blocks > self.num_blocks:
            raise ValueError(f"budget_tokens={budget_tokens} cannot hold one request of max_model_len="
                             f"{trace.max_model_len} under policy {policy!r}")

        self.prompt = trace.prompt_lens.tolist()  # Python lists: fast scalar access
        self.output = trace.output_lens.tolist()
        self.max_tokens = trace.max_tokens.tolist()
        self.arrivals = trace.arrivals.tolist()
        n = len(trace)
        self.generated = [0] * n
        self.reserved = [0] * n     # slots (contiguous) or blocks (paged) each request holds
        self.start = [0] * n        # contiguous policies: where its range starts
        self.tables = [[] for _ in range(n)]  # paged: each request's block table
        self.space = ContiguousSpace(budget_tokens)
        self.free_ids = deque(range(self.num_blocks) if policy == "paged" else ())  # free block ids, FIFO
        self.waiting: deque[int] = deque()
        self.running: list[int] = []  # in admission order
        self.t = self.next_arrival = self.finished = self.preemptions = self.recomputed = 0
        self.log = {k: [] for k in ("stored", "reserved", "external", "running", "waiting", "new_tokens")}

    @property
    def done(self) -> bool:
        return self.finished == len(self.trace)

    def run(self, max_steps: int = 10_000_000) -> SimResult:
        while not self.done and self.t < max_steps:
            self.step()
        return self.result()

    def step(self) -> None:
        while self.next_arrival < len(self.trace) and self.arrivals[self.next_arrival] <= self.t:
            self.waiting.append(self.next_arrival)
            self.next_arrival += 1
        external = self._admit()
        new_tokens = self._decode()
        self._record(external, new_tokens)
        self._finish()
        self.t += 1

    def result(self) -> SimResult:
        series = {k: np.asarray(v, dtype=np.int64) for k, v in self.log.items()}
        return SimResult(self.policy, self.budget, self.block_size, **series, preemptions=self.preemptions,
                         recomputed_tokens=self.recomputed, finished=self.finished)

    # -- memory ---------------------------------------------------------------------------
    def _need(self, context_len: int, r: int | None) -> int:
        """What request ``r`` must reserve to be admitted with ``context_len`` tokens stored."""
        if self.policy == "contiguous-max":
            return self.trace.max_model_len
        if self.policy == "contiguous-request":
            return self.trace.max_model_len if r is None else self.prompt[r] + self.max_tokens[r]
        return -(-(context_len + 1) // self.block_size)  # blocks for the prompt + this step's token

    def _reserve(self, r: int) -> bool:
        need = self._need(self.prompt[r] + self.generated[r], r)
        if self.policy == "paged":
            if len(self.free_ids) - need < self.watermark_blocks:
                return False
            self.tables[r] = [self.free_ids.popleft() for _ in range(need)]
        else:
            start = self.space.allocate(need)
            if start is None:
                return False
            self.start[r] = start
        self.reserved[r] = need
        return True

    def _release(self, r: int) -> None:
        if self.policy == "paged":
            self.free_ids.extend(self.tables[r])
            self.tables[r] = []
        else:
            self.space.free(self.start[r], self.reserved[r])
        self.reserved[r] = 0

    def _free_slots(self) -> int:
        return len(self.free_ids) * self.block_size if self.policy == "paged" else self.space.free_slots

    def memory_map(self) -> np.ndarray:
        """State of every slot of the budget now: one of FREE, STORED, RESERVED, HOLE.

        HOLE marks external fragmentation, as in the summary: free ranges too small for the
        request at the head of the queue when the free slots in total would hold it. Only
        contiguous policies have them.
        """
        slots = np.full(self.budget, FREE, dtype=np.int8)
        for r in self.running:
            context = self.prompt[r] + self.generated[r]
            if self.policy == "paged":
                for k, block in enumerate(self.tables[r]):
                    first = block * self.block_size
                    used = min(max(context - k * self.block_size, 0), self.block_size)
                    slots[first:first + self.block_size] = RESERVED
                    slots[first:first + used] = STORED
            else:
                slots[self.start[r]:self.start[r] + self.reserved[r]] = RESERVED
                slots[self.start[r]:self.start[r] + context] = STORED
        need = self._need(0, self.waiting[0]) if self.waiting else 0
        if self.policy != "paged" and self.waiting and self.space.free_slots >= need:
            for start, length in self.space.holes:
                if length < need:
                    slots[start:start + length] = HOLE
        return slots

    # -- the step's phases ----------------------------------------------------------------
    def _admit(self) -> int:
        """Admit FCFS; returns the external fragmentation seen by a blocked head request."""
        while self.waiting and (self.max_num_seqs is None or len(self.running) < self.max_num_seqs):
            r = self.waiting[0]
            if not self._reserve(r):
                if self.policy == "paged":
                    return 0  # any free block serves any request: no external fragmentation
                free = self._free_slots()
                return free if free >= self._need(0, r) else 0
            self.waiting.popleft()
            self.running.append(r)
        return 0

    def _decode(self) -> int:
        """Every running request appends one token; paged ones may need (and lack) a block."""
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if self.policy == "paged" and self.prompt[r] + self.generated[r] + 1 > self.reserved[r] * self.block_size:
                while not self.free_ids and self.running[-1] != r:
                    self._preempt(self.running[-1])
                if not self.free_ids:  # r is the youngest: it yields
                    self._preempt(r)
                    break
                self.tables[r].append(self.free_ids.popleft())
                self.reserved[r] += 1
            self.generated[r] += 1
            i += 1
        return i

    def _preempt(self, r: int) -> None:
        self.running.remove(r)
        self._release(r)
        self.waiting.appendleft(r)  # recompute later, ahead of new requests
        self.preemptions += 1
        self.recomputed += self.prompt[r] + self.generated[r]

    def _record(self, external: int, new_tokens: int) -> None:
        run = self.running
        self.log["stored"].append(sum(self.prompt[r] + self.generated[r] for r in run))
        self.log["reserved"].append(sum(self.reserved[r] for r in run) * self.block_size)
        self.log["external"].append(external)
        self.log["running"].append(len(run))
        self.log["waiting"].append(len(self.waiting))
        self.log["new_tokens"].append(new_tokens)

    def _finish(self) -> None:
        still = []
        for r in self.running:
            if self.generated[r] >= self.output[r]:
                self._release(r)
                self.finished += 1
            else:
                still.append(r)
        self.running = still


def simulate(trace: Trace, policy: str, budget_tokens: int, **options) -> SimResult:
    """Run one policy on ``trace`` to completion (options: block_size, watermark, max_num_seqs)."""
    return AllocationSimulator(trace, policy, budget_tokens, **options).run()


def compare_policies(trace: Trace, budget_tokens: int, policies=POLICIES, **options) -> dict[str, SimResult]:
    """:func:`simulate` each policy on the same trace and budget."""
    return {p: simulate(trace, p, budget_tokens, **options) for p in policies}


def summary_table(results: dict[str, SimResult]) -> str:
    """The headline numbers of several runs as a text table."""
    rows = []
    for res in results.values():
        s = res.summary()
        rows.append([s.policy, f"{s.utilisation:.1%}", f"{s.internal_frag:.1%}", f"{s.external_frag:.1%}",
                     f"{s.mean_running:.1f}", s.max_running, f"{s.throughput:.1f}", s.steps, s.preemptions])
    return text_table(["policy", "utilisation", "internal", "external", "mean running", "max running",
                       "tokens/step", "steps", "preemptions"], rows, align="l" + "r" * 8)


def memory_maps_at(trace: Trace, budget_tokens: int, step: int, policies=POLICIES, **options) -> dict[str, np.ndarray]:
    """Each policy's :meth:`~AllocationSimulator.memory_map` after ``step`` steps (or at its end)."""
    maps = {}
    for policy in policies:
        sim = AllocationSimulator(trace, policy, budget_tokens, **options)
        while sim.t < step and not sim.done:
            sim.step()
        maps[policy] = sim.memory_map()
    return maps


# -- block size (claim 5) -------------------------------------------------------------------
@dataclass(frozen=True)
class BlockSizeRow:
    """One block size: what paged allocation wastes, and how big the block tables get."""

    block_size: int
    last_block_waste: float   # empty slots per running sequence (all in its last block)
    waste_frac: float         # of the budget
    table_entries: float      # blocks per running sequence
    max_table_entries: int    # blocks of a max_model_len sequence: the block-table width
    utilisation: float
    mean_running: float
    throughput: float
    preemptions: int


def last_block_waste(seq_lens, block_size: int) -> int:
    """Empty slots in the last blocks of sequences of ``seq_lens`` tokens (paged allocation)."""
    check_int("block_size", block_size)
    lens = np.asarray(seq_lens, dtype=np.int64)
    if (lens < 0).any():
        raise ValueError("seq_lens must be >= 0")
    return int(((-lens) % block_size).sum())


def block_size_sweep(trace: Trace, budget_tokens: int, block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                     **options) -> list[BlockSizeRow]:
    """Paged allocation of the same trace and budget at each block size."""
    rows = []
    for bs in block_sizes:
        res = simulate(trace, "paged", budget_tokens, block_size=bs, **options)
        busy, s = res.busy, res.summary()
        seqs = res.running[busy].sum()
        rows.append(BlockSizeRow(
            block_size=bs,
            last_block_waste=float(res.internal[busy].sum() / seqs),
            waste_frac=s.internal_frag,
            table_entries=float(res.reserved[busy].sum() / bs / seqs),
            max_table_entries=-(-trace.max_model_len // bs),
            utilisation=s.utilisation, mean_running=s.mean_running,
            throughput=s.throughput, preemptions=s.preemptions,
        ))
    return rows


def sweep_table(rows: list[BlockSizeRow]) -> str:
    return text_table(
        ["block", "waste/seq", "waste", "blocks/seq", "table width", "utilisation", "mean running",
         "tokens/step", "preemptions"],
        [[r.block_size, f"{r.last_block_waste:.1f}", f"{r.waste_frac:.1%}", f"{r.table_entries:.1f}",
          r.max_table_entries, f"{r.utilisation:.1%}", f"{r.mean_running:.1f}", f"{r.throughput:.1f}",
          r.preemptions] for r in rows])
