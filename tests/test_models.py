"""kvlab.models without transformers: configs, the decoder, the paged path, the loader's errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvlab  # noqa: F401  (profile first)
from kvlab import profile
from helpers import tiny_tokenizer
from kvlab.models import (
    AttentionContext,
    CheckpointError,
    LlamaForCausalLM,
    ModelConfig,
    attention_backends,
    get_attention_backend,
    load_config,
    load_model,
    register_attention_backend,
    save_model,
    step_phase,
)
from kvlab.paging import BlockPool, allocate_kv_cache

TOL = 1e-4


def tiny_config(**kw) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                  bos_token_id=0, eos_token_id=0)
    fields.update(kw)
    return ModelConfig(**fields)


def tiny_model(config=None, seed=0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config or tiny_config())
    model.reset_parameters(std=0.2, seed=seed)
    return model.eval()


def hf_dict(**kw) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "rope_theta": 10000.0}
    cfg.update(kw)
    return cfg


def full_logits(model, ids):
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids).to(device)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids), device=device))).cpu()


# -- config ---------------------------------------------------------------------------------
def test_from_hf_reads_the_fields():
    c = ModelConfig.from_hf(hf_dict(tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 3],
                                    torch_dtype="bfloat16"))
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.tie_word_embeddings and c.eos_token_ids == [2, 3] and c.torch_dtype == "bfloat16"
    assert c.rope_scaling is None and not c.attention_bias
    assert ModelConfig.from_hf(hf_dict(num_key_value_heads=None)).num_kv_heads == 4


def test_rope_scaling_old_and_new_spellings_agree():
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    old = ModelConfig.from_hf(hf_dict(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **llama3}))
    new_cfg = hf_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **llama3})
    del new_cfg["rope_theta"]
    new = ModelConfig.from_hf(new_cfg)
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling and old.rope_scaling["rope_type"] == "llama3"
    legacy = ModelConfig.from_hf(hf_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf(hf_dict(rope_parameters={"rope_type": "default"})).rope_scaling is None


def test_qwen2_has_qkv_bias_and_no_output_bias():
    c = ModelConfig.from_hf(hf_dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert c.attention_bias and not c.attention_out_bias
    llama = ModelConfig.from_hf(hf_dict(attention_bias=True))
    assert llama.attention_bias and llama.attention_out_bias


@pytest.mark.parametrize("cfg, words", [
    (hf_dict(architectures=["GPT2LMHeadModel"]), ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"]),
    (hf_dict(architectures=None, model_type="gemma"), ["gemma", "MistralForCausalLM"]),
    (hf_dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), ["rope_scaling", "longrope", "llama3"]),
    (hf_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["rope_scaling", "low_freq_factor"]),
    (hf_dict(rope_scaling={"rope_type": "linear"}), ["rope_scaling", "factor"]),
    (hf_dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64),
     ["sliding_window", "64", "not supported"]),
    (hf_dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
             sliding_window=32, max_window_layers=0), ["sliding_window"]),
    (hf_dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (hf_dict(partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    (hf_dict(num_key_value_heads=3), ["num_key_value_heads"]),
    (hf_dict(vocab_size=None), ["vocab_size"]),
])
def test_unsupported_configs_raise_clear_errors(cfg, words):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf(cfg)
    for word in words:
        assert word in str(err.value)


def test_sliding_windows_that_never_slide_are_accepted():
    mistral = dict(architectures=["MistralForCausalLM"], model_type="mistral")
    assert ModelConfig.from_hf(hf_dict(**mistral, sliding_window=None)).model_type == "mistral"
    assert ModelConfig.from_hf(hf_dict(**mistral, sliding_window=128)).model_type == "mistral"
    qwen = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=32)
    assert ModelConfig.from_hf(hf_dict(**qwen, use_sliding_window=False)).model_type == "qwen2"
    # sliding starts at layer max_window_layers: with 28 >= 2 layers, no layer slides
    assert ModelConfig.from_hf(hf_dict(**qwen, use_sliding_window=True, max_window_layers=28))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_to_hf_reads_back_the_same_config(arch):
    bias = arch == "Qwen2ForCausalLM"
    c = tiny_config(architecture=arch, attention_bias=bias, tie_word_embeddings=True,
                    rope_scaling={"rope_type": "linear", "factor": 2.0})
    back = ModelConfig.from_hf(json.loads(json.dumps(c.to_hf())))
    assert back.to_dict() | {"extra": {}, "torch_dtype": None} == c.to_dict() | {"extra": {}, "torch_dtype": None}


# -- the decoder ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"tie_word_embeddings": True},
                                {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True},
                                {"architecture": "Qwen2ForCausalLM", "attention_bias": True}])
def test_num_params_counts_the_modules(kw):
    model = LlamaForCausalLM(tiny_config(**kw))
    assert model.num_parameters() == model.config.num_params


def test_a_batch_of_sequences_equals_each_alone():
    model = tiny_model()
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        batched = model(ids, torch.arange(11).expand(3, 11))
    for b in range(3):
        with torch.no_grad():
            alone = model(ids[b], torch.arange(11))
        torch.testing.assert_close(batched[b], alone, atol=TOL, rtol=0)


def test_positions_and_shapes_are_checked():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.tensor([1, 2]), torch.tensor([0, 128]))
    with pytest.raises(ValueError, match="same shape"):
        model(torch.tensor([1, 2]), torch.tensor([0]))


def test_low_precision_keeps_float32_rope_tables():
    model = tiny_model()
    ref = full_logits(model, [5, 6, 7, 8])
    model.to(torch.bfloat16)
    assert model.rotary.tables(torch.device("cpu"))[0].dtype == torch.float32
    out = full_logits(model, [5, 6, 7, 8])
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.25 * ref.abs().max()


def test_generate_is_greedy_and_stops_at_eos():
    model = tiny_model()
    new = model.generate([3, 4, 5], max_new_tokens=6, eos_token_id=-1)
    assert len(new) == 6
    ids = [3, 4, 5]
    for t in new:  # each token is the argmax of the full forward over what came before
        assert int(full_logits(model, ids)[-1].argmax()) == t
        ids.append(t)
    assert model.generate([3, 4, 5], max_new_tokens=6, eos_token_id=new[1]) == new[:2]


# -- the paged path ---------------------------------------------------------------------------
def make_cache(config, num_blocks=48, block_size=4, dtype=torch.float32):
    """A cache on the profile's device (on a GPU the paged path runs the fused Triton kernels)."""
    return allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                             dtype=dtype, device=profile.DEVICE)


def run_step(model, cache, pool, seqs, requests, backend="reference"):
    """One engine step: the tokens of ``requests`` [(seq, start, n)], packed, through the cache.
    The model moves to the cache's device."""
    device = cache.k.device
    model.to(device)
    ctx = AttentionContext.from_pool(cache, pool, requests, backend=backend)
    ids = torch.tensor([t for s, start, n in requests for t in seqs[s][start:start + n]], device=device)
    pos = torch.cat([torch.arange(start, start + n) for _, start, n in requests]).to(device)
    with torch.no_grad():
        return model(ids, pos, ctx)


@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 1, "tie_word_embeddings": True}])
def test_paged_prefill_then_decode_matches_the_full_forward(kw):
    """A ragged batch of 3 prompts in one packed prefill, then decode steps, all through a real
    BlockPool + KVCache + slot mapping: every logit equals the no-cache forward's."""
    model = tiny_model(tiny_config(**kw))
    gen = torch.Generator().manual_seed(2)
    seqs = {s: torch.randint(0, 300, (n,), generator=gen).tolist() for s, n in [("a", 5), ("b", 9), ("c", 1)]}
    pool, cache = BlockPool(num_blocks=48, block_size=4), make_cache(model.config)
    for s, ids in seqs.items():
        pool.allocate(s, len(ids))
    hidden = run_step(model, cache, pool, seqs, [(s, 0, len(ids)) for s, ids in seqs.items()])
    last = torch.tensor([len(ids) for ids in seqs.values()]).cumsum(0) - 1
    logits = model.compute_logits(hidden).cpu()
    for i, ids in enumerate(seqs.values()):
        ref = full_logits(model, ids)
        start = int(last[i]) + 1 - len(ids)
        torch.testing.assert_close(logits[start:start + len(ids)], ref, atol=TOL, rtol=0)
    for _ in range(4):  # decode: each sequence appends its greedy token
        requests = []
        for i, (s, ids) in enumerate(seqs.items()):
            ids.append(int(logits[int(last[i])].argmax()))  # greedy: the row of its last token
            pool.append(s, 1)
            requests.append((s, len(ids) - 1, 1))
        hidden = run_step(model, cache, pool, seqs, requests)
        last = torch.arange(len(seqs))
        logits = model.compute_logits(hidden).cpu()
        ref = torch.stack([full_logits(model, ids)[-1] for ids in seqs.values()])
        torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)
    assert pool.seq_len("b") == 13 and len(pool.block_table("b")) == 4


def test_chunked_prefill_matches_the_full_forward():
    """A prompt computed in two chunks, the second beside another sequence's decode step."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    seqs = {"long": torch.randint(0, 300, (14,), generator=gen).tolist(),
            "short": torch.randint(0, 300, (3,), generator=gen).tolist()}
    pool, cache = BlockPool(num_blocks=16, block_size=4), make_cache(model.config, num_blocks=16)
    pool.allocate("long", 6)
    pool.allocate("short", 2)
    run_step(model, cache, pool, seqs, [("long", 0, 6), ("short", 0, 2)])
    pool.append("long", 8)
    pool.append("short", 1)
    hidden = run_step(model, cache, pool, seqs, [("long", 6, 8), ("short", 2, 1)])
    logits = model.compute_logits(hidden).cpu()
    torch.testing.assert_close(logits[:8], full_logits(model, seqs["long"])[6:], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[8], full_logits(model, seqs["short"])[-1], atol=TOL, rtol=0)


def test_attention_backends_are_swappable():
    """A backend is chosen per step (the context carries it), by name or as a function."""
    calls = []

    def counting(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale):
        calls.append(q.shape)
        from kvlab.reference import paged_attention_ref

        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
                                   sm_scale=sm_scale).to(q.dtype)

    register_attention_backend("counting", counting)
    assert {"reference", "torch", "triton", "counting"} <= set(attention_backends())
    model = tiny_model()
    pool, cache = BlockPool(num_blocks=8, block_size=4), make_cache(model.config, num_blocks=8)
    pool.allocate(0, 3)
    by_name = run_step(model, cache, pool, {0: [1, 2, 3]}, [(0, 0, 3)], backend="counting")
    assert len(calls) == model.config.num_layers and calls[0] == (3, 4, 16)
    as_function = run_step(model, cache, pool, {0: [1, 2, 3]}, [(0, 0, 3)], backend=counting)
    assert len(calls) == 2 * model.config.num_layers
    torch.testing.assert_close(by_name, as_function, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope")
    with pytest.raises(TypeError):
        register_attention_backend("bad", 42)
    with pytest.raises(TypeError, match="registered name or a function"):
        get_attention_backend(42)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backends_agree_with_the_reference(backend):
    """The batched PyTorch backend and the Triton kernels (interpreted on the CPU) give the
    reference's hidden states, for a ragged prefill and then a decode step."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(5)
    seqs = {s: torch.randint(0, 300, (n,), generator=gen).tolist() for s, n in [("a", 6), ("b", 3)]}
    results = {}
    for name in ("reference", backend):
        pool, cache = BlockPool(num_blocks=16, block_size=4), make_cache(model.config, num_blocks=16)
        cache.k.fill_(float("nan"))           # slots no step wrote must never reach an output
        cache.v.fill_(float("nan"))
        for s, ids in seqs.items():
            pool.allocate(s, len(ids) - 1)
        prefill = run_step(model, cache, pool, seqs, [(s, 0, len(ids) - 1) for s, ids in seqs.items()], name)
        for s in seqs:
            pool.append(s, 1)
        decode = run_step(model, cache, pool, seqs, [(s, len(ids) - 1, 1) for s, ids in seqs.items()], name)
        results[name] = (prefill, decode)
    for ours, ref in zip(results[backend], results["reference"]):
        torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)


def test_a_step_names_its_phase():
    assert step_phase([1, 1, 1]) == "decode"
    assert step_phase([4, 4]) == "uniform"           # speculative verification of k + 1 = 4 tokens
    assert step_phase([7]) == "uniform"
    assert step_phase([1, 5]) == "mixed"
    model = tiny_model()
    pool, cache = BlockPool(num_blocks=8, block_size=4), make_cache(model.config, num_blocks=8)
    pool.allocate(0, 5)
    pool.allocate(1, 1)
    assert AttentionContext.from_pool(cache, pool, [(0, 0, 5), (1, 0, 1)]).phase == "mixed"
    assert AttentionContext.from_pool(cache, pool, [(0, 4, 1), (1, 0, 1)]).phase == "decode"


def test_backends_get_the_hints_their_signature_names():
    """A backend with a ``k_new`` parameter receives the layer's new keys (the rows the step wrote
    into the cache), and no hint it does not name (a surplus keyword would be a TypeError)."""
    from kvlab.reference import gather_kv, paged_attention_ref

    seen = {}

    def wants_new_keys(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *, k_new=None,
                       max_query_len=None, phase=None):
        seen.setdefault("k_new", k_new)
        seen.setdefault("k_cached", gather_kv(k_cache, block_tables[0], int(seq_lens[0])))
        seen.setdefault("max_query_len", max_query_len)
        seen.setdefault("phase", phase)
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
                                   sm_scale=sm_scale).to(q.dtype)

    model = tiny_model()
    pool, cache = BlockPool(num_blocks=8, block_size=4), make_cache(model.config, num_blocks=8)
    pool.allocate(0, 6)
    run_step(model, cache, pool, {0: [5, 6, 7, 8, 9, 10]}, [(0, 0, 6)], backend=wants_new_keys)
    assert seen["k_new"].shape == (6, model.config.num_kv_heads, model.config.head_dim)
    torch.testing.assert_close(seen["k_new"], seen["k_cached"], rtol=0, atol=0)
    assert seen["max_query_len"] == 6 and seen["phase"] == "uniform"


def test_a_context_needs_flat_tokens():
    model = tiny_model()
    pool, cache = BlockPool(num_blocks=8, block_size=4), make_cache(model.config, num_blocks=8)
    pool.allocate(0, 2)
    ctx = AttentionContext.from_pool(cache, pool, [(0, 0, 2)])
    with pytest.raises(ValueError, match="flat"):
        model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), ctx)


# -- loading and saving -------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_save_then_load_gives_the_same_model(tmp_path, tied):
    model = tiny_model(tiny_config(tie_word_embeddings=tied))
    tok = tiny_tokenizer()
    save_model(model, tok, None, tmp_path, dtype=torch.float32)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert ("lm_head.weight" in names) == (not tied)
    assert "model.layers.1.self_attn.q_proj.weight" in names
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    loaded, tok2, config = load_model(tmp_path)
    assert config.tie_word_embeddings == tied and tok2.get_vocab_size() == tok.get_vocab_size()
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = [1, 2, 3, 4, 5]
    torch.testing.assert_close(full_logits(loaded, ids), full_logits(model, ids), atol=0, rtol=0)
    assert loaded.generate(ids, 5) == model.generate(ids, 5)


def test_sharded_checkpoints_load(tmp_path):
    model = tiny_model()
    save_model(model, tiny_tokenizer(), None, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "model.safetensors").exists()
    loaded, _, _ = load_model(tmp_path)
    torch.testing.assert_close(full_logits(loaded, [7, 8, 9]), full_logits(model, [7, 8, 9]), atol=0, rtol=0)


def test_load_in_low_precision(tmp_path):
    save_model(tiny_model(), tiny_tokenizer(), None, tmp_path, dtype=torch.bfloat16)
    assert load_config(tmp_path).torch_dtype == "bfloat16"
    model, _, _ = load_model(tmp_path)  # on the CPU, None means float32
    assert model.dtype == torch.float32
    model, _, _ = load_model(tmp_path, dtype="float16")
    assert model.dtype == torch.float16 and all(p.dtype == torch.float16 for p in model.parameters())
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype="int8")


@pytest.fixture
def checkpoint(tmp_path):
    save_model(tiny_model(), tiny_tokenizer(), None, tmp_path)
    return tmp_path


def rewrite_weights(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_a_missing_weight_is_named(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_model(checkpoint)


def test_an_extra_weight_is_named(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(checkpoint)


def test_a_misshapen_weight_is_named(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \[65\]"):
        load_model(checkpoint)


def test_old_rotary_buffers_are_ignored(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(checkpoint)


def test_a_missing_tokenizer_is_a_clear_error(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(checkpoint)
    model, tok, _ = load_model(checkpoint, require_tokenizer=False)
    assert tok is None and model.config.num_layers == 2


def test_missing_folders_and_files_are_clear_errors(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(checkpoint)
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(checkpoint)


def test_the_fused_kernels_give_the_pytorch_forward(monkeypatch):
    """The model's GPU path (merged projections; RMSNorm + residual, SiLU-and-mul and RoPE + K/V
    write as Triton kernels, interpreted here) gives the plain PyTorch forward's hidden states
    and the same cache contents."""
    from kvlab.models import ops

    model = tiny_model()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 300, (9,), generator=gen).tolist()
    results = []
    for fused in (False, True):
        if fused:
            model.fuse()
            monkeypatch.setattr(ops, "use_kernels", lambda x: True)
        pool, cache = BlockPool(num_blocks=8, block_size=4), make_cache(model.config, num_blocks=8)
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
        pool.allocate(0, 9)
        hidden = run_step(model, cache, pool, {0: ids}, [(0, 0, 9)])
        results.append((hidden, cache.k.clone(), cache.v.clone()))
    for plain, fused in zip(*results):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=0, equal_nan=True)


def test_only_short_uniform_queries_run_as_decode_rows():
    """Verification of a few drafts may run as decode rows; a lone long prompt (also a uniform
    step) never does: as rows it would read all its K/V once per token."""
    from kvlab.models.backends import verify_with_paged_decode

    h200 = dict(num_heads=32, num_kv_heads=8, num_sms=132)
    assert verify_with_paged_decode(1, 6, **h200)            # batch 1: too few prefill programs
    assert verify_with_paged_decode(8, 3, **h200)            # fewer tokens than GQA heads
    assert not verify_with_paged_decode(8, 5, **h200)
    assert not verify_with_paged_decode(1, 2048, **h200)     # a prompt
    assert not verify_with_paged_decode(1, 16384, **h200)
