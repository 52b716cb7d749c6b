"""KV memory accounting: how many bytes a model's KV cache takes, and how much fits on a GPU.

Every decoder layer caches one key and one value vector per KV head for every token it has
seen, so a token costs, over the whole model::

    kv_bytes_per_token = 2 (K and V) * num_layers * num_kv_heads * head_dim * bytes_per_element

Grouped-query attention (GQA) shrinks ``num_kv_heads`` below ``num_heads`` and the cache
with it: Llama-3-70B has 64 query heads but 8 KV heads, so it caches 8x less per token than
the same model with multi-head attention (MHA) would.

Units: ``GB`` is 10^9 bytes and ``GiB`` is 2^30 bytes; they differ by 7.4%, and mixing them
is the most common slip in memory arithmetic. :func:`format_bytes` prints both.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.validation import check_count

GiB = 2**30
GB = 10**9


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, or a TypeError/ValueError that names ``name``.

    :func:`kvlab.validation.check_count` with two differences kept for this module's callers:
    NumPy's integers are taken (returned as ``int``), and ``minimum`` defaults to 1.
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    return check_count(name, value, minimum=minimum)


# -- model specs --------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as memory is concerned.

    ``mlp_matrices`` is 3 for a SwiGLU MLP (gate, up, down: Llama, Mistral, Qwen) and 2 for
    a classic MLP (up, down: GPT-3). ``max_position_embeddings`` is the context length the
    config declares (None when a config does not say). ``dtype`` is the one the checkpoint was
    saved in ("bfloat16", say), None when unknown; it is not part of the shape, so two specs that
    differ only in it are equal.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    mlp_matrices: int = 3
    dtype: str | None = field(default=None, compare=False)

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                     "intermediate_size", "vocab_size", "mlp_matrices"):
            check_int(name, getattr(self, name))
        if self.max_position_embeddings is not None:
            check_int("max_position_embeddings", self.max_position_embeddings)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def attention(self) -> str:
        """"MHA" (one KV head per query head), "MQA" (one KV head) or "GQA" (in between)."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def num_params(self) -> int:
        """Parameter count of a Llama-style decoder (biases and learned positions ignored).

        With h = hidden_size, I = intermediate_size, V = vocab_size, d = head_dim,
        H = num_heads, Hkv = num_kv_heads, m = mlp_matrices, L = num_layers::

            embeddings   V*h            (+ V*h for the LM head unless tied)
            per layer    h*H*d + 2*h*Hkv*d + H*d*h    (q, k, v, o projections)
                         + m*h*I                      (MLP)
                         + 2*h                        (two RMSNorm weights)
            final norm   h
        """
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        per_layer = attention + self.mlp_matrices * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h


# Llama-style presets (SwiGLU MLP, untied embeddings, head_dim 128), one row each:
# name, layers, query heads, KV heads, hidden size, MLP size, vocabulary, context length.
_LLAMA_STYLE = [
    ("llama-2-7b", 32, 32, 32, 4096, 11008, 32000, 4096),
    ("llama-3-8b", 32, 32, 8, 4096, 14336, 128256, 8192),
    ("llama-3-70b", 80, 64, 8, 8192, 28672, 128256, 8192),
    ("mistral-7b", 32, 32, 8, 4096, 14336, 32000, 32768),
    ("qwen2-72b", 80, 64, 8, 8192, 29568, 152064, 32768),
]
PRESETS: dict[str, ModelSpec] = {
    name: ModelSpec(name, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                    hidden_size=hidden, intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=context)
    for name, layers, heads, kv_heads, hidden, mlp, vocab, context in _LLAMA_STYLE
}
# GPT-3 (Brown et al., 2020): classic 2-matrix MLP of 4*h, tied embeddings, 2048 context.
PRESETS["gpt-3-175b"] = ModelSpec("gpt-3-175b", num_layers=96, num_heads=96, num_kv_heads=96, head_dim=128,
                                  hidden_size=12288, intermediate_size=4 * 12288, vocab_size=50257,
                                  tie_word_embeddings=True, max_position_embeddings=2048, mlp_matrices=2)


def get_spec(name_or_path) -> ModelSpec:
    """A :class:`ModelSpec` from a preset name, a ``config.json`` (or its folder), or a spec."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    key = str(name_or_path).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return spec_from_hf_config(path)
    raise ValueError(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                     "and not a config.json or a folder holding one")


def spec_from_hf_config(path_or_dict, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (a path or the parsed dict) into a :class:`ModelSpec`.

    This is kvlab's one reader of a config's shape: :meth:`kvlab.models.ModelConfig.from_hf`
    takes its shape from here and adds what running the model needs. ``num_key_value_heads``
    defaults to ``num_attention_heads`` (MHA) and ``head_dim`` to ``hidden_size //
    num_attention_heads``, as in the transformers library. Multimodal configs that nest the
    language model under ``text_config`` are read from there. Every error names the key.
    """
    config, where = _read_config(path_or_dict)

    def count(key, default=None, required=True):
        value = config.get(key)
        if value is None:
            if required and default is None:
                raise ValueError(f"{where}: missing field {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: field {key!r} must be a positive int, got {value!r}")
        return value

    num_heads = count("num_attention_heads")
    num_kv_heads = count("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{where}: 'num_attention_heads' ({num_heads}) must be a multiple of "
                         f"'num_key_value_heads' ({num_kv_heads})")
    hidden_size = count("hidden_size")
    dtype_key = "torch_dtype" if config.get("torch_dtype") else "dtype"     # transformers 5 writes "dtype"
    dtype = config.get(dtype_key)
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"{where}: field {dtype_key!r} must be a string such as 'bfloat16', got {dtype!r}")
    return ModelSpec(
        name=name or config.get("_name_or_path") or config.get("model_type") or "custom",
        num_layers=count("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=count("head_dim", default=hidden_size // num_heads),
        hidden_size=hidden_size,
        intermediate_size=count("intermediate_size"),
        vocab_size=count("vocab_size"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=count("max_position_embeddings", required=False),
        dtype=dtype,
    )


def _read_config(path_or_dict) -> tuple[dict, str]:
    """The config as a dict (a file parsed, a nested ``text_config`` taken out) and its name for errors."""
    if isinstance(path_or_dict, dict):
        config, where = path_or_dict, "config"
    else:
        where = str(path_or_dict)
        try:
            config = json.loads(Path(path_or_dict).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(config).__name__}")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return config, where


# -- bytes ----------------------------------------------------------------------------------
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}   # fp64: the tests' models
_DTYPE_ALIASES = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "bfloat16": "bf16",
                  "float16": "fp16", "half": "fp16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` ("bf16", "fp8", ... or "bfloat16", "fp8_e4m3", ...)."""
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str such as 'bf16', got {type(dtype).__name__}")
    key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def kv_bytes_per_layer_per_token(spec, dtype: str = "bf16") -> int:
    """K and V of one token in one layer: 2 * num_kv_heads * head_dim * bytes."""
    spec = get_spec(spec)
    return 2 * spec.num_kv_heads * spec.head_dim * dtype_bytes(dtype)


def kv_bytes_per_token(spec, dtype: str = "bf16") -> int:
    """K and V of one token in all layers: 2 * num_layers * num_kv_heads * head_dim * bytes."""
    spec = get_spec(spec)
    return spec.num_layers * kv_bytes_per_layer_per_token(spec, dtype)


def kv_bytes(spec, num_tokens: int, batch: int = 1, dtype: str = "bf16") -> int:
    """KV cache of ``batch`` sequences of ``num_tokens`` tokens each."""
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("batch", batch, minimum=0)
    return batch * num_tokens * kv_bytes_per_token(spec, dtype)


def weight_bytes(spec, dtype: str = "bf16") -> int:
    """Memory of the weights stored in ``dtype``."""
    return get_spec(spec).num_params * dtype_bytes(dtype)


# -- GPUs and capacity ----------------------------------------------------------------------
# Total memory as CUDA reports it (torch.cuda.mem_get_info()[1]): the number vLLM multiplies by
# gpu_memory_utilization. The driver keeps some memory back, so it is below the marketed size,
# and it moves by a few hundred MiB with the driver and ECC setting: check yours. The H200 value
# is a measured total; the others are typical reports. The marketed "GB" is closer to GiB:
# an "80GB" A100 reports 79.25 GiB (85.1 GB), the "141GB" H200 139.80 GiB (150.1 GB).
GPUS: dict[str, int] = {
    "A100-40GB": round(39.50 * GiB),
    "A100-80GB": round(79.25 * GiB),
    "H100-80GB": round(79.11 * GiB),
    "H200-141GB": 150_109_880_320,
    "L4-24GB": round(22.03 * GiB),
    "RTX-4090-24GB": round(23.65 * GiB),
}


def gpu_total_bytes(gpu_bytes) -> int:
    """``gpu_bytes`` as a byte count: a name in :data:`GPUS` ("H100-80GB") or a count already."""
    if isinstance(gpu_bytes, str):
        if gpu_bytes not in GPUS:
            raise ValueError(f"unknown GPU {gpu_bytes!r}; known: {', '.join(GPUS)} (or pass bytes)")
        return GPUS[gpu_bytes]
    return check_int("gpu_bytes", gpu_bytes)


def kv_budget_bytes(spec, gpu_bytes, gpu_memory_utilization: float = 0.9, weight_dtype: str = "bf16") -> int:
    """Bytes left for the KV cache, the vLLM way: utilization * total - weights.

    Like vLLM's estimate before profiling, this ignores activations, CUDA graphs and the
    CUDA context (together a few GB), so it is an upper bound.
    """
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)):
        raise TypeError(f"gpu_memory_utilization must be a number, got {type(gpu_memory_utilization).__name__}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    total = gpu_total_bytes(gpu_bytes)
    weights = weight_bytes(spec, weight_dtype)
    budget = int(gpu_memory_utilization * total) - weights
    if budget <= 0:
        raise ValueError(
            f"{get_spec(spec).name} weights in {weight_dtype} need {format_bytes(weights)}, but "
            f"{gpu_memory_utilization:g} of the GPU is only {format_bytes(int(gpu_memory_utilization * total))}: "
            "use more GPUs (tensor parallelism), a smaller weight dtype, or a higher utilization")
    return budget


def max_sequences(spec, gpu_bytes, seq_len: int, gpu_memory_utilization: float = 0.9,
                  weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> int:
    """How many sequences of ``seq_len`` tokens fit in the KV budget of one GPU.

    ``gpu_bytes`` is the GPU's total memory, or a name in :data:`GPUS`.
    """
    check_int("seq_len", seq_len)
    budget = kv_budget_bytes(spec, gpu_bytes, gpu_memory_utilization, weight_dtype)
    return budget // (seq_len * kv_bytes_per_token(spec, kv_dtype))


# -- quantised KV cache (kv_cache_dtype) --------------------------------------------------------
KV_CACHE_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "int8": 1}   # kvlab.quantization's stored dtypes
SCALE_BYTES = 4                                                 # one float32 scale per (token, KV head), K and V


def kv_cache_bytes_per_token(spec, kv_cache_dtype: str = "auto", model_dtype: str = "bf16") -> int:
    """K and V of one token in all layers, as the cache stores them, scales included.

    ``"auto"`` stores ``model_dtype``: :func:`kv_bytes_per_token`. ``"fp8"``/``"int8"`` store one
    byte per value plus, per layer and KV head, a float32 scale for K and one for V::

        2 * num_layers * num_kv_heads * (head_dim * 1 + 4)
    """
    spec = get_spec(spec)
    if kv_cache_dtype == "auto":
        return kv_bytes_per_token(spec, model_dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: auto, fp8, int8")
    per_head = spec.head_dim * KV_CACHE_DTYPE_BYTES[kv_cache_dtype] + SCALE_BYTES
    return 2 * spec.num_layers * spec.num_kv_heads * per_head


def sequences_with_kv_cache_dtype(spec, gpu_bytes, seq_len: int, kv_cache_dtype: str,
                                  gpu_memory_utilization: float = 0.9, weight_dtype: str = "bf16") -> tuple[int, int]:
    """How many ``seq_len``-token sequences fit with ``"auto"`` (the weights' dtype) and with
    ``kv_cache_dtype``: ``(auto, quantised)``. Their ratio is what quantising buys, a little
    under 2x for bf16 -> fp8 because of the scales."""
    check_int("seq_len", seq_len)
    budget = kv_budget_bytes(spec, gpu_bytes, gpu_memory_utilization, weight_dtype)
    return tuple(budget // (seq_len * kv_cache_bytes_per_token(spec, d, weight_dtype))
                 for d in ("auto", kv_cache_dtype))


# -- printing -------------------------------------------------------------------------------
def format_bytes(n) -> str:
    """``n`` bytes in decimal and binary units: ``format_bytes(5 * 10**9)`` is '5.00 GB (4.66 GiB)'."""
    n = int(n)
    for decimal, binary, d_name, b_name in ((GB, GiB, "GB", "GiB"), (10**6, 2**20, "MB", "MiB"),
                                            (10**3, 2**10, "KB", "KiB")):
        if abs(n) >= decimal:
            return f"{n / decimal:.2f} {d_name} ({n / binary:.2f} {b_name})"
    return f"{n} B"


def text_table(headers, rows, align: str | None = None) -> str:
    """A plain-text table (stable output for notebooks and tests).

    ``align`` has one letter per column, ``l`` or ``r``; by default every column is right-aligned.
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    align = align or "r" * len(headers)
    pad = {"l": str.ljust, "r": str.rjust}
    lines = ["  ".join(pad[a](c, w) for c, w, a in zip(row, widths, align)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

