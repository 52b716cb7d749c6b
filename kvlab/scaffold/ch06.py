"""Chapter 6, given: the launcher of the stage-2 merge kernel."""
import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton


def merge_with(merge_splits_kernel):
    """``merge_with_kernel(partial_out, lse, dtype=None)``, launching ``merge_splits_kernel``."""

    def merge_with_kernel(partial_out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Launch the kernel (given): ``partial_out [..., num_splits, D]``, ``lse [..., num_splits]`` -> ``[..., D]``."""
        *lead, num_splits, head_dim = partial_out.shape
        partial = partial_out.reshape(-1, num_splits, head_dim).to(torch.float32).contiguous()
        lse_rows = lse.reshape(-1, num_splits).to(torch.float32).contiguous()
        out = torch.empty(partial.shape[0], head_dim, dtype=dtype or partial_out.dtype, device=partial_out.device)
        merge_splits_kernel[(partial.shape[0],)](partial, lse_rows, out, num_splits, HEAD_DIM=head_dim,
                                                 SPLITS_PAD=triton.next_power_of_2(num_splits))
        return out.reshape(*lead, head_dim)

    return merge_with_kernel
