"""Chapter 5 answers: the same names and signatures as ``exercises/ch05.py``."""
import math

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

# Given (not a task), shared with exercises/ch05.py: read kvlab/scaffold/ch05.py.
from kvlab.scaffold.ch05 import PIECES, attention_kernel, attention_with, my_attention_user  # noqa: F401


# -- task chunked_attention ------------------------------------------------------------------
def chunked_attention(q, k, v, block_n: int, causal: bool = True, sm_scale: float | None = None):
    """Softmax attention of one head, ``block_n`` keys at a time; returns ``[num_q, head_dim]`` float32."""
    num_q, head_dim = q.shape
    num_k = k.shape[0]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    q = q.float() * scale
    m = torch.full((num_q,), float("-inf"), device=q.device)
    l = torch.zeros(num_q, device=q.device)
    acc = torch.zeros(num_q, head_dim, device=q.device)
    # query i sits at position num_k - num_q + i
    q_pos = torch.arange(num_k - num_q, num_k, device=q.device)[:, None]
    for start in range(0, num_k, block_n):
        k_tile, v_tile = k[start:start + block_n].float(), v[start:start + block_n].float()
        s = q @ k_tile.T                                        # [num_q, block_n]: the only scores held
        if causal:
            k_pos = torch.arange(start, start + k_tile.shape[0], device=q.device)[None, :]
            s = s.masked_fill(k_pos > q_pos, float("-inf"))
        m_new = torch.maximum(m, s.max(dim=1).values)
        # A row that has seen no key yet keeps m = -inf: measure against 0 so exp gives 0, not NaN.
        base = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - base)
        p = torch.exp(s - base[:, None])
        l = l * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v_tile
        m = m_new
    return acc / l[:, None]


# -- task online_softmax ---------------------------------------------------------------------
@triton.jit
def online_softmax_update(acc, m_i, l_i, s, v):
    """Fold one tile of keys into the running softmax of ``BLOCK_M`` query rows."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)              # 0 on the first tile (m_i = -inf)
    p = tl.exp(s - m_new[:, None])           # masked keys: exp(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, m_new, l_i


# Given: attention(q, k, v, ...) runs attention_kernel with online_softmax_update.
attention = attention_with(online_softmax_update)


# -- task causal_bounds ----------------------------------------------------------------------
def causal_tile_bounds(start_m: int, len_q: int, len_k: int, block_m: int, block_n: int,
                       causal: bool = True) -> tuple[int, int]:
    """The keys that the queries ``start_m .. start_m + block_m - 1`` need, as ``(full_end, end)``."""
    if causal and len_q > len_k:
        raise ValueError(f"causal attention needs len_q <= len_k, got {len_q} > {len_k}")
    if not causal:
        return len_k // block_n * block_n, len_k
    shift = len_k - len_q
    first_sees = start_m + shift + 1                          # keys 0 .. start_m + shift
    last_sees = min(start_m + block_m, len_q) + shift         # the last real query of the block
    return first_sees // block_n * block_n, last_sees


# Given: use_my_attention(pieces=PIECES, **settings), an LLM whose attention backend runs your pieces.
use_my_attention = my_attention_user(chunked_attention, attention, causal_tile_bounds)
