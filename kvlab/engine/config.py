"""EngineConfig: every setting of the engine, checked once, in one place.

:class:`~kvlab.engine.LLM` builds one from its keyword arguments (vLLM's names) and hands plain
values from it to the parts it builds: the block pool (``num_blocks``, ``block_size``, prefix
caching), the scheduler (the step's limits) and the model runner (the cache's size, CUDA
graphs, the attention backend). None of them reads the config object itself.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from kvlab.engine.offload import PREEMPTION_MODES
from kvlab.engine.scheduler import check_scheduling
from kvlab.engine.spec_decode import SpeculativeConfig
from kvlab.quantization import kv_cache_format
from kvlab.validation import check_bool, check_count, check_fraction

#: Batch sizes a decode step is padded up to, each replayed from its own CUDA graph (as vLLM).
CUDAGRAPH_BATCH_SIZES = (1, 2, 4, 8, *range(16, 513, 8))


@dataclass
class EngineConfig:
    """The engine's settings (vLLM's names). ``None`` means "decide from the model and the device".

    ``block_size``: tokens per KV block. ``num_gpu_blocks``: the cache's size in blocks (default:
    ``max_num_seqs`` sequences of ``max_model_len``, or less where the GPU has less: what
    ``gpu_memory_utilization`` of it leaves once weights, activations and CUDA graphs are paid
    for).
    ``max_num_seqs``, ``max_num_batched_tokens``: the limits of one step. ``max_model_len``:
    the longest sequence (default: the model's context). ``enable_prefix_caching``: reuse
    cached blocks of identical prefixes. ``enforce_eager``: never use CUDA graphs.
    ``attention_backend``: ``"auto"`` (the Triton kernels on a GPU, the PyTorch reference on
    the CPU), a registered name, or a function (:mod:`kvlab.models.backends`).
    ``dtype``, ``device``: where and how the model runs. ``seed``: the seed of requests whose
    SamplingParams give none. ``speculative_config``: None, or a dict of vLLM's keys
    (:class:`~kvlab.engine.spec_decode.SpeculativeConfig`): ``{"method": "ngram",
    "num_speculative_tokens": k, ...}`` or ``{"method": "draft_model", "model": path, ...}``.
    ``enable_chunked_prefill`` (on, as in vLLM v1): prompts longer than what is left of a step's
    budget are computed in chunks; ``long_prefill_token_threshold`` caps one prompt's chunk (0:
    no cap); ``max_num_partial_prefills``: prompts part-way through at once.
    ``scheduling_policy``: ``"fcfs"``, or ``"static"`` (a batch runs to completion before the
    next is admitted: chapter 8's baseline). ``prefill_priority_after``: seconds after which a
    waiting prompt's chunks go before the decodes (None: never). See :mod:`kvlab.engine.scheduler`.
    ``kv_cache_dtype``: ``"auto"`` (the model's dtype), ``"fp8"`` (e4m3) or ``"int8"``, with a
    float32 scale per (token, KV head) beside the values (:mod:`kvlab.quantization`).
    ``swap_space``: GiB of host memory for swapped-out sequences (0: none, preemption always
    recomputes). ``preemption_mode``: ``"auto"`` (swap or recompute, whichever the cost model
    of :mod:`kvlab.engine.offload` says is cheaper), ``"swap"`` (whenever the host has room) or
    ``"recompute"``.
    ``tensor_parallel_size``: ranks the model is split across, one process each
    (:mod:`kvlab.engine.tensor_parallel`); it must divide the model's attention heads, KV heads
    (kvlab refuses rather than replicating KV heads) and ``intermediate_size``; no speculative
    decoding at more than 1.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    enforce_eager: bool = False
    attention_backend: object = "auto"
    dtype: object = None
    device: object = None
    seed: int | None = 0
    speculative_config: object = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    scheduling_policy: str = "fcfs"
    prefill_priority_after: float | None = None
    kv_cache_dtype: str = "auto"
    swap_space: float = 0
    preemption_mode: str = "auto"
    tensor_parallel_size: int = 1

    def __post_init__(self):
        check_count("block_size", self.block_size, minimum=1)
        check_count("max_num_seqs", self.max_num_seqs, minimum=1)
        for name in ("num_gpu_blocks", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name), minimum=1)
        for name in ("enable_prefix_caching", "enforce_eager"):
            check_bool(name, getattr(self, name))
        check_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        if self.seed is not None:
            check_count("seed", self.seed)
        check_scheduling(self.enable_chunked_prefill, self.long_prefill_token_threshold,
                         self.max_num_partial_prefills, self.scheduling_policy, self.prefill_priority_after)
        kv_cache_format(self.kv_cache_dtype)         # a known name, or a clear error
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) \
                or not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space must be GiB of host memory >= 0, got {self.swap_space!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        check_count("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if self.tensor_parallel_size > 1 and self.speculative_config is not None:
            raise ValueError(f"speculative_config is not supported with tensor_parallel_size > 1 "
                             f"(got {self.tensor_parallel_size})")

    def resolve(self, context_length: int) -> "EngineConfig":
        """Fill in what depends on the model: ``max_model_len`` (checked against the model's
        ``context_length``) and ``max_num_batched_tokens``."""
        if self.max_model_len is None:
            self.max_model_len = context_length
        elif not 1 < self.max_model_len <= context_length:
            raise ValueError(f"max_model_len must be an int in 2..{context_length} (the model's "
                             f"max_position_embeddings), got {self.max_model_len!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(2048, self.max_model_len, self.max_num_seqs)
        return self

    def cudagraph_batch_sizes(self) -> list[int]:
        """The decode batch sizes captured as CUDA graphs: the buckets up to ``max_num_seqs``."""
        sizes = [b for b in CUDAGRAPH_BATCH_SIZES if b < self.max_num_seqs]
        return sizes + [self.max_num_seqs] if self.max_num_seqs <= CUDAGRAPH_BATCH_SIZES[-1] else sizes

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
