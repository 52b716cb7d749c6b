"""Chapter 5, given: the attention kernel around your online-softmax update, its launcher, and
``use_my_attention``, which serves an ``LLM`` whose attention runs your pieces."""
import math

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

from kvlab import kernel_plan
from kvlab.engine import LLM
from kvlab.engine.spec_decode import DEFAULT_DRAFT_MODEL
from kvlab.reference import attention_ref, gather_kv
from kvlab.scaffold import check_pieces, is_written

PIECES = ("chunked_attention", "online_softmax_update", "causal_tile_bounds")
BLOCK_M = BLOCK_N = 16          # the tiles the engine's attention runs with
# The engine of the chapter's last section: the course's smaller model (4 layers, 2 query heads
# over 1 KV head), so that Triton's CPU interpreter keeps up, in float32 on a GPU too (as the given
# attention computes, so that the two engines' tokens compare); prompts go in chunks of 8 tokens,
# so most chunks extend a cached prefix (chapter 8 schedules such chunks).
ENGINE_SETTINGS = {"model": DEFAULT_DRAFT_MODEL, "dtype": "float32", "max_model_len": 128,
                   "long_prefill_token_threshold": 8}


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, len_q, len_k, group, sm_scale,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     online_softmax_update: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program computes ``BLOCK_M`` queries of one head, over tiles of ``BLOCK_N`` keys.

    ``online_softmax_update`` (a ``@triton.jit`` function, passed at launch) folds in each tile.
    """
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    kv_head = head // group                         # grouped-query attention
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=offs_m[:, None] < len_q, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = len_k - len_q                           # causal: query i sees keys 0 .. i + shift
    end = len_k
    if CAUSAL:
        end = tl.minimum(start_m + BLOCK_M + shift, len_k)
    for start_n in range(0, end, BLOCK_N):
        keys = start_n + offs_n
        k = tl.load(k_ptr + keys[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=keys[:, None] < len_k, other=0.0)
        v = tl.load(v_ptr + keys[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=keys[:, None] < len_k, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        visible = keys[None, :] < len_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v)
    out = acc / l_i[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out,
             mask=offs_m[:, None] < len_q)


def attention_with(online_softmax_update):
    """``attention(q, k, v, ...)``, launching ``attention_kernel`` with ``online_softmax_update``."""

    def attention(q, k, v, causal: bool = True, sm_scale: float | None = None, out=None,
                  block_m: int = 16, block_n: int = 16):
        """Run ``attention_kernel`` on one sequence, float32.

        ``q`` ``[num_q, num_heads, head_dim]``, ``k``/``v`` ``[num_k, num_kv_heads, head_dim]``
        (the layout of ``kvlab.reference.attention_ref``); writes into ``out`` if given.
        """
        num_q, num_heads, head_dim = q.shape
        num_k, num_kv_heads = k.shape[0], k.shape[1]
        if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
            raise TypeError(f"q, k, v must be float32, got {q.dtype}, {k.dtype}, {v.dtype}")
        if num_heads % num_kv_heads or (causal and num_q > num_k) or num_k == 0:
            raise ValueError(f"bad shapes: q {list(q.shape)}, k {list(k.shape)} (causal={causal})")
        if out is None:
            out = torch.empty_like(q)
        sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        grid = (triton.cdiv(num_q, block_m), num_heads)
        attention_kernel[grid](q, k, v, out, num_q, num_k, num_heads // num_kv_heads, sm_scale,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               out.stride(0), out.stride(1), online_softmax_update=online_softmax_update,
                               CAUSAL=bool(causal), HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n)
        return out

    return attention


def course_chunked_attention(q, k, v, block_n: int, causal: bool = True, sm_scale: float | None = None):
    """The course's stand-in for ``chunked_attention`` (same arguments): ``attention_ref`` on one head."""
    return attention_ref(q[:, None], k[:, None], v[:, None], causal=causal, sm_scale=sm_scale)[:, 0]


def attention_backend_with(chunked_attention, attention, causal_tile_bounds):
    """An attention backend (:mod:`kvlab.models.backends`) that runs chapter 5's pieces.

    For each sequence of a step, with its keys read through its block table:

    * several queries (a prompt, or a chunk of one): ``attention`` (``attention_kernel`` with an
      ``online_softmax_update``), ``BLOCK_M`` queries at a time, over the keys ``0 .. end - 1``
      of ``causal_tile_bounds``: the pages past ``end`` are never read;
    * one query (a decode step): ``chunked_attention``, one query head at a time.
    """

    def flash_backend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale):
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]                # query heads per KV head
        first = 0
        for table, seq_len, query_len in zip(block_tables.tolist(), seq_lens.tolist(), query_lens.tolist()):
            queries, rows = q[first:first + query_len].float(), out[first:first + query_len]
            first += query_len
            if query_len == 1:
                k, v = gather_kv(k_cache, table, seq_len).float(), gather_kv(v_cache, table, seq_len).float()
                for h in range(q.shape[1]):
                    rows[:, h] = chunked_attention(queries[:, h], k[:, h // group], v[:, h // group], BLOCK_N,
                                                   causal=True, sm_scale=sm_scale)
                continue
            for start_m in range(0, query_len, BLOCK_M):
                _, end = causal_tile_bounds(start_m, query_len, seq_len, BLOCK_M, BLOCK_N)
                k, v = gather_kv(k_cache, table, end).float(), gather_kv(v_cache, table, end).float()
                block = slice(start_m, start_m + BLOCK_M)
                rows[block] = attention(queries[block].contiguous(), k, v, causal=True, sm_scale=sm_scale)
        return out

    return flash_backend


def my_attention_user(chunked_attention, attention, causal_tile_bounds):
    """The function ``use_my_attention``, bound to one implementation's pieces."""

    def use_my_attention(pieces=PIECES, **settings):
        """An ``LLM`` (``settings`` as ``LLM``'s) whose attention runs your ``pieces``.

        ``pieces``: a subset of ``PIECES``; the others are the course's (``attention_ref`` for
        ``chunked_attention`` and for the kernel, ``kvlab.kernel_plan.causal_tile_bounds``). The
        backend (``attention_backend_with``) goes in through the engine's plug-in point,
        ``LLM(attention_backend=...)``.
        """
        check_pieces(pieces, PIECES)
        if "attention_backend" in settings:
            raise TypeError("use_my_attention sets attention_backend itself")
        backend = attention_backend_with(
            chunked_attention if "chunked_attention" in pieces else course_chunked_attention,
            attention if "online_softmax_update" in pieces else attention_ref,
            causal_tile_bounds if "causal_tile_bounds" in pieces else kernel_plan.causal_tile_bounds)
        return LLM(attention_backend=backend, **settings)

    return use_my_attention


def written_pieces(module) -> list[str]:
    """The ``PIECES`` of ``module`` (your ``exercises/ch05.py``) that no longer raise NotImplementedError."""
    x = torch.zeros(1, 1, 16, device=kvlab.profile.DEVICE)
    probes = {"chunked_attention": lambda: module.chunked_attention(x[0], x[0], x[0], BLOCK_N),
              "online_softmax_update": lambda: module.attention(x, x, x),
              "causal_tile_bounds": lambda: module.causal_tile_bounds(0, 1, 1, BLOCK_M, BLOCK_N)}
    return [name for name, probe in probes.items() if is_written(probe)]
