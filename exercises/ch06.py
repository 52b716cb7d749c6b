"""Chapter 6 exercises: FlashDecoding's split ranges and its log-sum-exp merge.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch06                                 # in a terminal
    kvlab.check("ch06")                              # in the notebook
    pytest tests/graded -m ch06 --impl=exercises     # the same tests, raw

Tasks: ``split_ranges`` (split_ranges and split_pages: which tokens and which pages each split
program reads), ``merge_splits`` (stage 2 in PyTorch), ``merge_kernel`` (the body of the
stage-2 Triton kernel). Then ``use_my_decoding`` (given) serves text from the engine with your
pieces as its attention. Stuck? ``kvlab.use_solution("ch06")`` swaps in the answer and keeps
yours as ``exercises/ch06_mine.py``.

Conventions, as in ``kvlab.kernels.paged_decode``: split ``g`` of a sequence produces its
*normalised* partial output ``out_g = sum_i exp(s_i - m_g) v_i / l_g`` over its tokens, and
``lse_g = m_g + log(l_g)`` with ``m_g`` the split's largest score and ``l_g = sum_i exp(s_i - m_g)``.
A split that holds no token has ``lse_g = -inf``, and its partial output may hold anything
(NaN included): it must carry no weight.
"""
import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

# Given (not a task), shared with solutions/ch06.py: read kvlab/scaffold/ch06.py.
from kvlab.scaffold.ch06 import PIECES, merge_with, my_decoding_user  # noqa: F401


# -- task split_ranges ---------------------------------------------------------------------
def split_ranges(seq_len: int, num_splits: int, block_n: int, max_seq_len: int | None = None) -> list[tuple[int, int]]:
    """The token range ``[start, end)`` each of the ``num_splits`` split programs reads of one sequence.

    Every split has the same length, ``tokens_per_split`` = ceil(max_seq_len / num_splits)
    rounded *up* to a multiple of ``block_n`` (the kernel reads whole tiles of ``block_n``
    tokens); split ``g`` starts at ``g * tokens_per_split``. Cut every range at ``seq_len``:
    an empty split is ``(seq_len, seq_len)``. Return exactly ``num_splits`` pairs.

    ``max_seq_len`` (default: ``seq_len``) is the length the splits are cut from.
    ``decode_split_kernel`` cuts each sequence by its own length: the ranges it reads are
    ``split_ranges(seq_len, num_splits, block_n)``, i.e. ``max_seq_len = seq_len``, and a
    sequence of fewer tiles than splits leaves its last splits empty. A larger ``max_seq_len``
    gives the ranges of a kernel that cuts every sequence of a launch by one shared length,
    the longest sequence's (computed on the host): there a short sequence can leave more of
    its last splits empty.

    Errors: TypeError for a count that is not an int; ValueError for ``seq_len``,
    ``num_splits`` or ``block_n`` below 1, or ``max_seq_len < seq_len`` (the splits would
    miss the sequence's last tokens).
    """
    raise NotImplementedError("split_ranges: tokens_per_split = ceil(ceil(max_seq_len / num_splits) / block_n) "
                              "* block_n; split g reads [g * tokens_per_split, (g + 1) * tokens_per_split), cut "
                              "at seq_len")


def split_pages(block_table, start: int, end: int, block_size: int) -> list[int]:
    """The physical pages a split reading positions ``start .. end - 1`` loads, in logical order.

    Position ``pos`` lives in page ``block_table[pos // block_size]``; list each page once
    (a page holds ``block_size`` consecutive positions). An empty range reads no page.
    ValueError if ``start > end``, ``start < 0``, or a position lies beyond the table.
    """
    raise NotImplementedError("split_pages: the logical blocks from start // block_size to (end - 1) // block_size, "
                              "looked up in the block table")


# -- task merge_splits ---------------------------------------------------------------------
def merge_splits(partial_out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Stage 2: merge the splits' partial outputs into the attention output.

    ``partial_out`` is ``[..., num_splits, head_dim]`` (normalised partial outputs), ``lse``
    ``[..., num_splits]``; returns ``[..., head_dim]`` in ``partial_out``'s dtype, computed in
    float32 at least (float64 stays float64).

        out = sum_g exp(lse_g - lse_max) * out_g / sum_g exp(lse_g - lse_max)

    * subtract the largest lse of each row before ``exp``: lse can be in the thousands;
    * an empty split (lse = -inf) gets weight 0 and its partial output (anything, even NaN)
      must not reach the result; every row has at least one non-empty split.

    Errors: TypeError if an argument is not a tensor; ValueError unless ``lse.shape ==
    partial_out.shape[:-1]``.
    """
    raise NotImplementedError("merge_splits: weights = exp(lse - max lse), zero out the partials of empty splits, "
                              "then a weighted average over the split dimension")


# -- task merge_kernel ---------------------------------------------------------------------
@triton.jit
def merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, num_splits,
                        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One program merges one row (one sequence's query head): the Triton form of ``merge_splits``.

    * ``partial_ptr``: float32 ``[rows, num_splits, HEAD_DIM]``, contiguous: the row's split
      ``g`` starts at element ``(row * num_splits + g) * HEAD_DIM``;
    * ``lse_ptr``: float32 ``[rows, num_splits]``; ``out_ptr``: ``[rows, HEAD_DIM]`` in any float
      dtype (cast with ``.to(out_ptr.dtype.element_ty)``);
    * ``tl.arange`` needs a power of two: load ``SPLITS_PAD >= num_splits`` splits and mask the
      padding (lse -inf for padding makes its weight 0);
    * an empty split (lse = -inf) may hold NaN in ``partial_ptr``: mask it out of the load.
    * ``&`` of two block masks is fine (``(splits < num_splits) & (lse > float("-inf"))``); a
      block ``&`` a scalar condition (``(dims < HEAD_DIM) & (row >= 0)``) runs on a GPU but Triton
      3.9's CPU interpreter rejects it ("mask has unsupported dtype"): fold the scalar into the
      bound instead, ``dims < tl.where(row >= 0, HEAD_DIM, 0)``, so the mask is one comparison.
    """
    raise NotImplementedError("merge_splits_kernel: load the row's lse (masked), weights = exp(lse - max), load the "
                              "partials of splits that exist and hold tokens, store sum(w * partial) / sum(w)")


# Given: merge_with_kernel(partial_out, lse, dtype=None) launches your kernel.
merge_with_kernel = merge_with(merge_splits_kernel)


# Given: use_my_decoding(pieces=PIECES, **settings), an LLM whose attention backend runs your pieces.
use_my_decoding = my_decoding_user(split_ranges, split_pages, merge_splits, merge_with_kernel)
