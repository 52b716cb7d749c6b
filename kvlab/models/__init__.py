"""Layer 4: a Llama-family decoder that loads HF-format checkpoints from a local folder.

>>> from kvlab.models import load_model
>>> model, tokenizer, config = load_model("path/to/checkpoint")   # doctest: +SKIP
>>> ids = tokenizer.encode("def __init__(self").ids                # doctest: +SKIP
>>> tokenizer.decode(model.generate(ids, max_new_tokens=16))       # doctest: +SKIP

``model(input_ids, positions, ctx)`` runs flat packed tokens; with an
:class:`AttentionContext` their K/V go to the paged cache and attention reads it there.
"""
from kvlab.models.attention import (
    Attention,
    AttentionContext,
    attention_backends,
    causal_attention,
    get_attention_backend,
    paged_attention,
    register_attention_backend,
    set_attention_backend,
    use_attention_backend,
)
from kvlab.models.config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig
from kvlab.models.llama import LlamaForCausalLM, RMSNorm, RotaryEmbedding, rope_inv_freq
from kvlab.models.loader import CheckpointError, load_config, load_model, load_tokenizer, save_model

__all__ = [
    "Attention", "AttentionContext", "attention_backends", "causal_attention", "get_attention_backend",
    "paged_attention", "register_attention_backend", "set_attention_backend", "use_attention_backend",
    "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelConfig",
    "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding", "rope_inv_freq",
    "CheckpointError", "load_config", "load_model", "load_tokenizer", "save_model",
]
