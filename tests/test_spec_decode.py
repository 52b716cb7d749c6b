"""Speculative decoding: rejection sampling is exact, the proposers, the rollback, and the engine
with either method gives what it gives without speculation."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab  # noqa: F401  (profile first)
from kvlab.engine import SamplingParams
from kvlab.engine.rejection_sampler import greedy_accept, rejection_sample
from kvlab.engine.spec_decode import SpeculativeConfig, propose_ngram
from kvlab.models import LlamaForCausalLM, ModelConfig
from kvlab.paging import BlockPool
from kvlab.paging.prefix_hash import hash_blocks
from helpers import one_thread  # noqa: F401  (a fixture)

CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}     # chi-square critical values at p = 0.001
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}
PROMPTS = ["def __init__(self, name):\n        self.name = name\n", "import os\nimport sys\n\ndef main():\n",
           "class Queue:\n    def ", "for i in range(10):\n    print(i)\nfor j in range("]


def LLM(*args, **kwargs):      # noqa: N802
    """float32 (exactness, not bf16 ties) and a fixed cache (on a GPU the default takes 90% of it)."""
    kwargs.setdefault("num_gpu_blocks", 1024)
    return kvlab.LLM(*args, dtype="float32", **kwargs)


pytestmark = pytest.mark.usefixtures("one_thread")


# -- rejection sampling ------------------------------------------------------------------------
def chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def distributions(seed: int, vocab: int, k: int):
    gen = torch.Generator().manual_seed(seed)
    p = (1.5 * torch.randn(k + 1, vocab, generator=gen)).softmax(-1)
    q = (1.5 * torch.randn(k, vocab, generator=gen)).softmax(-1)
    return p, q, gen


def run_many(p, q, n, gen, one_hot=False):
    """n independent rows of the same (p, q): drafts drawn from q (or a fixed token if one-hot)."""
    k = q.shape[0]
    if one_hot:
        drafts = torch.tensor([2, 0, 1][:k]).expand(n, k)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], 1)
        draft_probs = q.expand(n, *q.shape)
    return rejection_sample(drafts, draft_probs, p.expand(n, *p.shape), generator=gen), drafts


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_the_target(seed, one_hot):
    """Whatever q is, the first emitted token is distributed as p_1, and the second (where the
    first draft was kept) as p_2."""
    vocab, k, n = 6, 2, 40_000
    p, q, gen = distributions(seed, vocab, k)
    out, _ = run_many(p, q, n, gen, one_hot)
    assert chi2(out[:, 0], p[0]) < CHI2_999[vocab - 1]
    second = out[:, 1][out[:, 1] >= 0]
    assert len(second) > 1000
    assert chi2(second, p[1]) < CHI2_999[vocab - 1]


def test_q_equal_p_accepts_everything_and_the_bonus_follows_p():
    vocab, k, n = 5, 3, 30_000
    p, _, gen = distributions(3, vocab, k)
    out, drafts = run_many(p, p[:k], n, gen)
    assert (out >= 0).all()                               # k + 1 tokens in every row
    assert torch.equal(out[:, :k], drafts)
    assert chi2(out[:, k], p[k]) < CHI2_999[vocab - 1]


def test_residual_by_hand():
    """p = (.5, .3, .2), q = (.2, .6, .2), draft token 1 (p/q = .5): rejected half the time; the
    replacement follows max(0, p - q) / sum = (1, 0, 0)."""
    p = torch.tensor([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    n = 20_000
    out = rejection_sample(torch.ones(n, 1, dtype=torch.long), q.expand(n, 1, 3), p.expand(n, 2, 3),
                           generator=torch.Generator().manual_seed(0))
    rejected = out[:, 1] < 0
    assert abs(rejected.float().mean() - 0.5) < 0.02
    assert (out[rejected, 0] == 0).all()
    assert (out[~rejected, 0] == 1).all()


def test_one_hot_target_is_greedy_acceptance():
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 4, 7
    target = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, target[:, :k],
                         torch.randint(0, vocab, (batch, k), generator=gen))
    one_hot = torch.nn.functional.one_hot(target, vocab).float()
    got = rejection_sample(drafts, None, one_hot, generator=gen).tolist()
    for row, t, d in zip(got, target.tolist(), drafts.tolist()):
        a = next((i for i in range(k) if d[i] != t[i]), k)
        assert row == d[:a] + [t[a]] + [-1] * (k - a)
        assert greedy_accept(d, t) == row[:a + 1]


def test_missing_drafts_are_replaced_from_p():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    n = 20_000
    out = rejection_sample(torch.full((n, 1), -1), None, p.expand(n, 2, 3), generator=torch.Generator().manual_seed(1))
    assert (out[:, 1] == -1).all()
    assert chi2(out[:, 0], p[0]) < CHI2_999[2 + 1] + 10   # dof 2: well inside


def test_per_row_generators_repeat():
    p, q, _ = distributions(5, 8, 3)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(2)]
        return rejection_sample(drafts, q.expand(2, *q.shape), p.expand(2, *p.shape), generator=gens)

    assert torch.equal(run(7), run(7))


@pytest.mark.parametrize("drafts, q, p, message", [
    (torch.zeros(2, 3), None, torch.rand(2, 4, 5), "integer tensor"),
    (torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 3, 5), r"\[batch, k \+ 1, vocab\]"),
    (torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 4), torch.rand(2, 4, 5), "draft_probs"),
    (torch.full((2, 3), 9), None, torch.rand(2, 4, 5), "token ids in 0..4"),
])
def test_bad_arguments_are_refused(drafts, q, p, message):
    with pytest.raises((TypeError, ValueError), match=message):
        rejection_sample(drafts, q, p)


# -- the n-gram proposer --------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),          # "1 2" seen before: what followed
    ([1, 2, 9, 5, 2, 7, 1, 2], 2, [9, 5]),       # longest suffix first
    ([5, 1, 7, 1, 8, 1], 2, [8, 1]),             # the most recent occurrence of "1"
    ([1, 2, 3], 4, []),                          # nothing repeats
    ([4, 4], 3, [4]),                            # fewer tokens than k follow
])
def test_propose_ngram(tokens, k, expected):
    assert propose_ngram(tokens, k, 1, 4) == expected


def test_propose_ngram_respects_min_n():
    assert propose_ngram([1, 2, 3, 1], 2, prompt_lookup_min=2) == []
    assert propose_ngram([1, 2, 3, 1], 2, prompt_lookup_min=1) == [2, 3]


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("config, error, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens must be >= 1"),
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "method must be one of"),
    ({"method": "ngram"}, ValueError, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, ValueError, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     ValueError, "prompt_lookup_max must be >= 3"),
    ("ngram", TypeError, "must be a dict"),
])
def test_bad_speculative_configs_are_refused(config, error, message):
    with pytest.raises(error, match=message):
        SpeculativeConfig.from_dict(config)
    with pytest.raises(error, match=message):
        LLM(speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused():
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=2048)
    with pytest.raises(ValueError, match="vocabulary has 100 tokens"):
        LLM(speculative_config={"model": LlamaForCausalLM(config), "num_speculative_tokens": 2})


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline():
    llm = LLM(max_num_seqs=8, enable_prefix_caching=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm):
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    if hasattr(llm.proposer, "pool"):
        assert llm.proposer.pool.num_free_blocks == llm.proposer.pool.num_blocks


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_greedy_speculation_equals_greedy(spec, baseline):
    """Batched, with prefix caching (the prompts twice: the second round hits the cache)."""
    llm = LLM(max_num_seqs=8, enable_prefix_caching=True, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=40)
    for _ in range(2):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == baseline
    stats = llm.spec_decode_stats
    k = spec["num_speculative_tokens"]
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert 1 <= stats.mean_acceptance_length <= k + 1
    assert len(stats.accepted_per_position) == k
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:]))
    assert outs[0].spec_decode_stats.num_drafts > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_stop_strings_end_speculation_where_they_end_plain_decoding(spec, baseline):
    """A stop string completed by an accepted draft ends the output at that token: the tokens
    after it, emitted in the same step, are taken back (text, tokens and log-probability are
    those of decoding without speculation)."""
    plain, llm = LLM(max_num_seqs=8), LLM(max_num_seqs=8, speculative_config=spec)
    texts = [plain.tokenizer.decode(ids) for ids in baseline]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[t[a:a + 2]])
              for t in texts for a in (len(t) // 4, len(t) // 2, 3 * len(t) // 4)]
    prompts = [p for p in PROMPTS for _ in range(3)]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (w.text, w.token_ids, w.finish_reason,
                                                                         w.stop_reason)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert all(w.outputs[0].finish_reason == "stop" for w in want)
    assert_no_leak(llm)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_seeded_sampling_repeats(spec):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=s) for s in (1, 2, 3)]
    runs = [[o.outputs[0].token_ids for o in LLM(max_num_seqs=4, speculative_config=spec).generate(
        PROMPTS[:3], params, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_parallel_samples_abort_and_the_context_limit():
    """n = 2 samples speculate independently; an aborted request and sequences stopped by
    max_model_len leave no block behind in either cache; greedy still equals no speculation."""
    llm = LLM(max_num_seqs=6, max_model_len=48, speculative_config=DRAFT)
    plain = LLM(max_num_seqs=6, max_model_len=48)
    greedy = SamplingParams(temperature=0, max_tokens=100)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], greedy, use_tqdm=False)]
    llm.add_request(PROMPTS[0], SamplingParams(temperature=1.0, n=2, max_tokens=30, seed=0), request_id="a")
    llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30), request_id="b")
    for _ in range(3):
        llm.step()
    assert llm.abort_request("b")
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                assert all(len(c.token_ids) == 30 or c.finish_reason == "length" for c in out.outputs)
    assert_no_leak(llm)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_drafts_stop_at_the_end_of_the_cache(spec):
    """A sequence that ends filling every slot of a small cache: its last steps propose fewer
    drafts instead of booking slots the cache does not have (which failed the step), and its
    tokens are those of an engine without speculation."""
    plain = LLM(num_gpu_blocks=3, block_size=16, enable_prefix_caching=True)
    prompt = plain.tokenizer.encode(PROMPTS[0]).ids
    params = SamplingParams(temperature=0, max_tokens=3 * 16 + 1 - len(prompt), ignore_eos=True)
    want = plain.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    llm = LLM(num_gpu_blocks=3, block_size=16, enable_prefix_caching=True, speculative_config=spec)
    got = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert got.error is None and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(prompt) + len(got.outputs[0].token_ids) - 1 == llm.pool.capacity     # every slot used
    assert llm.spec_decode_stats.num_drafts > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_samples_fork_off_a_prompt_whose_last_chunk_is_one_token(spec):
    """A 9-token prompt in chunks of 8: its last chunk is one token, computed as a decode is.
    Its n = 2 samples fork off that step, so it takes no drafts (they were left without a
    token, and the step failed); greedy, each sample equals the engine without speculation."""
    plain = LLM(max_num_batched_tokens=8, max_num_seqs=2)
    prompt = plain.tokenizer.encode(PROMPTS[1]).ids[:9]
    params = SamplingParams(temperature=0, n=2, max_tokens=12, ignore_eos=True)
    want = plain.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    llm = LLM(max_num_batched_tokens=8, max_num_seqs=2, speculative_config=spec)
    got = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert got.error is None
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert llm.spec_decode_stats.num_drafts > 0
    assert_no_leak(llm)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), k=st.integers(1, 5), block_size=st.sampled_from([2, 4, 16]))
def test_rollback_never_caches_an_unverified_token(seed, k, block_size):
    """After every step: each sequence's cached block hashes are those of its own accepted
    tokens, only of computed ones, and its pool length equals its computed tokens."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(1, 8000, 6).tolist()
    prompts = [(motif * 5)[: int(rng.integers(3, 30))] + rng.integers(1, 8000, 3).tolist() for _ in range(3)]
    llm = LLM(max_num_seqs=4, block_size=block_size, enable_prefix_caching=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    params = SamplingParams(temperature=0.7, max_tokens=int(rng.integers(4, 20)), seed=seed, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.add_request({"prompt_token_ids": p}, params, request_id=str(i))
    pool = llm.pool
    while llm.has_unfinished_requests():
        llm.step()
        for seq in llm.scheduler.running:
            hashes = pool.seq_hashes[seq.seq_id]
            assert len(hashes) * block_size <= seq.num_computed_tokens == pool.seq_len(seq.seq_id)
            assert hashes == hash_blocks(seq.token_ids[:len(hashes) * block_size], block_size, None)
    assert_no_leak(llm)


# -- the rollback itself ------------------------------------------------------------------------
def test_truncate_frees_empty_blocks_and_keeps_shared_ones():
    pool = BlockPool(8, 4)
    pool.allocate("a", 6)
    pool.fork("a", "b")
    pool.append("a", 5)                      # copy-on-write of block 1, then block 3
    assert pool.truncate("a", 9) == []       # 9 tokens still need 3 blocks
    freed = pool.truncate("a", 4)
    assert sorted(freed) == sorted(set(freed)) and len(freed) == 2
    assert pool.block_table("a") == pool.block_table("b")[:1]
    assert pool.num_used_blocks == 2 and pool.seq_len("a") == 4
    before = (pool.block_table("a"), pool.seq_len("a"), pool.num_free_blocks)
    with pytest.raises(ValueError, match="only cuts"):
        pool.truncate("a", 5)
    assert (pool.block_table("a"), pool.seq_len("a"), pool.num_free_blocks) == before


def test_truncate_refuses_to_cut_a_cached_block():
    pool = BlockPool(8, 4, enable_prefix_caching=True)
    pool.allocate("a", 9, list(range(9)))
    with pytest.raises(ValueError, match="cached blocks"):
        pool.truncate("a", 7)
    assert pool.truncate("a", 8) == [2] and pool.seq_len("a") == 8


def test_uniform_verification_through_paged_decode_matches_the_reference():
    """The Triton backend verifies a small uniform step with paged_decode, one row per query."""
    from kvlab.models.backends import reference_backend, triton_backend

    from kvlab import profile

    gen = torch.Generator().manual_seed(0)
    batch, q_len, heads, kv_heads, dim, block = 2, 3, 4, 2, 16, 4
    on = lambda t: t.to(profile.DEVICE)  # noqa: E731
    seq_lens = on(torch.tensor([7, 11], dtype=torch.int32))
    k_cache = on(torch.randn(8, block, kv_heads, dim, generator=gen))
    v_cache = on(torch.randn(8, block, kv_heads, dim, generator=gen))
    tables = on(torch.tensor([[3, 0, 0], [5, 1, 6]], dtype=torch.int32))
    q = on(torch.randn(batch * q_len, heads, dim, generator=gen))
    query_lens = on(torch.full((batch,), q_len, dtype=torch.int32))
    got = triton_backend(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.25, phase="uniform",
                         max_seq_len=11, max_query_len=q_len)
    want = reference_backend(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.25)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 3), st.integers(0, 2), st.integers(1, 6))
def test_the_proposers_index_gives_propose_ngrams_drafts(tokens, lookup_min, extra, k):
    """NgramProposer's incremental index proposes what the plain scan does, step after step."""
    from kvlab.engine.spec_decode import NgramProposer

    class Seq:
        seq_id, token_ids = 0, []

    proposer = NgramProposer(SpeculativeConfig("ngram", k, lookup_min + extra, lookup_min))
    for end in range(1, len(tokens) + 1):
        Seq.token_ids = tokens[:end]
        assert proposer.propose([Seq], [k])[0] == [propose_ngram(tokens[:end], k, lookup_min, lookup_min + extra)]
