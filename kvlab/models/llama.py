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

from kvlab.models.attention import Attention, AttentionContext
from kvlab.models.config import ModelConfig


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics taken in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Rotation frequency of each pair of dims, ``[head_dim // 2]`` float32, and the factor
    that scales cos and sin (1 except for YaRN), with the config's ``rope_scaling`` applied."""
    dim, base = config.head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base ** exponents)
    scaling = config.rope_scaling
    kind = scaling["rope_type"] if scaling else None
    if kind is None or kind == "dynamic":
        # dynamic NTK only changes frequencies past max_position_embeddings, which we refuse.
        return inv_freq, 1.0
    factor = scaling["factor"]
    if kind == "linear":
        # positions / factor, i.e. frequencies / factor
        return inv_freq / factor, 1.0
    if kind == "llama3":
        # keep high frequencies, divide low ones by factor, blend in between
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, dim, base, scaling)
    raise ValueError(f"unsupported rope_scaling {scaling!r}")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the slow dims, keep the fast ones, ramp between; scale attention."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def dim_for(rotations):  # the dim whose wavelength fits `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(s["beta_fast"]), dim_for(s["beta_slow"])
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to ``max_position_embeddings``, looked up by position.

    The tables stay float32 whatever dtype the model is cast to (they are not buffers);
    a copy is made per device on first use.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, scale = rope_inv_freq(config)
        # explicit device: the model may be built under a meta-device context (the loader does)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.max_positions = config.max_position_embeddings
        self._tables = {torch.device("cpu"): (emb.cos() * scale, emb.sin() * scale)}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device not in self._tables:
            cos, sin = self._tables[torch.device("cpu")]
            self._tables[device] = (cos.to(device), sin.to(device))
        return self._tables[device]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(positions.device)
        return cos[positions], sin[positions]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, ctx=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack without the output head (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama/Qwen2/Mistral decoder with an LM head (tied to the embeddings if configured)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
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
        sequence (or a batch of them, ``[B, T]``).
        """
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids {list(input_ids.shape)} and positions {list(positions.shape)} "
                             f"must have the same shape")
        if ctx is not None and input_ids.dim() != 1:
            raise ValueError("with an AttentionContext, input_ids must be flat packed tokens [T]")
        if positions.numel() and not torch.compiler.is_compiling():
            top = int(positions.max())
            if top >= self.rotary.max_positions:
                raise ValueError(f"position {top} is beyond max_position_embeddings "
                                 f"({self.rotary.max_positions})")
        cos, sin = self.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., vocab]``."""
        return self.lm_head(hidden)

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
