"""The sampler: greedy, top-k and top-p masks, seeded draws, and the distribution it draws from."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab  # noqa: F401  (profile first)
from kvlab.engine.sampler import apply_top_k, apply_top_p, sample, sampling_probs
from kvlab.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0],
                       [0.0, 3.0, 3.0, -2.0, 1.0]])


def test_temperature_zero_is_argmax_and_ignores_the_masks():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, temperature=0.0, top_k=3, top_p=0.5)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1).max(-1).values)


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    gens = [None, torch.Generator().manual_seed(5), None, torch.Generator().manual_seed(6)]
    out = sample(logits, temperature=[0.0, 1.0, 0.0, 1.0], generators=gens)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    # the random rows' logprobs are those of the tokens drawn, under the raw logits
    lp = logits.log_softmax(-1)
    for i in (1, 3):
        assert math.isclose(float(out.logprobs[i]), float(lp[i, out.token_ids[i]]), rel_tol=1e-5)


def test_top_k_keeps_the_k_largest():
    masked = apply_top_k(LOGITS, torch.tensor([2, 1]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False, False]
    # ties at the k-th value all stay: row 1 has two logits of 3.0
    assert torch.isfinite(masked[1]).tolist() == [False, True, True, False, False]
    for off in (0, -1, 99):
        assert torch.equal(apply_top_k(LOGITS, off), LOGITS)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_top_p(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]       # 0.5 alone reaches 0.5
    assert kept(0.6) == [True, True, False, False]        # 0.5 + 0.3 reaches 0.6
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]      # the top token always stays
    assert kept(1.0) == [True, True, True, True]


def test_top_k_then_top_p_renormalise():
    probs = sampling_probs(LOGITS[:1], temperature=1.0, top_k=3, top_p=1.0)[0]
    expected = LOGITS[0, :3].softmax(-1)
    torch.testing.assert_close(probs[:3], expected)
    assert probs[3:].sum() == 0
    assert torch.allclose(sampling_probs(LOGITS, temperature=0.0).sum(-1), torch.ones(2))


@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.floats(0.01, 1.0), st.integers(-1, 14))
@settings(max_examples=60, deadline=None)
def test_masks_always_keep_the_most_likely_token(values, top_p, top_k):
    logits = torch.tensor([values])
    probs = sampling_probs(logits, temperature=0.7, top_k=top_k, top_p=top_p)[0]
    assert probs[logits[0].argmax()] > 0
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    if top_k > 0:
        # ties at the k-th value may keep a few more
        assert int((probs > 0).sum()) <= max(top_k, int((logits[0] >= logits[0].sort(descending=True).values[
            min(top_k, len(values)) - 1]).sum()))


def test_seeded_draws_are_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    first = sample(logits, 1.0, generators=[torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    again = sample(logits, 1.0, generators=[torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    assert torch.equal(first.token_ids, again.token_ids)
    # row 1 alone, with the same seed, draws the same token as it did inside the batch
    alone = sample(logits[1:2], 1.0, generators=[torch.Generator().manual_seed(8)])
    assert alone.token_ids[0] == first.token_ids[1]
    # and a sequence of draws from one generator is reproducible too
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    draws1 = [int(sample(logits[:1], 1.0, generators=[g1]).token_ids[0]) for _ in range(20)]
    draws2 = [int(sample(logits[:1], 1.0, generators=[g2]).token_ids[0]) for _ in range(20)]
    assert draws1 == draws2 and len(set(draws1)) > 1


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.7)])
def test_draws_follow_the_distribution(temperature, top_k, top_p):
    """Chi-square goodness of fit of 20 000 draws on a 5-token vocabulary."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    probs = sampling_probs(logits[None], temperature, top_k, top_p)[0]
    n = 20_000
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = sample(logits.expand(n, -1), temperature, top_k, top_p).token_ids
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[probs == 0].sum() == 0           # masked tokens are never drawn
    keep = probs > 0
    expected = probs[keep].double() * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5                             # chi-square, 4 degrees of freedom, p = 0.0004
    # and the temperature does what it says: the top token's share matches softmax(logits / T)
    if top_k == 0 and top_p == 1.0:
        torch.testing.assert_close(probs, (logits / temperature).softmax(-1))


# -- SamplingParams ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    ({"temperature": -0.1}, ["temperature", ">= 0"]),
    ({"temperature": float("nan")}, ["temperature"]),
    ({"top_p": 0.0}, ["top_p", "(0, 1]"]),
    ({"top_p": 1.5}, ["top_p", "(0, 1]"]),
    ({"top_k": -2}, ["top_k"]),
    ({"max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"n": 0}, ["n must be", ">= 1"]),
    ({"seed": 1.5}, ["seed"]),
    ({"stop": ["ok", ""]}, ["stop strings", "non-empty"]),
    ({"stop": 5}, ["stop"]),
    ({"stop_token_ids": [1, -2]}, ["stop_token_ids"]),
    ({"ignore_eos": "yes"}, ["ignore_eos"]),
])
def test_sampling_params_name_the_broken_field(kw, words):
    params = SamplingParams(**kw)        # construction never raises: validate does
    with pytest.raises(ValueError) as err:
        params.validate()
    for word in words:
        assert word in str(err.value)


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams().validate()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.ignore_eos) == (1, 1.0, 1.0, -1, 16,
                                                                                           None, False)
    assert SamplingParams(stop="x").stop_strings == ["x"] and SamplingParams().stop_strings == []
    assert SamplingParams(temperature=0).greedy
