"""The memory attention needs: the score matrix of naive attention, computed and measured.

Naive attention writes the scores ``S = Q Kᵀ`` (``len_q x len_k`` per head) to memory, then
their softmax ``P`` (the same size), then reads ``P`` back for ``P V``. FlashAttention keeps
both in on-chip tiles and writes only the output. :func:`score_matrix_row` gives the arithmetic;
:func:`peak_memory` measures what a function really allocates, on a CPU or a CUDA device.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _check_length(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class ScoreMatrixRow:
    """The score matrix of one sequence: its size, per head and per layer, and for a whole model."""

    seq_len: int
    elements: int            # seq_len ** 2 scores, per head per layer
    matrix_bytes: int        # elements * bytes per element
    write_read_bytes: int    # written once and read back once: 2 * matrix_bytes
    layer_bytes: int         # every head of a layer materialised at once: num_heads * matrix_bytes
    model_traffic_bytes: int  # write + read, every head of every layer


def score_matrix_row(seq_len: int, bytes_per_element: int = 2, num_heads: int = 1,
                     num_layers: int = 1) -> ScoreMatrixRow:
    """The ``seq_len x seq_len`` score matrix of a prefill, in bytes (2 per element: bf16/fp16)."""
    for name, value in (("seq_len", seq_len), ("bytes_per_element", bytes_per_element),
                        ("num_heads", num_heads), ("num_layers", num_layers)):
        _check_length(name, value)
    elements = seq_len * seq_len
    matrix = elements * bytes_per_element
    return ScoreMatrixRow(seq_len, elements, matrix, 2 * matrix, num_heads * matrix,
                          2 * matrix * num_heads * num_layers)


def _check_attention_args(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, len, head_dim], got shape {list(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} must agree in batch and head_dim")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's {q.shape[1]} heads must be a multiple of k's {k.shape[1]}")


def naive_attention(q, k, v, causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """Attention the textbook way: the whole score matrix goes to memory, then its softmax.

    Shapes as :func:`kvlab.kernels.flash_attention`'s batched form: ``q`` ``[batch, num_heads,
    len_q, head_dim]``, ``k``/``v`` ``[batch, num_kv_heads, len_k, head_dim]``; causal queries
    are the last ``len_q`` positions. Computes in the inputs' dtype.
    """
    _check_attention_args(q, k, v)
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs len_q <= len_k, got {q.shape[2]} > {k.shape[2]}")
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    scores = (q * scale) @ k.transpose(-1, -2)               # [batch, heads, len_q, len_k] in memory
    if causal:
        len_q, len_k = q.shape[2], k.shape[2]
        hidden = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).triu_(len_k - len_q + 1)
        scores.masked_fill_(hidden, float("-inf"))
    probs = scores.softmax(dim=-1)                            # a second matrix of the same size
    return probs @ v


class _NewStorageBytes(TorchDispatchMode):
    """While active, adds up the bytes of every storage a torch op creates, as long as it lives."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Outputs that reuse an argument's storage (views, in-place ops, set_) allocate nothing.
        reused = {x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else x.data_ptr()
                  for x in tree_leaves((args, kwargs)) if isinstance(x, (torch.Tensor, torch.UntypedStorage))}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in reused or key in self._sizes:
                continue
            self._sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


@dataclass(frozen=True)
class PeakMemory:
    """The most memory ``fn`` held at once beyond what existed before it ran, and how it was measured."""

    bytes: int
    method: str


def peak_memory(fn: Callable[[], object], device: str | torch.device = "cpu") -> PeakMemory:
    """Run ``fn()`` and measure the peak of the memory it allocated (its result included).

    On CUDA: ``torch.cuda.max_memory_allocated`` around the call (after one warm-up call, so
    one-time allocations such as cuBLAS workspaces and kernel compilation don't count). On a CPU:
    every storage that torch ops create while ``fn`` runs is counted from its creation until it
    is freed. Memory outside torch tensors (a kernel's registers, or the numpy tiles of Triton's
    interpreter, its stand-in for them) is not counted on either device.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    device = torch.device(device)
    if device.type == "cuda":
        fn()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return PeakMemory(peak, "torch.cuda.max_memory_allocated")
    if device.type != "cpu":
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    with _NewStorageBytes() as counter:
        result = fn()
        del result
    return PeakMemory(counter.peak, "bytes of the tensors torch allocated (CPU)")
