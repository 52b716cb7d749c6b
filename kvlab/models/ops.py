"""The decoder's small ops, each in two implementations: PyTorch and a fused Triton kernel.

A decode step is short: at batch 1 an 8B model's layer moves ~450 MB of weights in ~0.1 ms.
Written as plain PyTorch, RMSNorm, RoPE and SiLU-times-up are several kernels each, and a step
launches over a thousand kernels whose launch gaps cost more than their work. On a GPU the
engine therefore runs each as **one** kernel of the course's (:mod:`kvlab.kernels`):

==========================  ================================================  =====================
op                          PyTorch (the reference; CPU, training)            fused kernel (GPU)
==========================  ================================================  =====================
:func:`rms_norm`            ``x + residual``, then RMSNorm                    ``rms_norm``
:func:`silu_and_mul`        ``silu(gate) * up``                               ``silu_and_mul``
:func:`rope_and_write_kv`   RoPE on q and k, then K/V into the paged cache    ``rotary_write_kv``
:func:`linear` of one row   ``F.linear`` (cuBLAS on a GPU; oneDNN on the CPU)  ``matvec``
==========================  ================================================  =====================

The kernels have no backward pass, so they run only where no gradient is wanted (the engine
runs under ``torch.inference_mode``). In the CPU profile the PyTorch versions run: Triton's
interpreter would be far slower.

:func:`fuse_linears` merges projections that read the same input (q/k/v; gate/up) into one
matrix product.
"""
from __future__ import annotations

import torch
from torch import nn

from kvlab.models.rope import apply_rope, rotate_heads


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels run for ``x``: on a GPU, with no gradient wanted."""
    return x.is_cuda and not torch.is_grad_enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * x / rms(x)`` (statistics in float32). With ``residual``: ``s = x + residual``
    first, and ``(rms_norm(s), s)`` is returned, the residual stream carried to the next layer."""
    if use_kernels(x):
        from kvlab.kernels import rms_norm as rms_norm_kernel

        shape = x.shape          # the kernel takes rows: [tokens, hidden]
        flat = lambda t: t.reshape(-1, shape[-1])  # noqa: E731
        if residual is None:
            return rms_norm_kernel(flat(x), weight, eps, validate=False).view(shape)
        out, residual = rms_norm_kernel(flat(x), weight, eps, flat(residual), validate=False)
        return out.view(shape), residual.view(shape)
    if residual is not None:
        x = x + residual
    # Plain ops, not nn.functional.rms_norm: the same numbers, but on the CPU that one runs a
    # dozen small ops inside, and in a decode step each op starts cold (a matrix product has
    # just pushed everything else out of the caches). xf * xf is xf.pow(2), bit for bit.
    xf = x.float()
    xf = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    out = weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))
    return out if residual is None else (out, x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` from the two halves of one merged gate/up projection."""
    if use_kernels(gate_up):
        from kvlab.kernels import silu_and_mul as silu_and_mul_kernel

        out = silu_and_mul_kernel(gate_up.reshape(-1, gate_up.shape[-1]), validate=False)
        return out.view(*gate_up.shape[:-1], out.shape[-1])
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def rope_and_write_kv(q, k, v, positions, rotary, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, *,
                      has_padding: bool | None = None):
    """Rotate ``q`` and ``k`` by their tokens' positions, write ``k`` and ``v`` to the cache
    slots ``slot_mapping`` (-1: write nothing); returns the rotated ``(q, k)``. With
    ``k_scale``/``v_scale`` the cache is quantised: each (token, KV head) row is stored in the
    cache's format and its scale beside it. ``has_padding``: whether ``slot_mapping`` holds -1
    entries, if the caller knows (the step's context does); None: the CPU write looks."""
    if use_kernels(q) and k_scale is None:
        from kvlab.kernels import rotary_write_kv

        cos, sin = rotary.tables(q.device)
        rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, validate=False)
        return q, k          # rotated in place
    q, k = rope_qk(q, k, positions, rotary)
    if k_scale is not None:
        write_kv_quantized(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    elif k_cache.is_cuda:    # gradients wanted on a GPU: the plain write kernel
        from kvlab.kernels import write_kv

        write_kv(k, v.contiguous(), k_cache, v_cache, slot_mapping, validate=False)
    else:                    # the CPU: PyTorch, as write_kv would (slot -1: padding, not written)
        slots, k_rows, v_rows = slot_mapping, k, v
        if has_padding is None:
            has_padding = len(slots) > 0 and int(slots.min()) < 0
        if has_padding:
            keep = slots >= 0     # the returned k keeps every row: attention still needs them
            slots, k_rows, v_rows = slots[keep], k[keep], v[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k_rows)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v_rows)
    return q, k


def rope_qk(q, k, positions, rotary):
    """``q [T, H, D]`` and ``k [T, KV, D]`` rotated by :func:`~kvlab.models.rope.apply_rope`.
    On the CPU in float32 (the CPU engine) the same numbers come from
    :func:`~kvlab.models.rope.rotate_heads`, in fewer ops."""
    if q.is_cuda or q.dtype != torch.float32 or k.dtype != torch.float32:
        cos, sin = rotary(positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cos, signed_sin = rotary.rotation(positions)
    return rotate_heads(q, cos, signed_sin), rotate_heads(k, cos, signed_sin)


def write_kv_quantized(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Quantise and scatter a step's K/V: the Triton kernel where kernels run, else its
    PyTorch reference (bytes copied as uint8, which every device can index)."""
    if use_kernels(k):
        from kvlab.kernels import write_kv_quantized as kernel

        kernel(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, validate=False)
        return
    from kvlab.paging.kv_cache import block_and_offset
    from kvlab.quantization import quantize_kv

    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scales in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        values, scale = quantize_kv(x, cache.dtype)
        cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, values.view(torch.uint8))
        scales[block_and_offset(slots, scales.shape[1])] = scale


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. On a GPU, one half-precision row without bias goes to
    :func:`kvlab.kernels.matvec`, the rest to cuBLAS. On the CPU, in inference, through oneDNN with the weight
    reordered once into its blocked layout: at a decode step's few rows its kernel reads the
    weight about 1.4-2x faster than MKL's (the CPU engine's step is mostly these products)."""
    if use_kernels(x) and bias is None and x.numel() == x.shape[-1] and x.dtype != torch.float32 \
            and weight.dtype == x.dtype and weight.is_contiguous():
        # One row (a batch-1 decode step): the course's matrix-vector kernel reads the weight
        # faster than cuBLAS's batch-1 kernels (kvlab.kernels.matvec).
        from kvlab.kernels import matvec

        return matvec(x.reshape(-1).contiguous(), weight, validate=False).view(*x.shape[:-1], weight.shape[0])
    if x.is_cuda or torch.is_grad_enabled() or x.dtype != torch.float32 \
            or not torch.backends.mkldnn.is_available() or x.numel() == 0:
        return nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    # oneDNN picks its kernel by the layout: one for a single row, one for batches.
    packed = _onednn_weight(weight, rows=1 if flat.shape[0] == 1 else ONEDNN_BATCH)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits ``hidden @ weight.T``: the vocabulary-wide product, the largest of a decode step."""
    return linear(hidden, weight)


ONEDNN_BATCH = 64      # the batch size oneDNN lays a weight out for (any batch of 2 or more may use it)


def _onednn_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` in oneDNN's layout for products of ``rows`` rows, made once (again if it changed).
    Kept on the weight itself, so it lives exactly as long as the weight."""
    packs = weight.__dict__.setdefault("_onednn_packs", {})
    version, packed = packs.get(rows, (None, None))
    if version != weight._version:               # new, or the weight changed in place
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        packs[rows] = (weight._version, packed)
    return packed


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input, stacked by rows.

    Each original layer's weight becomes a view into the merged one, so no memory is doubled
    and the checkpoint's names (``q_proj.weight`` ...) still address the same numbers."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("fuse_linears needs all the layers with a bias, or none")
    row = 0
    for lin in linears:
        rows = lin.out_features
        lin.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias
