"""rms_norm: the model's RMSNorm in one launch, optionally fused with the residual add before it.

In PyTorch, ``weight * (xf * rsqrt(mean(xf**2) + eps)).to(dtype)`` is five or six kernels, and
the decoder runs it twice per layer. Here one program normalizes one row. With ``residual`` it
is vLLM's ``fused_add_rms_norm``: the decoder layer carries the residual stream separately, and
the add that closes one sub-block happens inside the norm that opens the next::

    h, residual = rms_norm(attn_out, post_attention_layernorm.weight, eps, residual)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.checks import check_same_device

# One program holds a whole row in registers; past this a row would spill to local memory.
MAX_HIDDEN = 65536


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr,            # [num_tokens, hidden], rows may be strided
    weight_ptr,                     # [hidden]
    out_ptr, residual_out_ptr,      # [num_tokens, hidden], rows may be strided
    x_row_stride, residual_row_stride, out_row_stride, residual_out_row_stride,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,            # next_power_of_2(hidden): the whole row at once
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # Every load of the row comes before any store: out may be x and residual_out may be
    # residual (in place), since no other program touches this row.
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Rounded to the dtype, as PyTorch's ``x + residual`` is: this is the stream the next
        # layer adds to, and the value the statistics are taken of.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * residual_out_row_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    # The model rounds the normalized row to the dtype *before* the weight multiplies it.
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             validate: bool = True):
    """RMSNorm of the rows of ``x [num_tokens, hidden]``, exactly as the model's ``RMSNorm``.

    Without ``residual`` returns ``weight * (xf * rsqrt(mean(xf**2, -1) + eps)).to(x.dtype)``
    with ``xf = x.float()``. With ``residual`` (same shape and dtype) returns
    ``(rms_norm(s), s)`` where ``s = x + residual`` rounded to the dtype.

    Results go to fresh contiguous tensors, or into ``out`` (and ``residual_out``) if given;
    these may be ``x`` (and ``residual``) themselves, vLLM's in-place form. ``x``, ``residual``
    and the outputs may have strided rows but each row must be contiguous. ``x``, ``weight``
    (and ``residual``) share one dtype: float32, float16 or bfloat16.
    """
    if validate:
        check_rms_norm_args(x, weight, eps, residual, out, residual_out)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device) if out is None else out
    if residual is not None and residual_out is None:
        residual_out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens:
        has_residual = residual is not None
        # Without a residual the kernel never touches those pointers: pass x in their place.
        res, res_out = (residual, residual_out) if has_residual else (x, x)
        block = triton.next_power_of_2(hidden)
        # Triton's layer-norm tutorial: more warps for longer rows, so each thread keeps few elements.
        num_warps = min(max(block // 256, 1), 8)
        rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            hidden, float(eps), HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=num_warps)
    return out if residual is None else (out, residual_out)


def check_rms_norm_args(x, weight, eps, residual=None, out=None, residual_out=None) -> None:
    """Raise TypeError/ValueError naming the first argument of rms_norm that breaks a rule."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {list(x.shape)}")
    num_tokens, hidden = x.shape
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x has hidden size {hidden}: one program normalizes a whole row, which must "
                         f"hold 1..{MAX_HIDDEN} elements")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype}, x has {x.dtype}")
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden}] tensor, got shape {list(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if residual is None and residual_out is not None:
        raise ValueError("residual_out is the sum x + residual: it needs residual")
    tensors = {"x": x, "weight": weight}
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, x has {x.dtype}")
        if t.shape != x.shape:
            raise ValueError(f"{name} must have x's shape {list(x.shape)}, got {list(t.shape)}")
        tensors[name] = t
    if out is not None and residual_out is not None and out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out are one buffer: the norm and the sum would overwrite each other")
    for name, t in tensors.items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last stride 1), got strides {list(t.stride())}")
    check_same_device(**tensors)
