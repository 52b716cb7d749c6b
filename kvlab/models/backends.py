"""Paged-attention backends: where an engine step meets the course's attention kernels.

A backend is a function ``fn(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
sm_scale)`` that returns the attention of a step's packed queries ``q [num_tokens,
num_heads, head_dim]`` to their sequences' paged K/V (one layer's caches, ``[num_blocks,
block_size, num_kv_heads, head_dim]``, already holding the step's new tokens). Two come with
the course:

* ``"reference"``: :func:`kvlab.reference.paged_attention_ref`, gather then attend, one
  sequence at a time, in PyTorch: the obvious version, which tests compare against;
* ``"torch"``: the same in one batch (every sequence's keys gathered into one padded tensor,
  one masked ``scaled_dot_product_attention``): the CPU profile's engine runs this;
* ``"triton"``: the course's kernels. A **decode** step (one query per sequence) goes to
  :func:`~kvlab.kernels.paged_decode` (FlashDecoding, chapter 6); every other step (prompts,
  chunks, speculative verification) to :func:`~kvlab.kernels.paged_prefill` (chapter 5), except
  some **uniform** steps (speculative verification of q = k + 1 tokens per sequence): their q
  queries per sequence go to ``paged_decode`` as q rows of one token each, row ``j`` reading
  ``seq_len - q + 1 + j`` keys, which is the causal mask (SGLang verifies the same way). See
  :func:`verify_with_paged_decode` for when.

A learner's own backend plugs in by name (:func:`register_attention_backend`) or as the
function itself: ``LLM(attention_backend=my_fn)``. Decode steps replay CUDA graphs only through
a backend marked ``fn.cuda_graph_safe = True`` (it reads nothing back to the host); any other
runs eagerly. Keyword parameters of the function named
like one of :data:`HINTS` receive what the engine knows about the step up front (so a kernel
needs no read back to the host): the step's phase, the longest sequence and query, the
queries' offsets, the split count a CUDA graph fixed, and the new tokens' K/V.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from kvlab.kernel_plan import num_sms
from kvlab.quantization import dequantize_kv
from kvlab.reference import paged_attention_ref

# What a backend can receive beyond the seven positional arguments, each only if its signature
# names it (see AttentionContext for their meaning).
HINTS = ("phase", "max_seq_len", "max_query_len", "cu_query_lens", "num_splits", "k_new", "v_new",
         "k_scale", "v_scale")


def reference_backend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *, k_scale=None,
                      v_scale=None):
    if k_scale is not None:     # a quantised cache: the reference dequantises the whole layer first
        k_cache, v_cache = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
    out = paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_lens, causal=True,
                              sm_scale=sm_scale, dtype=torch.float32)
    return out.to(q.dtype)


def torch_backend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *, max_seq_len=None,
                  max_query_len=None, cu_query_lens=None, k_scale=None, v_scale=None):
    """Gather-then-attend for the whole batch at once (padded to the longest sequence). A
    quantised cache is dequantised as it is gathered (only the slots the batch reads)."""
    batch, num_heads, head_dim = seq_lens.shape[0], q.shape[1], q.shape[2]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    plan = _batch_plan(block_tables, seq_lens, query_lens, k_cache.shape[1], q.shape[0], max_seq_len,
                       max_query_len, cu_query_lens, dtype)
    k, v = (_gather(cache, plan, batch, scale, dtype).transpose(1, 2)
            for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)))
    if plan.rows is None:       # every sequence has max_query_len queries: the packed rows as they are
        qp = q.view(batch, -1, num_heads, head_dim)
    else:
        qp = q[plan.rows]
    out = torch.nn.functional.scaled_dot_product_attention(_as(qp.transpose(1, 2), dtype), k, v, attn_mask=plan.mask,
                                                           scale=sm_scale, enable_gqa=True).transpose(1, 2)
    out = out.reshape(-1, num_heads, head_dim) if plan.rows is None else out[plan.real]
    return _as(out, q.dtype)                                                          # [num_tokens, H, D]


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without the call when ``x`` already has it (each call costs a few us)."""
    return x if x.dtype == dtype else x.to(dtype)


def _gather(cache, plan, batch: int, scale=None, dtype=torch.float32) -> torch.Tensor:
    """One layer's K (or V) of every sequence side by side, ``[batch, L, num_kv_heads, head_dim]``
    in ``dtype``; with ``scale`` (a quantised cache) the gathered values are dequantised."""
    if scale is None:
        rows = _as(cache.flatten(0, 1).index_select(0, plan.slots), dtype)               # [B * L, KV, D]
    else:       # float8 is gathered as bytes: not every device indexes float8 tensors
        values = cache.view(torch.uint8).flatten(0, 1).index_select(0, plan.slots).view(cache.dtype)
        rows = dequantize_kv(values, scale.flatten(0, 1).index_select(0, plan.slots), dtype)
    return rows.view(batch, -1, *cache.shape[2:])


@dataclass(frozen=True)
class BatchPlan:
    """Where a step's padded batch comes from: the same in every layer, so made once per step."""

    slots: torch.Tensor          # [B * L] the cache slot of each gathered key, each sequence's L side by side
    mask: torch.Tensor           # [B, 1, Qmax, L] added to the scores: 0 where a query sees the key, else -inf
    rows: torch.Tensor | None    # [B, Qmax] packed row of each padded query; None: no padding
    real: torch.Tensor | None    # [B, Qmax] which padded queries are real


_last_plan: tuple = ((), None)     # (what it was made from, the plan)


def _batch_plan(block_tables, seq_lens, query_lens, block_size, num_tokens, max_seq_len, max_query_len,
                cu_query_lens, dtype=torch.float32) -> BatchPlan:
    """The indices and masks of a step's padded batch, the same in every layer: made once per step.
    Every layer of a step hands the same tensor objects (a context builds new ones per step and
    this backend is never replayed from a CUDA graph, so none is changed in place meanwhile)."""
    global _last_plan
    made_for, plan = _last_plan
    if made_for and made_for[3:] == (num_tokens, dtype) and all(a is b for a, b in zip(made_for, (
            block_tables, seq_lens, query_lens))):
        return plan
    key = (block_tables, seq_lens, query_lens, num_tokens, dtype)
    batch = seq_lens.shape[0]
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    max_query_len = int(query_lens.max()) if max_query_len is None else max_query_len
    if cu_query_lens is None:
        cu_query_lens = torch.nn.functional.pad(query_lens.cumsum(0), (1, 0))
    pages = block_tables[:, :-(-max_seq_len // block_size)].long()                    # [B, P]
    i = torch.arange(max_query_len, device=seq_lens.device)
    j = torch.arange(pages.shape[1] * block_size, device=seq_lens.device)                # key index, [L]
    slots = (pages[:, :, None] * block_size + torch.arange(block_size, device=pages.device)).flatten(1)  # [B, L]
    # Slots past a sequence's end may hold anything, NaN included, and a masked key's zero weight
    # times a NaN value is still NaN: they are read from the sequence's first slot instead (a real
    # key and value, which the mask gives no weight).
    slots = torch.where(j >= seq_lens.view(-1, 1), slots.narrow(1, 0, 1), slots)
    # Bottom-right causal: query i of b sees keys 0 .. seq_len - query_len + i. The mask is
    # additive, in the dtype of the scores (what SDPA would make of a bool mask on every call).
    last_key = (seq_lens - query_lens).view(-1, 1) + i                                  # [B, Qmax]
    sees = j <= last_key.view(batch, 1, max_query_len, 1)                               # [B, 1, Qmax, L]
    mask = torch.full(sees.shape, float("-inf"), dtype=dtype, device=sees.device).masked_fill_(sees, 0.0)
    rows = real = None
    if num_tokens != batch * max_query_len:
        # Query i of sequence b is packed row cu[b] + i (rows past its query_len are padding).
        rows = (cu_query_lens[:-1, None] + i).clamp(max=num_tokens - 1)
        real = i < query_lens[:, None]
    plan = BatchPlan(slots.flatten(), mask, rows, real)
    _last_plan = (key, plan)
    return plan


#: Verify through paged_decode where :func:`verify_with_paged_decode` says so (False: never).
SPLIT_KV_VERIFY = True
VERIFY_QUERY_TILE = 64      # the query tokens of one paged_prefill program (its smallest BLOCK_M)


def verify_with_paged_decode(batch: int, query_len: int, num_heads: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a uniform step runs faster as ``batch * query_len`` decode rows.

    ``paged_prefill`` runs one program per (query tile, sequence, query head): for a short
    query (verifying k + 1 drafts) and few sequences that is fewer programs than the GPU has
    SMs, where the split-KV decode kernel fills them all. It also reads a sequence's K/V once
    per query head of a GQA group, the decode rows once per query token: with fewer query
    tokens than group heads, the rows read less. (H200, 8B-shaped model, group 4: verification
    of 6 tokens at batch 1 costs 1.10x a decode step this way, 1.26x through paged_prefill; at
    batch 8 the rows lose from q = 5 on; benchmarks/RESULTS.md.) A long query, such as a lone
    prompt, fills the GPU through its query tiles, and as rows it would read all of its K/V
    once per token: never.
    """
    programs = batch * num_heads * -(-query_len // VERIFY_QUERY_TILE)
    return SPLIT_KV_VERIFY and (programs < num_sms or query_len < num_heads // num_kv_heads)


def reads_new_kv(max_seq_len: int | None, max_query_len: int | None) -> bool:
    """Whether ``paged_prefill`` is handed the step's own K/V (``k_new``/``v_new``).

    With them it reads the new tokens' keys as whole TMA tiles and only a cached prefix through
    the block table: the fastest way for fresh prompts (0.93-0.98 of the contiguous kernel on an
    H200, against 0.83-0.87 reading every key through the table). When a sequence extends a
    cached prefix the extra pass over the new keys costs more than it saves (extends: 0.83-0.91
    against 0.84-0.94 through the table; benchmarks/RESULTS.md). A step whose longest sequence
    is no longer than its longest query is fresh prompts only.
    """
    return max_seq_len is not None and max_query_len is not None and max_seq_len <= max_query_len


def triton_backend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *, phase="mixed",
                   max_seq_len=None, max_query_len=None, cu_query_lens=None, num_splits=None, k_new=None,
                   v_new=None, k_scale=None, v_scale=None):
    """The course's kernels; the engine built the arguments, so they are not checked again.

    A quantised cache (``k_scale``/``v_scale``): both kernels read its codes and dequantise in
    registers. Every key then comes from the cache, the step's own included (``k_new``/``v_new``
    are not used): the new tokens are seen as the cache holds them, as every later step and the
    reference backend see them."""
    from kvlab.kernels import paged_decode, paged_prefill   # here: kvlab.models loads without Triton

    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    if phase == "decode":
        return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, num_splits, sm_scale,
                            max_seq_len=max_seq_len, validate=False, **scales)
    batch, num_heads = seq_lens.shape[0], q.shape[1]
    if phase == "uniform" and max_query_len and (verify_with_paged_decode(
            batch, max_query_len, num_heads, k_cache.shape[2], num_sms(q.device))):
        rows = torch.arange(1 - max_query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
        return paged_decode(q, k_cache, v_cache, block_tables.repeat_interleave(max_query_len, dim=0),
                            (seq_lens[:, None] + rows).flatten(), None, sm_scale,
                            max_seq_len=max_seq_len or int(seq_lens.max()), validate=False, **scales)
    if scales or not reads_new_kv(max_seq_len, max_query_len):
        k_new = v_new = None
    return paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, k_new=k_new,
                         v_new=v_new, max_query_len=max_query_len, max_seq_len=max_seq_len,
                         cu_query_lens=cu_query_lens, validate=False, **scales)


# A backend that reads nothing back to the host can be recorded in a CUDA graph; one that does
# (the references read the lengths) runs eagerly. Mark your own with ``fn.cuda_graph_safe = True``.
triton_backend.cuda_graph_safe = True


_REGISTRY: dict[str, Callable] = {"reference": reference_backend, "torch": torch_backend,
                                  "triton": triton_backend}


@dataclass(frozen=True)
class AttentionBackend:
    """A backend function, and which of the :data:`HINTS` its signature takes."""

    name: str
    fn: Callable
    hints: frozenset

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether a step through it can be captured as a CUDA graph (no reads to the host)."""
        return bool(getattr(self.fn, "cuda_graph_safe", False))

    def __call__(self, q, k_cache, v_cache, sm_scale, ctx, **extra) -> torch.Tensor:
        """Attend through ``ctx`` (an :class:`~kvlab.models.context.AttentionContext`);
        ``extra`` holds the layer's own hints (``k_new``, ``v_new``)."""
        if "k_scale" in extra and "k_scale" not in self.hints:
            raise ValueError(f"attention backend {self.name!r} cannot read a quantised KV cache "
                             f"(kv_cache_dtype={ctx.kv_cache.kv_cache_dtype!r}): its signature must take "
                             f"k_scale and v_scale")
        known = dict(ctx.hints(), **extra)
        taken = {name: known[name] for name in self.hints if name in known}
        return self.fn(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.query_lens, sm_scale, **taken)


def register_attention_backend(name: str, fn: Callable) -> None:
    """Make ``fn(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale)`` selectable
    by ``name``. ``q`` is ``[num_tokens, num_heads, head_dim]``, the caches one layer's
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; it returns ``q``'s shape and dtype.
    Keyword parameters named like the :data:`HINTS` receive them."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend's name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise TypeError(f"an attention backend must be callable, got {type(fn).__name__}")
    _REGISTRY[name] = fn


def attention_backends() -> list[str]:
    """The registered backends' names."""
    return list(_REGISTRY)


def get_attention_backend(backend="reference") -> AttentionBackend:
    """An :class:`AttentionBackend` from a registered name or a function with the signature."""
    if isinstance(backend, AttentionBackend):
        return backend
    if isinstance(backend, str):
        if backend not in _REGISTRY:
            raise ValueError(f"unknown attention backend {backend!r}; registered: {', '.join(_REGISTRY)}")
        return AttentionBackend(backend, _REGISTRY[backend], _hints_taken(_REGISTRY[backend]))
    if callable(backend):
        return AttentionBackend(getattr(backend, "__name__", "custom"), backend, _hints_taken(backend))
    raise TypeError(f"attention_backend must be a registered name or a function, got {type(backend).__name__}")


def _hints_taken(fn) -> frozenset:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for name in HINTS if name in params)
