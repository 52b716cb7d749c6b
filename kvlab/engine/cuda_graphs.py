"""CUDA graphs: a decode step replayed as one launch instead of hundreds.

A decode step of an 8B model launches ~10 kernels per layer, ~330 in all; launched one by one
from Python, the launches take longer than the GPU's work (the GPU idles between kernels). A
CUDA graph records the whole forward once and replays it with a single call. What a replay
cannot change is the graph's shapes and addresses, so (as vLLM and nano-vllm do):

* inputs live in **persistent buffers** (token ids, positions, slots, block tables, lengths):
  a step writes its own values into a pinned host twin of them and copies it over in two
  transfers (one per dtype), before the replay;
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

from kvlab.kernel_plan import choose_num_splits
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
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        # Two flat buffers, on the device and pinned on the host, each tensor a view of one:
        # int64 [ids | positions | slots] and int32 [seq_lens | block_tables], so a step's
        # inputs cross over in two copies. The int32 one is copied up to its bucket's table rows.
        pin = device.type == "cuda"
        self.host64 = torch.zeros(3 * tokens, dtype=torch.long, pin_memory=pin)
        self.host32 = torch.zeros(batch + batch * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.host64[2 * tokens:] = -1         # until a step says otherwise, every row is padding:
        self.host32[:batch] = query_len       # no slot written, q keys read from block 0
        self.dev64, self.dev32 = self.host64.to(device), self.host32.to(device)
        self.input_ids, self.positions, self.slot_mapping = self.dev64.view(3, tokens)
        self.seq_lens = self.dev32[:batch]
        self.block_tables = self.dev32[batch:].view(batch, self.max_blocks)
        self.query_lens = torch.full((batch,), query_len, dtype=torch.int32, device=device)
        self.cu_query_lens = torch.arange(0, tokens + 1, query_len, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size that holds ``batch`` sequences, or None."""
        return next((b for b in self.batch_sizes if b >= batch), None)

    def context(self, batch: int) -> AttentionContext:
        """The context a graph of ``batch`` sequences reads: views of the persistent buffers."""
        tokens = batch * self.query_len
        splits = None
        if self.query_len == 1:   # fixed at capture, from the longest sequence the engine allows
            sms = torch.cuda.get_device_properties(self.kv_cache.k.device).multi_processor_count
            splits = choose_num_splits(batch, self.kv_cache.num_kv_heads, self.max_model_len, sms,
                                       quantised=self.kv_cache.quantized)
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
        q, width = self.query_len, self.batch_sizes[-1] * self.query_len
        ids64, lens32 = self.host64.numpy(), self.host32.numpy()
        tables = lens32[self.batch_sizes[-1]:].reshape(-1, self.max_blocks)
        for row, values in enumerate((input_ids, positions, slot_mapping)):
            ids64[row * width:row * width + batch * q] = values
            ids64[row * width + batch * q:row * width + bucket * q] = -1 if row == 2 else 0   # padding
        lens32[:batch] = seq_lens
        lens32[batch:bucket] = q          # padding rows: q keys of block 0 (tables[row, 0] is valid)
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = table
        self.dev64.copy_(self.host64, non_blocking=True)
        used = self.batch_sizes[-1] + bucket * self.max_blocks
        self.dev32[:used].copy_(self.host32[:used], non_blocking=True)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch * q]
