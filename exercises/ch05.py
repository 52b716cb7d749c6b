"""Chapter 5 exercises: FlashAttention's online softmax, and the tiles a causal block needs.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch05                                 # in a terminal
    kvlab.check("ch05")                              # in the notebook
    pytest tests/graded -m ch05 --impl=exercises     # the same tests, raw

Tasks: ``chunked_attention`` (attention over chunks of keys with a running softmax, in
PyTorch), ``online_softmax`` (``online_softmax_update``, the loop body of the given Triton kernel
``attention_kernel`` in ``kvlab/scaffold/ch05.py``), ``causal_bounds`` (``causal_tile_bounds``).
Then ``use_my_attention`` (given) serves text from the engine with your pieces as its attention.
Stuck? ``kvlab.use_solution("ch05")`` swaps in the answer and keeps yours as
``exercises/ch05_mine.py``.
"""
import math

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

# Given (not a task), shared with solutions/ch05.py: read kvlab/scaffold/ch05.py.
from kvlab.scaffold.ch05 import PIECES, attention_kernel, attention_with, my_attention_user  # noqa: F401


# -- task chunked_attention ------------------------------------------------------------------
def chunked_attention(q, k, v, block_n: int, causal: bool = True, sm_scale: float | None = None):
    """Softmax attention of one head, ``block_n`` keys at a time; returns ``[num_q, head_dim]`` float32.

    ``q`` is ``[num_q, head_dim]``, ``k`` and ``v`` ``[num_k, head_dim]``. With ``causal`` the
    queries are the *last* ``num_q`` positions of the sequence: query ``i`` sees keys
    ``0 .. num_k - num_q + i``. ``sm_scale`` defaults to ``1 / sqrt(head_dim)``.

    Keep, for every query row, a running max ``m`` of its scores, a running sum ``l`` of
    ``exp(score - m)`` and an accumulator ``acc`` of ``exp(score - m) * v``, and fold the keys in
    chunk by chunk. The full ``[num_q, num_k]`` score matrix must never exist: the grader
    measures the memory your function allocates. Mask hidden keys with ``-inf``.
    """
    raise NotImplementedError("chunked_attention: for each chunk of keys, compute its scores, raise the running "
                              "max, rescale l and acc by exp(m_old - m_new), then add the chunk's terms; "
                              "divide acc by l at the end")


# -- task online_softmax ---------------------------------------------------------------------
@triton.jit
def online_softmax_update(acc, m_i, l_i, s, v):
    """Fold one tile of keys into the running softmax of ``BLOCK_M`` query rows.

    * ``s`` ``[BLOCK_M, BLOCK_N]`` float32: the tile's scores, already scaled; a key a row must
      not see is ``-inf``.
    * ``v`` ``[BLOCK_N, HEAD_DIM]`` float32: the tile's values (rows past the last key are 0).
    * ``m_i`` ``[BLOCK_M]``: each row's running max (``-inf`` before the first tile);
      ``l_i`` ``[BLOCK_M]``: its running sum of ``exp(score - m_i)``;
      ``acc`` ``[BLOCK_M, HEAD_DIM]``: its running sum of ``exp(score - m_i) * v``.

    Return the updated ``(acc, m_i, l_i)``. ``attention_kernel`` calls it once per tile, in key
    order, and divides ``acc`` by ``l_i`` at the end. Every query sees key 0, which is in the
    first tile, so ``m_i`` is finite from the first call on. Useful: ``tl.max(x, 1)``,
    ``tl.sum(x, 1)``, ``tl.maximum``, ``tl.exp``, ``tl.dot(p, v)``, ``x[:, None]``. In the
    interpreter you can ``print`` inside it. (If you add a mask: a block ``&`` a scalar condition
    is refused by Triton 3.9's CPU interpreter, "mask has unsupported dtype"; use ``tl.where``
    on the scalar, e.g. ``cols < tl.where(ok, N, 0)``, so the mask is one comparison.)
    """
    raise NotImplementedError("online_softmax_update: raise the running max, rescale the past (l_i and acc) "
                              "by alpha = exp(m_old - m_new), then add this tile's exp(s - m_new) terms")


# Given: attention(q, k, v, causal=True, sm_scale=None, out=None, block_m=16, block_n=16) runs
# attention_kernel, which calls your online_softmax_update once per tile of keys.
attention = attention_with(online_softmax_update)


# -- task causal_bounds ----------------------------------------------------------------------
def causal_tile_bounds(start_m: int, len_q: int, len_k: int, block_m: int, block_n: int,
                       causal: bool = True) -> tuple[int, int]:
    """The keys that the queries ``start_m .. start_m + block_m - 1`` need, as ``(full_end, end)``.

    * ``full_end``: the largest multiple of ``block_n`` such that *every* query of the block
      sees every key below it (those tiles need no mask);
    * ``end``: one past the last key that *any* query of the block sees (tiles from
      ``full_end`` up to ``end`` run with a mask; keys from ``end`` on are never loaded).

    Only queries below ``len_q`` count (the last block may be ragged). Causal attention is
    bottom-right aligned: query ``i`` sees keys ``0 .. i + len_k - len_q``; without ``causal``
    every query sees all ``len_k`` keys. Raise ValueError when ``causal`` and ``len_q > len_k``.
    """
    raise NotImplementedError("causal_tile_bounds: which keys does the block's first query see, and its last? "
                              "Round the first count down to whole tiles")


# Given: use_my_attention(pieces=PIECES, **settings), an LLM whose attention backend runs your pieces.
use_my_attention = my_attention_user(chunked_attention, attention, causal_tile_bounds)
