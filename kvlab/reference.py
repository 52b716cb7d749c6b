"""Plain PyTorch references for the course's kernels: slow, obvious, and the ground truth.

Kernel tests compare against these in float32 or float64. Shapes follow the kernels:
tokens are packed along dim 0, heads and head_dim follow (``[tokens, heads, head_dim]``).
"""
from __future__ import annotations

import math

import torch


def write_kv_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """What :func:`kvlab.kernels.write_kv` does: ``cache[slot] = token`` for every slot >= 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]


def copy_blocks_ref(caches, block_mapping) -> None:
    """What :func:`kvlab.kernels.copy_blocks` does: ``cache[..., dst, :, :, :] = cache[..., src, :, :, :]``."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in caches:
        layers = cache if cache.dim() == 5 else cache.unsqueeze(0)
        layers[:, dst] = layers[:, src]


def gather_kv(cache: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, read through its block table.

    ``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``; returns
    ``[seq_len, num_kv_heads, head_dim]``, contiguous in token order.
    """
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    table = torch.as_tensor(block_table, dtype=torch.int64, device=cache.device)[:num_blocks]
    return cache[table].reshape(-1, *cache.shape[2:])[:seq_len]


def attention_ref(q, k, v, causal: bool = True, sm_scale: float | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Softmax attention of one sequence, computed in ``dtype``.

    ``q`` is ``[num_q, num_heads, head_dim]``, ``k``/``v`` ``[num_kv, num_kv_heads, head_dim]``
    with ``num_heads`` a multiple of ``num_kv_heads`` (grouped-query attention: query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)``). With ``causal`` the queries are
    the *last* ``num_q`` positions of the sequence, so query ``i`` sees keys ``0 ..
    num_kv - num_q + i``: this covers prefill (num_q == num_kv), decode (num_q == 1) and
    extending a cached prefix.
    """
    num_q, num_heads, head_dim = q.shape
    num_kv, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    qf = q.to(dtype).transpose(0, 1)                                   # [H, num_q, D]
    kf = k.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)   # [H, num_kv, D]
    vf = v.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * sm_scale                      # [H, num_q, num_kv]
    if causal:
        q_pos = torch.arange(num_kv - num_q, num_kv, device=q.device)[:, None]
        k_pos = torch.arange(num_kv, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return (scores.softmax(dim=-1) @ vf).transpose(0, 1)               # [num_q, H, D]


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_lens=None, causal: bool = True,
                        sm_scale: float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention of a batch whose K/V live in the paged cache: gather, then attend.

    ``q`` packs every sequence's queries, ``[sum(query_lens), num_heads, head_dim]``; sequence
    ``i`` has ``seq_lens[i]`` tokens in the cache (its new tokens included) and its queries are
    its last ``query_lens[i]`` tokens (default 1 each: a decode step). ``block_tables`` is a
    list of lists or a ``[batch, max_blocks]`` tensor. Returns ``[sum(query_lens), num_heads,
    head_dim]`` in ``dtype``.
    """
    seq_lens = [int(n) for n in seq_lens]
    query_lens = [1] * len(seq_lens) if query_lens is None else [int(n) for n in query_lens]
    if len(query_lens) != len(seq_lens) or sum(query_lens) != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens, query_lens {query_lens} sum to {sum(query_lens)}")
    out, start = [], 0
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
        if q_len > seq_len:
            raise ValueError(f"a sequence has {q_len} queries but only {seq_len} cached tokens")
        k = gather_kv(k_cache, table, seq_len)
        v = gather_kv(v_cache, table, seq_len)
        out.append(attention_ref(q[start:start + q_len], k, v, causal=causal, sm_scale=sm_scale, dtype=dtype))
        start += q_len
    return torch.cat(out) if out else q.new_empty(0, *q.shape[1:], dtype=dtype)


# -- the decoder's elementwise layers: the model's own PyTorch, line for line -------------
def rms_norm_ref(x, weight, eps, residual=None):
    """What :func:`kvlab.kernels.rms_norm` does: the model's ``RMSNorm.forward``; with
    ``residual``, ``(rms_norm_ref(x + residual), x + residual)``."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


def silu_and_mul_ref(x):
    """What :func:`kvlab.kernels.silu_and_mul` does: ``F.silu(gate) * up`` of ``x = [gate | up]``."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """What :func:`kvlab.kernels.rotary_write_kv` does, in place like it: ``q`` and ``k`` rotated
    as the model's ``apply_rope`` rotates them, then :func:`write_kv_ref` of the rotated ``k``."""
    c, s = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)   # [T, 1, D]: every head
    for x in (q, k):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        x.copy_((xf * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype))
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
