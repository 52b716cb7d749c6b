"""ModelConfig: the shape of a Llama-family decoder, read from a Hugging Face ``config.json``.

The shape (layers, heads, sizes, context length, dtype) is read by chapter 1's
:func:`kvlab.accounting.spec_from_hf_config`, the one reader of a config's shape;
:meth:`ModelConfig.from_hf` adds what running the model needs. Three architectures share one
decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP) and differ only in
small switches, which it turns into fields:

=====================  ===========================================================
``LlamaForCausalLM``   ``attention_bias`` puts a bias on q/k/v *and* o (default off)
``Qwen2ForCausalLM``   always a bias on q, k and v, never on o
``MistralForCausalLM`` a ``sliding_window``, which this decoder does not implement:
                       accepted only when null or at least the context length
=====================  ===========================================================

RoPE: ``rope_theta`` is the base of the rotation frequencies; ``rope_scaling`` (older
configs) or ``rope_parameters`` (newer ones) may stretch them for longer contexts. The
types ``linear``, ``llama3``, ``yarn`` and ``dynamic`` are supported (``dynamic`` changes
nothing within ``max_position_embeddings``, the longest sequence this model accepts).
Anything this decoder cannot run exactly raises a ValueError that names the field.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvlab.accounting import ModelSpec, spec_from_hf_config
from kvlab.validation import check_count

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic")
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_MAX_POSITIONS = 2048   # when a config.json does not say (transformers' LlamaConfig default)
# The fields a ModelConfig shares with chapter 1's ModelSpec, by the same names (and
# max_position_embeddings, which a ModelSpec may leave None).
SHAPE_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size",
                "vocab_size", "tie_word_embeddings")


def _positive_int(name: str, value) -> int:
    """:func:`kvlab.validation.check_count` (>= 1), every refusal a ValueError about the config field."""
    try:
        return check_count(name, value, minimum=1)
    except (TypeError, ValueError):
        raise ValueError(f"config field {name!r} must be a positive int, got {value!r}") from None


@dataclass
class ModelConfig:
    """Everything the decoder needs to know; built by :meth:`from_hf` or by hand (training)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None  # None, or {"rope_type": "linear" | "llama3" | "yarn" | "dynamic", ...}
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # biases on q_proj, k_proj, v_proj
    attention_out_bias: bool = False  # a bias on o_proj (Llama's attention_bias sets both)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None    # the dtype the checkpoint was saved in, e.g. "bfloat16"
    extra: dict = field(default_factory=dict, repr=False)  # unknown keys, kept for saving back

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    # -- derived ------------------------------------------------------------------------
    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def num_params(self) -> int:
        """Parameters of the model this config builds (a tied lm_head counted once)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.attention_bias + h * self.attention_out_bias
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def spec(self) -> ModelSpec:
        """The same shape as chapter 1's :class:`kvlab.accounting.ModelSpec` (what memory
        accounting reads): one shape, two views."""
        return ModelSpec(name=self.architecture, **{name: getattr(self, name) for name in SHAPE_FIELDS},
                         max_position_embeddings=self.max_position_embeddings, dtype=self.torch_dtype)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    # -- HF config.json -----------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Read a HF ``config.json`` dict; raise ValueError naming any field we cannot honour.

        The shape comes from :func:`kvlab.accounting.spec_from_hf_config`; this adds the
        architecture's switches, RoPE, norms and token ids, and refuses what the decoder cannot run.
        """
        archs = cfg.get("architectures") or []
        if not archs:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if cfg.get("model_type") not in by_type:
                raise ValueError(f"config.json names no 'architectures' and its model_type "
                                 f"{cfg.get('model_type')!r} is not one of {sorted(by_type)}; supported "
                                 f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
            archs = [by_type[cfg["model_type"]]]
        arch = archs[0]
        if len(archs) != 1 or arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architectures {archs!r} in config.json; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")

        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config field 'hidden_act' is {act!r}: only 'silu' (SwiGLU) is supported")
        shape = spec_from_hf_config(cfg, name=arch)
        max_pos = shape.max_position_embeddings or DEFAULT_MAX_POSITIONS

        # RoPE: older configs keep rope_theta at the top and the scaling in rope_scaling; newer
        # ones put both in rope_parameters.
        rope_params = cfg.get("rope_parameters")
        rope_scaling = cfg.get("rope_scaling")
        if isinstance(rope_params, dict) and rope_params and not rope_scaling:
            if any(isinstance(v, dict) for v in rope_params.values()):
                raise ValueError("config field 'rope_parameters' differs per layer type: not supported")
            rope_scaling = rope_params
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(rope_scaling, dict):
            theta = rope_scaling.get("rope_theta")
        theta = float(DEFAULT_ROPE_THETA if theta is None else theta)
        prf = cfg.get("partial_rotary_factor", (rope_scaling or {}).get("partial_rotary_factor", 1.0))
        if prf not in (None, 1, 1.0):
            raise ValueError(f"config field 'partial_rotary_factor' is {prf}: only full rotary (1.0) is supported")

        model_type = SUPPORTED_ARCHITECTURES[arch]
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        _check_sliding_window(cfg, model_type, max_pos)

        known = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                 "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                 "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
                 "torch_dtype", "dtype", "sliding_window", "use_sliding_window", "max_window_layers",
                 "layer_types", "partial_rotary_factor"}
        return cls(
            architecture=arch,
            **{name: getattr(shape, name) for name in SHAPE_FIELDS},
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            attention_bias=qkv_bias,
            attention_out_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            torch_dtype=shape.dtype,
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_hf(self, torch_dtype: str | None = None) -> dict:
        """A ``config.json`` dict that kvlab and ``transformers`` both read back to this config."""
        if self.model_type == "qwen2" and (not self.attention_bias or self.attention_out_bias):
            raise ValueError("Qwen2ForCausalLM always has q/k/v biases and no o_proj bias")
        if self.model_type != "qwen2" and self.attention_bias != self.attention_out_bias:
            raise ValueError(f"{self.architecture} has one 'attention_bias' switch for q/k/v and o: "
                             "attention_bias and attention_out_bias must agree")
        cfg = dict(self.extra)
        cfg.update({
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype or self.torch_dtype or "float32",
        })
        if self.model_type == "qwen2":
            cfg["use_sliding_window"] = False
        else:
            cfg["attention_bias"] = self.attention_bias
        if self.model_type == "mistral":
            cfg["sliding_window"] = None
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


def _check_sliding_window(cfg: dict, model_type: str, max_pos: int) -> None:
    """Sliding-window attention is not implemented: accept a config only if it never slides."""
    if model_type == "llama":
        return
    window = cfg.get("sliding_window")
    if model_type == "qwen2":
        # Qwen2 slides only with use_sliding_window, and then only in layers >= max_window_layers.
        num_layers = cfg.get("num_hidden_layers", 0)
        if not cfg.get("use_sliding_window", False) or cfg.get("max_window_layers", 0) >= num_layers:
            window = None
    if window is not None and window < max_pos:
        raise ValueError(f"config field 'sliding_window' is {window}, shorter than max_position_embeddings "
                         f"({max_pos}): sliding-window attention is not supported (a window of null or "
                         f">= the context length is)")


def normalize_rope_scaling(scaling: dict | None, max_position_embeddings: int) -> dict | None:
    """``rope_scaling`` as ``None`` (plain RoPE) or a dict with ``rope_type`` and its parameters.

    Raises a ValueError naming ``rope_scaling`` for a type this decoder does not implement.
    """
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"config field 'rope_scaling' must be null or a dict, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config field 'rope_scaling' has rope_type {kind!r}, which is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)} (or null)")
    out = {"rope_type": kind}

    def number(key, default=None):
        value = scaling.get(key, default)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config field 'rope_scaling' ({kind}) needs a number {key!r}, got {value!r}")
        return float(value)

    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if kind in ("linear", "dynamic"):
        out["factor"] = number("factor")
    elif kind == "llama3":
        out["factor"] = number("factor")
        out["low_freq_factor"] = number("low_freq_factor")
        out["high_freq_factor"] = number("high_freq_factor")
        out["original_max_position_embeddings"] = int(original)
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError("config field 'rope_scaling' (llama3) needs high_freq_factor > low_freq_factor")
    elif kind == "yarn":
        factor = scaling.get("factor")
        out["factor"] = float(max_position_embeddings / original if factor is None else factor)
        out["original_max_position_embeddings"] = int(original)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if scaling.get(key) is not None:
                out[key] = number(key)
        out["beta_fast"] = float(scaling.get("beta_fast") or 32.0)
        out["beta_slow"] = float(scaling.get("beta_slow") or 1.0)
        out["truncate"] = bool(scaling.get("truncate", True))
    if out.get("factor", 1.0) <= 0 or not math.isfinite(out.get("factor", 1.0)):
        raise ValueError(f"config field 'rope_scaling' has an invalid factor {out.get('factor')!r}")
    return out
