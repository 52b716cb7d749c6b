"""The engine end to end, on a tiny random model saved to disk: greedy output equals the plain
no-cache loop (with prefix caching, with preemption), parallel sampling forks, seeded sampling
repeats, stop rules, and bad requests fail alone."""
from pathlib import Path

import pytest
import torch

import kvlab  # noqa: F401  (profile first)
from helpers import tiny_tokenizer
from kvlab.engine import LLM, CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from kvlab.models import LlamaForCausalLM, ModelConfig, load_model, register_attention_backend, save_model
from helpers import one_thread  # noqa: F401  (a fixture)

BLOCK = 8
PROBE = [5, 17, 42]          # a prompt whose greedy continuation the fixture looks at
GREEDY = SamplingParams(temperature=0, max_tokens=10)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(vocab_size: int) -> LlamaForCausalLM:
    """2 layers, hidden 64, GQA 4/2 heads, 128 positions, random weights, float32."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    model.reset_parameters(std=0.2, seed=0)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer random model with the tiny BPE tokenizer. Its EOS is the 4th token of the
    probe prompt's greedy continuation, so that EOS really happens."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.get_vocab_size())
    free_run = model.generate(PROBE, 12, eos_token_id=-1)
    assert free_run[3] not in free_run[:3]
    model.config.eos_token_id = free_run[3]
    return save_model(model, tok, None, tmp_path_factory.mktemp("tiny"), dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, tokenizer, config = load_model(checkpoint)
    return model, tokenizer


def ragged_prompts(seed=0, shared_prefix=0):
    """Prompts of 1, B-1, B, B+1 and 30 tokens (B = block size), after a shared prefix if asked."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 280, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(1, 280, (n,), generator=gen).tolist() for n in (1, BLOCK - 1, BLOCK, BLOCK + 1, 30)]


def assert_pool_empty(llm):
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    assert not llm.pool.block_tables and not llm.scheduler.running and not llm.scheduler.waiting
    assert not llm.requests


def assert_greedy_matches(outputs, prompts, model, max_tokens):
    eos = model.config.eos_token_ids
    for prompt, out in zip(prompts, outputs):
        assert out.error is None and out.finished
        ref = model.generate(prompt, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert got.finish_reason == ("stop" if ref[-1] in eos else "length")


# -- greedy parity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["plain", "prefix_caching", "preemption", "prefix_caching+preemption"])
def test_greedy_equals_the_no_cache_loop(checkpoint, reference, case):
    caching, preempt = "prefix_caching" in case, "preemption" in case
    model, _ = reference
    prompts = ragged_prompts(shared_prefix=2 * BLOCK + 3 if caching else 0)
    longest = -(-(max(map(len, prompts)) + GREEDY.max_tokens) // BLOCK)
    # forced preemption: room for the longest sequence and one block more, far from all of them
    llm = LLM(checkpoint, block_size=BLOCK, enable_prefix_caching=caching,
              num_gpu_blocks=longest + 1 if preempt else None)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert_greedy_matches(outputs, prompts, model, GREEDY.max_tokens)
    assert (llm.scheduler.num_preemptions > 0) == preempt
    if caching:
        assert outputs[0].num_cached_tokens == 0
        # admitted in the same step as the first, the others find nothing yet: a block joins the
        # prefix cache only once its K/V has been computed
        if not preempt:
            assert [o.num_cached_tokens for o in outputs[1:]] == [0] * 4
        again = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= 2 * BLOCK for o in again)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
        assert llm.reset_prefix_cache() and not llm.pool.cached_blocks
    assert_pool_empty(llm)


def test_text_prompts_and_output_fields(checkpoint, reference):
    model, tok = reference
    llm = LLM(checkpoint, block_size=BLOCK)
    prompts = ["def f(self):", "import os"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput] * 2
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt).ids
        assert out.prompt == prompt and out.prompt_token_ids == ids and out.finished and out.error is None
        [c] = out.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0
        assert c.token_ids == model.generate(ids, 6)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.cumulative_logprob < 0
    # one string, a dict, and a token list are prompts too
    [one] = llm.generate("import os", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    [ids] = llm.generate([{"prompt_token_ids": outs[1].prompt_token_ids}], SamplingParams(temperature=0, max_tokens=6),
                         use_tqdm=False)
    assert one.outputs[0].token_ids == ids.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert_pool_empty(llm)


def test_progress_bar_and_step_api(checkpoint, capsys):
    llm = LLM(checkpoint, block_size=BLOCK)
    llm.generate(ragged_prompts()[:3], GREEDY)                     # use_tqdm on by default
    assert "Processed prompts" in capsys.readouterr().err
    rid = llm.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=3))
    assert llm.has_unfinished_requests()
    seen = []
    while llm.has_unfinished_requests():
        seen += llm.step()
        assert llm.last_schedule.num_batched_tokens <= llm.scheduler.max_num_batched_tokens
    assert [o.request_id for o in seen] == [rid] * 3
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3] and seen[-1].finished
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    llm.add_request([3], request_id="mine")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([4], request_id="mine")
    while llm.has_unfinished_requests():
        llm.step()
    assert_pool_empty(llm)


def test_final_only_requests_report_once_and_the_same(checkpoint):
    """output_kind=FINAL_ONLY (vLLM's): step() says nothing of the request until it finishes,
    then gives what a CUMULATIVE twin ends with; DELTA is refused, naming the field."""
    llm = LLM(checkpoint, block_size=BLOCK)
    final = SamplingParams(temperature=0, max_tokens=5, stop=["zz"], output_kind=RequestOutputKind.FINAL_ONLY)
    llm.add_request([3, 4, 5], final, request_id="final")
    llm.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=5, stop=["zz"]), request_id="each")
    seen = []
    while llm.has_unfinished_requests():
        seen += llm.step()
    assert [o.request_id for o in seen if o.request_id == "final"] == ["final"]
    assert [o.finished for o in seen if o.request_id == "each"] == [False] * 4 + [True]
    last = {o.request_id: o for o in seen}
    assert last["final"].finished and last["final"].outputs[0] == last["each"].outputs[0]
    with pytest.raises(ValueError, match="output_kind must be"):
        llm.add_request([3], SamplingParams(output_kind=RequestOutputKind.DELTA))
    assert_pool_empty(llm)


# -- parallel sampling ---------------------------------------------------------------------------
def test_n_greedy_samples_share_the_prompt_blocks(checkpoint, reference):
    model, _ = reference
    llm = LLM(checkpoint, block_size=BLOCK)
    prompt = ragged_prompts()[-1]                                  # 30 tokens: 3 full blocks + 6
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, n=3, ignore_eos=True))
    llm.step()                                                     # the prompt, once; then the fork
    tables = [llm.pool.block_table(s.seq_id) for s in llm.scheduler.running]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
    assert all(llm.pool.ref_counts[b] == 3 for b in tables[0])
    while llm.has_unfinished_requests():
        [out] = llm.step()
    samples = [c.token_ids for c in out.outputs]
    assert samples[0] == samples[1] == samples[2] == model.generate(prompt, 6, eos_token_id=-1)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    blocks_each = -(-(len(prompt) + 6) // BLOCK)
    assert llm.scheduler.peak_used_blocks < 3 * blocks_each          # the prompt's full blocks are shared
    assert llm.scheduler.num_copied_blocks == 2                     # the shared half block, copied twice
    assert_pool_empty(llm)


def test_n_random_samples_differ_and_repeat_with_a_seed(checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11, ignore_eos=True)
    runs = [LLM(checkpoint, block_size=BLOCK).generate([PROBE], params, use_tqdm=False)[0] for _ in range(2)]
    samples = [[c.token_ids for c in r.outputs] for r in runs]
    assert samples[0] == samples[1]
    assert len({tuple(s) for s in samples[0]}) == 3


# -- seeded sampling -----------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_whatever_the_batch(checkpoint):
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=8, seed=1234, ignore_eos=True)
    alone = LLM(checkpoint, block_size=BLOCK).generate([PROBE], seeded, use_tqdm=False)[0]
    # in a batch, with other random requests around it and a cache so small it preempts
    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=5, seed=99)
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([ragged_prompts()[-1], PROBE, [9] * 20], [others, seeded, others], use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=8, seed=4321, ignore_eos=True)
    assert llm.generate([PROBE], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone.outputs[0].token_ids
    assert_pool_empty(llm)


# -- stopping -----------------------------------------------------------------------------------
def test_eos_max_tokens_and_ignore_eos(checkpoint, reference):
    model, _ = reference
    eos = model.config.eos_token_id
    free_run = model.generate(PROBE, 8, eos_token_id=-1)
    llm = LLM(checkpoint, block_size=BLOCK)
    stop_eos, ignore, short = llm.generate(
        [PROBE] * 3, [SamplingParams(temperature=0, max_tokens=8),
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                      SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)
    assert stop_eos.outputs[0].token_ids == free_run[:4] and free_run[3] == eos
    assert stop_eos.outputs[0].finish_reason == "stop" and stop_eos.outputs[0].stop_reason is None
    assert ignore.outputs[0].token_ids == free_run and ignore.outputs[0].finish_reason == "length"
    assert short.outputs[0].token_ids == free_run[:2] and short.outputs[0].finish_reason == "length"
    assert_pool_empty(llm)


def test_stop_token_ids(checkpoint, reference):
    model, _ = reference
    free_run = model.generate(PROBE, 10, eos_token_id=-1)
    k = next(i for i in range(4, 10) if free_run[i] not in free_run[:i])
    llm = LLM(checkpoint, block_size=BLOCK)
    [out] = llm.generate([PROBE], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                 stop_token_ids=[free_run[k]]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == free_run[:k + 1] and c.finish_reason == "stop" and c.stop_reason == free_run[k]


def test_stop_strings_cut_the_text(checkpoint, reference):
    model, tok = reference
    free_run = model.generate(PROBE, 12, eos_token_id=-1)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    # the first token whose text brings a new character: stopping on it must end there
    for k in range(2, 12):
        before, now = decode(free_run[:k - 1]), decode(free_run[:k])
        if now.startswith(before) and len(now) > len(before) and now[len(before)] not in before + "\ufffd":
            stop = now[len(before)]
            break
    else:
        pytest.fail("no usable stop string in the probe's continuation")
    llm = LLM(checkpoint, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["never-there", stop])
    [out] = llm.generate([PROBE], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == free_run[:k] and c.text == before
    # completed by the last token max_tokens allows: still a stop, as in vLLM
    [out] = llm.generate([PROBE], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text, c.token_ids) == ("stop", stop, before, free_run[:k])
    assert_pool_empty(llm)


# -- bad requests ----------------------------------------------------------------------------------------
def test_each_bad_request_fails_alone(checkpoint, reference):
    model, _ = reference
    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=6)      # 48 slots; the context is 128
    good = [[3, 4, 5], [7] * 9]
    cases = [
        ("", GREEDY, "empty"),
        ([], GREEDY, "empty"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1] * 130, GREEDY, "context"),
        ([1] * 60, GREEDY, "KV cache"),
        ([1, 10_000], GREEDY, "token"),
        ([1, 2], SamplingParams(n=300), "max_num_seqs"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, GREEDY, "takes the keys"),
        ("\udcff", GREEDY, "not valid text"),
        (torch.tensor([1, 2]), GREEDY, ".tolist()"),
    ]
    prompts = [good[0]] + [c[0] for c in cases] + [good[1]]
    params = [GREEDY] + [c[1] for c in cases] + [GREEDY]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_matches([outs[0], outs[-1]], good, model, GREEDY.max_tokens)
    for (_, _, word), out in zip(cases, outs[1:-1]):
        assert out.finished and out.outputs == [] and out.error and word in out.error, (word, out.error)
    assert_pool_empty(llm)


def test_token_ids_of_other_integer_types_are_taken(checkpoint):
    import numpy as np

    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=6)
    prompts = [[np.int64(3), 4, 5], {"prompt_token_ids": [np.int32(3), torch.tensor(4), 5]}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None, None] and [o.prompt_token_ids for o in outs] == [[3, 4, 5]] * 2
    assert all(type(t) is int for o in outs for t in o.prompt_token_ids)


def test_a_request_that_outgrows_the_cache_fails_with_its_tokens_so_far(checkpoint):
    llm = LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=3)     # 24 slots
    long, fine = llm.generate([[2] * 20, [3, 4]], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                                   SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)],
                              use_tqdm=False)
    assert long.error and "KV cache" in long.error and long.outputs[0].finish_reason == "error"
    assert 0 < len(long.outputs[0].token_ids) < 40
    assert fine.error is None and len(fine.outputs[0].token_ids) == 3
    assert_pool_empty(llm)


def test_bad_calls_and_settings_raise(checkpoint):
    with pytest.raises(ValueError, match="one per prompt"):
        LLM(checkpoint, num_gpu_blocks=4).generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(checkpoint, max_model_len=10_000)
    with pytest.raises(ValueError, match="attention backend"):
        LLM(checkpoint, attention_backend="no-such-backend")
    with pytest.raises(FileNotFoundError, match="checkpoint folder"):
        LLM(Path(checkpoint) / "missing")


def test_the_default_model_is_named_when_missing(monkeypatch, tmp_path):
    import kvlab.engine.llm as llm_module

    monkeypatch.setattr(llm_module, "DEFAULT_MODEL", tmp_path / "kvlab-tiny-target")
    with pytest.raises(FileNotFoundError, match="default model"):
        LLM()


def test_attention_goes_through_the_chosen_backend(checkpoint, reference):
    from kvlab.reference import paged_attention_ref

    calls = []

    def counting(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale):
        calls.append(q.shape[0])
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
                                   sm_scale=sm_scale).to(q.dtype)

    register_attention_backend("engine-test-counting", counting)
    llm = LLM(checkpoint, block_size=BLOCK, attention_backend="engine-test-counting")
    [out] = llm.generate([PROBE], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    layers = reference[0].config.num_layers
    assert calls == [len(PROBE)] * layers + [1] * (2 * layers)     # a prefill, then two decode steps


def test_cache_size(checkpoint, monkeypatch):
    import kvlab.engine.model_runner as runner

    if torch.cuda.is_available():
        # On a GPU the cache takes what gpu_memory_utilization leaves after weights and activations.
        llm = LLM(checkpoint, block_size=BLOCK, gpu_memory_utilization=0.3)
        total = torch.cuda.get_device_properties(0).total_memory
        assert 0 < llm.model_runner.kv_cache.nbytes <= 0.3 * total
        assert llm.pool.num_blocks == llm.model_runner.kv_cache.num_blocks
        assert LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=3).pool.num_blocks == 3
        return
    # On the CPU: max_num_seqs sequences of max_model_len tokens: 4 x 128 / 8 blocks
    llm = LLM(checkpoint, block_size=BLOCK, max_num_seqs=4)
    assert llm.pool.num_blocks == llm.model_runner.kv_cache.num_blocks == 4 * 128 // BLOCK
    per_block = runner.block_bytes(llm.config, BLOCK, torch.float32)
    assert llm.model_runner.kv_cache.nbytes == llm.pool.num_blocks * per_block
    # ... unless that takes more than the CPU budget
    monkeypatch.setattr(runner, "CPU_KV_CACHE_BYTES", 10 * per_block + 1)
    assert LLM(checkpoint, block_size=BLOCK, max_num_seqs=4).pool.num_blocks == 10
    assert LLM(checkpoint, block_size=BLOCK, num_gpu_blocks=3).pool.num_blocks == 3
    # in the Triton interpreter the kernels are slow: "auto" takes the batched PyTorch backend there
    assert runner.pick_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert runner.pick_attention_backend("auto", torch.device("cuda")).name == "triton"


def test_greedy_through_the_triton_kernels(checkpoint, reference):
    """The course's kernels as the engine's backend (paged_prefill for prompts, paged_decode
    for decode steps; interpreted here) give the no-cache loop's greedy tokens, prefix hits
    and all."""
    model, _ = reference
    prompts = ragged_prompts(seed=1, shared_prefix=BLOCK + 3)[1:4]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(checkpoint, block_size=BLOCK, enable_prefix_caching=True, attention_backend="triton")
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == model.generate(prompt, 4, eos_token_id=-1)
    assert_pool_empty(llm)
