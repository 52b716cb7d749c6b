"""Chapter 5, given: the attention kernel around your online-softmax update, and its launcher."""
import math

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton
import triton.language as tl


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
