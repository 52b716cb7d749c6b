"""kvlab.accounting: bytes per token, parameter counts, HF configs, GPU capacity."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import accounting as acc
from kvlab.accounting import GB, GiB, PRESETS, ModelSpec

LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


# -- bytes per token --------------------------------------------------------------------------
@pytest.mark.parametrize("name, bf16_bytes", [
    ("llama-2-7b", 524_288), ("llama-3-8b", 131_072), ("llama-3-70b", 327_680),
    ("mistral-7b", 131_072), ("qwen2-72b", 327_680), ("gpt-3-175b", 4_718_592),
])
def test_kv_bytes_per_token_known_values(name, bf16_bytes):
    assert acc.kv_bytes_per_token(name) == bf16_bytes
    assert acc.kv_bytes_per_token(name, "fp8") == bf16_bytes // 2
    assert acc.kv_bytes_per_token(name, "fp32") == bf16_bytes * 2
    assert acc.kv_bytes_per_layer_per_token(name) * PRESETS[name].num_layers == bf16_bytes


def test_seed_claims_2_and_3():
    # claim 2: Llama-3-70B at 32K tokens is 10 GiB, not "over 5 GB"
    assert acc.kv_bytes("llama-3-70b", 32_768) == 10 * GiB
    # claim 3: GPT-3 is 4.5 MiB per token; 2048 and 4096 tokens are 9 and 18 GiB
    assert acc.kv_bytes_per_token("gpt-3-175b") == 4.5 * 2**20
    assert acc.kv_bytes("gpt-3-175b", 2048) == 9 * GiB
    assert acc.kv_bytes("gpt-3-175b", 4096) == 18 * GiB
    assert round(acc.kv_bytes("gpt-3-175b", 4096) / GB, 1) == 19.3


def test_kv_bytes_scales_with_tokens_and_batch():
    per_token = acc.kv_bytes_per_token("llama-3-8b")
    assert acc.kv_bytes("llama-3-8b", 1000, batch=4) == 4000 * per_token
    assert acc.kv_bytes("llama-3-8b", 0) == 0


@given(layers=st.integers(1, 200), kv_heads=st.integers(1, 128), head_dim=st.integers(1, 512),
       dtype=st.sampled_from(sorted(acc.DTYPE_BYTES)))
@settings(max_examples=60, deadline=None)
def test_kv_bytes_per_token_formula(layers, kv_heads, head_dim, dtype):
    spec = ModelSpec("x", num_layers=layers, num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     hidden_size=64, intermediate_size=64, vocab_size=10)
    assert acc.kv_bytes_per_token(spec, dtype) == 2 * layers * kv_heads * head_dim * acc.DTYPE_BYTES[dtype]


def test_dtype_aliases_and_errors():
    assert acc.dtype_bytes("bfloat16") == 2 and acc.dtype_bytes("FP8_E4M3") == 1
    assert acc.dtype_bytes("float64") == 8          # a float64 model's cache (a draft model's, say)
    with pytest.raises(ValueError, match="dtype"):
        acc.kv_bytes_per_token("llama-3-8b", "int4")
    with pytest.raises(TypeError, match="dtype"):
        acc.kv_bytes_per_token("llama-3-8b", 2)


# -- parameter counts -------------------------------------------------------------------------
@pytest.mark.parametrize("name, published", [
    ("llama-2-7b", 6.74e9), ("llama-3-8b", 8.03e9), ("llama-3-70b", 70.6e9),
    ("mistral-7b", 7.24e9), ("qwen2-72b", 72.7e9), ("gpt-3-175b", 175e9),
])
def test_param_counts_match_published_sizes(name, published):
    assert abs(PRESETS[name].num_params / published - 1) < 0.02


def test_weight_bytes():
    assert acc.weight_bytes("llama-3-8b") == 2 * PRESETS["llama-3-8b"].num_params
    assert acc.weight_bytes("llama-3-8b", "fp8") == PRESETS["llama-3-8b"].num_params


def test_attention_kinds():
    assert PRESETS["llama-2-7b"].attention == "MHA"
    assert PRESETS["llama-3-70b"].attention == "GQA"
    mqa = ModelSpec("mqa", num_layers=1, num_heads=8, num_kv_heads=1, head_dim=8, hidden_size=64,
                    intermediate_size=64, vocab_size=10)
    assert mqa.attention == "MQA"


def test_spec_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelSpec("bad", num_layers=1, num_heads=6, num_kv_heads=4, head_dim=8, hidden_size=48,
                  intermediate_size=8, vocab_size=8)
    with pytest.raises(ValueError, match="num_layers"):
        ModelSpec("bad", num_layers=0, num_heads=1, num_kv_heads=1, head_dim=8, hidden_size=8,
                  intermediate_size=8, vocab_size=8)


# -- Hugging Face configs ---------------------------------------------------------------------
def test_hf_config_file_matches_the_preset(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B_CONFIG))
    spec = acc.spec_from_hf_config(path, name="llama-3-8b")
    assert spec == PRESETS["llama-3-8b"]
    assert acc.get_spec(tmp_path).num_kv_heads == 8  # a folder holding config.json
    assert acc.get_spec(str(path)).num_params == PRESETS["llama-3-8b"].num_params


def test_hf_config_defaults():
    config = {k: v for k, v in LLAMA_3_8B_CONFIG.items()
              if k not in ("num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")}
    config["head_dim"] = None
    spec = acc.spec_from_hf_config(config)
    assert spec.num_kv_heads == 32 and spec.head_dim == 128
    assert spec.max_position_embeddings is None and not spec.tie_word_embeddings
    assert spec.name == "llama"


def test_hf_config_nested_text_config():
    spec = acc.spec_from_hf_config({"model_type": "vlm", "text_config": LLAMA_3_8B_CONFIG})
    assert spec.num_layers == 32


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"])
def test_hf_config_missing_field_is_named(field):
    config = dict(LLAMA_3_8B_CONFIG)
    del config[field]
    with pytest.raises(ValueError, match=field):
        acc.spec_from_hf_config(config)


@pytest.mark.parametrize("value", ["32", -1, 0, 2.5, True])
def test_hf_config_invalid_field_is_named(value):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        acc.spec_from_hf_config(dict(LLAMA_3_8B_CONFIG, num_key_value_heads=value))


def test_hf_config_bad_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        acc.spec_from_hf_config(path)


def test_get_spec_unknown_name():
    with pytest.raises(ValueError, match="llama-3-8b"):  # the message lists the presets
        acc.get_spec("no-such-model")
    assert acc.get_spec("LLaMA-3-8B") is PRESETS["llama-3-8b"]


# -- GPUs and capacity ------------------------------------------------------------------------
def test_gpu_memory_units():
    # the H200's total as CUDA reports it: 139.8 GiB, which is 150.1 GB
    assert acc.GPUS["H200-141GB"] / GiB == pytest.approx(139.80, abs=0.01)
    assert acc.GPUS["H200-141GB"] / GB == pytest.approx(150.11, abs=0.01)
    for name, total in acc.GPUS.items():
        marketed = int(name.rsplit("-", 1)[1].removesuffix("GB"))
        assert 0.9 * marketed * GiB < total <= marketed * GiB, name  # a little under the label read as GiB


def test_max_sequences_known_value():
    spec = PRESETS["llama-3-8b"]
    budget = int(0.9 * acc.GPUS["H200-141GB"]) - 2 * spec.num_params
    assert acc.max_sequences(spec, "H200-141GB", 8192) == budget // (8192 * 131_072)
    assert acc.max_sequences(spec, acc.GPUS["H200-141GB"], 8192) == budget // (8192 * 131_072)
    assert acc.max_sequences(spec, "H200-141GB", 8192, kv_dtype="fp8") == budget // (8192 * 65_536)


@given(seq_len=st.integers(1, 200_000), util=st.floats(0.3, 1.0))
@settings(max_examples=50, deadline=None)
def test_max_sequences_fits_and_is_maximal(seq_len, util):
    spec = PRESETS["mistral-7b"]
    n = acc.max_sequences(spec, "A100-80GB", seq_len, gpu_memory_utilization=util)
    budget = acc.kv_budget_bytes(spec, "A100-80GB", util)
    per_seq = seq_len * acc.kv_bytes_per_token(spec)
    assert n * per_seq <= budget < (n + 1) * per_seq


def test_max_sequences_when_weights_do_not_fit():
    with pytest.raises(ValueError, match="weights"):
        acc.max_sequences("llama-3-70b", "A100-80GB", 4096)  # 141 GB of bf16 weights
    with pytest.raises(ValueError, match="weights"):
        acc.max_sequences("llama-3-70b", "H200-141GB", 4096)  # 0.9 x 150.1 GB = 135.1 GB < 141.1 GB
    assert acc.max_sequences("llama-3-70b", "H200-141GB", 4096, gpu_memory_utilization=1.0) > 0
    with pytest.raises(ValueError, match="weights"):
        acc.max_sequences("gpt-3-175b", "H200-141GB", 2048)


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(seq_len=-1), ValueError, "seq_len"), (dict(seq_len=0), ValueError, "seq_len"),
    (dict(seq_len=1.5), TypeError, "seq_len"),
    (dict(seq_len=8, gpu_memory_utilization=0), ValueError, "gpu_memory_utilization"),
    (dict(seq_len=8, gpu_memory_utilization=1.1), ValueError, "gpu_memory_utilization"),
    (dict(seq_len=8, gpu_memory_utilization="0.9"), TypeError, "gpu_memory_utilization"),
    (dict(seq_len=8, kv_dtype="fp4"), ValueError, "dtype"),
])
def test_max_sequences_bad_arguments(kwargs, error, word):
    with pytest.raises(error, match=word):
        acc.max_sequences("llama-3-8b", "H100-80GB", **kwargs)


def test_bad_gpu_and_token_counts():
    with pytest.raises(ValueError, match="GPU"):
        acc.max_sequences("llama-3-8b", "TPU", 8)
    with pytest.raises(ValueError, match="num_tokens"):
        acc.kv_bytes("llama-3-8b", -5)
    with pytest.raises(ValueError, match="batch"):
        acc.kv_bytes("llama-3-8b", 5, batch=-1)


# -- printing ---------------------------------------------------------------------------------
def test_format_bytes_gives_both_units():
    assert acc.format_bytes(10 * GiB) == "10.74 GB (10.00 GiB)"
    assert acc.format_bytes(327_680) == "327.68 KB (320.00 KiB)"
    assert acc.format_bytes(4_718_592) == "4.72 MB (4.50 MiB)"
    assert acc.format_bytes(12) == "12 B"


def test_text_table():
    table = acc.text_table(["a", "bb"], [[1, 2], [333, 4]])
    assert table.splitlines() == ["  a  bb", "---  --", "  1   2", "333   4"]
    assert acc.text_table(["a", "bb"], [[1, 2]], align="lr").splitlines() == ["a  bb", "-  --", "1   2"]


def test_the_runnable_config_and_the_memory_spec_read_one_shape():
    """ModelConfig.spec() (the engine's view) equals what chapter 1's reader makes of the same
    config.json, for both shipped models."""
    from kvlab.engine.llm import DEFAULT_MODEL
    from kvlab.models import ModelConfig

    for folder in (DEFAULT_MODEL, DEFAULT_MODEL.parent / "kvlab-tiny-draft"):
        raw = json.loads((folder / "config.json").read_text())
        got = ModelConfig.from_hf(raw).spec()
        want = acc.spec_from_hf_config(raw, name=got.name)
        assert got == want and got.dtype == want.dtype == "bfloat16"


# Published configs, trimmed to the keys that matter here (and the ones the runnable reader checks).
HF_CONFIGS = {
    "llama-3-8b": LLAMA_3_8B_CONFIG | {"rope_theta": 500000.0, "hidden_act": "silu"},
    "llama-3-70b": LLAMA_3_8B_CONFIG | {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                                        "num_hidden_layers": 80, "rope_theta": 500000.0},
    "qwen2-0.5b (tied)": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                          "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
                          "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                          "tie_word_embeddings": True, "sliding_window": 32768, "use_sliding_window": False,
                          "max_window_layers": 24, "rope_theta": 1000000.0, "torch_dtype": "bfloat16"},
    "mistral-7b-v0.3": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
                        "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768,
                        "sliding_window": None, "rope_theta": 1000000.0, "torch_dtype": "bfloat16"},
    "mistral-nemo (head_dim given)": {"architectures": ["MistralForCausalLM"], "hidden_size": 5120, "head_dim": 128,
                                      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 40,
                                      "num_key_value_heads": 8, "vocab_size": 131072,
                                      "max_position_embeddings": 1024000, "dtype": "bfloat16"},
    "optional keys left out": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                               "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000},
}


def _shape(spec) -> dict:
    """Every field but the name and the context length (dtype included, which == leaves out)."""
    return {k: v for k, v in vars(spec).items() if k not in ("name", "max_position_embeddings")}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_both_readers_agree(name):
    """ModelConfig.from_hf takes its shape from spec_from_hf_config: the two views of one config agree."""
    from kvlab.models import ModelConfig

    raw = HF_CONFIGS[name]
    spec = acc.spec_from_hf_config(raw)
    config = ModelConfig.from_hf(raw)
    got = config.spec()
    assert _shape(got) == _shape(spec)
    # a runnable model needs a context length: 2048 when the config does not say
    assert got.max_position_embeddings == (spec.max_position_embeddings or 2048) == config.max_position_embeddings
    if name == "optional keys left out":
        assert spec.num_kv_heads == 4 and spec.head_dim == 64 and not spec.tie_word_embeddings
        assert spec.max_position_embeddings is None and spec.dtype is None
    if name.startswith("qwen2"):
        assert spec.tie_word_embeddings and config.attention_bias
    if name.startswith("mistral-nemo"):
        assert spec.head_dim == 128 != spec.hidden_size // spec.num_heads and spec.dtype == "bfloat16"


@pytest.mark.parametrize("change, key", [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_attention_heads": None}, "num_attention_heads"),
    ({"hidden_size": None}, "hidden_size"),
    ({"intermediate_size": None}, "intermediate_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_key_value_heads": "8"}, "num_key_value_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),      # 32 heads are not a multiple of 5
    ({"head_dim": -1}, "head_dim"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"torch_dtype": 16}, "torch_dtype"),
    ({"torch_dtype": None, "dtype": ["bf16"]}, "'dtype'"),
])
def test_a_bad_config_names_the_key_in_both_readers(change, key):
    from kvlab.models import ModelConfig

    raw = {k: v for k, v in (LLAMA_3_8B_CONFIG | change).items() if v is not None}
    with pytest.raises(ValueError, match=key):
        acc.spec_from_hf_config(raw)
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf(raw)


def test_accounting_does_not_load_the_model_code():
    """Chapter 1's module stays light: reading a config's shape does not import kvlab.models."""
    import subprocess
    import sys

    code = ("import sys, kvlab.accounting as acc; acc.spec_from_hf_config(%r); "
            "print(sorted(m for m in sys.modules if m.startswith('kvlab.models')))" % LLAMA_3_8B_CONFIG)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
