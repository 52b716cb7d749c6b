"""Chapter 6, given: the launcher of the stage-2 merge kernel, and ``use_my_decoding``, which
serves an ``LLM`` whose attention runs your pieces."""
import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch
import triton

from kvlab import kernel_plan
from kvlab.engine import LLM
from kvlab.engine.spec_decode import DEFAULT_DRAFT_MODEL
from kvlab.kernels.paged_decode import merge_splits_kernel as course_merge_splits_kernel
from kvlab.scaffold import check_pieces, is_written

PIECES = ("split_ranges", "split_pages", "merge_splits", "merge_splits_kernel")
NUM_SPLITS, BLOCK_N = 4, 16     # every decode step cuts each sequence into 4 splits of whole 16-token tiles
# The engine of the chapter's last section: the course's smaller model (4 layers, 2 query heads
# over 1 KV head), so that Triton's CPU interpreter keeps up, in float32 on a GPU too (as the given
# attention computes, so that the two engines' tokens compare); prompts go in chunks of 8 tokens,
# so most chunks have a cached prefix to merge with (chapter 8 schedules such chunks).
ENGINE_SETTINGS = {"model": DEFAULT_DRAFT_MODEL, "dtype": "float32", "max_model_len": 128,
                   "long_prefill_token_threshold": 8}


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


def attend(q, k, v, sm_scale: float, causal: bool):
    """One split's attention, in float32: ``(out, lse)``, ``out`` normalised ``[num_q, num_heads, D]``
    and ``lse [num_q, num_heads]``. ``q`` is ``[num_q, num_heads, D]``, ``k``/``v`` ``[num_k,
    num_kv_heads, D]``; ``causal``: the queries are the last ``num_q`` of the keys' positions.
    No keys: ``out`` 0 and ``lse`` -inf, as ``decode_split_kernel`` writes for an empty split."""
    num_q, num_heads, head_dim = q.shape
    if k.shape[0] == 0:
        return (q.new_zeros(q.shape, dtype=torch.float32),
                q.new_full((num_q, num_heads), float("-inf"), dtype=torch.float32))
    group = num_heads // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale                   # [H, num_q, num_k]
    if causal:
        num_k = k.shape[0]
        hidden = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).triu_(num_k - num_q + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out, scores.logsumexp(dim=-1).transpose(0, 1)


def read_positions(cache, pages: list[int], start: int, end: int) -> torch.Tensor:
    """Positions ``start .. end - 1`` of a sequence, ``[end - start, num_kv_heads, D]``, read from
    ``pages``: the pages that hold them, in logical order (``split_pages``)."""
    block_size = cache.shape[1]
    if start == end:
        return cache.new_empty(0, *cache.shape[2:])
    rows = cache[torch.as_tensor(pages, dtype=torch.long, device=cache.device)].reshape(-1, *cache.shape[2:])
    first = start % block_size
    if rows.shape[0] < first + end - start:
        raise ValueError(f"split_pages gave {len(pages)} pages for positions {start}..{end - 1}, which span "
                         f"{(end - 1) // block_size - start // block_size + 1} pages of {block_size}")
    return rows[first:first + end - start]


def decoding_backend_with(split_ranges, split_pages, merge_splits, merge_with_kernel):
    """An attention backend (:mod:`kvlab.models.backends`) that runs chapter 6's pieces.

    * A decode step: each sequence is cut into ``NUM_SPLITS`` ranges (``split_ranges``), each
      range reads its pages (``split_pages``) and attends on its own (``attend``); then one
      launch of ``merge_with_kernel`` merges every sequence's splits.
    * Any other step (prompt chunks): a sequence's new tokens attend to its cached prefix and,
      causally, to themselves, as two splits merged by ``merge_splits`` (the first chunk of a
      prompt has no prefix: an empty split). With ``merge_splits=None`` they attend to all
      their keys as one split, with nothing to merge.
    """

    def read(cache, table, start, end):
        return read_positions(cache, split_pages(table, start, end, cache.shape[1]), start, end)

    def split_kv_backend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *, phase="mixed"):
        tables, lens = block_tables.tolist(), seq_lens.tolist()
        if phase == "decode":
            partials, lses = [], []
            for b, (table, seq_len) in enumerate(zip(tables, lens)):
                ranges = split_ranges(seq_len, NUM_SPLITS, BLOCK_N)
                if len(ranges) != NUM_SPLITS:
                    raise ValueError(f"split_ranges({seq_len}, {NUM_SPLITS}, {BLOCK_N}) gave {len(ranges)} ranges, "
                                     f"expected {NUM_SPLITS}")
                splits = [attend(q[b:b + 1], read(k_cache, table, s, e), read(v_cache, table, s, e), sm_scale, False)
                          for s, e in ranges]
                partials.append(torch.stack([out[0] for out, _ in splits], dim=1))      # [H, splits, D]
                lses.append(torch.stack([lse[0] for _, lse in splits], dim=1))          # [H, splits]
            return merge_with_kernel(torch.stack(partials), torch.stack(lses), dtype=q.dtype)
        out, first = [], 0
        for table, seq_len, query_len in zip(tables, lens, query_lens.tolist()):
            queries, cached = q[first:first + query_len], seq_len - query_len
            first += query_len
            if merge_splits is None:
                keys, values = read(k_cache, table, 0, seq_len), read(v_cache, table, 0, seq_len)
                out.append(attend(queries, keys, values, sm_scale, True)[0])
                continue
            prefix = attend(queries, read(k_cache, table, 0, cached), read(v_cache, table, 0, cached), sm_scale, False)
            new = attend(queries, read(k_cache, table, cached, seq_len), read(v_cache, table, cached, seq_len),
                         sm_scale, True)
            out.append(merge_splits(torch.stack([prefix[0], new[0]], dim=-2), torch.stack([prefix[1], new[1]], dim=-1)))
        return torch.cat(out).to(q.dtype)

    return split_kv_backend


course_merge_with_kernel = merge_with(course_merge_splits_kernel)


def my_decoding_user(split_ranges, split_pages, merge_splits, merge_with_kernel):
    """The function ``use_my_decoding``, bound to one implementation's pieces."""

    def use_my_decoding(pieces=PIECES, **settings):
        """An ``LLM`` (``settings`` as ``LLM``'s) whose attention runs your ``pieces``.

        ``pieces``: a subset of ``PIECES``; the others are the course's
        (``kvlab.kernel_plan.split_token_ranges`` and ``pages_read``, its ``merge_splits_kernel``;
        without ``merge_splits``, prompt chunks are not split). The backend (``decoding_backend_with``) goes in
        through the engine's plug-in point, ``LLM(attention_backend=...)``.
        """
        check_pieces(pieces, PIECES)
        if "attention_backend" in settings:
            raise TypeError("use_my_decoding sets attention_backend itself")
        backend = decoding_backend_with(
            split_ranges if "split_ranges" in pieces else kernel_plan.split_token_ranges,
            split_pages if "split_pages" in pieces else kernel_plan.pages_read,
            merge_splits if "merge_splits" in pieces else None,
            merge_with_kernel if "merge_splits_kernel" in pieces else course_merge_with_kernel)
        return LLM(attention_backend=backend, **settings)

    return use_my_decoding


def written_pieces(module) -> list[str]:
    """The ``PIECES`` of ``module`` (your ``exercises/ch06.py``) that no longer raise NotImplementedError."""
    partial = torch.zeros(1, 2, 16, device=kvlab.profile.DEVICE)
    lse = torch.zeros(1, 2, device=kvlab.profile.DEVICE)
    probes = {"split_ranges": lambda: module.split_ranges(16, 2, 16),
              "split_pages": lambda: module.split_pages([0], 0, 1, 16),
              "merge_splits": lambda: module.merge_splits(partial, lse),
              "merge_splits_kernel": lambda: module.merge_with_kernel(partial, lse)}
    return [name for name, probe in probes.items() if is_written(probe)]
