"""ModelRunner: owns the model and its paged KV cache, and runs one scheduled step.

A step, as the runner does it::

    copy the step's copy-on-write blocks          kvlab.kernels.copy_blocks
    pack every scheduled sequence's new tokens    input_ids [T], positions [T]
    say where they go and what each one reads     AttentionContext (slots, block tables)
    forward                                       every layer writes its K/V, then attends
    logits of each sequence's last token only     [batch, vocab]
    sample                                        one token per sequence (forks share a row)

**How big the cache is** (the number of blocks, decided once, here):

* ``num_gpu_blocks`` given: exactly that many.
* On a GPU: what ``gpu_memory_utilization`` of the device's memory leaves once the weights,
  whatever else is already allocated, and the activations of one full-size warm-up step
  (``max_num_batched_tokens`` tokens) are paid for; vLLM sizes its cache the same way.
* On the CPU: enough blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens,
  but at most :data:`CPU_KV_CACHE_BYTES` of memory.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from kvlab.engine.sampler import SamplerOutput, sample
from kvlab.engine.scheduler import SchedulerOutput
from kvlab.models.attention import AttentionContext, attention_backends, use_attention_backend
from kvlab.paging.block_pool import blocks_needed, check_count, slot_mapping
from kvlab.paging.kv_cache import allocate_kv_cache

CPU_KV_CACHE_BYTES = 1 << 30  # the most memory the KV cache takes on the CPU by default (1 GiB)


def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V of ``block_size`` tokens in every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def pick_attention_backend(name: str | None, device: torch.device) -> str | None:
    """The paged-attention backend a runner uses; None means whichever is active globally.

    ``"auto"``: the Triton kernels (a backend registered as ``"triton"``) on a GPU, else the
    active one (the PyTorch reference, unless changed): in Triton's CPU interpreter the
    kernels are correct but far slower than PyTorch.
    """
    if name == "auto":
        return "triton" if device.type == "cuda" and "triton" in attention_backends() else None
    if name is not None and name not in attention_backends():
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(attention_backends())}")
    return name


class ModelRunner:
    """The model, its KV cache, and the step that turns a schedule into sampled tokens."""

    def __init__(self, model, block_size: int = 16, num_gpu_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 attention_backend: str | None = "auto"):
        check_count("block_size", block_size, minimum=1)
        self.model = model
        self.config = model.config
        self.device = model.device
        self.block_size = block_size
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.attention_backend = pick_attention_backend(attention_backend, self.device)
        if num_gpu_blocks is None:
            num_gpu_blocks = self.default_num_blocks(gpu_memory_utilization, max_num_seqs, max_num_batched_tokens)
        check_count("num_gpu_blocks", num_gpu_blocks, minimum=1)
        c = self.config
        self.kv_cache = allocate_kv_cache(c.num_layers, num_gpu_blocks, block_size, c.num_kv_heads, c.head_dim,
                                          dtype=model.dtype, device=self.device)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # -- sizing the cache ------------------------------------------------------------------
    def default_num_blocks(self, gpu_memory_utilization: float, max_num_seqs: int,
                           max_num_batched_tokens: int) -> int:
        per_block = block_bytes(self.config, self.block_size, self.model.dtype)
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget(gpu_memory_utilization, max_num_batched_tokens)
            if budget < per_block:
                raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                                 f"{gpu_memory_utilization}: raise it, or pass num_gpu_blocks")
            return int(budget // per_block)
        wanted = max_num_seqs * blocks_needed(self.max_model_len, self.block_size)
        return max(1, min(wanted, CPU_KV_CACHE_BYTES // per_block))

    def _gpu_kv_budget(self, utilization: float, max_num_batched_tokens: int) -> float:
        """Bytes the cache may take: ``utilization`` of the device, less what is in use now and
        the activation peak of a warm-up step of ``max_num_batched_tokens`` tokens."""
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        num_tokens = min(max_num_batched_tokens, self.max_model_len)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device))
            self.model.compute_logits(hidden[-min(num_tokens, 256):]).float()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        del hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total * utilization - (total - free) - activations

    def new_generator(self, seed: int) -> torch.Generator:
        """A random generator on the model's device, seeded (one per sample of a request)."""
        return torch.Generator(device=self.device).manual_seed(seed)

    # -- one step ------------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed ``input_ids``, ``positions`` and the index of each sequence's last token."""
        ids, positions, last, end = [], [], [], 0
        for item in out.scheduled:
            stop = item.start + item.num_new
            ids += item.seq.token_ids[item.start:stop]
            positions += range(item.start, stop)
            end += item.num_new
            last.append(end - 1)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), as_tensor(last)

    def build_context(self, out: SchedulerOutput, pool) -> AttentionContext:
        """Where the step's new tokens go (``slot_mapping``) and what each sequence reads.

        Built here rather than with ``AttentionContext.from_pool``: the pool's own slot
        mapping refuses any write into a block that several sequences hold, a guard against
        bypassing copy-on-write. One write into such a block is legitimate, and the engine
        makes it: with prefix caching, a request admitted in the same step as another may
        already find the blocks that the other is filling for the first time in this very
        step (their hashes are registered when the blocks are booked). That is safe because
        every layer writes the whole step's K/V before any sequence attends.
        """
        tables = [pool.block_table(item.seq.seq_id) for item in out.scheduled]
        slots = [slot for item, table in zip(out.scheduled, tables)
                 for slot in slot_mapping(table, item.start, item.num_new, self.block_size)]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        ints = lambda x, dtype=torch.int32: torch.tensor(x, dtype=dtype, device=self.device)  # noqa: E731
        seq_lens = [item.start + item.num_new for item in out.scheduled]
        query_lens = [item.num_new for item in out.scheduled]
        return AttentionContext(
            kv_cache=self.kv_cache,
            slot_mapping=ints(slots, torch.int64),
            block_tables=ints(padded),
            seq_lens=ints(seq_lens),
            query_lens=ints(query_lens),
            validate=False,
            max_seq_len=max(seq_lens),
            max_query_len=max(query_lens),
            cu_query_lens=ints([0, *itertools.accumulate(query_lens)]),
        )

    def apply_copies(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: make each ``dst`` block hold what ``src`` holds, in every layer."""
        if not pairs:
            return
        from kvlab.kernels import copy_blocks

        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device).reshape(-1, 2)
        copy_blocks([self.kv_cache.k, self.kv_cache.v], mapping, validate=False)

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput, pool) -> torch.Tensor:
        """Apply the step's copies, run the forward, return ``[len(out.sample_seqs), vocab]`` logits."""
        self.apply_copies(out.blocks_to_copy)
        if not out.scheduled:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        input_ids, positions, last = self.prepare_inputs(out)
        ctx = self.build_context(out, pool)
        with self._backend():
            hidden = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden[last]).float()
        rows = [i for i, item in enumerate(out.scheduled) for _ in range(1 + len(item.forks))]
        return logits[rows] if len(rows) != len(out.scheduled) else logits

    def execute(self, out: SchedulerOutput, pool) -> SamplerOutput:
        """Run the step and sample one token for each of ``out.sample_seqs``."""
        logits = self.compute_logits(out, pool)
        seqs = out.sample_seqs
        if not seqs:
            return SamplerOutput(torch.empty(0, dtype=torch.long), torch.empty(0))
        params = [s.params for s in seqs]
        return sample(logits, [p.temperature for p in params], [p.top_k for p in params],
                      [p.top_p for p in params], [s.generator for s in seqs])

    def _backend(self):
        if self.attention_backend is None:
            return contextlib.nullcontext()
        return use_attention_backend(self.attention_backend)
