"""Chapter 6 answers: the same names and signatures as ``exercises/ch06.py``."""
import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

# Given (not a task), shared with exercises/ch06.py: read kvlab/scaffold/ch06.py.
from kvlab.scaffold.ch06 import merge_with

from kvlab.validation import check_count


# -- task split_ranges ---------------------------------------------------------------------
def split_ranges(seq_len: int, num_splits: int, block_n: int, max_seq_len: int | None = None) -> list[tuple[int, int]]:
    for name, value in (("seq_len", seq_len), ("num_splits", num_splits), ("block_n", block_n)):
        check_count(name, value, minimum=1)
    if max_seq_len is None:
        max_seq_len = seq_len
    check_count("max_seq_len", max_seq_len, minimum=1)
    if max_seq_len < seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) is shorter than seq_len ({seq_len})")
    per_split = -(-max_seq_len // num_splits)
    per_split = -(-per_split // block_n) * block_n
    return [(min(g * per_split, seq_len), min((g + 1) * per_split, seq_len)) for g in range(num_splits)]


def split_pages(block_table, start: int, end: int, block_size: int) -> list[int]:
    check_count("block_size", block_size, minimum=1)
    if start < 0 or start > end:
        raise ValueError(f"need 0 <= start <= end, got start {start}, end {end}")
    if end > len(block_table) * block_size:
        raise ValueError(f"position {end - 1} is beyond the table's {len(block_table)} blocks of {block_size}")
    if start == end:
        return []
    return [int(b) for b in block_table[start // block_size:(end - 1) // block_size + 1]]


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
