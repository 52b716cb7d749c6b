"""The context of one engine step: where its new tokens' K/V go, and what each sequence reads.

A step packs the new tokens of several sequences one after another. For each layer the model
needs to know where those tokens' K/V go in the paged cache (``slot_mapping``), and what every
sequence attends to (its ``block_table`` and ``seq_len``). The step's **phase** says what kind
of step it is, decided once on the host from the query lengths (never guessed from shapes
inside the model):

* ``"decode"``: one new token per sequence;
* ``"uniform"``: the same ``q > 1`` new tokens per sequence (speculative verification of
  ``k + 1`` tokens);
* ``"mixed"``: anything else: prompts, chunks of prompts, beside decodes.

Decode and uniform steps have shapes fixed by their batch size (and ``q``), so the engine can
replay them as CUDA graphs; mixed steps run eagerly.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvlab.models.backends import AttentionBackend, get_attention_backend

DECODE, UNIFORM, MIXED = "decode", "uniform", "mixed"


def step_phase(query_lens) -> str:
    """``"decode"``, ``"uniform"`` or ``"mixed"`` for a step with these new-token counts."""
    lens = set(query_lens)
    if lens == {1}:
        return DECODE
    if len(lens) == 1 and min(lens) > 1:
        return UNIFORM
    return MIXED


@dataclass
class AttentionContext:
    """Where a step's new tokens go in the paged cache, and what each sequence attends to.

    ``slot_mapping`` (int64 ``[num_tokens]``): the physical cache slot of each new token, in
    the packed order of the step (-1: a padding token, written nowhere).
    ``block_tables`` (int32 ``[batch, max_blocks]``): each sequence's blocks, padded with 0.
    ``seq_lens`` (int32 ``[batch]``): tokens of each sequence in the cache *after* this step.
    ``query_lens`` (int32 ``[batch]``): new tokens of each sequence this step, packed in batch
    order; a sequence's new tokens are its last ``query_lens[i]`` positions.
    ``phase``: ``"decode"``, ``"uniform"`` or ``"mixed"`` (see the module docstring).
    ``backend``: the paged attention every layer calls (:mod:`kvlab.models.backends`).
    ``max_seq_len``, ``max_query_len``, ``cu_query_lens``, ``num_splits``: what a kernel would
    otherwise compute from the lengths on every layer (by a read back to the host); known once
    per step, handed to the backends whose signature takes them.
    ``has_padding``: whether ``slot_mapping`` holds -1 entries (None: not known; look).
    """

    kv_cache: object  # kvlab.paging.KVCache
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    phase: str = MIXED
    backend: AttentionBackend = None
    max_seq_len: int | None = None
    max_query_len: int | None = None
    cu_query_lens: torch.Tensor | None = None
    num_splits: int | None = None
    has_padding: bool | None = None

    def __post_init__(self):
        if not isinstance(self.backend, AttentionBackend):
            self.backend = get_attention_backend(self.backend or "reference")

    def hints(self) -> dict:
        return {"phase": self.phase, "max_seq_len": self.max_seq_len, "max_query_len": self.max_query_len,
                "cu_query_lens": self.cu_query_lens, "num_splits": self.num_splits}

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def from_pool(cls, kv_cache, pool, requests, device=None, backend="reference") -> "AttentionContext":
        """The context of one step from a :class:`kvlab.paging.BlockPool`.

        ``requests`` is a list of ``(seq_id, start, num_new)``: the step computes positions
        ``start .. start + num_new - 1`` of each sequence, which the pool must already hold
        (``allocate``/``append`` first). The sequence then has ``start + num_new`` cached tokens.
        The pool's own slot mapping refuses a write into a block other sequences share, and a
        sequence may appear once.
        """
        from kvlab.paging import batch_slot_mapping

        slots = batch_slot_mapping(pool, requests).tolist()
        return build_attention_context(kv_cache, [pool.block_table(seq_id) for seq_id, _, _ in requests],
                                       [start for _, start, _ in requests], [n for _, _, n in requests],
                                       slots, backend=backend, device=device)


def build_attention_context(kv_cache, block_tables: list[list[int]], starts: list[int], query_lens: list[int],
                            slot_mapping: list[int], *, backend="reference", device=None,
                            num_splits: int | None = None) -> AttentionContext:
    """The one builder of a step's :class:`AttentionContext`, from plain host lists.

    Sequence ``i`` computes positions ``starts[i] .. starts[i] + query_lens[i] - 1`` through
    ``block_tables[i]``; ``slot_mapping`` holds the packed step's slots. Everything a kernel
    would read back from the device (the maxima, the queries' offsets) is computed here, once.
    """
    device = kv_cache.k.device if device is None else device
    seq_lens = [start + n for start, n in zip(starts, query_lens)]
    width = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    ints = lambda x, dtype=torch.int32: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
    return AttentionContext(
        kv_cache=kv_cache,
        slot_mapping=ints(slot_mapping, torch.int64),
        block_tables=ints(padded).reshape(len(block_tables), width),
        seq_lens=ints(seq_lens),
        query_lens=ints(query_lens),
        phase=step_phase(query_lens),
        backend=get_attention_backend(backend),
        max_seq_len=max(seq_lens, default=0),
        max_query_len=max(query_lens, default=0),
        cu_query_lens=ints([0, *itertools.accumulate(query_lens)]),
        num_splits=num_splits,
        has_padding=min(slot_mapping, default=0) < 0,
    )
