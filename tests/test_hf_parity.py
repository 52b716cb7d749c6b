"""Parity with transformers: tiny random checkpoints saved by HF, loaded by kvlab, same logits.

Each case is a real HF model class with random weights, written by ``save_pretrained``
(safetensors) into a temporary folder with a small tokenizer beside it; kvlab's loader reads
the folder. Logits must agree to 1e-4 in float32 and greedy continuations token for token.
"""
import json

import pytest
import torch

import kvlab  # noqa: F401  (profile first)
from helpers import tiny_tokenizer

transformers = pytest.importorskip("transformers")

from kvlab.models import LlamaForCausalLM, ModelConfig, load_model, save_model  # noqa: E402
from kvlab.models.llama import RotaryEmbedding  # noqa: E402

TOL = 1e-4
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=0,
             eos_token_id=0)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "llama-gqa-llama3-rope": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                                   rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama-tied-mha-bias": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                attention_bias=True, head_dim=32)),
    "qwen2-qkv-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                           rope_theta=1000000.0)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, tie_word_embeddings=False, sliding_window=None)),
}


def hf_model(config_class: str, kw: dict, seed: int = 0):
    config = getattr(transformers, config_class)(**SMALL, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # HF starts biases at 0 and norm weights at 1: perturb them, so that loading them matters
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(HF model, kvlab model) for one case, through a checkpoint folder."""
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_model(*CASES[request.param])
    hf.save_pretrained(path)
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    model, tok, config = load_model(path)
    assert tok is not None and config.architecture == hf.config.architectures[0]
    return hf, model


def test_logits_match_transformers(pair):
    hf, model = pair
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        out = model.compute_logits(model(ids, torch.arange(len(ids))))
    assert ref.abs().max() > 1.0  # the random weights give logits with some spread
    assert (out - ref).abs().max().item() <= TOL


def test_greedy_continuation_matches_transformers(pair):
    hf, model = pair
    prompt = [5, 17, 42, 99, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    ref_new = ref[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=16) == ref_new
    assert len(ref_new) >= 8  # a continuation, not an immediate end of text


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model(*CASES["llama-gqa-llama3-rope"])
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, tok, _ = load_model(tmp_path, require_tokenizer=False)
    assert tok is None
    ids = torch.arange(1, 30)
    with torch.no_grad():
        diff = model.compute_logits(model(ids, torch.arange(29))) - hf(ids[None]).logits[0]
    assert diff.abs().max().item() <= TOL


@pytest.mark.parametrize("arch, tied", [("LlamaForCausalLM", True), ("Qwen2ForCausalLM", False)])
def test_transformers_reads_what_kvlab_saves(tmp_path, arch, tied):
    config = ModelConfig(architecture=arch, vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=tied, attention_bias=arch == "Qwen2ForCausalLM",
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    model.reset_parameters(std=0.2, seed=0)
    save_model(model.eval(), tiny_tokenizer(), config, tmp_path, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == arch
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = model.compute_logits(model(ids, torch.arange(20))) - hf(ids[None]).logits[0]
    assert diff.abs().max().item() <= TOL
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok("def f(self):")["input_ids"] == tiny_tokenizer().encode("def f(self):").ids


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    LLAMA3,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
     "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "attention_factor": 1.3},
])
def test_rope_tables_match_transformers(scaling):
    """cos/sin of every position for each supported rope_scaling type."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kw = dict(SMALL, rope_theta=50000.0, rope_scaling=dict(scaling) if scaling else None)
    hf_config = transformers.LlamaConfig(**kw)
    ours = RotaryEmbedding(ModelConfig.from_hf(hf_config.to_dict() | {"architectures": ["LlamaForCausalLM"]}))
    pos = torch.arange(128)
    cos, sin = LlamaRotaryEmbedding(config=hf_config)(torch.zeros(1, dtype=torch.float32), pos[None])
    our_cos, our_sin = ours(pos)
    assert (our_cos - cos[0]).abs().max() <= 1e-6 and (our_sin - sin[0]).abs().max() <= 1e-6
