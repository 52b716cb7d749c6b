"""The first Triton kernel of the course: ``out = x + y``, one block of elements per program."""
import torch
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)                      # which block of the vector this program owns
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n                          # the last block may run past the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, block: int = 256) -> torch.Tensor:
    if x.shape != y.shape or x.device != y.device:
        raise ValueError(f"x {list(x.shape)} on {x.device} and y {list(y.shape)} on {y.device} must match")
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    add_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
    return out
