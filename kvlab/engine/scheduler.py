"""Scheduler: continuous batching with chunked prefill over the paged KV cache.

Every step fills a token budget, ``max_num_batched_tokens``, in vLLM v1's order:

1. **Running sequences**, oldest first. A decoding one needs one token (plus ``k`` drafts with
   speculative decoding: ``1 + k`` count against the budget); one still computing its prompt
   takes its next **chunk**: as many of its remaining prompt tokens as the budget (and
   ``long_prefill_token_threshold``) allow. If the pool has no block for it, the most recently
   admitted running sequence is *preempted* (:meth:`Scheduler.preemption_victims`): its blocks
   go back to the pool and it returns to the front of the waiting queue, keeping its generated
   tokens, to be recomputed later as prompt + output ("recompute" preemption, chunked like any
   prompt). A sequence that cannot grow even when it is the only one left can never fit: it
   finishes with an error.
2. **Waiting sequences are admitted**, first come first served, while ``max_num_seqs``, the
   budget and the pool's free blocks allow (but not in a step that had to preempt: memory is
   short). Its prefix-cache hit is looked up on the whole prompt first; then it computes its
   first chunk. At most ``max_num_partial_prefills`` prompts are part-way through at once.

**Swapping** (chapter 9): with a host tier (``host_blocks``, from the engine's ``swap_space``),
a preempted sequence may instead be *swapped out*: its computed blocks are copied to host
memory (``blocks_to_swap_out``), it keeps its progress and waits in ``swapped``; when blocks
free up it comes back before any new request (``blocks_to_swap_in``; blocks still in the
prefix cache are reused, not copied). ``preemption_mode`` "auto" picks swap or recompute per
sequence with the cost model of :mod:`kvlab.engine.offload`; the output says which
(``swapped_out`` among ``preempted``).

**The prefix cache's host tier** (chapter 9, ``host_prefix_cache``: a
:class:`~kvlab.engine.offload.HostPrefixCache` with its own host blocks, attached to the pool):
a cached block the pool evicts while a step is planned is copied to the host by that step's
swap-outs (``prefix_blocks_saved``), which run before anything of the step writes the cache;
a waiting prompt's cache hit goes on through the hashes the tier holds, brought back into
blocks the prompt holds at once by the step's swap-ins (``prefix_blocks_restored``), so that
nothing of the same step can evict them before the copy. The host blocks those swap-ins read
are reused only from the next step on. Blocks booked for draft tokens (after the step's copies
have been handed out) are not saved: what they evict is lost, as without the tier.

With ``enable_chunked_prefill=False`` a prompt is computed whole in one step, so a prompt
longer than the budget can never run. Prompts and decodes share one step, packed together.

Two policies for chapter 8's comparisons: ``scheduling_policy="static"`` admits new requests
only while the running batch has not started decoding (a batch runs to completion before the
next is formed), and ``prefill_priority_after`` (seconds; the seed article's fairness rule)
schedules the chunks of prompts that have waited longer than that *before* the decodes.

:meth:`Scheduler.update` then appends each sampled token (only sequences whose step reached
their last token get one: a prompt's earlier chunks sample nothing), forks the extra samples of
a request (``n > 1``) off its first sample once the prompt is computed, so they share its blocks
(:meth:`BlockPool.fork`), and retires finished sequences, freeing their blocks.

The scheduler only books blocks. What the model runner needs from the pool travels in the
:class:`SchedulerOutput`: each scheduled sequence's block table, and the copy-on-write pairs
the pool recorded while the step was planned (:attr:`SchedulerOutput.blocks_to_copy`), to be
copied before the forward pass. The runner never sees the pool.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from kvlab.errors import OutOfBlocksError
from kvlab.engine.offload import PREEMPTION_MODES, preemption_mode
from kvlab.engine.sequence import Sequence, SequenceStatus
from kvlab.paging.block_pool import BlockPool, blocks_needed, slot_mapping
from kvlab.validation import check_bool, check_count


@dataclass
class ScheduledSequence:
    """One sequence of a step: it computes positions ``start .. start + num_new - 1``."""

    seq: Sequence
    start: int
    num_new: int
    is_prefill: bool = False   # computes prompt tokens (a whole prompt or a chunk; prompt + output after preemption)
    forks: list[Sequence] = field(default_factory=list)  # samples to fork off it after this step
    block_table: list[int] = field(default_factory=list)  # its blocks once the step is booked
    spec_token_ids: list[int] = field(default_factory=list)  # drafts it verifies (-1: padding)
    # whether the step reaches the sequence's last token, so it samples the next one (a prompt's
    # earlier chunks do not); fixed when the step is planned
    samples: bool = field(init=False)

    def __post_init__(self):
        self.samples = self.start + self.num_new == self.seq.num_tokens

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence in the cache after this step (drafts included)."""
        return self.start + self.num_new

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: its chunk of the sequence's uncomputed ones, then its
        drafts (padding drafts as token 0: their results are never kept)."""
        end = self.seq_len - len(self.spec_token_ids)
        return self.seq.token_ids[self.start:end] + [max(t, 0) for t in self.spec_token_ids]

    @property
    def num_logits(self) -> int:
        """Logit rows it needs: none (an early chunk), one, or one per draft plus the bonus."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    """What one step runs, and what the scheduler did to get there."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)   # failed while scheduling
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    block_size: int = 16
    # chapter 9: preempted by swapping (a subset of ``preempted``), and brought back
    swapped_out: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    # the prefix cache's host tier: evicted cached blocks copied out, and hits brought back
    # (also among blocks_to_swap_out / blocks_to_swap_in)
    prefix_blocks_saved: list[tuple[int, int]] = field(default_factory=list)     # (device block, host block)
    prefix_blocks_restored: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    def slot_mapping(self) -> list[int]:
        """The cache slot of every new token of the step, in packed order."""
        return [slot for s in self.scheduled
                for slot in slot_mapping(s.block_table, s.start, s.num_new, self.block_size)]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    @property
    def requests(self) -> list[tuple[int, int, int]]:
        """``(seq_id, start, num_new)`` per scheduled sequence, for ``AttentionContext.from_pool``."""
        return [(s.seq.seq_id, s.start, s.num_new) for s in self.scheduled]

    @property
    def sample_seqs(self) -> list[Sequence]:
        """The sequences that get a token this step, in the order the sampler fills them:
        each scheduled sequence that samples, followed by the samples forked off it."""
        return [seq for s in self.scheduled if s.samples for seq in (s.seq, *s.forks)]

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.preempted or self.finished or self.swapped_in)


SCHEDULING_POLICIES = ("fcfs", "static")


def check_scheduling(enable_chunked_prefill, long_prefill_token_threshold, max_num_partial_prefills,
                     scheduling_policy, prefill_priority_after) -> None:
    """Refuse bad scheduler settings, naming the setting and the rule."""
    check_bool("enable_chunked_prefill", enable_chunked_prefill)
    check_count("long_prefill_token_threshold", long_prefill_token_threshold)
    check_count("max_num_partial_prefills", max_num_partial_prefills, minimum=1)
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
    if prefill_priority_after is not None and (isinstance(prefill_priority_after, bool) or not isinstance(
            prefill_priority_after, (int, float)) or prefill_priority_after < 0):
        raise ValueError(f"prefill_priority_after must be None or seconds >= 0, got {prefill_priority_after!r}")


class Scheduler:
    """FCFS continuous batching with recompute preemption, on a :class:`BlockPool`."""

    # With preemption_mode "auto": the rule that picks swap or recompute for a victim, called as
    # (num_tokens, bytes_per_token, costs, host_free_bytes). Chapter 9's exercise plugs in its own.
    choose_preemption_mode = staticmethod(preemption_mode)

    def __init__(self, pool: BlockPool, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, eos_token_ids=(), num_lookahead_tokens: int = 0, *,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 max_num_partial_prefills: int = 1, scheduling_policy: str = "fcfs",
                 prefill_priority_after: float | None = None, clock=time.monotonic, host_blocks=None,
                 preemption_mode: str = "auto", preemption_costs=None, bytes_per_token: int = 0,
                 host_prefix_cache=None, vocab_size: int | None = None):
        check_count("max_num_seqs", max_num_seqs, minimum=1)
        check_count("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence decodes one token per step")
        check_scheduling(enable_chunked_prefill, long_prefill_token_threshold, max_num_partial_prefills,
                         scheduling_policy, prefill_priority_after)
        if max_model_len is not None:
            check_count("max_model_len", max_model_len, minimum=1)
        check_count("bytes_per_token", bytes_per_token)
        if vocab_size is not None:
            check_count("vocab_size", vocab_size, minimum=1)
        self.pool = pool
        self.vocab_size = vocab_size                # sampled ids must lie below it (None: unchecked)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # speculative decoding: every running sequence may verify this many drafts per step,
        # so each counts 1 + num_lookahead_tokens tokens against the step's budget
        self.num_lookahead_tokens = check_count("num_lookahead_tokens", num_lookahead_tokens)
        if max_num_batched_tokens < 1 + num_lookahead_tokens:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= 1 + num_lookahead_tokens "
                             f"({1 + num_lookahead_tokens}): a speculating sequence verifies its drafts and one more")
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold     # 0: no cap
        self.max_num_partial_prefills = max_num_partial_prefills
        self.scheduling_policy = scheduling_policy
        self.prefill_priority_after = prefill_priority_after
        self.clock = clock
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if host_blocks is not None and preemption_mode == "auto" and (preemption_costs is None or bytes_per_token < 1):
            raise ValueError("preemption_mode='auto' with host blocks needs preemption_costs and bytes_per_token")
        self.host_blocks = host_blocks              # a HostBlockAllocator, or None: recompute only
        self.preemption_mode = preemption_mode
        self.preemption_costs = preemption_costs
        self.bytes_per_token = bytes_per_token
        self.swapped: deque[Sequence] = deque()     # swapped out, oldest first
        self._host_to_free: list[int] = []          # host blocks read by the latest step's swap-ins
        self.host_prefix_cache = host_prefix_cache  # evicted prefix-cache blocks on the host, or None
        if host_prefix_cache is not None:
            pool.attach_host_tier(host_prefix_cache)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # in admission order, oldest first
        self._seq_ids: set = set()               # of the sequences added and not yet released
        # counters, for tests and notebooks
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_copied_blocks = 0
        self.num_host_prefix_saved = 0          # blocks copied to the prefix cache's host tier
        self.num_host_prefix_hits = 0           # blocks of cache hits brought back from it
        self.peak_used_blocks = 0
        self._unrecorded: SchedulerOutput | None = None   # a step not yet passed to update()

    # -- queues ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (its ``forks`` join the batch after its prompt is computed)."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"seq must be a Sequence, got {type(seq).__name__}")
        if not seq.num_prompt_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} has an empty prompt")
        if seq.seq_id in self._seq_ids or seq.seq_id in self.pool:
            raise ValueError(f"sequence id {seq.seq_id!r} is already in the scheduler")
        self._seq_ids.add(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        if seq.arrival_time is None:
            seq.arrival_time = self.clock()
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- planning a step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step: book its blocks and say what runs (see the module docstring)."""
        if self._unrecorded is not None:
            raise RuntimeError("the previous step has not been recorded: call update() with its tokens first")
        out = SchedulerOutput(block_size=self.pool.block_size)
        if self._host_to_free:          # the previous step has read them (copies run in order)
            self.host_blocks.free(self._host_to_free)
            self._host_to_free = []
        if self.host_prefix_cache is not None:
            self.host_prefix_cache.next_step()
        budget = self.max_num_batched_tokens
        if self._overdue():          # the fairness rule: overdue prompts before the decodes
            budget = self._schedule_running(out, budget, prefills_only=True)
            if not out.preempted:
                budget = self._schedule_waiting(out, budget, overdue_only=True)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_swapped(out)
        if not out.preempted and not self.swapped:      # the swapped are older than any new request
            self._schedule_waiting(out, budget)
        out.blocks_to_copy = self.pool.take_copies()
        if self.host_prefix_cache is not None:
            out.prefix_blocks_saved, out.prefix_blocks_restored = self.host_prefix_cache.take_transfers()
            out.blocks_to_swap_out += out.prefix_blocks_saved
            out.blocks_to_swap_in += out.prefix_blocks_restored
            self.num_host_prefix_saved += len(out.prefix_blocks_saved)
            self.num_host_prefix_hits += len(out.prefix_blocks_restored)
        for item in out.scheduled:
            item.block_table = self.pool.block_table(item.seq.seq_id)
        self.num_steps += 1
        self.num_copied_blocks += len(out.blocks_to_copy)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        self._unrecorded = out if out.scheduled else None
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens of a prompt with ``remaining`` to compute that this step takes (0: none)."""
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        cap = self.long_prefill_token_threshold or remaining
        return max(0, min(remaining, cap, budget))

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefills_only: bool = False) -> int:
        """Book the next tokens of every running sequence not yet in ``out`` (a decode's one,
        a prompt's next chunk), preempting the youngest when blocks run out; returns the
        budget left. A sequence the budget has no room for waits for the next step."""
        done = {id(item.seq) for item in out.scheduled}
        queue, kept = deque(self.running), []
        while queue:
            seq = queue.popleft()
            decoding = seq.num_computed_tokens == seq.num_tokens - 1
            num_new = 1 if decoding else self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            cost = 1 + self.num_lookahead_tokens if decoding else num_new   # a decode's drafts come later
            if id(seq) in done or (prefills_only and (decoding or not self._is_overdue(seq))) \
                    or num_new == 0 or budget < cost:
                kept.append(seq)           # not this step
                continue
            if not self._make_room(seq, num_new, queue, kept, out):
                continue
            start = seq.num_computed_tokens
            self.pool.append(seq.seq_id, num_new, seq.token_ids[start:start + num_new], cache=False)
            kept.append(seq)
            item = ScheduledSequence(seq, start, num_new, is_prefill=not decoding)
            item.forks = list(seq.forks) if item.samples else []
            out.scheduled.append(item)
            budget -= cost
        self.running = kept
        return budget

    def _make_room(self, seq: Sequence, num_new: int, queue: deque, kept: list, out: SchedulerOutput) -> bool:
        """Free blocks until ``seq`` can take ``num_new`` more tokens; False if ``seq`` itself had to go."""
        if blocks_needed(seq.num_tokens, self.pool.block_size) > self.pool.num_blocks:
            self._fail(seq, self._too_big(seq), out)
            return False
        if self.pool.can_append(seq.seq_id, num_new):
            return True
        scheduled = {id(item.seq) for item in out.scheduled}
        younger = [s for s in queue if id(s) not in scheduled]
        for victim in self.preemption_victims(seq, num_new, younger):
            if victim is seq:
                break
            if victim not in younger:
                raise ValueError(f"preemption_victims chose {victim!r}, not one of its candidates")
            younger.remove(victim)
            queue.remove(victim)
            self._preempt(victim, out)
            if self.pool.can_append(seq.seq_id, num_new):
                return True
        if kept or queue:                  # seq itself yields
            self._preempt(seq, out)
        else:                              # alone, and still no room: it can never fit
            self._fail(seq, self._too_big(seq), out)
        return False

    def preemption_victims(self, seq: Sequence, num_new: int, candidates: list[Sequence]) -> list[Sequence]:
        """Whom to preempt, in order, so that ``seq`` gets blocks for ``num_new`` more tokens.

        ``candidates``: the running sequences admitted after ``seq`` whose turn in this step has
        not come, oldest first. They are preempted in the order returned until ``seq`` fits; if
        it still does not (or the list holds ``seq`` itself), ``seq`` yields, or fails if nothing
        else runs. The rule: the most recently admitted first, so the oldest keep progressing.
        A subclass may choose otherwise (chapter 8)."""
        return candidates[::-1]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, overdue_only: bool = False) -> int:
        """Admit waiting sequences in arrival order while sequences, tokens and blocks allow."""
        num_seqs = sum(1 + len(s.forks) for s in self.running)    # forks join once the prompt is done
        partial = sum(s.num_computed_tokens < s.num_tokens - 1 for s in self.running)
        if self.scheduling_policy == "static" and any(s.num_computed_tokens >= s.num_prompt_tokens
                                                      for s in self.running):
            return budget                  # static batching: the batch is decoding, nobody joins
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if overdue_only and not self._is_overdue(seq):
                break
            problem = self._never_fits(seq)
            if problem:
                self.waiting.popleft()
                self._fail(seq, problem, out)
                continue
            width = 1 + len(seq.forks)     # its samples all run from the next step on
            if num_seqs + width > self.max_num_seqs:
                break
            if self.host_prefix_cache is None:      # the hit, on the whole prompt
                cached = len(self.pool.computed_blocks(seq.token_ids, seq.cache_salt)) * self.pool.block_size
            else:                                   # through both tiers
                cached = self.pool.num_cached_blocks(seq.token_ids, seq.cache_salt) * self.pool.block_size
            num_new = self._chunk(seq.num_tokens - cached, budget)
            finishes = cached + num_new == seq.num_tokens
            if num_new == 0 or (not finishes and partial >= self.max_num_partial_prefills):
                break
            try:
                # cache=False: its blocks join the prefix cache once their K/V is computed (update)
                end = cached + num_new
                self.pool.allocate(seq.seq_id, end, seq.token_ids[:end], salt=seq.cache_salt, cache=False)
            except OutOfBlocksError:
                break
            self.waiting.popleft()
            self._admit(seq, num_new, out)
            budget -= num_new
            num_seqs += width
            partial += not finishes
        return budget

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        """Bring swapped-out sequences back, oldest first, while sequences and blocks allow (with
        a block to spare for each one's next token). They compute again from the next step."""
        bs = self.pool.block_size
        num_seqs = sum(1 + len(s.forks) for s in self.running)
        while self.swapped and num_seqs < self.max_num_seqs:
            seq = self.swapped[0]
            n = seq.num_computed_tokens
            if blocks_needed(n + 1, bs) > self.pool.num_free_blocks:
                break
            table = self.pool.allocate(seq.seq_id, n, seq.token_ids[:n], salt=seq.cache_salt, cache=False)
            reused = self.pool.num_cached_tokens.get(seq.seq_id, 0) // bs   # still in the prefix cache
            out.blocks_to_swap_in += zip(seq.host_blocks[reused:], table[reused:])
            self._host_to_free += seq.host_blocks
            seq.host_blocks = []
            seq.status = SequenceStatus.RUNNING
            self.swapped.popleft()
            self.running.append(seq)
            out.swapped_in.append(seq)
            num_seqs += 1

    def _admit(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        cached = self.pool.num_cached_tokens.get(seq.seq_id, 0)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached
        seq.num_computed_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        item = ScheduledSequence(seq, cached, num_new, is_prefill=True)
        item.forks = list(seq.forks) if item.samples else []
        out.scheduled.append(item)

    def _overdue(self) -> bool:
        return self.prefill_priority_after is not None and any(
            self._is_overdue(s) for s in (*self.waiting, *self.running) if s.num_computed_tokens < s.num_tokens - 1)

    def _is_overdue(self, seq: Sequence) -> bool:
        """The fairness rule: a prompt waiting longer than ``prefill_priority_after`` seconds."""
        return self.prefill_priority_after is not None and \
            self.clock() - seq.arrival_time > self.prefill_priority_after

    def _never_fits(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never be admitted, or None."""
        if 1 + len(seq.forks) > self.max_num_seqs:
            return f"n={1 + len(seq.forks)} samples exceed max_num_seqs={self.max_num_seqs}"
        if not self.enable_chunked_prefill and seq.num_tokens > self.max_num_batched_tokens:
            return (f"sequence has {seq.num_tokens} tokens to compute in one step, more than "
                    f"max_num_batched_tokens={self.max_num_batched_tokens} (enable_chunked_prefill=False: "
                    f"prompts are not split into chunks)")
        if blocks_needed(seq.num_tokens, self.pool.block_size) > self.pool.num_blocks:
            return self._too_big(seq)
        return None

    def _too_big(self, seq: Sequence) -> str:
        bs = self.pool.block_size
        return (f"the KV cache is too small: the sequence needs {blocks_needed(seq.num_tokens, bs)} blocks "
                f"of {bs} tokens to go on, the whole cache has {self.pool.num_blocks}")

    def add_draft_tokens(self, out: SchedulerOutput, item: ScheduledSequence, draft_token_ids: list[int]) -> bool:
        """Book slots for a decoding sequence's drafts (-1 for padding) in step ``out``, so the
        step verifies them. False (and nothing booked) if the pool has no room for them."""
        if item.is_prefill or item.spec_token_ids or item.num_new != 1:
            raise ValueError("only a decoding sequence without drafts can take drafts")
        n = len(draft_token_ids)
        if n == 0 or not self.pool.can_append(item.seq.seq_id, n):
            return False
        self.pool.append(item.seq.seq_id, n, [max(t, 0) for t in draft_token_ids], cache=False)
        if self.host_prefix_cache is not None:   # the step's copies are handed out: too late to save
            saved, _ = self.host_prefix_cache.take_transfers()
            self.host_prefix_cache.discard([host for _, host in saved])
        item.spec_token_ids = [int(t) for t in draft_token_ids]
        item.num_new += n
        item.block_table = self.pool.block_table(item.seq.seq_id)
        out.blocks_to_copy += self.pool.take_copies()
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return True

    # -- changing a sequence's state ---------------------------------------------------------
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self._preemption_mode(seq) == "swap":
            n = blocks_needed(seq.num_computed_tokens, self.pool.block_size)
            host = self.host_blocks.allocate(n)
            out.blocks_to_swap_out += zip(self.pool.block_table(seq.seq_id)[:n], host)
            self.pool.free(seq.seq_id)
            seq.swap_out(host)
            self.swapped.appendleft(seq)   # preempted youngest first: the oldest ends up in front
            out.swapped_out.append(seq)
            self.num_swapped_out += 1
        else:
            self.pool.free(seq.seq_id)
            seq.reset_for_recompute()
            self.waiting.appendleft(seq)   # it arrived before everything still waiting
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _preemption_mode(self, seq: Sequence) -> str:
        """"swap" or "recompute" for ``seq`` (see the module docstring)."""
        n = seq.num_computed_tokens
        if self.host_blocks is None or self.preemption_mode == "recompute" or n == 0 or seq.forks:
            return "recompute"
        run = self.host_blocks.largest_run()
        if blocks_needed(n, self.pool.block_size) > run:
            return "recompute"             # no room on the host
        if self.preemption_mode == "swap":
            return "swap"
        return self.choose_preemption_mode(n, self.bytes_per_token, self.preemption_costs,
                                           run * self.pool.block_size * self.bytes_per_token)

    def _fail(self, seq: Sequence, message: str, out: SchedulerOutput) -> None:
        for s in (seq, *seq.forks):
            self.finish_sequence(s, "error", error=message)
            out.finished.append(s)
        seq.forks = []

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason=None, error: str | None = None) -> None:
        """End ``seq`` now (a stop string, an error): free its blocks and drop it from the queues."""
        seq.finish(reason, stop_reason=stop_reason, error=error)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self._seq_ids.discard(seq.seq_id)
        if seq.seq_id in self.pool:
            self.pool.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
            self._host_to_free += seq.host_blocks
            seq.host_blocks = []

    # -- after the step ----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled_token_ids, logprobs=None) -> list[Sequence]:
        """Record a step's results: ``sampled_token_ids[i]`` (and ``logprobs[i]``) belong to
        ``out.sample_seqs[i]``: one token, or, for a sequence that verified drafts, the list it
        emitted (its accepted drafts, then one more). Returns the sequences that finished.

        A verifying sequence keeps the K/V of its accepted drafts; the slots of the rejected
        ones are given back (:meth:`BlockPool.truncate`) before any block is cached."""
        if out.scheduled and out is not self._unrecorded:
            raise ValueError("update() takes the output of the latest schedule(), once")
        samples = out.sample_seqs
        tokens, logprobs, emitted = self._check_results(out, samples, sampled_token_ids, logprobs)
        self._unrecorded = None
        for item in out.scheduled:
            self._record_computed(item, len(emitted.get(id(item.seq), (None,))) - 1)
            self._fork(item)
        finished = []
        for seq, new, lps in zip(samples, tokens, logprobs):
            for token, logprob in zip(new, lps):
                seq.append_token(token, logprob)
                if seq.check_stop(self.eos_token_ids, self.max_model_len):
                    finished.append(seq)
                    break
        for seq in finished:
            self._release(seq)
        return finished

    def _check_results(self, out: SchedulerOutput, samples: list, sampled_token_ids, logprobs=None) -> tuple[list, list, dict]:
        """``update``'s results as a list of tokens and one of log-probabilities per sequence of
        ``samples`` (``out.sample_seqs``), and the tokens by ``id`` of their sequence, checked
        before anything changes (ValueError): one entry per sample, token ids in
        ``0..vocab_size - 1``, 1..``num_logits`` tokens per scheduled sequence that samples, as
        many log-probabilities as tokens."""
        try:
            tokens = [[int(t) for t in x] if isinstance(x, (list, tuple)) else [int(x)] for x in sampled_token_ids]
        except (TypeError, ValueError):
            raise TypeError(f"sampled token ids must be ints (a list of them per sequence), "
                            f"got {list(sampled_token_ids)!r}") from None
        if len(tokens) != len(samples):
            raise ValueError(f"the step sampled tokens for {len(tokens)} sequences, it ran {len(samples)}")
        top = self.vocab_size or math.inf
        bad = next((row for row in tokens if any(not 0 <= t < top for t in row)), None)
        if bad is not None:
            raise ValueError(f"sampled token ids must be >= 0 and < vocab_size ({self.vocab_size}), got {bad}")
        if logprobs is None:
            logprobs = [[0.0] * len(t) for t in tokens]
        logprobs = [[float(v) for v in x] if isinstance(x, (list, tuple)) else [float(x)] for x in logprobs]
        if [len(x) for x in logprobs] != [len(t) for t in tokens]:
            raise ValueError("logprobs must hold one log-probability per sampled token")
        emitted = dict(zip(map(id, samples), tokens))
        for item in out.scheduled:
            got = len(emitted.get(id(item.seq), ()))
            if item.samples and not 1 <= got <= item.num_logits:
                raise ValueError(f"sequence {item.seq.seq_id} emitted {got} tokens; a step gives it "
                                 f"1..{item.num_logits}")
        return tokens, logprobs, emitted

    def _record_computed(self, item: ScheduledSequence, num_accepted: int) -> None:
        """The step computed ``item``'s tokens; of its drafts, ``num_accepted`` were kept."""
        seq = item.seq
        seq.num_computed_tokens = item.seq_len - len(item.spec_token_ids) + num_accepted
        if item.spec_token_ids:
            self.pool.truncate(seq.seq_id, seq.num_computed_tokens)      # rollback of the rejected
            seq.spec_stats.record(item.spec_token_ids, num_accepted)
        self.pool.cache_blocks(seq.seq_id, seq.num_computed_tokens)      # their K/V exists now

    def abandon(self, out: SchedulerOutput, error: str) -> list[Sequence]:
        """The step ``out`` failed before its tokens were sampled: end every sequence it ran (and
        the samples that were to fork off them) with ``error``, freeing their blocks. None of
        those blocks was registered in the prefix cache (see ``cache_blocks`` in update), so no
        later prompt can hit K/V that was never computed. The sequences the step swapped out
        or in end too: their copies may not have happened, and so do the prefix cache's blocks
        the step was to copy to or from the host. Returns the ended sequences."""
        if out is not self._unrecorded and out.scheduled:
            raise ValueError("abandon() takes the output of the latest schedule(), once")
        self._unrecorded = None
        ended = [seq for item in out.scheduled for seq in (item.seq, *item.seq.forks)]
        ended += [seq for seq in (*out.swapped_out, *out.swapped_in) if seq not in ended and not seq.is_finished]
        for item in out.scheduled:
            item.seq.forks = []
        for seq in ended:
            self.finish_sequence(seq, "error", error=error)
        if self.host_prefix_cache is not None:  # the tiers' copies may not have happened either
            self.pool.forget([device for _, device in out.prefix_blocks_restored])
            self.host_prefix_cache.discard([host for _, host in out.prefix_blocks_saved])
        return ended

    def _fork(self, item: ScheduledSequence) -> None:
        """The parent's prompt is computed: its other samples start sharing its blocks."""
        parent = item.seq
        if not item.forks:
            return
        at = self.running.index(parent) + 1
        for child in item.forks:
            self.pool.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.arrival_time = parent.arrival_time     # a preempted sample waits as its request did
            child.status = SequenceStatus.RUNNING
        self.running[at:at] = item.forks
        parent.forks = []
