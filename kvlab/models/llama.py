"""A Llama-family decoder over flat packed tokens: the model the course's engine serves.

One class covers Llama, Qwen2 and Mistral checkpoints (see :mod:`kvlab.models.config`)::

    embed_tokens -> L x [ RMSNorm -> attention (RoPE, GQA) -> +residual
                          RMSNorm -> SwiGLU MLP             -> +residual ] -> RMSNorm -> lm_head

``forward(input_ids [T], positions [T], ctx)`` takes the *new* tokens of a step, packed one
sequence after another as vLLM and nano-vllm do, with each token's position in its own
sequence; it returns hidden states ``[T, hidden]``, and :meth:`LlamaForCausalLM.compute_logits`
turns the rows you need (usually each sequence's last) into logits. Without a context it is
plain causal attention over the tokens as one sequence, and it also accepts a batch
``[B, T]`` of equal-length sequences (training).

Parameter names mirror HF's (``model.layers.0.self_attn.q_proj.weight`` ...) so that
checkpoints load by name.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.models import ops
from kvlab.models.attention import Attention
from kvlab.models.config import ModelConfig
from kvlab.models.context import AttentionContext
from kvlab.models.parallel import SINGLE, ParallelContext, gather_logits, vocab_parallel_embedding, vocab_shard_size
from kvlab.models.rope import RotaryEmbedding, rope_inv_freq  # noqa: F401  (rope_inv_freq: re-exported)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics taken in float32.

    Called with a ``residual`` it adds it first and returns ``(normed, x + residual)``: the
    decoder carries its residual stream that way, so the add costs no kernel of its own."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; :meth:`fuse` merges gate and up into one product.
    With ``tp`` of size N, its rank's ``I / N`` features; down's partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, tp: ParallelContext = SINGLE):
        super().__init__()
        self.tp = tp
        h, i, bias = config.hidden_size, tp.divide(config.intermediate_size, "intermediate_size"), config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up = None              # (weight, bias) of the merged projection, once fused

    def fuse(self) -> None:
        if self.gate_up is None:
            self.gate_up = ops.fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            out = ops.linear(ops.silu_and_mul(ops.linear(x, *self.gate_up)), self.down_proj.weight, self.down_proj.bias)
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """RMSNorm -> attention -> RMSNorm -> MLP, each sub-block's output added to the residual
    stream. The stream travels beside the hidden states (``x, residual``) and each add happens
    inside the next norm (:class:`RMSNorm` with a residual)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: ParallelContext = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x, residual, positions, ctx=None):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """The decoder stack without the output head (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, tp: ParallelContext = SINGLE):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_shard_size(config.vocab_size, tp.size), config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama/Qwen2/Mistral decoder with an LM head (tied to the embeddings if configured).

    ``tp``: this copy's rank of a tensor-parallel group (:mod:`kvlab.models.parallel`); every
    layer then holds that rank's shard, and the forward makes the group's collectives."""

    def __init__(self, config: ModelConfig, tp: ParallelContext = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.rotary = RotaryEmbedding(config)
        self.model = LlamaModel(config, self.rotary, tp)
        self.lm_head = nn.Linear(config.hidden_size, vocab_shard_size(config.vocab_size, tp.size), bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, the LM head *is* the embedding matrix (one Parameter)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (or ``[B, T, hidden]``) of the given tokens.

        ``positions`` gives each token's position in its own sequence (same shape as
        ``input_ids``). With ``ctx`` the tokens are one engine step, flat ``[T]``; their K/V
        are written to the paged cache and attention reads it. Without, they are one causal
        sequence (or a batch of them, ``[B, T]``). With a context nothing is read back to the
        host (the engine checked the positions), so a step can be captured as a CUDA graph.
        """
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids {list(input_ids.shape)} and positions {list(positions.shape)} "
                             f"must have the same shape")
        if ctx is not None and input_ids.dim() != 1:
            raise ValueError("with an AttentionContext, input_ids must be flat packed tokens [T]")
        if ctx is None and positions.numel() and not torch.compiler.is_compiling():
            top = int(positions.max())
            if top >= self.rotary.max_positions:
                raise ValueError(f"position {top} is beyond max_position_embeddings "
                                 f"({self.rotary.max_positions})")
        x, residual = vocab_parallel_embedding(input_ids, self.model.embed_tokens, self.tp), None
        try:
            for layer in self.model.layers:
                x, residual = layer(x, residual, positions, ctx)
        finally:
            self.rotary.forget()     # its lookup of these positions served every layer
        x, _ = self.model.norm(x, residual)
        return x

    def fuse(self) -> "LlamaForCausalLM":
        """Merge q/k/v and gate/up into one projection each (for inference: call it last,
        once the model has its device and dtype). The checkpoint's names still work."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., vocab]``."""
        return gather_logits(ops.lm_head(hidden, self.lm_head.weight), self.config.vocab_size, self.tp)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        """Fresh weights for training: N(0, std) matrices, output projections scaled down by
        sqrt(2 * num_layers) (so the residual stream does not grow with depth), zero biases,
        unit norms."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        out_std = std / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=gen) * s)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, eos_token_id=None) -> list[int]:
        """Greedy continuation without a cache: re-run the whole sequence for every token.

        Slow on purpose (it is the reference the paged engine must match). Stops after
        ``max_new_tokens`` or at an EOS id (default: the config's); returns the new ids.
        """
        eos = self.config.eos_token_ids if eos_token_id is None else (
            list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("generate needs at least one prompt token")
        new: list[int] = []
        for _ in range(max_new_tokens):
            if len(ids) >= self.config.max_position_embeddings:
                break
            tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
            hidden = self(tokens, torch.arange(len(ids), device=self.device))
            nxt = int(self.compute_logits(hidden[-1]).argmax())
            ids.append(nxt)
            new.append(nxt)
            if nxt in eos:
                break
        return new
