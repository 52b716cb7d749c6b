"""Chapter 9 answers: the same names and signatures as ``exercises/ch09.py``."""
import math  # noqa: F401

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch

from kvlab.kernels.write_kv_quant import power_of_two_scale, round_half_even, round_to_e4m3  # noqa: F401
# The write_kernel answer is the course's own kernel: read kernels/write_kv_quant.py.
from kvlab.kernels.write_kv_quant import quantize_rows, write_kv_quantized_kernel  # noqa: F401
# Given (not tasks), shared with exercises/ch09.py: read kvlab/scaffold/ch09.py.
from kvlab.scaffold.ch09 import PIECES, PreemptionCosts, my_quantization_user, write_kv_quantized_with  # noqa: F401
from kvlab.validation import check_count

# dtype, max, and the range of the scales' exponents (every code times 2**e is an fp16 number)
FORMATS = {"fp8": (torch.float8_e4m3fn, 448.0, -15, 7), "int8": (torch.int8, 127.0, -24, 9)}


# -- task quantize -------------------------------------------------------------------------------
def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be 'fp8' or 'int8', got {kv_cache_dtype!r}")
    dtype, qmax, min_exponent, max_exponent = FORMATS[kv_cache_dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    ratio = amax * (1.0 / qmax)
    mantissa, exponent = torch.frexp(ratio)         # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)      # 0.5: ratio is a power of two already
    # ratio 0: a row of zeros (scale 1, below), or amax > 0 so small (1e-44) that the ratio
    # underflows to 0: not zeros, so the smallest scale (frexp(0) would give exponent 0, scale 1)
    exponent = torch.where(ratio > 0, exponent, min_exponent)
    scale = torch.ldexp(torch.ones_like(ratio), exponent.clamp(min_exponent, max_exponent))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)
    return y.to(dtype), scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if tuple(scales.shape) != tuple(codes.shape[:-1]):
        raise ValueError(f"scales must have shape {list(codes.shape[:-1])}, got {list(scales.shape)}")
    return codes.float() * scales.float()[..., None]


# -- task write_kernel ---------------------------------------------------------------------------
# The course's write_kv_quantized_kernel, with its quantize_rows for each of K and V (both below).
write_kv_quantized = write_kv_quantized_with(write_kv_quantized_kernel)


# -- task preemption_mode ------------------------------------------------------------------------
def swap_seconds(num_tokens: int, bytes_per_token: int, costs: PreemptionCosts) -> float:
    return 2 * (costs.latency + num_tokens * bytes_per_token / costs.bandwidth)


def recompute_seconds(num_tokens: int, costs: PreemptionCosts) -> float:
    return num_tokens * costs.prefill_per_token + num_tokens ** 2 * costs.prefill_per_token_sq


def preemption_mode(num_tokens: int, bytes_per_token: int, costs: PreemptionCosts, host_free_bytes: int) -> str:
    for name, count in (("num_tokens", num_tokens), ("bytes_per_token", bytes_per_token),
                        ("host_free_bytes", host_free_bytes)):
        check_count(name, count)        # an int (TypeError), not negative (ValueError)
    fits = num_tokens * bytes_per_token <= host_free_bytes
    cheaper = swap_seconds(num_tokens, bytes_per_token, costs) < recompute_seconds(num_tokens, costs)
    return "swap" if fits and cheaper else "recompute"


# -- task crossover ------------------------------------------------------------------------------
def crossover_tokens(bytes_per_token: int, costs: PreemptionCosts, max_tokens: int = 1 << 20) -> int | None:
    def swap_wins(n):
        return swap_seconds(n, bytes_per_token, costs) < recompute_seconds(n, costs)

    if not swap_wins(max_tokens):
        return None
    lo, hi = -1, max_tokens            # swap loses at lo (or lo is before the range), wins at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if swap_wins(mid):
            hi = mid
        else:
            lo = mid
    return hi


# Given: use_my_quantization(llm) serves an LLM(kv_cache_dtype="fp8" or "int8") with your
# quantize_kv / dequantize_kv and your write kernel (kvlab/scaffold/ch09.py says how).
use_my_quantization = my_quantization_user(quantize_kv, dequantize_kv, write_kv_quantized)
