"""CUDA graphs: a decode step replayed as one launch instead of hundreds.

A decode step of an 8B model launches ~10 kernels per layer, ~330 in all; launched one by one
from Python, the launches take longer than the GPU's work (the GPU idles between kernels). A
CUDA graph records the whole forward once and replays it with a single call. What a replay
cannot change is the graph's shapes and addresses, so (as vLLM and nano-vllm do):

* inputs live in **persistent buffers** (token ids, positions, slots, block tables, lengths):
  a step copies its own values into them before the replay;
* the batch is padded up to a **bucket** (1, 2, 4, 8, 16, 24, ...), one graph per bucket;
  padding rows write to no slot (slot -1) and their outputs are ignored;
* the kernels' grids depend on nothing the step changes: ``paged_decode``'s split count is
  fixed per bucket at capture, and each sequence's split length is computed on the device
  from its own length.

A graph's phase is ``"decode"`` (``query_len`` 1) or ``"uniform"`` (``query_len`` q > 1 tokens
per sequence, speculative verification), which runs ``paged_prefill`` instead.
"""
from __future__ import annotations

import torch

from kvlab.models.context import DECODE, UNIFORM, AttentionContext


class CudaGraphs:
    """One captured forward (ids -> logits) per batch-size bucket, for steps of ``query_len``
    tokens per sequence."""

    def __init__(self, model, kv_cache, backend, batch_sizes: list[int], max_model_len: int,
                 query_len: int = 1):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.batch_sizes = sorted(batch_sizes)
        self.query_len = query_len
        self.max_model_len = max_model_len
        device = kv_cache.k.device
        batch, tokens = self.batch_sizes[-1], self.batch_sizes[-1] * query_len
        max_blocks = -(-max_model_len // kv_cache.block_size)
        zeros = lambda *shape, dtype=torch.int32: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = zeros(tokens, dtype=torch.long)
        self.positions = zeros(tokens, dtype=torch.long)
        self.slot_mapping = zeros(tokens, dtype=torch.long)
        self.block_tables = zeros(batch, max_blocks)
        self.seq_lens = zeros(batch)
        self.query_lens = torch.full((batch,), query_len, dtype=torch.int32, device=device)
        self.cu_query_lens = torch.arange(0, tokens + 1, query_len, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size that holds ``batch`` sequences, or None."""
        return next((b for b in self.batch_sizes if b >= batch), None)

    def context(self, batch: int) -> AttentionContext:
        """The context a graph of ``batch`` sequences reads: views of the persistent buffers."""
        from kvlab.kernels.paged_decode import choose_num_splits

        tokens = batch * self.query_len
        splits = None
        if self.query_len == 1:   # fixed at capture, from the longest sequence the engine allows
            sms = torch.cuda.get_device_properties(self.kv_cache.k.device).multi_processor_count
            splits = choose_num_splits(batch, self.kv_cache.num_kv_heads, self.max_model_len, sms)
        return AttentionContext(
            kv_cache=self.kv_cache, slot_mapping=self.slot_mapping[:tokens], block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch], query_lens=self.query_lens[:batch],
            phase=DECODE if self.query_len == 1 else UNIFORM, backend=self.backend,
            max_seq_len=self.max_model_len, max_query_len=self.query_len,
            cu_query_lens=self.cu_query_lens[:batch + 1], num_splits=splits)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Record one graph per bucket, largest first, all in one memory pool."""
        from tqdm.auto import tqdm

        self._pad(0, self.batch_sizes[-1])        # capture-time inputs write nowhere
        pool = torch.cuda.graph_pool_handle()
        sizes = sorted(self.batch_sizes, reverse=True)
        for batch in tqdm(sizes, desc=f"Capturing CUDA graphs (q={self.query_len})", disable=not progress,
                          dynamic_ncols=True):
            tokens = batch * self.query_len
            ctx = self.context(batch)
            ids, positions = self.input_ids[:tokens], self.positions[:tokens]

            def forward():
                return self.model.compute_logits(self.model(ids, positions, ctx))

            forward()                              # warm-up: compile kernels, size cuBLAS workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward()
            self.graphs[batch] = (graph, logits)
        torch.cuda.synchronize()

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            block_tables: list[list[int]], seq_lens: list[int]) -> torch.Tensor:
        """Copy one step's inputs into the buffers, replay its bucket's graph; returns the
        logits of the step's tokens (a view of the graph's output: use it before the next run)."""
        batch = len(seq_lens)
        bucket = self.bucket(batch)
        tokens = batch * self.query_len
        self.input_ids[:tokens].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:tokens].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:tokens].copy_(torch.tensor(slot_mapping), non_blocking=True)
        self.seq_lens[:batch].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        width = max(len(t) for t in block_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        self.block_tables[:batch, :width].copy_(table, non_blocking=True)
        self._pad(batch, bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:tokens]

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start .. end - 1`` become padding: no cache write, a harmless short read."""
        if end > start:
            q = self.query_len
            self.slot_mapping[start * q:end * q] = -1
            self.input_ids[start * q:end * q] = 0
            self.positions[start * q:end * q] = 0
            self.seq_lens[start:end] = q
