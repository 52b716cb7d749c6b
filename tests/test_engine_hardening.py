"""The engine under stress: a failed step, tenants, concurrent callers, bad input, and a
hypothesis state machine that adds, aborts, steps and fails steps at random."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab  # noqa: F401  (profile first)
from kvlab import LLM, SamplingParams
from kvlab.models import LlamaForCausalLM, ModelConfig
from kvlab.engine.model_runner import block_bytes
from kvlab.paging import BlockPool

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def micro_model(dtype=torch.float64) -> LlamaForCausalLM:
    """2 layers of width 32 in float64: a step costs well under a millisecond."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    model.reset_parameters(std=0.3, seed=0)
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return micro_model()


def engine(model, **kw) -> LLM:
    kw = {"block_size": BLOCK, "num_gpu_blocks": 40, "device": "cpu", "max_num_seqs": 4, **kw}
    return LLM(model, **kw)


def alone(model, prompt, params=GREEDY) -> list[int]:
    """The greedy continuation of ``prompt`` by the no-cache loop."""
    return model.generate(prompt, params.max_tokens, eos_token_id=-1)


def assert_idle_and_clean(llm):
    """No request left, no block leaked: every block is free or (once) in the prefix cache."""
    pool = llm.pool
    assert not llm.requests and not llm.scheduler.running and not llm.scheduler.waiting
    assert not pool.block_tables and not any(pool.ref_counts)
    assert pool.num_free_blocks == pool.num_blocks
    assert len(pool.free_blocks) + len(pool.evictable) == pool.num_blocks
    assert sorted(pool.cached_blocks.values()) == sorted(pool.evictable)


class FailOnce:
    """Wraps the runner's forward: raises on call number ``when`` (1-based), then works."""

    def __init__(self, runner, when: int):
        self.runner, self.when, self.calls = runner, when, 0
        self.inner = runner.compute_logits
        runner.compute_logits = self

    def __call__(self, out):
        self.calls += 1
        if self.calls == self.when:
            self.inner(out)            # the layers wrote K/V: the failure comes after
            raise RuntimeError("injected failure")
        return self.inner(out)


# -- 1. a failed step -----------------------------------------------------------------------------
def test_a_failed_step_ends_its_requests_and_the_engine_keeps_serving(model):
    llm = engine(model, enable_prefix_caching=True)
    prompt = list(range(1, 11))                         # two full blocks and a half
    FailOnce(llm.model_runner, when=1)                 # the prefill step fails
    [failed] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and "injected failure" in failed.error
    assert_idle_and_clean(llm)
    assert not llm.pool.cached_blocks                   # nothing of the failed step is cached
    [again] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert again.error is None and again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == alone(model, prompt)
    [third] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert third.num_cached_tokens == 2 * BLOCK and third.outputs[0].token_ids == alone(model, prompt)


def test_a_failed_decode_step_spares_requests_it_did_not_run(model):
    llm = engine(model, max_num_seqs=1)
    a = llm.add_request([3, 4, 5], GREEDY)
    b = llm.add_request([6, 7], GREEDY)
    FailOnce(llm.model_runner, when=2)                 # a's first decode step fails; b waits
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update({o.request_id: o for o in llm.step() if o.finished})
    assert outputs[a].outputs[0].finish_reason == "error"
    assert outputs[b].error is None and outputs[b].outputs[0].token_ids == alone(model, [6, 7])
    assert_idle_and_clean(llm)


def test_abort_request_frees_its_blocks_at_any_point(model):
    llm = engine(model, enable_prefix_caching=True)
    rid = llm.add_request(list(range(1, 12)), SamplingParams(temperature=0, max_tokens=20, n=2))
    assert not llm.abort_request("no-such-request")
    llm.step()
    llm.step()
    assert llm.pool.num_used_blocks > 0
    assert llm.abort_request(rid) and not llm.abort_request(rid)
    assert_idle_and_clean(llm)
    queued = llm.add_request([1, 2, 3], GREEDY)
    assert llm.abort_request([queued, "other"])         # still waiting: never ran
    assert_idle_and_clean(llm)


# -- 2. tenants -----------------------------------------------------------------------------------
def test_requests_of_different_salts_never_share_a_block(model):
    llm = engine(model, enable_prefix_caching=True)
    secret = list(range(1, 14))

    def cached(salt=None):
        prompt = {"prompt_token_ids": secret, **({"cache_salt": salt} if salt is not None else {})}
        [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
        return out.num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 3 * BLOCK              # the same tenant hits its own prefix
    assert cached("tenant-b") == 0                      # another tenant learns nothing
    assert cached() == 0 and cached() == 3 * BLOCK      # no salt is a tenant of its own
    assert cached(b"tenant-a") == 3 * BLOCK             # bytes and str name the same salt


@pytest.mark.parametrize("salt, error", [(3, TypeError), (10**8, TypeError), (b"", ValueError), ("", ValueError),
                                         (["a"], TypeError)])
def test_bad_salts_are_refused(model, salt, error):
    llm = engine(model, enable_prefix_caching=True)
    with pytest.raises(error, match="cache_salt"):
        llm.add_request({"prompt_token_ids": [1, 2, 3], "cache_salt": salt}, GREEDY)
    [out] = llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_salt": salt}], GREEDY, use_tqdm=False)
    assert "cache_salt" in out.error
    with pytest.raises(error, match="cache_salt"):
        BlockPool(8, 4, enable_prefix_caching=True).allocate("a", 3, [1, 2, 3], salt=salt)
    assert_idle_and_clean(llm)


# -- 3. concurrent callers --------------------------------------------------------------------------
def test_generate_returns_only_its_own_requests(model):
    llm = engine(model)
    queued = llm.add_request([9, 8, 7], GREEDY)
    [mine] = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert mine.prompt_token_ids == [1, 2, 3] and mine.outputs[0].token_ids == alone(model, [1, 2, 3])
    theirs = []
    while llm.has_unfinished_requests() or not theirs:
        theirs += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in theirs] == [queued]
    assert theirs[0].outputs[0].token_ids == alone(model, [9, 8, 7])


def test_user_and_automatic_request_ids_never_collide(model):
    llm = engine(model)
    assert llm.add_request([1, 2], GREEDY, request_id="0") == "0"
    auto = llm.add_request([3, 4], GREEDY)
    assert auto != "0"
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([5], GREEDY, request_id=auto)
    outs = llm.generate([[6, 7]], GREEDY, use_tqdm=False)
    assert outs[0].request_id not in ("0", auto)


def test_sampling_params_changed_after_submission_change_nothing(model):
    llm = engine(model)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rid = llm.add_request([1, 2, 3], params)
    params.max_tokens = -5                  # a later change, invalid even: the request keeps its copy
    params.temperature = 7.0
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    assert outs[0].request_id == rid and outs[0].outputs[0].token_ids == alone(model, [1, 2, 3], params=GREEDY)[:3]


# -- 5. edge checks ---------------------------------------------------------------------------------
def test_truthy_strings_are_not_booleans(model):
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        engine(model, enable_prefix_caching="no")
    with pytest.raises(TypeError, match="enforce_eager"):
        engine(model, enforce_eager="yes")
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        BlockPool(8, 4, enable_prefix_caching="no")


def test_a_sequence_twice_in_one_batch_is_refused():
    from kvlab.paging import batch_slot_mapping

    pool = BlockPool(8, 4)
    pool.allocate("a", 6)
    with pytest.raises(ValueError, match="twice"):
        batch_slot_mapping(pool, [("a", 0, 3), ("a", 3, 3)])


# -- 6. the two planted bugs that survived -----------------------------------------------------------
def test_copy_on_write_copies_from_the_block_that_holds_the_data():
    """allocate a, fork a->b, append b, fork b->c, append c: c's copy must come from the block
    that holds the data (a's), not from b's copy, which is not made yet."""
    pool = BlockPool(8, 4)
    pool.allocate("a", 2)
    pool.fork("a", "b")
    pool.append("b", 1)
    pool.fork("b", "c")
    pool.append("c", 1)
    src = pool.block_table("a")[0]
    assert pool.take_copies() == [(src, pool.block_table("b")[0]), (src, pool.block_table("c")[0])]


def test_a_sequence_stops_exactly_at_the_context_length(model):
    """max_model_len bounds prompt + output: with 60 of 64 tokens, exactly 4 more come."""
    llm = engine(model, max_model_len=64, num_gpu_blocks=32)
    [out] = llm.generate([list(range(1, 61))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


# -- the state machine --------------------------------------------------------------------------------
class EngineMachine:
    """Random add / abort / step / failing step on a small cache with prefix caching, where
    preemption happens. Checked after every action: reference counts equal table occurrences,
    and cached blocks hold exactly their tokens' K/V. At the end: every request ended, no block
    leaked, and every greedy output equals the prompt's continuation run alone."""

    model = micro_model()

    def __init__(self, **settings):
        self.settings = {"enable_prefix_caching": True, "num_gpu_blocks": 9, "max_num_seqs": 3, **settings}
        self.llm = engine(self.model, **self.settings)
        self.prompts, self.done, self.aborted = {}, {}, set()
        self.verified = {}                       # hash -> block whose K/V was checked

    def add(self, prompt, shared, tokens, n=1):
        if shared and self.prompts:                  # share a prefix with an earlier prompt
            prompt = list(self.prompts.values())[-1][0][:8] + prompt[:6]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True) if n == 1 else \
            SamplingParams(temperature=0.8, n=n, seed=tokens, max_tokens=tokens, ignore_eos=True)
        rid = self.llm.add_request(prompt, params)
        self.prompts[rid] = (prompt, params)

    def abort(self, rid):
        assert self.llm.abort_request(rid)
        self.aborted.add(rid)

    def step(self, fail=False):
        if fail:
            FailOnce(self.llm.model_runner, when=1)
        for o in self.llm.step():
            if o.finished:
                self.done[o.request_id] = o
        if fail:   # the wrapper is spent; unwrap it
            self.llm.model_runner.compute_logits = self.llm.model_runner.compute_logits.inner

    def check(self):
        pool = self.llm.pool
        counts = [0] * pool.num_blocks
        for table in pool.block_tables.values():
            for b in table:
                counts[b] += 1
        assert counts == pool.ref_counts
        sched = self.llm.scheduler
        if sched.host_blocks is not None:         # each host block is free or one swapped sequence's
            booked = sum(len(s.host_blocks) for s in sched.swapped) + len(sched._host_to_free)
            assert booked + sched.host_blocks.num_free_blocks == sched.host_blocks.num_blocks
        if self.settings.get("kv_cache_dtype", "auto") == "auto":
            self.check_cached_blocks()

    def check_cached_blocks(self):
        """Every cached hash names a block whose K equals a fresh prefill of the tokens it hashes
        (checked once per hash and block: the newly cached ones)."""
        pool, cache = self.llm.pool, self.llm.model_runner.kv_cache
        for seq_id, hashes in pool.seq_hashes.items():
            new = [i for i, h in enumerate(hashes) if h in pool.cached_blocks
                   and self.verified.get(h) != pool.cached_blocks[h]]
            if not new:
                continue
            fresh = fresh_kv(self.model, pool.seq_tokens[seq_id][:len(hashes) * BLOCK])
            for i in new:
                block = pool.cached_blocks[hashes[i]]
                got = cache.k[:, block].reshape(cache.num_layers, BLOCK, -1)
                want = fresh[:, i * BLOCK:(i + 1) * BLOCK].reshape(cache.num_layers, BLOCK, -1)
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
                self.verified[hashes[i]] = block

    def finish(self):
        for _ in range(500):
            if not self.llm.has_unfinished_requests():
                break
            self.step()
        assert_idle_and_clean(self.llm)
        sched = self.llm.scheduler
        if sched.host_blocks is not None:
            sched.schedule()                      # host blocks are given back a step after their copy
            assert sched.host_blocks.num_free_blocks == sched.host_blocks.num_blocks
        dtype = self.settings.get("kv_cache_dtype", "auto")
        reference = None if dtype == "auto" else engine(self.model, kv_cache_dtype=dtype)
        for rid, (prompt, params) in self.prompts.items():
            if rid in self.aborted:
                continue
            out = self.done[rid]
            if out.error:
                assert "injected failure" in out.error
                continue
            if params.temperature > 0:
                assert len(out.outputs) == params.n
            elif reference is None:
                assert out.outputs[0].token_ids == alone(self.model, prompt, params)
            else:                                 # a quantised cache: the same cache, served alone
                [want] = reference.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
                assert out.outputs[0].token_ids == want.outputs[0].token_ids


PROMPTS = st.lists(st.integers(1, 63), min_size=1, max_size=14)
ACTIONS = st.one_of(
    st.tuples(st.just("add"), PROMPTS, st.booleans(), st.integers(1, 10)),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("step"), st.sampled_from([False, False, False, True])),   # 1 in 4 steps fails
)


def run_machine(machine, data, actions, num_actions=300):
    for _ in range(num_actions):
        action = data.draw(actions)
        if action[0] == "add" and len(machine.llm.requests) < 6:
            machine.add(*action[1:])
        elif action[0] == "abort" and machine.llm.requests:
            machine.abort(sorted(machine.llm.requests)[action[1] % len(machine.llm.requests)])
        else:
            machine.step(fail=action[0] == "step" and action[1])
        machine.check()
    machine.finish()


@settings(max_examples=6, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_engine_state_machine(data):
    """300 random actions per example (more steps than adds: requests run to their end)."""
    run_machine(EngineMachine(), data, ACTIONS)


def draft_model():
    model = micro_model()
    model.reset_parameters(std=0.3, seed=5)
    return model.double().eval()


BLOCK_BYTES = {dtype: block_bytes(micro_model().config, BLOCK, torch.float64, dtype) for dtype in ("auto", "fp8", "int8")}
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@settings(max_examples=16, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1))
def test_engine_state_machine_with_every_feature(seed):
    """The same on an engine that also swaps to the host, keeps evicted prefix blocks there,
    quantises its cache, computes prompts in chunks, speculates and forks n = 2 samples (the
    settings and 200 actions drawn from ``seed``): nothing leaks in either tier, and greedy
    output is what the same cache gives a prompt served alone."""
    rng = random.Random(seed)
    dtype = rng.choice(["auto", "fp8", "int8"])
    spec = rng.choice([None, NGRAM, {"method": "draft_model", "model": draft_model(), "num_speculative_tokens": 2}])
    machine = EngineMachine(kv_cache_dtype=dtype, swap_space=rng.choice([0, 16, 32]) * BLOCK_BYTES[dtype] / 2**30,
                            preemption_mode=rng.choice(["swap", "auto", "recompute"]),
                            max_num_batched_tokens=rng.choice([8, 12, 64]), speculative_config=spec,
                            long_prefill_token_threshold=rng.choice([0, 3]), num_gpu_blocks=8, max_num_seqs=4)
    for _ in range(200):
        action = rng.random()
        if action < 0.3 and len(machine.llm.requests) < 6:
            prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(1, 15))]
            machine.add(prompt, rng.random() < 0.5, rng.randrange(1, 11), n=rng.choice([1, 1, 1, 2]))
        elif action < 0.33 and machine.llm.requests:
            machine.abort(rng.choice(sorted(machine.llm.requests)))
        else:
            machine.step(fail=rng.random() < 0.15)
        machine.check()
    machine.finish()


def fresh_kv(model, tokens) -> torch.Tensor:
    """K of ``tokens`` in every layer ``[layers, T, kv_heads, head_dim]``, by a no-cache forward."""
    from kvlab.models.rope import apply_rope

    ks = []
    with torch.no_grad():
        x = model.model.embed_tokens(torch.tensor(tokens))
        positions = torch.arange(len(tokens))
        residual = None
        for layer in model.model.layers:
            h, residual = (layer.input_layernorm(x), x) if residual is None else layer.input_layernorm(x, residual)
            _, k, _ = layer.self_attn.project(h)
            cos, sin = layer.self_attn.rotary(positions)
            ks.append(apply_rope(k, cos, sin))
            x = layer.self_attn(h, positions)
            x, residual = layer.post_attention_layernorm(x, residual)
            x = layer.mlp(x)
    return torch.stack(ks)


def test_causal_must_be_a_bool():
    from kvlab.kernels import flash_attention

    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(TypeError, match="causal"):
        flash_attention(q, q, q, causal="no")


def test_the_plug_in_points(model):
    """A learner's pool, sampler and attention backend run inside the real engine."""
    from kvlab.engine.sampler import sample
    from kvlab.reference import paged_attention_ref

    calls = {"pool": 0, "sampler": 0, "backend": 0}

    class MyPool(BlockPool):
        def allocate(self, *args, **kw):
            calls["pool"] += 1
            return super().allocate(*args, **kw)

    def my_sampler(logits, *args):
        calls["sampler"] += 1
        return sample(logits, *args)

    def my_backend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale):
        calls["backend"] += 1
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
                                   sm_scale=sm_scale).to(q.dtype)

    llm = engine(model, attention_backend=my_backend)
    llm.use_pool(MyPool(llm.model_runner.num_blocks, BLOCK))
    llm.sampler = my_sampler
    [out] = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == alone(model, [1, 2, 3])
    assert calls == {"pool": 1, "sampler": GREEDY.max_tokens, "backend": GREEDY.max_tokens * model.config.num_layers}
    with pytest.raises(ValueError, match="blocks"):
        llm.use_pool(BlockPool(3, BLOCK))


@pytest.mark.parametrize("bad", ["negative id", "outside the vocabulary", "one token too many"])
def test_a_sampler_that_returns_bad_tokens_fails_its_step_not_the_engine(model, bad):
    """A plug-in sampler's bad output ends the step's requests with an error; the engine serves on."""
    from kvlab.engine.sampler import SamplerOutput, sample

    llm = engine(model, enable_prefix_caching=True)
    prompt = list(range(1, 8))

    def broken(logits, *args):
        out = sample(logits, *args)
        ids = {"negative id": torch.full_like(out.token_ids, -1),
               "outside the vocabulary": torch.full_like(out.token_ids, model.config.vocab_size),
               "one token too many": torch.cat([out.token_ids, out.token_ids[:1]])}[bad]
        return SamplerOutput(ids, torch.zeros(len(ids)))

    llm.sampler = broken
    [failed] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and "the step failed" in failed.error
    assert_idle_and_clean(llm)
    assert not llm.pool.cached_blocks
    llm.sampler = sample                               # the engine's own sampler again
    [again] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert again.error is None and again.outputs[0].token_ids == alone(model, prompt)


def test_an_impossible_top_k_is_refused_and_the_batch_serves_on(model):
    llm = engine(model)
    with pytest.raises(ValueError, match="top_k"):
        llm.add_request([1, 2, 3], SamplingParams(top_k=2**63, max_tokens=2))
    assert not llm.requests and not llm.scheduler.waiting
    big = SamplingParams(temperature=0, top_k=10**6, max_tokens=6, ignore_eos=True)   # above the vocabulary: keeps all
    [out] = llm.generate([[1, 2, 3]], big, use_tqdm=False)
    assert out.outputs[0].token_ids == alone(model, [1, 2, 3])


def test_the_scheduler_refuses_what_it_cannot_run():
    from kvlab.engine.scheduler import Scheduler
    from kvlab.engine.sequence import Sequence

    scheduler = Scheduler(BlockPool(16, BLOCK), max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence(0, "r0", [1, 2, 3], GREEDY)
    scheduler.add(seq)
    for bad, error, message in ((seq, ValueError, "already in the scheduler"),
                                (Sequence(0, "r1", [4, 5], GREEDY), ValueError, "already in the scheduler"),
                                (Sequence(1, "r2", [], GREEDY), ValueError, "empty prompt"),
                                ([1, 2, 3], TypeError, "Sequence")):
        with pytest.raises(error, match=message):
            scheduler.add(bad)
    assert list(scheduler.waiting) == [seq]
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="logprobs"):
        scheduler.update(out, [7], [[0.0, 0.0]])        # one token, two log-probabilities
    with pytest.raises(ValueError, match=">= 0"):
        scheduler.update(out, [-1])
    with pytest.raises(TypeError, match="sampled token ids must be ints"):
        scheduler.update(out, [None])                   # a sample left without a token
    assert seq.num_computed_tokens == 0 and seq.output_token_ids == []
    scheduler.update(out, [7])                          # the same step, recorded once it is right
    assert seq.output_token_ids == [7]
    for kw, message in ((dict(max_model_len="64"), "max_model_len"), (dict(max_model_len=0), "max_model_len"),
                        (dict(bytes_per_token=-3), "bytes_per_token")):
        with pytest.raises((ValueError, TypeError), match=message):
            Scheduler(BlockPool(16, BLOCK), **kw)
