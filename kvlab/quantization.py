"""A quantised KV cache: K and V stored in 8 bits, one float32 scale per (token, KV head).

``kv_cache_dtype`` takes vLLM's names:

* ``"auto"``: the model's dtype (bfloat16, say), no quantisation;
* ``"fp8"``: float8 e4m3fn (``torch.float8_e4m3fn``): 3 mantissa bits, largest value 448;
* ``"int8"``: integers -127..127 (-128 is left out so the grid is symmetric).

A value ``x`` is stored as ``q = round(clamp(x / scale, -max, max))`` and read back as
``q * scale``. ``scale`` is the smallest power of two at or above ``amax * (1 / max)`` (the float32
reciprocal, see :func:`power_of_two_scale`), with ``amax`` the largest ``|x|`` of one token's ``head_dim`` values in one KV head: the row's largest value
lands in the top half of the grid, ``(max / 2, max]``.

**Why a power of two.** Multiplying a code by a power of two only moves its exponent, so
``q * scale`` is exact in any float format that has the bits of ``q`` and the range: in fp16,
for every scale from ``2**min_exponent`` to ``2**max_exponent`` (fp8: 2^-15 .. 2^7, int8:
2^-24 .. 2^9; every code times such a scale is an fp16 number, subnormals included). A kernel
can then dequantise a whole tile of K or V once, exactly, into the 16-bit numbers the tensor
cores take, instead of applying a key's scale to its column of scores in the attention loop
(``kvlab.kernels.paged_prefill_ws``). What it costs: fp8's 3 mantissa bits give every value the
same relative precision wherever the row's largest one lands, but that largest value is no longer
stored exactly (with ``amax / max`` it landed on 448 itself), so a row that one value dominates
comes back about 1.5x less exact (2.6% against 1.7% on :func:`outlier_kv` data; 2.65% against
2.57% on Gaussian rows). int8 loses up to one bit on a row whose largest value lands just above
``max / 2`` (0.91% against 0.65% on Gaussian rows). On the shipped model both stay far inside 1%
of perplexity (benchmarks/RESULTS.md). The OCP microscaling formats (MXFP8,
MXINT8) make the same choice: one power-of-two scale per group of values. Scales are clamped to
that range, so a row larger than ``max * 2**max_exponent`` (57,344 for fp8, 65,024 for int8:
fp16's range, about) saturates, and a row smaller than ``max * 2**min_exponent`` keeps its
values to within ``2**(min_exponent - 1)`` of a code step (fp16's precision near zero).

**Why one scale per (token, KV head).** A token's K and V are written once, when its forward
pass computes them, and never change. A scale of its own can be fixed at that moment, from
that token's values alone, without revisiting any other token. A per-tensor scale would need
the largest value over all tokens, future ones included (or a calibration run that guesses
it); and one outlier token (an attention sink, say) would set it for everyone: every other
token would use a small corner of the grid and lose its resolution.
:func:`quantization_error` measures it on :func:`outlier_kv` data (256 tokens, 4 of them 100x
larger, 2 KV heads of 64): int8 loses 1.9% of a token per (token, head), 60% per tensor (most
values round to 0). fp8 loses 2.6% either way: its exponent absorbs a 100x outlier, and the
error only blows up (47% per tensor, 4% per (token, head)) when the others fall to its
subnormals, at 10^5x. The scales cost 4 bytes
per ``head_dim`` values: 3% of an fp8 cache at ``head_dim`` 128.

The cache: values ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the stored dtype and
scales ``[num_blocks, block_size, num_kv_heads]`` float32 beside them, for K and for V
(:func:`allocate_quantized_kv_cache`, one layer, slot-major). The engine's ``KVCache`` keeps the
scales with that shape but per page and KV head in memory
(:func:`kvlab.paging.kv_cache.per_page_and_head`): the kernels read them through their strides,
so they take either layout. ``kvlab.kernels.write_kv_quantized`` quantises as it
scatters; ``paged_decode`` and ``paged_prefill`` read the codes and scales and dequantise on
chip, never into a copy of the cache: the Triton kernels multiply each key's scores by its scale
and each value's probabilities by its own, ``paged_prefill_ws`` writes ``code * scale`` (exact in
fp16, the scales being powers of two) into shared memory for the tensor cores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheFormat:
    """How a quantised cache stores a value: its torch dtype and the largest magnitude it holds."""

    name: str
    dtype: torch.dtype
    max: float
    min_exponent: int     # scales are powers of two 2**e, e in [min_exponent, max_exponent]:
    max_exponent: int     # every code times one of them is an fp16 number


KV_CACHE_DTYPES: dict[str, KVCacheFormat | None] = {
    "auto": None,                                                 # the model's dtype, not quantised
    "fp8": KVCacheFormat("fp8", torch.float8_e4m3fn, 448.0, -15, 7),     # codes: multiples of 2^-9 up to 448
    "int8": KVCacheFormat("int8", torch.int8, 127.0, -24, 9),            # codes: integers up to 127
}
_ALIASES = {"fp8_e4m3": "fp8"}
QUANTIZED_DTYPES = {f.dtype: f for f in KV_CACHE_DTYPES.values() if f is not None}
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)   # what "auto" stores
GRANULARITIES = ("token_head", "tensor")


def kv_cache_format(kv_cache_dtype) -> KVCacheFormat | None:
    """The format of ``kv_cache_dtype`` ("auto", "fp8", "int8", or a stored torch dtype); None for "auto"."""
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype not in QUANTIZED_DTYPES:
            raise ValueError(f"{kv_cache_dtype} is not a quantised KV cache dtype; known: "
                             f"{', '.join(map(str, QUANTIZED_DTYPES))}")
        return QUANTIZED_DTYPES[kv_cache_dtype]
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str such as 'fp8', got {type(kv_cache_dtype).__name__}")
    name = _ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def _quantized_format(kv_cache_dtype) -> KVCacheFormat:
    fmt = kv_cache_format(kv_cache_dtype)
    if fmt is None:
        raise ValueError("kv_cache_dtype 'auto' stores the model's dtype: there is nothing to quantise")
    return fmt


def quantize_kv(x: torch.Tensor, kv_cache_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., num_kv_heads, head_dim]``: returns ``(q, scale)``.

    ``q`` has ``x``'s shape in the format's dtype; ``scale`` is ``x.shape[:-1]`` float32, one per
    (token, KV head): :func:`power_of_two_scale` of the row's ``amax`` over ``head_dim``, 1 where
    the values are all zero. Values are divided by the scale in float32 (exact: a power of two),
    clamped to ``[-max, max]`` and rounded to the nearest stored value (ties to even). This is the
    reference the Triton kernel matches bit for bit.
    """
    fmt = _quantized_format(kv_cache_dtype)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError("x must be a floating-point tensor [..., head_dim]")
    if x.shape[-1] == 0:
        raise ValueError("x must have head_dim >= 1 values a row, got 0")
    x = x.float()
    scale = power_of_two_scale(x.abs().amax(dim=-1), fmt)
    return _to_grid(x / scale[..., None], fmt), scale


def power_of_two_scale(amax: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """The scale of rows whose largest magnitude is ``amax`` (float32): the smallest power of two
    at or above ``amax * (1.0 / max)``, clamped to ``[2**min_exponent, 2**max_exponent]``; 1 where
    ``amax`` is 0 (a row of zeros comes back as zeros, not NaN)."""
    # amax times the float32 reciprocal of max, not amax / max: a GPU's PyTorch divides a tensor by
    # a number that way, so this is the one rounding every device and the kernel agree on.
    ratio = amax.float() * (1.0 / fmt.max)
    mantissa, exponent = torch.frexp(ratio)             # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = torch.where(ratio > 0, exponent, fmt.min_exponent).clamp(fmt.min_exponent, fmt.max_exponent)
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    return torch.where(amax > 0, scale, torch.ones_like(ratio))


def _to_grid(y: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """``y`` (float32, already divided by its scale) clamped and rounded to the stored dtype."""
    y = y.clamp(-fmt.max, fmt.max)          # float8_e4m3fn has no infinity: 500 must become 448
    if fmt.dtype == torch.int8:
        y = torch.round(y)                  # ties to even, as the float8 conversion rounds
    return y.to(fmt.dtype)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``: the values a kernel reading the quantised cache computes with."""
    if not isinstance(q, torch.Tensor) or q.dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"q must be a float8_e4m3fn or int8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise TypeError(f"scale must be a floating-point tensor, got {getattr(scale, 'dtype', type(scale).__name__)}")
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}")
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale must have shape {list(q.shape[:-1])} (one per row of q), got {list(scale.shape)}")
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantization_error(x: torch.Tensor, granularity: str = "token_head", kv_cache_dtype: str = "fp8") -> float:
    """Mean over tokens of ``|x_t - dequantised x_t| / |x_t|`` (norms over heads and head_dim).

    ``x`` is ``[num_tokens, num_kv_heads, head_dim]``. ``granularity`` "token_head" uses a scale
    per (token, KV head), as the cache does; "tensor" one scale for the whole of ``x``. A mean
    over tokens weighs every token alike, so a few outliers cannot hide the others' error.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be [num_tokens, num_kv_heads, head_dim], got shape {list(x.shape)}")
    x = x.double()
    if granularity == "token_head":
        back = dequantize_kv(*quantize_kv(x, kv_cache_dtype), dtype=torch.float64)
    else:
        fmt = _quantized_format(kv_cache_dtype)
        scale = (x.abs().max() / fmt.max).float()             # one scale, set by the largest value of all
        back = _to_grid(x.float() / scale, fmt).double() * scale.double()
    err = (x - back).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1).clamp(min=1e-30)
    return err.mean().item()


def outlier_kv(num_tokens: int, num_kv_heads: int, head_dim: int, num_outliers: int = 4, gain: float = 100.0,
               seed: int = 0) -> torch.Tensor:
    """K/V-like float32 data ``[num_tokens, num_kv_heads, head_dim]`` with a few outlier tokens.

    Channels have scales of their own (log-normal, as keys' channels do), and ``num_outliers``
    tokens (the first one among them, like an attention sink) are ``gain`` times larger.
    """
    gen = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(num_kv_heads, head_dim, generator=gen))
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * channel
    outliers = torch.cat([torch.zeros(1, dtype=torch.long),
                          torch.randperm(num_tokens - 1, generator=gen)[:max(num_outliers - 1, 0)] + 1])
    x[outliers[:num_outliers]] *= gain
    return x


def allocate_quantized_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                                kv_cache_dtype, device="cpu"):
    """``(k_cache, v_cache, k_scale, v_scale)`` of one layer, zeroed.

    Caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the format's dtype; scales
    ``[num_blocks, block_size, num_kv_heads]`` float32, contiguous (slot-major): a slot's scales
    sit at the same (block, offset) as its values, so one slot index finds both.
    """
    fmt = _quantized_format(kv_cache_dtype)
    for name, n in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    shape = (num_blocks, block_size, num_kv_heads)
    return (torch.zeros(*shape, head_dim, dtype=fmt.dtype, device=device),
            torch.zeros(*shape, head_dim, dtype=fmt.dtype, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device))
