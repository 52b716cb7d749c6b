"""Rotary position embeddings (RoPE): the frequencies, their tables, and the rotation.

A head's ``head_dim`` dims form ``head_dim / 2`` pairs; pair ``i`` of the token at position
``p`` is rotated by the angle ``p * inv_freq[i]``. Dot products of rotated queries and keys
then depend only on the distance between their positions. :func:`rope_inv_freq` gives the
frequencies (with the config's ``rope_scaling``: linear, Llama 3, YaRN),
:class:`RotaryEmbedding` their cos/sin tables, :func:`apply_rope` the rotation in PyTorch
(HF's "rotate half" layout: pair ``i`` is dims ``i`` and ``i + head_dim / 2``), and
:func:`rotate_heads` the same numbers in fewer ops (the CPU engine's). On a GPU the engine
rotates inside :func:`kvlab.kernels.rotary_write_kv`, fused with the K/V write.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvlab.models.config import ModelConfig


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
        self._last = None        # (positions, their (cos, sin)) of the forward under way
        self._last_rotation = None   # (positions, their rotate_heads tables) of the forward under way
        self._tables = {torch.device("cpu"): (emb.cos() * scale, emb.sin() * scale)}
        self._rotation_tables = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device not in self._tables:
            cos, sin = self._tables[torch.device("cpu")]
            self._tables[device] = (cos.to(device), sin.to(device))
        return self._tables[device]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a forward asks for the same positions tensor: look it up once. (The
        # model forgets it when the forward ends: see LlamaForCausalLM.forward.)
        if self._last is not None and self._last[0] is positions:
            return self._last[1]
        cos, sin = self.tables(positions.device)
        self._last = (positions, (cos[positions], sin[positions]))
        return self._last[1]

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` of ``positions [T]``, each ``[T, 1, D]`` (a heads dim to
        broadcast over): what :func:`rotate_heads` takes. Looked up once per forward, like
        :meth:`forward`'s tables; ``signed_sin`` is ``sin`` with its first half negated."""
        if self._last_rotation is not None and self._last_rotation[0] is positions:
            return self._last_rotation[1]
        device = positions.device
        if device not in self._rotation_tables:
            cos, sin = self.tables(device)
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._rotation_tables[device] = (cos.unsqueeze(1), signed_sin.unsqueeze(1))
        cos, signed_sin = self._rotation_tables[device]
        self._last_rotation = (positions, (cos[positions], signed_sin[positions]))
        return self._last_rotation[1]

    def forget(self) -> None:
        self._last = self._last_rotation = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim (the HF Llama convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., T, H, D]`` by the angles of its tokens' positions (``cos``/``sin [..., T, D]``).

    Computed in float32 and cast back to ``x``'s dtype.
    """
    xf = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` for float32 ``x [T, H, D]`` in four ops, with the tables of
    :meth:`RotaryEmbedding.rotation` (the engine's CPU path, where each op's fixed cost is
    most of its time).

    ``rotate_half(x) * sin`` is ``(-x2 * sin1, x1 * sin2)``. Rolling ``x`` by half its dim gives
    ``(x2, x1)``, and ``signed_sin = (-sin1, sin2)`` carries the sign: the same products, so the
    same numbers, without the negation and the concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
