"""ModelRunner: owns the model and its paged KV cache, and runs one scheduled step.

A step, as the runner does it::

    swap blocks out to the host tier and back     kvlab.engine.offload (chapter 9)
    copy the step's copy-on-write blocks          kvlab.kernels.copy_blocks
    pack every scheduled sequence's new tokens    input_ids [T], positions [T]
    say where they go and what each one reads     AttentionContext (slots, block tables, phase)
    forward                                       every layer writes its K/V, then attends
    logits of each sequence's last token only     [batch, vocab]
    (then LLM.step samples, on the device         one token per sequence (forks share a row))

A **decode** step (one new token per sequence) whose batch fits a captured bucket replays a
CUDA graph (:mod:`kvlab.engine.cuda_graphs`); every other step runs eagerly. Attention goes
through the runner's backend (:mod:`kvlab.models.backends`): on a GPU the course's kernels,
``paged_decode`` for decode steps and ``paged_prefill`` for the rest.

**How big the cache is** (the number of blocks, decided once, here):

* ``num_gpu_blocks`` given: exactly that many.
* On a GPU: what ``gpu_memory_utilization`` of the device's memory leaves once the weights,
  whatever else is already allocated, the activations of one full-size step
  (``max_num_batched_tokens`` tokens) and those the CUDA graphs keep are paid for; vLLM sizes
  its cache the same way.
* On the CPU: enough blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens,
  but at most :data:`CPU_KV_CACHE_BYTES` of memory.

``swap_space`` (GiB, vLLM's name) adds a host tier of that size for swapped-out sequences.

At tensor parallelism N each rank's cache holds its own ``KV / N`` KV heads under the same
block ids, so a block costs each rank ``1/N`` of its bytes; every rank sizes its own and they
take the smallest count (:mod:`kvlab.engine.tensor_parallel`).
"""
from __future__ import annotations

import itertools

import torch

from kvlab.accounting import kv_cache_bytes_per_token
from kvlab.engine.cuda_graphs import CudaGraphs
from kvlab.engine.offload import HostKVCache
from kvlab.engine.scheduler import SchedulerOutput
from kvlab.models.backends import get_attention_backend
from kvlab.models.context import DECODE, UNIFORM, build_attention_context, step_phase
from kvlab.paging.block_pool import blocks_needed, check_count
from kvlab.paging.kv_cache import allocate_kv_cache
from kvlab.quantization import kv_cache_format

CPU_KV_CACHE_BYTES = 1 << 30  # the most memory the KV cache takes on the CPU by default (1 GiB)


def block_bytes(config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block: K and V of ``block_size`` tokens in every layer (chapter 1's formula),
    as ``kv_cache_dtype`` stores them (scales included)."""
    return block_size * kv_cache_bytes_per_token(config.spec(), kv_cache_dtype, str(dtype).removeprefix("torch."))


def pick_attention_backend(backend, device: torch.device):
    """The runner's backend: ``"auto"`` is the Triton kernels on a GPU and the batched PyTorch
    path on the CPU (in Triton's interpreter the kernels are correct but far slower)."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    return get_attention_backend(backend)


class ModelRunner:
    """The model, its KV cache, and the step that turns a schedule into sampled tokens."""

    def __init__(self, model, *, block_size: int = 16, num_gpu_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 attention_backend="auto", enforce_eager: bool = False,
                 cudagraph_batch_sizes: list[int] | None = None, extra_block_bytes: int = 0,
                 kv_cache_dtype: str = "auto", swap_space: float = 0):
        check_count("block_size", block_size, minimum=1)
        self.extra_block_bytes = check_count("extra_block_bytes", extra_block_bytes)
        self.model = model.fuse()
        self.config = model.config
        self.tp = model.tp                    # this rank of a tensor-parallel group (size 1: alone)
        self.device = model.device
        self.block_size = block_size
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.backend = pick_attention_backend(attention_backend, self.device)
        self.kv_cache_dtype = kv_cache_dtype
        if kv_cache_format(kv_cache_dtype) is not None and "k_scale" not in self.backend.hints:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs an attention backend that reads a quantised "
                             f"cache (its signature takes k_scale and v_scale); {self.backend.name!r} does not")
        use_graphs = self.device.type == "cuda" and not enforce_eager and self.backend.cuda_graph_safe
        graph_sizes = (cudagraph_batch_sizes or [1, 2, 4, 8]) if use_graphs else []
        if num_gpu_blocks is None:
            num_gpu_blocks = self.default_num_blocks(gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
                                                     max(graph_sizes, default=0))
            num_gpu_blocks = self.tp.agree_min(num_gpu_blocks, self.device)
        check_count("num_gpu_blocks", num_gpu_blocks, minimum=1)
        c, kv_heads = self.config, self.config.num_kv_heads // self.tp.size     # this rank's KV heads
        self.kv_cache = allocate_kv_cache(c.num_layers, num_gpu_blocks, block_size, kv_heads, c.head_dim,
                                          dtype=model.dtype, device=self.device, kv_cache_dtype=kv_cache_dtype)
        # chapter 9: the host tier, swap_space GiB of (pinned) host memory in blocks like the cache's
        host_blocks = int(swap_space * 2**30) // (self.kv_cache.nbytes // num_gpu_blocks)
        self.host_cache = HostKVCache(self.kv_cache, host_blocks) if host_blocks else None
        self.graphs = None                                   # decode steps
        self.uniform_graphs: dict[int, CudaGraphs] = {}      # steps of q > 1 tokens per sequence, by q
        self._graph_sizes = graph_sizes
        if graph_sizes:
            self.graphs = CudaGraphs(self.model, self.kv_cache, self.backend, graph_sizes, self.max_model_len)
            self.graphs.capture()

    def capture_uniform_graphs(self, query_len: int) -> None:
        """Also replay steps of ``query_len`` new tokens for every sequence (the uniform phase:
        verifying k + 1 speculative tokens) from CUDA graphs, one per batch-size bucket. Their
        activations come out of what the cache left (``gpu_memory_utilization``'s headroom).
        Without graphs (CPU, ``enforce_eager``) it does nothing."""
        check_count("query_len", query_len, minimum=2)
        if self._graph_sizes and query_len not in self.uniform_graphs:
            graphs = CudaGraphs(self.model, self.kv_cache, self.backend, self._graph_sizes, self.max_model_len,
                                query_len=query_len)
            graphs.capture()
            self.uniform_graphs[query_len] = graphs

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # -- sizing the cache ------------------------------------------------------------------
    def default_num_blocks(self, gpu_memory_utilization: float, max_num_seqs: int, max_num_batched_tokens: int,
                           max_graph_batch: int = 0) -> int:
        # extra_block_bytes: what each block costs elsewhere (a draft model's cache of as many blocks)
        # Never more blocks than max_num_seqs full-length sequences can fill. (vLLM takes the whole
        # budget; capping it lets a notebook keep several small engines in one process.)
        per_block = (block_bytes(self.config, self.block_size, self.model.dtype, self.kv_cache_dtype) // self.tp.size
                     + self.extra_block_bytes)
        wanted = max_num_seqs * blocks_needed(self.max_model_len, self.block_size)
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget(gpu_memory_utilization, max_num_batched_tokens, max_graph_batch)
            if budget < per_block:
                raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                                 f"{gpu_memory_utilization}: raise it, or pass num_gpu_blocks")
            return int(min(wanted, budget // per_block))
        return max(1, min(wanted, CPU_KV_CACHE_BYTES // per_block))

    def _gpu_kv_budget(self, utilization: float, max_num_batched_tokens: int, max_graph_batch: int) -> float:
        """Bytes the cache may take: ``utilization`` of the device, less what is in use now, the
        activation peak of a step of ``max_num_batched_tokens`` tokens (memory the caching
        allocator keeps), and that of the largest graph's step (memory its graph pool keeps)."""
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        activations = self._activation_peak(min(max_num_batched_tokens, self.max_model_len), all_logits=False)
        if max_graph_batch:
            activations += self._activation_peak(max_graph_batch, all_logits=True)
        free, total = torch.cuda.mem_get_info(self.device)
        return total * utilization - (total - free) - activations

    @torch.inference_mode()
    def _activation_peak(self, num_tokens: int, all_logits: bool) -> int:
        """Peak bytes allocated by one forward of ``num_tokens`` tokens (no cache: plain attention)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        hidden = self.model(ids, positions)
        self.model.compute_logits(hidden if all_logits else hidden[-min(num_tokens, 256):]).float()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden
        torch.cuda.empty_cache()
        return peak

    def new_generator(self, seed: int) -> torch.Generator:
        """A random generator on the model's device, seeded (one per sample of a request)."""
        return torch.Generator(device=self.device).manual_seed(seed)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Apply the step's copies, run the forward, return float32 logits: for each scheduled
        sequence, those of its last ``1 + len(spec_token_ids)`` tokens (one row, or the k + 1
        rows that verify its drafts), its last row repeated for the samples forked off it."""
        self.apply_copies(out.blocks_to_copy)
        if not out.scheduled:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        items = out.scheduled
        ids = [t for s in items for t in s.token_ids]
        positions = [p for s in items for p in range(s.start, s.seq_len)]
        query_lens = [s.num_new for s in items]
        rows = []
        for s, end in zip(items, itertools.accumulate(query_lens)):
            rows += range(end - s.num_logits, end)
            rows += [end - 1] * len(s.forks)
        return self.run(ids, positions, [s.block_table for s in items], [s.start for s in items], query_lens,
                        out.slot_mapping(), rows)

    @torch.inference_mode()
    def run(self, ids, positions, tables, starts, query_lens, slots, rows) -> torch.Tensor:
        """One forward of a step given as host lists; the float32 logits of the packed token
        rows ``rows``. Replays a CUDA graph when one fits, else runs eagerly."""
        every_row = rows == list(range(len(ids)))      # a decode step: no rows to pick
        graphs = self._graphs_for(query_lens)
        if graphs is not None:
            seq_lens = [start + q for start, q in zip(starts, query_lens)]
            logits = graphs.run(ids, positions, slots, tables, seq_lens)
            return (logits if every_row else logits[rows]).float()
        hidden = self.forward(ids, positions, tables, starts, query_lens, slots)
        if not every_row:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden).float()

    def _graphs_for(self, query_lens: list[int]) -> CudaGraphs | None:
        """The captured graphs that can replay a step of these query lengths, or None (eager)."""
        phase = step_phase(query_lens)
        graphs = self.graphs if phase == DECODE else self.uniform_graphs.get(query_lens[0]) if phase == UNIFORM \
            else None
        return graphs if graphs is not None and graphs.bucket(len(query_lens)) else None

    def forward(self, ids, positions, tables, starts, query_lens, slots) -> torch.Tensor:
        """An eager forward of one step from host lists: the hidden states of every new token."""
        ctx = build_attention_context(self.kv_cache, tables, starts, query_lens, slots, backend=self.backend)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return self.model(as_tensor(ids), as_tensor(positions), ctx)

    def apply_swaps(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Swap a step's blocks out to the host tier (``(device, host)`` pairs) and back in
        (``(host, device)``), one transfer per host run (a sequence's blocks), before the step's
        copies and forward. Out goes first: a block swapped out may be taken by the swap-ins or
        the new tokens of the same step."""
        for device_blocks, host_blocks in _runs(swap_out, host_first=False):
            self.host_cache.swap_out(device_blocks, host_blocks)
        for device_blocks, host_blocks in _runs(swap_in, host_first=True):
            self.host_cache.swap_in(host_blocks, device_blocks)

    def apply_copies(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: make each ``dst`` block hold what ``src`` holds, in every layer."""
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device).reshape(-1, 2)
        if self.device.type == "cuda":
            from kvlab.kernels import copy_blocks

            copy_blocks(self.kv_cache.block_tensors(), mapping, validate=False)
        else:                       # the CPU profile: PyTorch, not the interpreter
            from kvlab.reference import copy_blocks_ref

            copy_blocks_ref(self.kv_cache.block_tensors(), mapping)


def _runs(pairs, host_first: bool):
    """Split (device, host) block pairs (or (host, device)) into runs of consecutive host
    blocks: ``[(device_blocks, host_blocks), ...]``, one transfer each."""
    runs = []
    for pair in pairs:
        host, device = pair if host_first else pair[::-1]
        if runs and runs[-1][1][-1] + 1 == host:
            runs[-1][0].append(device)
            runs[-1][1].append(host)
        else:
            runs.append(([device], [host]))
    return runs
