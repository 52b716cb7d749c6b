"""Layer 4: a Llama-family decoder that loads HF-format checkpoints from a local folder.

>>> from kvlab.models import load_model
>>> model, tokenizer, config = load_model("path/to/checkpoint")   # doctest: +SKIP
>>> ids = tokenizer.encode("def __init__(self").ids                # doctest: +SKIP
>>> tokenizer.decode(model.generate(ids, max_new_tokens=16))       # doctest: +SKIP

``model(input_ids, positions, ctx)`` runs flat packed tokens; with an
:class:`AttentionContext` their K/V go to the paged cache and attention reads it there.

One concept per module: :mod:`~kvlab.models.config` (a checkpoint's shape),
:mod:`~kvlab.models.rope` (rotary positions), :mod:`~kvlab.models.ops` (the small ops, in
PyTorch and as fused kernels), :mod:`~kvlab.models.attention` (the attention layer),
:mod:`~kvlab.models.context` (one engine step: slots, block tables, phase),
:mod:`~kvlab.models.backends` (where a step meets the paged attention kernels),
:mod:`~kvlab.models.parallel` (tensor parallelism: the shards and their collectives),
:mod:`~kvlab.models.llama` (the decoder) and :mod:`~kvlab.models.loader` (files).
"""
from kvlab.models.attention import Attention, causal_attention
from kvlab.models.backends import (
    AttentionBackend,
    attention_backends,
    get_attention_backend,
    register_attention_backend,
)
from kvlab.models.config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig
from kvlab.models.context import AttentionContext, build_attention_context, step_phase
from kvlab.models.llama import LlamaForCausalLM, RMSNorm
from kvlab.models.loader import CheckpointError, load_config, load_model, load_tokenizer, save_model
from kvlab.models.rope import RotaryEmbedding, apply_rope, rope_inv_freq

__all__ = [
    "Attention", "causal_attention", "AttentionBackend", "attention_backends", "get_attention_backend",
    "register_attention_backend", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelConfig",
    "AttentionContext", "build_attention_context", "step_phase", "LlamaForCausalLM", "RMSNorm",
    "CheckpointError", "load_config", "load_model", "load_tokenizer", "save_model",
    "RotaryEmbedding", "apply_rope", "rope_inv_freq",
]
