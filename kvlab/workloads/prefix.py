"""Prefix caching at work: request streams served by a real :class:`BlockPool`, and what the cache saved.

Two workloads from the seed article's section 2.2 and from everyday chat serving:

* :func:`system_prompt_workload`: many requests share one long system prompt, each with
  its own question and a short answer, arriving over time;
* :func:`chat_workload`: several conversations; each turn's prompt is the whole history
  (system prompt, earlier questions and answers) plus a new user message.

:func:`run_workload` serves a workload step by step, a bounded number of requests at once:
a request's prompt is allocated in one go (prefill), then one token is appended per step
(decode) until its answer is complete, then it is freed. It records how many prompt tokens
were found in the cache, where each reused block's KV came from, blocks in use per step and
evictions. :func:`compare` runs a workload with and without prefix caching.

The same three operations, :func:`admit`, :func:`grow` and :func:`finish`, say what each
change did (hits, new blocks, evictions); :func:`scripted_scenario` is a small hand-written
run for the chapter's step-through. Everything is deterministic given a seed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import cycle

import numpy as np

from kvlab.paging.block_pool import BlockPool, blocks_needed

VOCAB_SIZE = 32_000


# -- what one change to the pool did --------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """The blocks one operation touched.

    ``hits``: cached blocks an arriving prompt reused (logical order); ``new``: blocks taken for
    KV to be computed; ``cached``: blocks that became full and were registered under their
    hash (reusable from now on); ``evicted``: cached blocks evicted to make room, least recent
    first; ``released``: blocks a finished sequence gave back (nobody holds them any more).
    """

    hits: tuple[int, ...] = ()
    new: tuple[int, ...] = ()
    cached: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    released: tuple[int, ...] = ()


def cached_prefix(pool: BlockPool, token_ids, salt=None) -> list[int]:
    """The cached blocks an allocation of prompt ``token_ids`` would reuse; changes nothing.

    The longest run of cached full blocks that starts the prompt, capped at
    ``(len(token_ids) - 1) // block_size`` blocks so the last prompt token is computed: the
    pool's own answer, :meth:`BlockPool.computed_blocks`.
    """
    return pool.computed_blocks(token_ids, salt)


def _evicted_since(evictable_before, pool: BlockPool, revived=()) -> tuple[int, ...]:
    """Blocks that were evictable before an operation and were evicted by it (not revived)."""
    revived = set(revived)
    return tuple(b for b in evictable_before if b not in pool.evictable and b not in revived)


def _registered_since(pool: BlockPool, seq_id, first: int) -> tuple[int, ...]:
    """Blocks of ``seq_id`` from logical block ``first`` on that the cache maps their hash to."""
    if not pool.enable_prefix_caching:
        return ()
    table, hashes = pool.block_tables[seq_id], pool.seq_hashes[seq_id]
    return tuple(table[i] for i in range(first, len(hashes)) if pool.cached_blocks.get(hashes[i]) == table[i])


def admit(pool: BlockPool, seq_id, token_ids, salt=None) -> Outcome:
    """Allocate ``seq_id``'s prompt; reports the cached blocks reused and the blocks evicted."""
    evictable_before = list(pool.evictable)
    table = pool.allocate(seq_id, len(token_ids), token_ids=token_ids, salt=salt)
    num_hits = pool.num_cached_tokens.get(seq_id, 0) // pool.block_size
    hits = tuple(table[:num_hits])
    return Outcome(hits=hits, new=tuple(table[num_hits:]), cached=_registered_since(pool, seq_id, num_hits),
                   evicted=_evicted_since(evictable_before, pool, hits))


def grow(pool: BlockPool, seq_id, token_ids) -> Outcome:
    """Append ``token_ids`` (decoded tokens) to ``seq_id``."""
    evictable_before = list(pool.evictable)
    hashed_before = len(pool.seq_hashes.get(seq_id, ()))
    new = pool.append(seq_id, len(token_ids), token_ids=token_ids)
    return Outcome(new=tuple(new), cached=_registered_since(pool, seq_id, hashed_before),
                   evicted=_evicted_since(evictable_before, pool))


def finish(pool: BlockPool, seq_id) -> Outcome:
    """Free ``seq_id``; cached blocks it releases stay reusable until evicted."""
    return Outcome(released=tuple(pool.free(seq_id)))


# -- workloads -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One request: its prompt, the answer it will generate, and when it arrives.

    ``arrival`` is a step number; for a request with ``after`` set (the previous turn of a
    conversation) it counts the steps after that request finished instead.
    """

    req_id: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    arrival: int = 0
    after: int | None = None
    salt: object = None


def _tokens(rng: np.random.Generator, low: int, high: int) -> tuple[int, ...]:
    """Random token ids, a length drawn from ``low .. high`` inclusive."""
    return tuple(rng.integers(1, VOCAB_SIZE, int(rng.integers(low, high + 1))).tolist())


def system_prompt_workload(num_requests: int = 100, system_tokens: int = 2048, question_tokens=(50, 300),
                           answer_tokens=(10, 40), max_gap: int = 2, seed: int = 0) -> list[Request]:
    """Requests that share a ``system_tokens``-token system prompt, each with its own question.

    Arrivals are 0 to ``max_gap`` steps apart; lengths are uniform in the inclusive ranges.
    """
    rng = np.random.default_rng(seed)
    system = tuple(rng.integers(1, VOCAB_SIZE, system_tokens).tolist())
    requests, step = [], 0
    for i in range(num_requests):
        requests.append(Request(i, system + _tokens(rng, *question_tokens), _tokens(rng, *answer_tokens), step))
        step += int(rng.integers(0, max_gap + 1))
    return requests


def chat_workload(num_conversations: int = 8, turns: int = 6, system_tokens: int = 256, user_tokens=(20, 120),
                  answer_tokens=(40, 160), think_steps=(0, 20), seed: int = 0) -> list[Request]:
    """Multi-turn chats: turn *t*'s prompt = system prompt + every earlier message + a new one.

    Conversations start ``think_steps`` apart; each later turn arrives ``think_steps`` steps
    after the previous turn of its conversation finished. Request ids run turn by turn.
    """
    rng = np.random.default_rng(seed)
    system = tuple(rng.integers(1, VOCAB_SIZE, system_tokens).tolist())
    history = [system] * num_conversations
    requests, start = [], 0
    for turn in range(turns):
        for conv in range(num_conversations):
            prompt = history[conv] + _tokens(rng, *user_tokens)
            answer = _tokens(rng, *answer_tokens)
            think = int(rng.integers(think_steps[0], think_steps[1] + 1))
            if turn == 0:
                start += think
            previous = None if turn == 0 else (turn - 1) * num_conversations + conv
            requests.append(Request(len(requests), prompt, answer, start if turn == 0 else think, previous))
            history[conv] = prompt + answer
    return requests


def with_salts(requests: list[Request], salts) -> list[Request]:
    """The same requests spread over tenants, round robin: each gets the next salt of ``salts``.

    A chat turn takes its previous turn's salt, so a conversation stays with one tenant.
    """
    tenants, tenant_of = cycle(salts), {}
    for r in requests:
        tenant_of[r.req_id] = tenant_of[r.after] if r.after is not None else next(tenants)
    return [replace(r, salt=tenant_of[r.req_id]) for r in requests]


# -- serving a workload ----------------------------------------------------------------------
@dataclass(frozen=True)
class RequestStats:
    """What serving one request found in the cache.

    ``hit_sources[j]`` names the KV that its ``j``-th reused block holds: ``(req_id, logical
    block)`` of the request that computed it.
    """

    req_id: int
    prompt_tokens: int
    cached_tokens: int
    admitted: int
    finished: int
    hit_sources: tuple[tuple[int, int], ...] = ()

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class WorkloadResult:
    """One run of a workload: per-request stats and the pool's use over time."""

    enable_prefix_caching: bool
    num_blocks: int
    block_size: int
    requests: tuple[RequestStats, ...]
    used_blocks: tuple[int, ...]        # blocks held by running requests, after each step
    evictable_blocks: tuple[int, ...]   # free blocks still holding cached KV, after each step
    evictions: int

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the cache: prefill tokens that were not computed."""
        return sum(r.cached_tokens for r in self.requests)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def peak_blocks(self) -> int:
        return max(self.used_blocks, default=0)

    @property
    def steps(self) -> int:
        return len(self.used_blocks)


def _ready(request: Request, step: int, finished_at: dict) -> bool:
    if request.after is None:
        return request.arrival <= step
    return request.after in finished_at and finished_at[request.after] + request.arrival <= step


@dataclass
class _Serving:
    """The state of one :func:`run_workload`: the pool, the running requests, what each block holds."""

    pool: BlockPool
    by_id: dict                                       # req id -> Request
    max_running: int
    running: dict = field(default_factory=dict)       # req id -> answer tokens generated so far
    stats: dict = field(default_factory=dict)         # req id -> RequestStats
    finished_at: dict = field(default_factory=dict)   # req id -> step
    written_by: dict = field(default_factory=dict)    # block -> (req id, logical block) whose KV it holds
    evictions: int = 0

    def blocks_left(self, rid) -> int:
        """Blocks request ``rid`` will still take until its answer is complete."""
        request = self.by_id[rid]
        total = blocks_needed(len(request.prompt) + len(request.output), self.pool.block_size)
        return total - len(self.pool.block_tables.get(rid, ()))

    def fits(self, request: Request) -> bool:
        """Whether the whole request fits beside what the running requests will still take."""
        hits = cached_prefix(self.pool, request.prompt, request.salt)
        revived = sum(b in self.pool.evictable for b in hits)   # reviving a freed cached block uses a free one
        promised = sum(self.blocks_left(rid) for rid in self.running)
        return self.blocks_left(request.req_id) - len(hits) + revived <= self.pool.num_free_blocks - promised

    def record(self, rid, outcome: Outcome, first_logical: int) -> None:
        self.evictions += len(outcome.evicted)
        for logical, block in enumerate(outcome.new, start=first_logical):
            self.written_by[block] = (rid, logical)

    def finish_done(self, step: int) -> None:
        for rid in [rid for rid, done in self.running.items() if done == len(self.by_id[rid].output)]:
            finish(self.pool, rid)
            del self.running[rid]
            self.finished_at[rid] = step
            self.stats[rid] = replace(self.stats[rid], finished=step)

    def admit_ready(self, waiting: list, step: int) -> set:
        """Admit arrived requests in order while they fit; returns the ids admitted."""
        admitted = set()
        for request in [r for r in waiting if _ready(r, step, self.finished_at)]:
            if len(self.running) >= self.max_running or not self.fits(request):
                break
            outcome = admit(self.pool, request.req_id, request.prompt, request.salt)
            sources = tuple(self.written_by[b] for b in outcome.hits)   # read before the new blocks are recorded
            self.record(request.req_id, outcome, first_logical=len(outcome.hits))
            self.stats[request.req_id] = RequestStats(request.req_id, len(request.prompt),
                                                      len(outcome.hits) * self.pool.block_size, step, -1, sources)
            waiting.remove(request)
            self.running[request.req_id] = 0
            admitted.add(request.req_id)
        return admitted

    def decode(self, skip: set) -> None:
        """One answer token for every running request not in ``skip`` (just admitted) nor done."""
        for rid, done in self.running.items():
            if rid in skip or done == len(self.by_id[rid].output):
                continue
            first_logical = len(self.pool.block_tables[rid])
            self.record(rid, grow(self.pool, rid, self.by_id[rid].output[done:done + 1]), first_logical)
            self.running[rid] = done + 1


def run_workload(requests: list[Request], num_blocks: int, block_size: int = 16, max_running: int = 8,
                 enable_prefix_caching: bool = True) -> WorkloadResult:
    """Serve ``requests`` on a fresh ``BlockPool(num_blocks, block_size, enable_prefix_caching)``.

    Each step: finished requests are freed; requests that have arrived are admitted in order
    while fewer than ``max_running`` run and the whole request fits (counting the blocks
    running requests will still take, and the cache hits the prompt would get); then every
    running request that was not just admitted decodes one token.
    """
    too_long = [r.req_id for r in requests if blocks_needed(len(r.prompt) + len(r.output), block_size) > num_blocks]
    if too_long:
        raise ValueError(f"requests {too_long[:5]} can never fit in {num_blocks} blocks of {block_size}")
    serving = _Serving(BlockPool(num_blocks, block_size, enable_prefix_caching), {r.req_id: r for r in requests},
                       max_running)
    waiting, used, evictable, step = list(requests), [], [], 0
    while waiting or serving.running:
        serving.finish_done(step)
        serving.decode(skip=serving.admit_ready(waiting, step))
        used.append(serving.pool.num_used_blocks)
        evictable.append(len(serving.pool.evictable))
        step += 1
    return WorkloadResult(enable_prefix_caching, num_blocks, block_size,
                          tuple(serving.stats[r.req_id] for r in requests), tuple(used), tuple(evictable),
                          serving.evictions)


def sequence_tokens(request: Request) -> tuple[int, ...]:
    """Every token a served request's sequence held: its prompt, then its answer."""
    return request.prompt + request.output


# -- with and without the cache ----------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """The same workload served with prefix caching and without."""

    name: str
    cached: WorkloadResult
    uncached: WorkloadResult

    @property
    def prefill_tokens_saved(self) -> int:
        return self.cached.cached_tokens

    @property
    def blocks_saved(self) -> int:
        """Peak blocks in use without the cache minus with it."""
        return self.uncached.peak_blocks - self.cached.peak_blocks

    def row(self) -> list:
        """One line of :func:`comparison_table`."""
        c, u = self.cached, self.uncached
        return [self.name, len(c.requests), c.prompt_tokens, f"{c.hit_rate:.1%}", self.prefill_tokens_saved,
                u.peak_blocks, c.peak_blocks, f"{self.blocks_saved} ({self.blocks_saved / u.peak_blocks:.0%})",
                c.evictions]


COMPARISON_HEADERS = ["workload", "requests", "prompt tokens", "hit rate", "prefill tokens saved",
                      "peak blocks without", "peak blocks with", "blocks saved", "evictions"]


def compare(name: str, requests: list[Request], num_blocks: int, block_size: int = 16, max_running: int = 8,
            uncached_blocks: int | None = None) -> Comparison:
    """Serve ``requests`` twice: with prefix caching in ``num_blocks`` blocks, and without it
    in ``uncached_blocks`` (default: the same pool)."""
    with_cache = run_workload(requests, num_blocks, block_size, max_running, enable_prefix_caching=True)
    without = run_workload(requests, uncached_blocks or num_blocks, block_size, max_running,
                           enable_prefix_caching=False)
    return Comparison(name, with_cache, without)


def comparison_table(comparisons: list[Comparison]) -> str:
    """The comparisons as a plain-text table (stable output for notebooks)."""
    from kvlab.accounting import text_table

    return text_table(COMPARISON_HEADERS, [c.row() for c in comparisons], align="l" + "r" * 8)


def pool_size_sweep(requests: list[Request], sizes, block_size: int = 16,
                    max_running: int = 8) -> list[WorkloadResult]:
    """The workload with prefix caching in pools of each size in ``sizes`` (memory pressure)."""
    return [run_workload(requests, n, block_size, max_running) for n in sizes]


# -- a small scripted scenario for the step-through -----------------------------------------
@dataclass(frozen=True)
class PrefixEvent:
    """One step of a scripted scenario: ``"arrive"`` (prompt ``tokens``, with ``salt``),
    ``"grow"`` (append decoded ``tokens``) or ``"finish"``."""

    kind: str
    seq_id: object
    tokens: tuple[int, ...] = ()
    salt: object = None


def apply_prefix_event(pool: BlockPool, event: PrefixEvent) -> Outcome:
    """Apply one scripted event to ``pool`` with :func:`admit`, :func:`grow` or :func:`finish`."""
    if event.kind == "arrive":
        return admit(pool, event.seq_id, event.tokens, event.salt)
    if event.kind == "grow":
        return grow(pool, event.seq_id, event.tokens)
    if event.kind == "finish":
        return finish(pool, event.seq_id)
    raise ValueError(f"unknown event kind {event.kind!r}; expected arrive, grow or finish")


def _phrase(word: str, blocks) -> str:
    return f"{word} {', '.join(map(str, blocks))}" if blocks else ""


def describe(event: PrefixEvent, outcome: Outcome, block_size: int) -> str:
    """What an event did, in words: ``"B arrives (11 tokens): hit 0, 1 (8 tokens); new 4"``."""
    o = outcome
    if event.kind == "arrive":
        salt = "" if event.salt is None else f", salt {event.salt!r}"
        head = f"{event.seq_id} arrives ({len(event.tokens)} tokens{salt})"
        hit = f"{_phrase('hit', o.hits)} ({len(o.hits) * block_size} tokens cached)" if o.hits else "no hit"
        parts = [hit, _phrase("new", o.new), _phrase("evicted", o.evicted)]
    elif event.kind == "grow":
        head = f"{event.seq_id} grows by {len(event.tokens)}"
        parts = [_phrase("new", o.new) or "fits in its last block", _phrase("full, now cached:", o.cached),
                 _phrase("evicted", o.evicted)]
    else:
        head = f"{event.seq_id} finishes"
        parts = [_phrase("releases", o.released) or "releases nothing (all shared)"]
    return f"{head}: " + "; ".join(p for p in parts if p)


SCENARIO_BLOCK_SIZE = 4
SCENARIO_NUM_BLOCKS = 10


def scripted_scenario() -> list[PrefixEvent]:
    """Hits, misses, reuse after free, LRU eviction and a tenant salt, on 10 blocks of 4 tokens.

    Token ids tell the story: 1-8 are a system prompt (two blocks), 11.. / 21.. / 31.. are
    three users' questions, 9x are answers, 50.. a long unrelated prompt.
    """
    system = tuple(range(1, 9))
    qa, qb = (11, 12, 13, 14, 15), (21, 22, 23)
    return [
        PrefixEvent("arrive", "A", system + qa),               # miss: everything computed
        PrefixEvent("arrive", "B", system + qb),               # hit: the system prompt
        PrefixEvent("grow", "A", (91, 92, 93)),                # A's third block fills up: cached
        PrefixEvent("finish", "A"),                            # its own blocks become evictable
        PrefixEvent("arrive", "C", system + qa + (91, 92, 93, 16, 17)),  # A's next turn: revives A's blocks
        PrefixEvent("finish", "B"),
        PrefixEvent("finish", "C"),                            # tail first: 3, 2, then 1, 0
        PrefixEvent("arrive", "D", tuple(range(50, 79))),      # long and unrelated: free blocks, then evictions
        PrefixEvent("finish", "D"),
        PrefixEvent("arrive", "E", system + qa),               # the system prompt survived; A's question did not
        PrefixEvent("arrive", "F", system + qa, salt="tenant-b"),  # same tokens, other tenant: no hit
    ]
