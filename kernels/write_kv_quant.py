"""write_kv_quantized: write_kv for a quantised cache (kv_cache_dtype "fp8" or "int8").

Token ``t`` goes to slot ``slot_mapping[t]`` (-1: padding, nothing written), as in write_kv;
on the way each (token, KV head) row of ``head_dim`` values gets its scale, the smallest power
of two at or above ``amax * (1 / max)`` (:func:`power_of_two_scale`), and is divided by it, clamped
and rounded to the stored dtype. The scale goes to the same slot
of ``k_scale``/``v_scale``. :func:`kvlab.quantization.quantize_kv` is the reference: the kernel
matches it bit for bit, in Triton's interpreter as on a GPU.

The rounding is done here, in float32, before the conversion: Triton's interpreter converts
float32 to float8 e4m3 by truncating the mantissa and adding the first dropped bit, with no
carry into the exponent (7.886 becomes 4.0) and no saturation (500 becomes 256). A value that
is already on the e4m3 grid converts exactly, on the interpreter and on a GPU alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.checks import check_write_kv_args
from kvlab.quantization import QUANTIZED_DTYPES


@triton.jit
def round_half_even(y):
    """``y`` (float32, |y| < 2**31) rounded to the nearest integer, ties to even, as float32."""
    n = y.to(tl.int32)                       # toward zero
    rest = y - n.to(tl.float32)              # exact: |rest| < 1
    up = (tl.abs(rest) > 0.5) | ((tl.abs(rest) == 0.5) & (n % 2 != 0))
    return tl.where(up, n + tl.where(y > 0, 1, -1), n).to(tl.float32)


@triton.jit
def round_to_e4m3(y):
    """``y`` (float32, |y| <= 448) rounded to the nearest float8 e4m3 value, ties to even.

    e4m3 has 3 mantissa bits: 8 steps per power of two, a step of 2**(e - 3) for values in
    [2**e, 2**(e + 1)); below 2**-6 (the subnormals) the step stays 2**-9. Dividing by a power
    of two is exact, so y / step is rounded to an integer and multiplied back.
    """
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127      # float32's exponent field
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)            # 2**(e - 3)
    inverse = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)         # 2**(3 - e)
    return round_half_even(y * inverse) * step


@triton.jit
def power_of_two_scale(amax, QMAX: tl.constexpr, FP8: tl.constexpr):
    """The scale of rows whose largest magnitude is ``amax`` (float32): the smallest power of two at
    or above ``amax * (1.0 / QMAX)``, its exponent clamped to fp8's [-15, 7] or int8's [-24, 9]
    (``kvlab.quantization``: every code times such a scale is an fp16 number); 1 where amax is 0."""
    ratio = amax * (1.0 / QMAX)                                   # as the reference: times the reciprocal
    bits = ratio.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127                         # ratio is in [2**e, 2**(e + 1))
    exponent = tl.where((bits & 0x7FFFFF) != 0, exponent + 1, exponent)    # not a power of two: round up
    exponent = tl.minimum(tl.maximum(exponent, -15 if FP8 else -24), 7 if FP8 else 9)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, scale, 1.0)


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr, FP8: tl.constexpr):
    """``x [heads, head_dim]`` float32 -> (values on the stored grid, still float32; scale per head)."""
    scale = power_of_two_scale(tl.max(tl.abs(x), axis=1), QMAX, FP8)
    # div_rn: IEEE division, as PyTorch's (a GPU's default float32 division is approximate; by a
    # power of two both are exact, but the clamp below must see the same y on every device).
    y = tl.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)      # float8 e4m3fn has no infinity: saturate
    if FP8:
        y = round_to_e4m3(y)
    else:
        y = round_half_even(y)
    return y, scale


@triton.jit
def write_kv_quantized_kernel(
    key_ptr, value_ptr,            # [num_tokens, num_kv_heads, head_dim], rows may be strided
    k_cache_ptr, v_cache_ptr,      # [num_blocks, block_size, num_kv_heads, head_dim] fp8 or int8, contiguous
    k_scale_ptr, v_scale_ptr,      # [num_blocks, block_size, num_kv_heads] float32, strided (below)
    slot_mapping_ptr,              # [num_tokens] int64
    key_token_stride, value_token_stride,
    scale_block_stride, scale_slot_stride, scale_head_stride,    # the scales' strides, K's and V's alike
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,     # the two rounded up to powers of two
    QMAX: tl.constexpr,            # 448.0 (fp8) or 127.0 (int8)
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    # A padding token (slot -1) has no rows: no load, no store.
    row_ok = heads < tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    offs = heads[:, None] * HEAD_DIM + dims[None, :]
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + offs
    # The engine keeps a page's scales of one head together ([num_blocks, num_kv_heads, block_size]
    # in memory, kvlab.paging.kv_cache): the strides find them in either layout.
    scale_offs = (slot // BLOCK_SIZE) * scale_block_stride + (slot % BLOCK_SIZE) * scale_slot_stride \
        + heads * scale_head_stride

    k = tl.load(key_ptr + token * key_token_stride + offs, mask=mask, other=0.0).to(tl.float32)
    k, k_scale = quantize_rows(k, QMAX, FP8)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_scale_ptr + scale_offs, k_scale, mask=row_ok)

    v = tl.load(value_ptr + token * value_token_stride + offs, mask=mask, other=0.0).to(tl.float32)
    v, v_scale = quantize_rows(v, QMAX, FP8)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_scale_ptr + scale_offs, v_scale, mask=row_ok)


def write_kv_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor, *,
                       validate: bool = True) -> None:
    """Quantise ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` (float16, bfloat16 or
    float32) into the fp8 or int8 caches, and their scales into ``k_scale``/``v_scale``.

    With ``validate`` (the default) every argument is checked first, as write_kv's are (one
    check kernel, one read): a rejected call writes nothing.
    """
    if validate:
        check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    launch_write_kv_quantized(write_kv_quantized_kernel, key, value, k_cache, v_cache, k_scale, v_scale,
                              slot_mapping)


def launch_write_kv_quantized(kernel, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Launch ``kernel`` (this module's, or one with its signature): one program per token, the
    scales' strides, the cache format's ``QMAX`` and ``FP8`` as constants. No checks."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fmt = QUANTIZED_DTYPES[k_cache.dtype]
    kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, key.stride(0), value.stride(0),
        *k_scale.stride(), BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim), QMAX=fmt.max,
        FP8=fmt.dtype == torch.float8_e4m3fn)
