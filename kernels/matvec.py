"""matvec: ``weight @ x``, one row of activations times a weight matrix (a batch-1 linear layer).

At batch 1 a decode step's matrix products are matrix-vector products: each weight is read
once and used for one multiply-add per element, so the time is the time to read the weights
(an 8B model's step reads ~15 GB of them). What matters is keeping enough loads in flight on
every SM. Each program owns ``BLOCK_N`` output rows and walks along K in ``BLOCK_K``-wide tiles,
multiplying in float32 and summing the partial products once at the end; the tile grid has
thousands of programs for a 4096-wide output, enough to cover every SM several times.

Inside a CUDA graph on an H200 this reads the weights at 3.0-4.4 TB/s where cuBLAS's batch-1
kernels read them at 2.4-4.3 (``benchmarks/RESULTS.md``, 2026-12-02): the engine uses it for
the batch-1 decode step's projections (:func:`kvlab.models.ops.linear`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab import profile
from kvlab.kernels.checks import check_out_tensor, check_same_device


@triton.jit
def matvec_kernel(
    x_ptr,                          # [K]
    w_ptr,                          # [N, K], rows contiguous (row stride K)
    out_ptr,                        # [N]
    N, K,
    BLOCK_N: tl.constexpr,          # output rows of one program
    BLOCK_K: tl.constexpr,          # columns of one tile
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    # One float32 partial sum per (row, column of the tile): the reduction across columns
    # happens once, after the loop, instead of once per tile.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        in_k = k + cols < K
        w = tl.load(w_rows + k + cols[None, :], mask=(rows[:, None] < N) & in_k[None, :], other=0.0)
        x = tl.load(x_ptr + k + cols, mask=in_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)


def matvec_config(n: int, k: int) -> dict:
    """Tile sizes and launch settings, from an H200 sweep at an 8B model's shapes: the wide
    gate/up and LM-head products take 16 rows x 256 columns a program; the others 8 x 512.
    With only ~512 programs (4096 output rows) each program runs 8 warps and no pipelining;
    with more, 4 warps and 3 tiles in flight. The interpreter takes small tiles, so short test
    shapes still cross several."""
    if profile.INTERPRETED:
        return dict(BLOCK_N=4, BLOCK_K=32, num_warps=1, num_stages=1)
    if n >= 16384:
        return dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3)
    if n <= 4096:
        return dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, num_stages=1)
    return dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3)


def matvec(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
           validate: bool = True) -> torch.Tensor:
    """``weight @ x`` for ``x [K]`` and ``weight [N, K]`` (``F.linear`` of one row, no bias);
    returns ``[N]`` in ``x``'s dtype (into ``out`` if given). Products are summed in float32."""
    if validate:
        check_matvec_args(x, weight, out)
    n, k = weight.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device) if out is None else out
    if n:
        cfg = matvec_config(n, k)
        matvec_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](x, weight, out, n, k, **cfg)
    return out


def check_matvec_args(x, weight, out=None) -> None:
    """Raise TypeError/ValueError naming the first argument of matvec that breaks a rule."""
    for name, t, dims in (("x", x, "[K]"), ("weight", weight, "[N, K]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != len(dims.split(",")):
            raise ValueError(f"{name} must be {dims}, got shape {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype}, x has {x.dtype}")
    if weight.shape[1] != x.shape[0]:
        raise ValueError(f"weight [N, K] = {list(weight.shape)} needs x of K = {weight.shape[1]} elements, "
                         f"got {x.shape[0]}")
    check_same_device(x=x, weight=weight)
    check_out_tensor(out, [weight.shape[0]], x)
