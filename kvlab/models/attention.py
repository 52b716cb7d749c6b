"""The decoder's attention layer, and the two ways it can attend.

**Without a context** (``ctx=None``) the tokens given are one whole sequence (or, for
training, a batch ``[B, T]`` of equal-length sequences) and attention is plain causal
attention over them: nothing is cached. Parity tests and the no-cache greedy loop use this.

**With a context** (:class:`AttentionContext`) the tokens are a serving engine's step: the
new tokens of several sequences packed one after another. Each layer first writes its new
K and V into the paged cache (:func:`kvlab.kernels.write_kv` through ``slot_mapping``), then
every sequence's queries attend to *all* of that sequence's cached tokens, found through
its block table. A prefill, a decode step and a chunk of a long prompt are the same call
with different ``query_lens``.

The paged attention itself is a swappable backend: :func:`paged_attention` calls whatever
:func:`set_attention_backend` chose (``"reference"``, the plain PyTorch gather-then-attend of
:func:`kvlab.reference.paged_attention_ref`, until the course's Triton kernels register
themselves with :func:`register_attention_backend`), or ``"triton"``: the course's kernels,
``paged_decode`` for decode steps and ``paged_prefill`` otherwise.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.reference import paged_attention_ref


# -- the context of one engine step -----------------------------------------------------
@dataclass
class AttentionContext:
    """Where a step's new tokens go in the paged cache, and what each sequence attends to.

    ``slot_mapping`` (int64 ``[num_tokens]``): the physical cache slot of each new token, in
    the packed order of the step (-1: a padding token, written nowhere).
    ``block_tables`` (int ``[batch, max_blocks]``): each sequence's blocks, padded with 0.
    ``seq_lens`` (``[batch]``): tokens of each sequence in the cache *after* this step.
    ``query_lens`` (``[batch]``): new tokens of each sequence this step, packed in batch order;
    a sequence's new tokens are its last ``query_lens[i]`` positions.
    ``validate``: check ``write_kv``'s arguments on every layer (reads slots back to the host).
    ``max_seq_len``, ``max_query_len``, ``cu_query_lens`` (optional): what a kernel would
    otherwise compute from the lengths on every layer (the two maxima by a read back to the
    host); the engine knows them once per step and hands them to backends that take them.
    """

    kv_cache: object  # kvlab.paging.KVCache
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    validate: bool = True
    max_seq_len: int | None = None
    max_query_len: int | None = None
    cu_query_lens: torch.Tensor | None = None

    def hints(self) -> dict:
        return {"max_seq_len": self.max_seq_len, "max_query_len": self.max_query_len,
                "cu_query_lens": self.cu_query_lens}

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def from_pool(cls, kv_cache, pool, requests, device=None, validate: bool = True) -> "AttentionContext":
        """The context of one step from a :class:`kvlab.paging.BlockPool`.

        ``requests`` is a list of ``(seq_id, start, num_new)``: the step computes positions
        ``start .. start + num_new - 1`` of each sequence, which the pool must already hold
        (``allocate``/``append`` first). The sequence then has ``start + num_new`` cached tokens.
        """
        from kvlab.paging import batch_slot_mapping

        device = kv_cache.k.device if device is None else device
        tables = [pool.block_table(seq_id) for seq_id, _, _ in requests]
        width = max((len(t) for t in tables), default=0)
        block_tables = torch.zeros((len(tables), max(width, 1)), dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return cls(
            kv_cache=kv_cache,
            slot_mapping=batch_slot_mapping(pool, requests, device=device),
            block_tables=block_tables.to(device),
            seq_lens=torch.tensor([start + n for _, start, n in requests], dtype=torch.int32, device=device),
            query_lens=torch.tensor([n for _, _, n in requests], dtype=torch.int32, device=device),
            validate=validate,
        )


# -- paged attention backends -------------------------------------------------------------
PagedAttentionFn = Callable[..., torch.Tensor]


def _paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale):
    out = paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_lens, causal=True,
                              sm_scale=sm_scale, dtype=torch.float32)
    return out.to(q.dtype)


def _paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *,
                            max_seq_len=None, max_query_len=None, cu_query_lens=None, k_new=None, v_new=None):
    """The course's kernels: FlashDecoding when every sequence brings one token (a decode
    step), else the paged prefill/extend kernel, which reads the step's own keys from
    ``k_new``/``v_new`` and only the cached prefix through the block tables. Arguments were
    built by the engine: no checks."""
    from kvlab.kernels import paged_decode, paged_prefill

    if q.shape[0] == query_lens.shape[0]:          # one query per sequence
        return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, sm_scale=sm_scale, validate=False,
                            max_seq_len=max_seq_len)
    return paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale=sm_scale,
                         k_new=k_new, v_new=v_new, validate=False, max_query_len=max_query_len,
                         cu_query_lens=cu_query_lens)


# What a layer can hand a backend beyond the seven positional arguments, each only to the
# backends whose signature names it: the step's lengths known up front (AttentionContext.hints)
# and the new tokens' K/V, which the cache also holds.
HINTS = ("max_seq_len", "max_query_len", "cu_query_lens", "k_new", "v_new")

_BACKENDS: dict[str, PagedAttentionFn] = {"reference": _paged_attention_reference, "triton": _paged_attention_triton}
_BACKEND_HINTS: dict[str, frozenset] = {"reference": frozenset(), "triton": frozenset(HINTS)}
_active_backend = "reference"


def _hints_taken(fn) -> frozenset:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for name in HINTS if name in params)


def register_attention_backend(name: str, fn: PagedAttentionFn) -> None:
    """Make ``fn(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale)`` selectable.

    ``q`` is ``[num_tokens, num_heads, head_dim]``, the caches one layer's
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; it returns ``q``'s shape and dtype.
    Keyword parameters named like the :data:`HINTS` receive them.
    """
    if not callable(fn):
        raise TypeError(f"an attention backend must be callable, got {type(fn).__name__}")
    _BACKENDS[name] = fn
    _BACKEND_HINTS[name] = _hints_taken(fn)


def attention_backends() -> list[str]:
    return list(_BACKENDS)


def get_attention_backend() -> str:
    return _active_backend


def set_attention_backend(name: str) -> str:
    """Choose the paged-attention backend every layer uses; returns the previous one's name."""
    global _active_backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(_BACKENDS)}")
    previous, _active_backend = _active_backend, name
    return previous


@contextlib.contextmanager
def use_attention_backend(name: str):
    """``with use_attention_backend("triton"): ...`` runs the block with that backend."""
    previous = set_attention_backend(name)
    try:
        yield
    finally:
        set_attention_backend(previous)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, hints=None):
    """Attention of a packed step's queries to their sequences' paged K/V (the active backend).

    ``hints`` (a dict of :data:`HINTS`) go to the backends whose signature takes them."""
    fn = _BACKENDS[_active_backend]
    taken = _BACKEND_HINTS.get(_active_backend, frozenset())
    extra = {name: value for name, value in (hints or {}).items() if name in taken}
    return fn(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, **extra)


def causal_attention(q, k, v, sm_scale: float) -> torch.Tensor:
    """Causal attention of one sequence ``[T, H, D]`` (or a batch ``[B, T, H, D]``), no cache.

    K/V have ``num_kv_heads`` heads; each serves ``H // num_kv_heads`` query heads (GQA).
    """
    group = q.shape[-2] // k.shape[-2]
    if group > 1:
        k = k.repeat_interleave(group, dim=-2)
        v = v.repeat_interleave(group, dim=-2)
    # SDPA wants heads before tokens: [..., H, T, D]
    out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                         is_causal=True, scale=sm_scale)
    return out.transpose(-3, -2)


# -- rotary position embeddings ---------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim (the HF Llama convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., T, H, D]`` by the angles of its tokens' positions (``cos``/``sin [..., T, D]``).

    Computed in float32 and cast back to ``x``'s dtype.
    """
    xf = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


# -- the layer ---------------------------------------------------------------------------
class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, over flat packed tokens.

    Parameter names follow HF (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) so that a
    checkpoint's ``model.layers.{i}.self_attn.*`` tensors load by name.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)
        h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(h, q, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.attention_bias)
        self.o_proj = nn.Linear(q, h, bias=config.attention_out_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext | None = None) -> torch.Tensor:
        """``x [..., T, hidden]`` with ``cos``/``sin [..., T, head_dim]`` of its positions."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if ctx is None:
            out = causal_attention(q, k, v, self.sm_scale)
        else:
            if x.dim() != 2:
                raise ValueError(f"with an AttentionContext the tokens must be flat [num_tokens, hidden], "
                                 f"got {list(x.shape)}")
            from kvlab.kernels import write_kv  # imported here: kvlab.models loads without Triton

            k_cache, v_cache = ctx.kv_cache.k[self.layer_idx], ctx.kv_cache.v[self.layer_idx]
            k, v = k.to(k_cache.dtype), v.contiguous().to(v_cache.dtype)
            write_kv(k, v, k_cache, v_cache, ctx.slot_mapping, validate=ctx.validate)
            out = paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.query_lens,
                                  self.sm_scale, dict(ctx.hints(), k_new=k, v_new=v))
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))
