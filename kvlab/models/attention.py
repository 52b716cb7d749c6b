"""The decoder's attention layer, and the two ways it can attend.

**Without a context** (``ctx=None``) the tokens given are one whole sequence (or, for
training, a batch ``[B, T]`` of equal-length sequences) and attention is plain causal
attention over them: nothing is cached. Parity tests and the no-cache greedy loop use this.

**With a context** (:class:`~kvlab.models.context.AttentionContext`) the tokens are a serving
engine's step: the new tokens of several sequences packed one after another. Each layer first
rotates its queries and keys and writes the new K and V into the paged cache through
``slot_mapping`` (:func:`~kvlab.models.ops.rope_and_write_kv`), then every sequence's queries
attend to *all* of that sequence's cached tokens, found through its block table, by the
context's backend (:mod:`kvlab.models.backends`). A prefill, a decode step and a chunk of a
long prompt are the same call with different ``query_lens``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.models import ops
from kvlab.models.context import AttentionContext
from kvlab.models.parallel import SINGLE, ParallelContext
from kvlab.models.rope import RotaryEmbedding, apply_rope


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


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, over flat packed tokens.

    Parameter names follow HF (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) so that a
    checkpoint's ``model.layers.{i}.self_attn.*`` tensors load by name. For serving,
    :meth:`fuse` merges the three input projections into one matrix product.

    With ``tp`` of size N (:mod:`kvlab.models.parallel`) it holds its rank's ``H / N`` query
    heads and ``KV / N`` KV heads; o_proj's partial sums are all-reduced.
    """

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, tp: ParallelContext = SINGLE):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = tp.divide(config.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.divide(config.num_kv_heads, "num_key_value_heads")
        self.head_dim = config.head_dim
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)
        self.rotary = rotary
        h, q, kv = config.hidden_size, self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(h, q, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.attention_bias)
        self.o_proj = nn.Linear(q, h, bias=config.attention_out_bias)
        self.qkv = None                  # (weight, bias) of the merged projection, once fused

    def fuse(self) -> None:
        """One ``[q + 2 kv, hidden]`` projection instead of three (for inference)."""
        if self.qkv is None:
            self.qkv = ops.fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor):
        """``q [..., H, D]``, ``k``, ``v [..., KV, D]``: views into one output when fused."""
        lead = x.shape[:-1]
        if self.qkv is not None:
            heads = ops.linear(x, *self.qkv).view(*lead, -1, self.head_dim)
            return heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=-2)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(*lead, self.num_heads, self.head_dim), k.view(*lead, self.num_kv_heads, self.head_dim),
                v.view(*lead, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None = None) -> torch.Tensor:
        """``x [..., T, hidden]`` with each token's position ``positions [..., T]``."""
        lead = x.shape[:-1]
        q, k, v = self.project(x)
        if ctx is None:
            cos, sin = self.rotary(positions)
            out = causal_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, self.sm_scale)
        else:
            if x.dim() != 2:
                raise ValueError(f"with an AttentionContext the tokens must be flat [num_tokens, hidden], "
                                 f"got {list(x.shape)}")
            k_cache, v_cache, k_scale, v_scale = ctx.kv_cache.layer(self.layer_idx)
            q, k = ops.rope_and_write_kv(q, k, v, positions, self.rotary, k_cache, v_cache, ctx.slot_mapping,
                                         k_scale, v_scale, has_padding=ctx.has_padding)
            scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
            out = ctx.backend(q, k_cache, v_cache, self.sm_scale, ctx, k_new=k, v_new=v, **scales)
        out = ops.linear(out.reshape(*lead, self.num_heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)
        return self.tp.all_reduce(out)
