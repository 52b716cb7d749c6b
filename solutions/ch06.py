"""Chapter 6 answers: the same names and signatures as ``exercises/ch06.py``."""
import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

# The split_ranges answers (split_ranges, split_pages) are the course's own planning, which the
# kernels use: read kvlab/kernel_plan.py.
from kvlab.kernel_plan import pages_read as split_pages  # noqa: F401
from kvlab.kernel_plan import split_token_ranges as split_ranges  # noqa: F401
# Given (not a task), shared with exercises/ch06.py: read kvlab/scaffold/ch06.py.
from kvlab.scaffold.ch06 import PIECES, merge_with, my_decoding_user  # noqa: F401


# -- task merge_splits ---------------------------------------------------------------------
def merge_splits(partial_out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    if not isinstance(partial_out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise TypeError("partial_out and lse must be torch tensors")
    if partial_out.dim() < 2 or lse.shape != partial_out.shape[:-1]:
        raise ValueError(f"lse must have shape partial_out.shape[:-1] = {list(partial_out.shape[:-1])}, "
                         f"got {list(lse.shape)}")
    compute = torch.float64 if partial_out.dtype == torch.float64 else torch.float32
    lse = lse.to(compute)
    weights = torch.exp(lse - lse.amax(dim=-1, keepdim=True))
    partial = torch.where(torch.isneginf(lse)[..., None], 0.0, partial_out.to(compute))
    out = (weights[..., None] * partial).sum(dim=-2) / weights.sum(dim=-1, keepdim=True)
    return out.to(partial_out.dtype)


# -- task merge_kernel ---------------------------------------------------------------------
@triton.jit
def merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, num_splits,
                        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    exists = splits < num_splits
    lse = tl.load(lse_ptr + row * num_splits + splits, mask=exists, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    has_tokens = exists & (lse > float("-inf"))
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=has_tokens[:, None], other=0.0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


# Given: merge_with_kernel(partial_out, lse, dtype=None) launches the kernel.
merge_with_kernel = merge_with(merge_splits_kernel)


# Given: use_my_decoding(pieces=PIECES, **settings), an LLM whose attention backend runs your pieces.
use_my_decoding = my_decoding_user(split_ranges, split_pages, merge_splits, merge_with_kernel)
