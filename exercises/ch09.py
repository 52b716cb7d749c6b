"""Chapter 9 exercises: a quantised KV cache (fp8, int8) and the swap-or-recompute choice.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch09                                 # in a terminal
    kvlab.check("ch09")                              # in the notebook
    pytest tests/graded -m ch09 --impl=exercises     # the same tests, raw

Tasks: ``quantize`` (``quantize_kv`` and ``dequantize_kv``: codes and one scale per
(token, KV head)), ``write_kernel`` (the body of the Triton kernel that quantises K/V as it
scatters them into the paged cache), ``preemption_mode`` (``swap_seconds``,
``recompute_seconds`` and ``preemption_mode``: swap a preempted sequence's blocks to the host,
or drop them and recompute), ``crossover`` (``crossover_tokens``: the length from which swapping
wins). Then ``use_my_quantization(llm)`` (given, at the end) serves an ``LLM(kv_cache_dtype=
"fp8")`` through your pieces. Stuck? ``kvlab.use_solution("ch09")`` swaps in the answer and keeps
yours as ``exercises/ch09_mine.py``.

The formats (vLLM's ``kv_cache_dtype`` names): ``"fp8"`` is float8 e4m3 (``torch.float8_e4m3fn``,
largest value 448); ``"int8"`` is the integers -127..127 (``torch.int8``; -128 is left out so the
grid is symmetric).
"""
import math  # noqa: F401  (you may use it)

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch  # noqa: F401  (you will use it)
import triton
import triton.language as tl

# Given: the course's helpers, for your kernel (help(power_of_two_scale.fn) and so on: each
# docstring gives its rule): power_of_two_scale(amax, QMAX, FP8) gives each row's scale by
# quantize_kv's rule (the smallest power of two at or above amax * (1.0 / QMAX), its exponent
# clamped to the format's range, 1 where amax is 0); round_to_e4m3(y) rounds float32 |y| <= 448
# to the nearest e4m3 value, round_half_even(y) to the nearest integer (ties to even); all three
# return float32. Their module, kvlab.kernels.write_kv_quant (kernels/write_kv_quant.py), also
# holds the course's whole write kernel: the write_kernel task's answer, to read after your attempt.
from kvlab.kernels.write_kv_quant import power_of_two_scale, round_half_even, round_to_e4m3  # noqa: F401
# Given (not tasks), shared with solutions/ch09.py: read kvlab/scaffold/ch09.py.
from kvlab.scaffold.ch09 import PIECES, PreemptionCosts, my_quantization_user, write_kv_quantized_with  # noqa: F401
from kvlab.validation import check_count  # noqa: F401  (TypeError/ValueError for a bad count: help(check_count))


# -- task quantize -------------------------------------------------------------------------------
def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., num_kv_heads, head_dim]`` (float16, bfloat16 or float32) to
    ``(codes, scales)``: ``codes`` has ``x``'s shape in the format's dtype (``torch.float8_e4m3fn``
    for ``"fp8"``, ``torch.int8`` for ``"int8"``), ``scales`` is ``x.shape[:-1]`` float32: one
    per (token, KV head), i.e. per row of ``head_dim`` values.

    In float32, for each row with ``amax`` its largest ``|x|`` and ``max`` the format's (448 or 127):

    * ``ratio = amax * (1.0 / max)``: amax times the float32 reciprocal, *not* ``amax / max``
      (the two differ in the last bit for some amax, enough to move a ratio across a power of
      two; a GPU's PyTorch divides by a number that way, and the course's kernel matches it);
    * ``scale`` is the smallest power of two at or above ``ratio``, ``2**e``, with ``e`` clamped to
      the format's range: -15..7 for fp8, -24..9 for int8. ``mantissa, exponent =
      torch.frexp(ratio)`` gives ``ratio = mantissa * 2**exponent`` with ``mantissa`` in [0.5, 1),
      so ``e = exponent``, except where ``mantissa`` is exactly 0.5: ``ratio`` is a power of two
      already, and ``e = exponent - 1``. Clamp ``e``, then ``torch.ldexp(torch.ones_like(ratio), e)``
      is ``2**e``, exactly. A row of zeros (``amax == 0``) gets scale 1, so nothing divides by 0
      and the row comes back as zeros, not NaN. A row with ``amax > 0`` but so small that
      ``ratio`` underflows to 0 in float32 (``amax`` below about 3e-43 for fp8, 9e-44 for int8:
      1e-44, say) is not a row of zeros: it gets the smallest scale, ``2**-15`` (fp8) or
      ``2**-24`` (int8), not 1 (``frexp(0)`` gives exponent 0: take the bottom of the range).
      Why a power of two: multiplying a code by a power of two only moves its exponent, so
      every code times its scale is an fp16 number, and a kernel can dequantise a whole tile of
      K or V exactly into fp16 for the tensor cores.
      The price: a row's largest value lands in ``(max / 2, max]`` (clamps aside), not on ``max``;
    * ``y = x / scale``, clamped to ``[-max, max]``. With a row's own scale ``y`` overshoots
      ``max`` by a rounding at most, but where ``e`` was clamped at the top (a row past ``448 *
      2**7`` = 57,344 for fp8, ``127 * 2**9`` = 65,024 for int8) values land past it, and e4m3fn
      has no infinity: 500 must become 448;
    * int8: rounded to the nearest integer, ties to even (``torch.round``), then ``.to(torch.int8)``;
      fp8: ``.to(torch.float8_e4m3fn)`` (PyTorch's conversion rounds to the nearest, ties to even).

    Errors: ValueError for a ``kv_cache_dtype`` other than "fp8" or "int8" ("auto" included: it
    stores the model's dtype, there is nothing to quantise).
    """
    raise NotImplementedError("quantize_kv: per row, the smallest power of two >= amax * (1.0 / max) (frexp, "
                              "exponent clamped, ldexp), 1 where amax is 0; codes = clamp(x / scale, -max, max), "
                              "rounded, converted")


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` in float32: ``codes [..., head_dim]`` (fp8 or int8), ``scales
    codes.shape[:-1]`` (one per row). ValueError if ``scales`` has another shape."""
    raise NotImplementedError("dequantize_kv: codes.float() times each row's scale (broadcast over head_dim)")


# -- task write_kernel ---------------------------------------------------------------------------
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
    FP8: tl.constexpr,             # True for fp8 (e4m3), False for int8
):
    """Program ``t`` quantises token ``t``'s K and V, all heads at once, into slot ``slot_mapping[t]``.

    * Load the slot (int64). A slot of -1 is padding: load nothing, store nothing (mask it off
      as chapter 2's kernel does: ``row_ok = heads < tl.where(slot >= 0, NUM_KV_HEADS, 0)``).
    * Token ``t``'s K is a ``[NUM_KV_HEADS, HEAD_DIM]`` tile at ``key_ptr + t * key_token_stride
      + head * HEAD_DIM + dim``; use ``tl.arange(0, HEADS_PAD)`` and ``tl.arange(0, DIM_PAD)``
      and mask the padding rows and columns. Compute in float32.
    * Per head (row): ``amax = tl.max(tl.abs(k), axis=1)``; ``scale = power_of_two_scale(amax,
      QMAX, FP8)`` (given: quantize_kv's power of two, 1 where amax is 0); ``y = tl.div_rn(k,
      scale[:, None])`` (IEEE division: a GPU's plain ``/`` is approximate; in the interpreter both
      are exact); clamp ``y`` to ``[-QMAX, QMAX]``.
    * Round **yourself**, then convert: fp8 with the given ``round_to_e4m3(y)``, int8 with
      ``round_half_even(y)``; then ``.to(k_cache_ptr.dtype.element_ty)``. Triton's CPU
      interpreter converts float32 to e4m3 wrongly for about 2% of values (7.886 becomes 4.0: it
      truncates the mantissa with no carry into the exponent) and does not saturate (500 becomes
      256, not 448); a value already on the e4m3 grid and within ±448 converts exactly, there as
      on a GPU.
    * Store the codes at element ``slot * NUM_KV_HEADS * HEAD_DIM + head * HEAD_DIM + dim`` of the
      flattened cache. Store each head's scale at block ``slot // BLOCK_SIZE``, offset ``slot %
      BLOCK_SIZE``, through the strides: ``(slot // BLOCK_SIZE) * scale_block_stride + (slot %
      BLOCK_SIZE) * scale_slot_stride + head * scale_head_stride``. The engine keeps a page's
      scales of one head together (``[num_blocks, num_kv_heads, block_size]`` in memory, which is
      how the attention kernels read them); a contiguous ``[num_blocks, block_size, num_kv_heads]``
      tensor works too. The same for V.
    """
    raise NotImplementedError("write_kv_quantized_kernel: load the slot; mask rows with tl.where(slot >= 0, "
                              "NUM_KV_HEADS, 0); amax per row, power_of_two_scale, div_rn, clamp, round_to_e4m3 / "
                              "round_half_even; store codes at the slot and scales through their strides")


# Given: write_kv_quantized(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) launches
# your kernel, one program per token.
write_kv_quantized = write_kv_quantized_with(write_kv_quantized_kernel)


# -- task preemption_mode ------------------------------------------------------------------------
def swap_seconds(num_tokens: int, bytes_per_token: int, costs: PreemptionCosts) -> float:
    """Seconds to swap ``num_tokens`` tokens of KV out to the host now and back in later: two
    transfers, each ``costs.latency + num_tokens * bytes_per_token / costs.bandwidth``."""
    raise NotImplementedError("swap_seconds: 2 * (latency + num_tokens * bytes_per_token / bandwidth)")


def recompute_seconds(num_tokens: int, costs: PreemptionCosts) -> float:
    """Seconds to recompute ``num_tokens`` tokens of KV as a prompt:
    ``num_tokens * prefill_per_token + num_tokens ** 2 * prefill_per_token_sq``."""
    raise NotImplementedError("recompute_seconds: linear term plus the quadratic (attention) term")


def preemption_mode(num_tokens: int, bytes_per_token: int, costs: PreemptionCosts, host_free_bytes: int) -> str:
    """``"swap"`` or ``"recompute"``: how to preempt a sequence holding ``num_tokens`` tokens of KV.

    ``"swap"`` only if both hold: its KV fits in the host memory left
    (``num_tokens * bytes_per_token <= host_free_bytes``), and swapping is strictly cheaper
    (``swap_seconds(...) < recompute_seconds(...)``). Otherwise, ties included, ``"recompute"``:
    it needs no host memory and no transfer.

    Errors: check ``num_tokens``, ``bytes_per_token`` and ``host_free_bytes``, in that order,
    with the given ``check_count(name, value)`` (``help(check_count)``): each must be an int,
    and a bool, a float (even ``2.0``), a str or None is not: TypeError; an int below 0:
    ValueError. (The course's engine has its own swap_seconds, recompute_seconds,
    preemption_mode and crossover_tokens in ``kvlab.engine.offload``: they are this task's and
    the next one's answers, to read after your own attempt.)
    """
    raise NotImplementedError("preemption_mode: check the three counts with check_count; 'swap' if it fits on "
                              "the host and swap_seconds < recompute_seconds, else 'recompute'")


# -- task crossover ------------------------------------------------------------------------------
def crossover_tokens(bytes_per_token: int, costs: PreemptionCosts, max_tokens: int = 1 << 20) -> int | None:
    """The smallest ``num_tokens`` (0 to ``max_tokens``) at which swapping is strictly cheaper
    than recomputing (``swap_seconds < recompute_seconds``), or None if there is none up to
    ``max_tokens``. Host memory plays no part here.

    Swap costs a fixed ``2 * latency`` plus a term linear in the tokens; recompute has no fixed
    cost and grows at least linearly (quadratically when ``prefill_per_token_sq > 0``). So once
    swapping is cheaper it stays cheaper: the tokens where it wins are one range up to
    ``max_tokens``, and you may search it (bisection) or solve for it, as long as your answer
    is exactly the first ``n`` where ``swap_seconds(n, ...) < recompute_seconds(n, ...)``.
    """
    raise NotImplementedError("crossover_tokens: the first n with swap_seconds(n) < recompute_seconds(n) "
                              "(bisection over 0..max_tokens, or solve and check the neighbours)")


# Given: use_my_quantization(llm) serves an LLM(kv_cache_dtype="fp8" or "int8") with your
# quantize_kv / dequantize_kv and your write kernel (kvlab/scaffold/ch09.py says how).
use_my_quantization = my_quantization_user(quantize_kv, dequantize_kv, write_kv_quantized)
