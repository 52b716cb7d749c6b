"""Speculative decoding: propose k tokens cheaply, verify them all in one target forward.

A decode step reads every weight and the whole KV cache to produce one token per sequence;
scoring ``k + 1`` tokens of a sequence in the same step reads the same bytes, so it costs about
the same. A *proposer* guesses the next ``k`` tokens; the target scores them in one forward
(the uniform phase: ``k + 1`` query tokens per sequence over its paged prefix); rejection
sampling (:mod:`kvlab.engine.rejection_sampler`) keeps a prefix of them and adds one token, so
the output is distributed exactly as without speculation.

Two proposers, configured as in vLLM (``LLM(speculative_config={...})``):

* ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
  "prompt_lookup_max": 4}``: find the sequence's last n tokens earlier in its own tokens
  (prompt and output; the longest n first, its most recent occurrence) and propose the k
  tokens that followed. No model; the drafts are deterministic (one-hot ``q``).
* ``{"method": "draft_model", "model": <checkpoint folder>, "num_speculative_tokens": k}``: a
  small model with the target's vocabulary proposes k tokens autoregressively, on its own paged
  KV cache (its own :class:`~kvlab.paging.BlockPool`), sampling with each request's settings.

**Rollback.** Verification writes K/V for all k + 1 positions. Rejected positions are cut off
afterwards (:meth:`BlockPool.truncate`), so blocks left empty go back to the pool and only
blocks whose tokens were accepted are ever registered in the prefix cache. The draft's cache is
cut back the same way, to the tokens it fed that the sequence kept.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from kvlab.engine.rejection_sampler import greedy_accept, rejection_sample
from kvlab.engine.sampler import GREEDY_TEMPERATURE, sampling_probs
from kvlab.errors import OutOfBlocksError
from kvlab.paging.block_pool import BlockPool
from kvlab.validation import check_count

METHODS = ("ngram", "draft_model")
DEFAULT_DRAFT_MODEL = Path(__file__).resolve().parent.parent / "models" / "weights" / "kvlab-tiny-draft"


@dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config``, checked (vLLM's keys)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: object = None

    @classmethod
    def from_dict(cls, config) -> "SpeculativeConfig":
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        config = dict(config)
        if "method" not in config:   # vLLM: a draft model's path alone means "draft_model"
            config["method"] = "draft_model" if config.get("model") is not None else None
        if config["method"] not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {config['method']!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens (k >= 1)")
        check_count("num_speculative_tokens", config["num_speculative_tokens"], minimum=1)
        spec = cls(**config)
        check_count("prompt_lookup_min", spec.prompt_lookup_min, minimum=1)
        check_count("prompt_lookup_max", spec.prompt_lookup_max, minimum=spec.prompt_lookup_min)
        if spec.method == "ngram" and spec.model is not None:
            raise ValueError("speculative_config: the ngram method uses no model; drop 'model'")
        return spec


# -- a speculative step, around the forward pass -------------------------------------------------
def propose_drafts(proposer, scheduler, out, max_model_len: int):
    """Drafts for every decoding sequence of step ``out``, booked in the pool with
    ``scheduler.add_draft_tokens`` and padded with -1 up to k, so that the step stays uniform
    (k + 1 tokens per sequence: a CUDA graph on a GPU), or fewer where ``max_model_len`` or the
    whole cache leaves fewer slots, and none for a sequence that forks samples. Returns the proposer's probabilities,
    a row per decoding sequence in step order (None for deterministic drafts)."""
    items = [s for s in out.scheduled if not s.is_prefill]
    if not items:
        return None
    k = scheduler.num_lookahead_tokens
    pool = scheduler.pool        # a draft needs a slot: fewer drafts near the context's or the cache's end
    limit = min(max_model_len, pool.num_blocks * pool.block_size)
    # A prompt whose last token is all its chunk left looks like a decode; if it forks samples
    # this step (n > 1), each of them samples its own token: no drafts for it.
    room = [0 if s.forks else max(0, min(k, limit - s.seq.num_tokens)) for s in items]
    drafts, probs = proposer.propose([s.seq for s in items], room)
    if any(drafts):
        for item, d, r in zip(items, drafts, room):
            if r:
                scheduler.add_draft_tokens(out, item, d + [-1] * (r - len(d)))
    return probs


def verify_drafts(out, logits, draft_probs, rejection_sampler=rejection_sample) -> list[tuple[list[int], list[float]]]:
    """Rejection sampling for step ``out``'s sequences that verify drafts (in step order):
    ``(tokens, logprobs)`` each. ``logits`` are the step's rows (``ScheduledSequence.num_logits``
    per sequence), ``draft_probs`` what :func:`propose_drafts` returned."""
    starts = itertools.accumulate([s.num_logits + len(s.forks) for s in out.scheduled], initial=0)
    start_of = {id(s): r for s, r in zip(out.scheduled, starts)}
    draft_row = {id(s): i for i, s in enumerate(s for s in out.scheduled if not s.is_prefill)}
    items = [s for s in out.scheduled if s.spec_token_ids]
    results = {}
    for k in sorted({len(s.spec_token_ids) for s in items}):      # one group unless near max_model_len
        group = [s for s in items if len(s.spec_token_ids) == k]
        if len(group) * (k + 1) == len(logits):                     # the whole step: no gather
            scores = logits.view(len(group), k + 1, -1)
        else:
            index = [start_of[id(s)] + j for s in group for j in range(k + 1)]
            scores = logits[torch.tensor(index, device=logits.device)].view(len(group), k + 1, -1)
        params = [s.seq.params for s in group]
        if rejection_sampler is rejection_sample and all(p.temperature < GREEDY_TEMPERATURE for p in params):
            # greedy: the same result as rejection sampling, decided on the host from the
            # target's choices (one copy from the device, no random numbers)
            best = scores.log_softmax(dim=-1).max(dim=-1)          # the choices and their logprobs
            choices, lps = torch.stack((best.indices.double(), best.values.double())).tolist()
            for s, choice, lp in zip(group, choices, lps):
                tokens = greedy_accept(s.spec_token_ids, choice)
                results[id(s)] = (tokens, lp[:len(tokens)])
            continue
        rep = lambda values: [v for v in values for _ in range(k + 1)]  # noqa: E731
        target = sampling_probs(scores.flatten(0, 1), rep([p.temperature for p in params]),
                                rep([p.top_k for p in params]), rep([p.top_p for p in params]))
        q = None if draft_probs is None else draft_probs[[draft_row[id(s)] for s in group], :k]
        drafts = torch.tensor([s.spec_token_ids for s in group], device=logits.device)
        emitted = rejection_sampler(drafts, q, target.view(len(group), k + 1, -1), [s.seq.generator for s in group])
        emitted = torch.as_tensor(emitted, device=logits.device)    # a plug-in sampler may answer on the host
        lps = scores.log_softmax(dim=-1).gather(2, emitted.clamp(min=0)[..., None]).squeeze(2)
        for s, t_row, lp_row in zip(group, *torch.stack((emitted.double(), lps.double())).tolist()):
            n = sum(t >= 0 for t in t_row)
            results[id(s)] = ([int(t) for t in t_row[:n]], lp_row[:n])
    return [results[id(s)] for s in items]


def record_verification(out, tokens, proposer, stats) -> None:
    """After ``scheduler.update``: roll each verifying sequence's draft cache back to what was
    kept, and count its drafts proposed and kept in ``stats``."""
    emitted = {id(seq): t for seq, t in zip(out.sample_seqs, tokens)}
    for item in out.scheduled:
        if item.spec_token_ids:
            proposer.rollback(item.seq)
            stats.record(item.spec_token_ids, len(emitted[id(item.seq)]) - 1)


# -- n-gram (prompt lookup) ----------------------------------------------------------------------
def propose_ngram(token_ids, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                  prompt_lookup_max: int = 4) -> list[int]:
    """Up to ``num_speculative_tokens`` drafts for a sequence of ``token_ids``: the tokens that
    followed the most recent earlier occurrence of its last n tokens, trying the longest n in
    ``prompt_lookup_max .. prompt_lookup_min`` first; [] if no suffix occurs earlier."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    last = len(tokens) - 1
    if last < 1:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])      # earlier copies of the last token
    matched = np.ones(len(ends), dtype=np.int64)          # how far each copy's match reaches back
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, min(prompt_lookup_max, last)):   # a copy ends at last - 1 at most
        alive &= ends >= m
        alive[alive] = tokens[ends[alive] - m] == tokens[last - m]
        matched += alive
    n = min(int(matched.max(initial=0)), prompt_lookup_max)
    if n < prompt_lookup_min:
        return []
    start = int(ends[matched >= n][-1]) + 1                # the most recent of the longest
    return tokens[start:start + num_speculative_tokens].tolist()


class NgramProposer:
    """Drafts from the sequence's own tokens (no model, no cache, deterministic).

    The same drafts as :func:`propose_ngram`, from an index kept per sequence and grown with
    its tokens (every n-gram, n <= ``prompt_lookup_max``, mapped to where it last ended), so a
    step looks its suffixes up instead of scanning the whole sequence.
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.index: dict[int, tuple[int, dict]] = {}    # seq_id -> (tokens indexed, n-gram -> end)

    def propose(self, seqs, room: list[int]):
        """``(drafts per sequence, None)``: at most ``room[i]`` drafts for ``seqs[i]``; None
        because deterministic drafts have one-hot probabilities."""
        return [self._propose(s, min(r, self.config.num_speculative_tokens)) for s, r in zip(seqs, room)], None

    def _propose(self, seq, k: int) -> list[int]:
        tokens, c = seq.token_ids, self.config
        ends = self._grow(seq.seq_id, tokens)
        for n in range(min(c.prompt_lookup_max, len(tokens) - 1), c.prompt_lookup_min - 1, -1):
            end = ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []

    def _grow(self, seq_id, tokens) -> dict:
        """Index the n-grams ending before the last token (each is followed by one at least)."""
        done, ends = self.index.get(seq_id, (0, {}))
        for end in range(done, len(tokens) - 1):
            for n in range(1, min(self.config.prompt_lookup_max, end + 1) + 1):
                ends[tuple(tokens[end - n + 1:end + 1])] = end
        self.index[seq_id] = (max(done, len(tokens) - 1), ends)
        return ends

    def rollback(self, seq) -> None:
        pass

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.index.pop(seq_id, None)


class DraftModelProposer:
    """A small model proposes k tokens per sequence on its own paged KV cache.

    ``runner`` is a :class:`~kvlab.engine.model_runner.ModelRunner` of the draft model, with
    as many blocks as the target's cache (the draft never holds more tokens than the target,
    plus k - 1). The draft's pool tracks, per sequence, the positions whose draft K/V exists.
    """

    def __init__(self, config: SpeculativeConfig, runner):
        self.k = config.num_speculative_tokens
        self.runner = runner
        runner.capture_uniform_graphs(2)     # the first draft forward of a step feeds two tokens
        self.pool = BlockPool(runner.num_blocks, runner.block_size)
        self.fed: dict[int, tuple[int, list[int]]] = {}   # seq_id -> (its length then, drafts fed back)

    @torch.inference_mode()
    def propose(self, seqs, room: list[int]):
        """``(drafts, q)``: k drafts for each sequence that has room for k (others get []), and
        ``q`` [len(seqs), k, vocab], the distributions they were drawn from (zeros for rows
        without drafts), or None when every draft is greedy (one-hot)."""
        starts = {i: self._book(seqs[i]) for i, r in enumerate(room) if r >= self.k}
        rows = [i for i, start in starts.items() if start is not None]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not rows:
            return drafts, None
        chosen = [seqs[i] for i in rows]
        greedy = all(s.params.temperature < GREEDY_TEMPERATURE for s in chosen)
        q = None if greedy else torch.zeros(len(seqs), self.k, self.runner.config.vocab_size,
                                            device=self.runner.device)
        # Feed what the draft has not seen, and at least the last two tokens: after a step the
        # draft lacks one or two of them, so every sequence it knows feeds two (one uniform
        # step, a CUDA graph on a GPU); rewriting a slot it had writes the same K/V.
        at = [min(starts[i], max(0, seqs[i].num_tokens - 2)) for i in rows]
        new = [s.token_ids[start:] for s, start in zip(chosen, at)]
        for j in range(self.k):
            logits = self._forward(chosen, at, new)
            if greedy:                   # a greedy draft is deterministic: its q is one-hot
                tokens = logits.argmax(dim=-1).tolist()
            else:
                probs = self._probs(logits, chosen)
                tokens = self._draw(probs, chosen)
                q[rows, j] = probs
            for i, t in zip(rows, tokens):
                drafts[i].append(t)
            at = [start + len(n) for start, n in zip(at, new)]
            new = [[t] for t in tokens]
        for i in rows:
            self.fed[seqs[i].seq_id] = (seqs[i].num_tokens, drafts[i][:-1])
        return drafts, q

    def _book(self, seq) -> int | None:
        """Book the slots this proposal writes: the sequence's tokens the draft has not seen,
        then k - 1 drafts. Returns the first unseen position (None: no room, no drafts)."""
        seen = self.pool.seq_len(seq.seq_id) if seq.seq_id in self.pool else None
        total = seq.num_tokens + self.k - 1
        try:
            if seen is None:
                self.pool.allocate(seq.seq_id, total)
            else:
                self.pool.append(seq.seq_id, total - seen)
        except OutOfBlocksError:
            self.forget([seq.seq_id])
            return None
        return seen or 0

    def _forward(self, seqs, starts, new) -> torch.Tensor:
        """One draft forward over each sequence's ``new`` tokens; the logits of each one's last."""
        tables = [self.pool.block_table(s.seq_id) for s in seqs]
        query_lens = [len(n) for n in new]
        ids = [t for n in new for t in n]
        positions = [p for start, n in zip(starts, new) for p in range(start, start + len(n))]
        slots = [slot for s, start, n in zip(seqs, starts, new)
                 for slot in self.pool.slot_mapping(s.seq_id, start, len(n))]
        ends = np.cumsum(query_lens) - 1
        return self.runner.run(ids, positions, tables, starts, query_lens, slots, ends.tolist())

    @staticmethod
    def _probs(logits, seqs) -> torch.Tensor:
        p = [s.params for s in seqs]
        return sampling_probs(logits, [x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p])

    @staticmethod
    def _draw(probs, seqs) -> list[int]:
        """A draft token per row: the argmax for greedy requests, else a draw with the
        request's generator."""
        tokens = probs.argmax(dim=-1)
        for i, s in enumerate(seqs):
            if s.params.temperature >= GREEDY_TEMPERATURE:
                tokens[i] = torch.multinomial(probs[i], 1, generator=s.generator)[0]
        return tokens.tolist()

    def rollback(self, seq) -> None:
        """Cut the draft's cache of ``seq`` back to the tokens it fed that ``seq`` kept."""
        if seq.seq_id not in self.fed or seq.seq_id not in self.pool:
            return
        length, fed = self.fed.pop(seq.seq_id)
        kept = 0
        for token, actual in zip(fed, seq.token_ids[length:]):
            if token != actual:
                break
            kept += 1
        self.pool.truncate(seq.seq_id, length + kept)

    def forget(self, seq_ids) -> None:
        """The sequences ended or were preempted: free their draft blocks."""
        for seq_id in seq_ids:
            self.fed.pop(seq_id, None)
            if seq_id in self.pool:
                self.pool.free(seq_id)
