"""silu_and_mul: the SwiGLU activation, ``silu(gate) * up``, in one launch.

With the gate and up projections merged into one matmul (``[num_tokens, 2 * d]``, gate first,
as vLLM's ``MergedColumnParallelLinear``), the activation reads both halves of a row and writes
``[num_tokens, d]``: one kernel instead of PyTorch's slice, silu and multiply.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.checks import check_out_tensor


@triton.jit
def silu_and_mul_kernel(
    x_ptr,                          # [num_tokens, 2 * d]: gate | up, rows may be strided
    out_ptr,                        # [num_tokens, d], rows may be strided
    x_row_stride, out_row_stride,
    d,
    BLOCK: tl.constexpr,            # columns one program computes
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    row = x_ptr + token * x_row_stride
    gate = tl.load(row + cols, mask=mask).to(tl.float32)
    up = tl.load(row + d + cols, mask=mask)
    # Two roundings to the dtype, as ``F.silu(gate) * up`` does in PyTorch: silu's result,
    # computed in float32, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``x = [gate | up]`` ``[num_tokens, 2 * d]``; returns ``[num_tokens, d]``.

    Rounds like PyTorch in float16/bfloat16 (silu in float32 rounded to the dtype, then the
    product rounded). ``x`` may have strided rows, each row contiguous. The result goes to a
    fresh contiguous tensor, or into ``out`` if given.
    """
    if validate:
        check_silu_and_mul_args(x, out)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device) if out is None else out
    if num_tokens and d:
        # A second grid axis over columns: intermediate sizes reach 14K-29K, and a decode step
        # has few tokens, so one program per token would leave most of the GPU idle.
        block = min(triton.next_power_of_2(d), 1024)
        grid = (num_tokens, triton.cdiv(d, block))
        silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), d, BLOCK=block)
    return out


def check_silu_and_mul_args(x, out=None) -> None:
    """Raise TypeError/ValueError naming the first argument of silu_and_mul that breaks a rule."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * d] (gate | up), got shape {list(x.shape)}")
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"x must have contiguous rows (last stride 1), got strides {list(x.stride())}")
    check_out_tensor(out, [x.shape[0], x.shape[1] // 2], x)
