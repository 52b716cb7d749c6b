"""Graded tests of chapter 7: ``pytest tests/graded -m ch07 --impl=exercises``."""
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvlab.engine.spec_decode import propose_ngram as kvlab_propose_ngram
from kvlab.errors import OutOfBlocksError, UnknownSequenceError
from kvlab.paging import BlockPool, blocks_needed
from kvlab.paging.prefix_hash import hash_blocks
from helpers import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.ch07

# chi-square critical values at p = 1e-4, by degrees of freedom: a correct sampler that draws its
# random numbers in another order than the answer fails one of the file's checks about once in 1,000
CHI2_999 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878, 8: 31.828}


def dirichlet(gen, *shape):
    """Random distributions [*shape] (the last dimension sums to 1), from ``gen``."""
    x = -torch.log(torch.rand(*shape, generator=gen))        # Exp(1): normalised, Dirichlet(1, ..., 1)
    return x / x.sum(dim=-1, keepdim=True)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of ``samples`` (token ids) against ``probs`` [V]; fails on a token of
    probability 0."""
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    impossible = expected == 0
    assert counts[impossible].sum() == 0, \
        f"tokens of probability 0 were emitted: {impossible.nonzero().flatten().tolist()}"
    return float(((counts[~impossible] - expected[~impossible]) ** 2 / expected[~impossible]).sum())


def check_follows(samples, probs, what):
    df = int((probs > 0).sum()) - 1
    stat = chi_square(samples, probs)
    counts = torch.bincount(samples, minlength=len(probs)) / max(len(samples), 1)
    assert stat < CHI2_999[df], (
        f"{what}: chi-square {stat:.1f} > {CHI2_999[df]} ({df} degrees of freedom, p = 1e-4) over {len(samples)} "
        f"samples: the frequencies {[round(x, 3) for x in counts.tolist()]} are not the target's "
        f"{[round(x, 3) for x in probs.tolist()]}")


def check_rows(out, drafts, k):
    """Each row: a prefix of its drafts, one token >= 0, then -1. Returns the accepted counts."""
    assert isinstance(out, torch.Tensor) and out.dtype == torch.long, \
        f"rejection_sample must return a LongTensor, got {getattr(out, 'dtype', type(out).__name__)}"
    want = (drafts.shape[0], k + 1)
    assert tuple(out.shape) == want, f"rejection_sample returned shape {tuple(out.shape)}, expected {want}"
    accepted = []
    for b, row in enumerate(out.tolist()):
        emitted = [t for t in row if t >= 0]
        n = len(emitted)
        assert n >= 1 and row[:n] == emitted and all(t == -1 for t in row[n:]), \
            f"row {b} is {row}: expected accepted drafts, one token, then -1 padding"
        assert row[:n - 1] == drafts[b, :n - 1].tolist(), \
            f"row {b} is {row}, drafts {drafts[b].tolist()}: the first {n - 1} tokens must be the accepted drafts"
        accepted.append(n - 1)
    return accepted


# -- accept ----------------------------------------------------------------------------------
P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
Q = torch.tensor([[0.3, 0.6, 0.1], [0.4, 0.4, 0.2], [0.5, 0.25, 0.25]])


@pytest.mark.task("accept")
@pytest.mark.parametrize("drafts, q, uniforms, want, why", [
    ([1, 0, 2], Q, [0.4, 0.3, 0.99], 3, "p/q is 0.5, 0.5, 3.2: u = 0.4, 0.3 accept, and p_2 > q_2 always accepts"),
    ([1, 0, 2], Q, [0.4, 0.7, 0.10], 1, "u = 0.7 >= p_1(0) / q_1(0) = 0.5 rejects draft 1: stop there"),
    ([1, 0, 2], Q, [0.6, 0.1, 0.10], 0, "u = 0.6 >= p_0(1) / q_0(1) = 0.5 rejects draft 0; later ones don't count"),
    ([1, -1, 2], Q, [0.1, 0.1, 0.10], 1, "-1 is no draft: stop there"),
    ([0, 1, 2], None, [0.5, 0.45, 0.9], 2, "one-hot q: accept while u < p_i(d_i) (0.6, 0.5, then 0.8 < 0.9 rejects)"),
    ([2, 1, 2], None, [0.05, 0.9, 0.1], 1, "one-hot q: p_1(1) = 0.5 <= 0.9 rejects the second"),
    ([-1, 0, 0], None, [0.0, 0.0, 0.0], 0, "no draft at all"),
], ids=["all kept", "second rejected", "first rejected", "no draft", "one-hot q", "one-hot q rejects", "none"])
def test_num_accepted_worked_examples(ch07, drafts, q, uniforms, want, why):
    got = ch07.num_accepted(torch.tensor(drafts), q, P, torch.tensor(uniforms))
    assert int(got) == want, f"drafts {drafts}, uniforms {uniforms}: {got} accepted, expected {want} ({why})"


@pytest.mark.task("accept")
def test_num_accepted_random(ch07):
    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        k, vocab = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(2, 8, (1,), generator=gen))
        p, q = dirichlet(gen, k + 1, vocab), dirichlet(gen, k, vocab)
        drafts = torch.randint(0, vocab, (k,), generator=gen)
        if trial % 5 == 0:
            drafts[int(torch.randint(0, k, (1,), generator=gen)):] = -1
        u = torch.rand(k, generator=gen)
        one_hot = trial % 2 == 0
        want = 0
        while want < k and drafts[want] >= 0 and \
                u[want] * (1.0 if one_hot else q[want, drafts[want]]) < p[want, drafts[want]]:
            want += 1
        got = ch07.num_accepted(drafts, None if one_hot else q, p, u)
        assert int(got) == want, (f"drafts {drafts.tolist()}, uniforms {[round(x, 3) for x in u.tolist()]}, "
                                  f"{'one-hot q' if one_hot else 'q given'}: {got} accepted, expected {want}")


# exact binary fractions: u * q lands exactly on p, or p is 0 and u is 0
P_EDGE = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.0, 0.5], [0.0, 0.25, 0.75]])
Q_EDGE = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.25, 0.5]])


@pytest.mark.task("accept")
@pytest.mark.parametrize("drafts, q, uniforms, want, why", [
    ([0, 0], Q_EDGE, [0.5, 0.0], 0, "u * q_0(0) = 0.5 * 0.5 = 0.25 is not < p_0(0) = 0.25: rejected"),
    ([1, 0], None, [0.75, 0.0], 0, "one-hot q: u = 0.75 is not < p_0(1) = 0.75: rejected"),
    ([2, 0], None, [0.0, 0.0], 0, "p_0(2) = 0: the target never emits token 2, not even with u = 0"),
    ([1, 1], Q_EDGE, [0.0, 0.0], 1, "p_1(1) = 0: the second draft is rejected even with u = 0"),
], ids=["u * q = p", "one-hot u = p", "p = 0, u = 0", "p = 0 after a kept draft"])
def test_num_accepted_is_strict(ch07, drafts, q, uniforms, want, why):
    got = ch07.num_accepted(torch.tensor(drafts), q, P_EDGE, torch.tensor(uniforms))
    assert int(got) == want, (f"drafts {drafts}, uniforms {uniforms}: {got} accepted, expected {want} "
                              f"(acceptance is strict, u * q < p: {why})")


# -- residual --------------------------------------------------------------------------------
@pytest.mark.task("residual")
def test_residual_worked_example(ch07):
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.2, 0.6, 0.1, 0.1])
    p0, q0 = p.clone(), q.clone()
    got = ch07.residual_distribution(p, q)
    # p - q = [0.3, -0.3, 0.1, -0.1] -> max(0, .) = [0.3, 0, 0.1, 0] -> / 0.4
    assert torch.allclose(got, torch.tensor([0.75, 0.0, 0.25, 0.0])), \
        f"residual of p={p.tolist()}, q={q.tolist()}: got {got.tolist()}, expected [0.75, 0, 0.25, 0]"
    assert torch.equal(p, p0) and torch.equal(q, q0), "residual_distribution changed its inputs"


@pytest.mark.task("residual")
def test_residual_special_cases(ch07):
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0])
    got = ch07.residual_distribution(p, one_hot)
    assert torch.allclose(got, torch.tensor([0.5, 0.0, 0.2, 0.0]) / 0.7), \
        f"one-hot q at token 1: p without token 1, renormalised; got {got.tolist()}"
    got = ch07.residual_distribution(p, torch.zeros(4))
    assert torch.allclose(got, p), f"q = 0 (no draft): the residual is p itself, got {got.tolist()}"
    got = ch07.residual_distribution(p, p.clone())
    assert torch.allclose(got, p), f"q = p leaves no residual mass: return p, got {got.tolist()}"
    got = ch07.residual_distribution(p, p + 1e-4)
    assert torch.allclose(got, p), \
        f"q above p everywhere (q = p up to rounding) leaves no residual mass: return p, got {got.tolist()}"


@pytest.mark.task("residual")
def test_residual_random(ch07):
    gen = torch.Generator().manual_seed(3)
    for _ in range(100):
        vocab = int(torch.randint(2, 12, (1,), generator=gen))
        p, q = dirichlet(gen, vocab), dirichlet(gen, vocab)
        want = (p - q).clamp(min=0)
        want = want / want.sum()
        got = ch07.residual_distribution(p, q)
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == (vocab,), f"expected a [{vocab}] tensor"
        assert torch.allclose(got, want, atol=1e-6), f"p={p.tolist()}, q={q.tolist()}: got {got.tolist()}"


# -- rejection_sample ------------------------------------------------------------------------
def draws(q, n, gen):
    """``n`` rows of drafts drawn from ``q`` [k, V]: [n, k]."""
    return torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(q.shape[0])], 1)


@pytest.mark.task("rejection_sample")
def test_shape_padding_and_only_residual_tokens(ch07):
    gen = torch.Generator().manual_seed(11)
    batch, k, vocab = 60, 3, 5
    p, q = dirichlet(gen, batch, k + 1, vocab), dirichlet(gen, batch, k, vocab)
    p[:, :, 0] = 0                                                     # token 0 is impossible
    p = p / p.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[b], 1, generator=gen).squeeze(1) for b in range(batch)])
    drafts[::4, 2:] = -1
    drafts[1::4, :] = -1
    out = ch07.rejection_sample(drafts, q, p, generator=gen)
    accepted = check_rows(out, drafts, k)
    for b, a in enumerate(accepted):
        t = int(out[b, a])
        if a == k:
            assert p[b, k, t] > 0, f"row {b}: bonus token {t} has probability 0 under p_k"
        else:
            q_a = q[b, a] if drafts[b, a] >= 0 else torch.zeros(vocab)
            assert p[b, a, t] > q_a[t], (f"row {b}: after {a} accepted draft(s), token {t} has "
                                         f"p = {float(p[b, a, t]):.3f} <= q = {float(q_a[t]):.3f}: "
                                         f"the residual max(0, p - q) gives it nothing")
    assert all(a == 0 for a in accepted[1::4]), "rows without drafts accept nothing"
    assert all(a <= 2 for a in accepted[::4]), "a -1 draft is never accepted"


@pytest.mark.task("rejection_sample")
@pytest.mark.parametrize("one_hot", [False, True], ids=["q given", "q one-hot"])
def test_greedy_target_is_greedy_verification(ch07, one_hot):
    gen = torch.Generator().manual_seed(5)
    batch, k, vocab = 40, 4, 6
    best = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    p = torch.nn.functional.one_hot(best, vocab).float()
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, best[:, :k],
                         torch.randint(0, vocab, (batch, k), generator=gen))
    drafts[::7, 1:] = -1
    q = None if one_hot else dirichlet(gen, batch, k, vocab)
    out = ch07.rejection_sample(drafts, q, p, generator=gen)
    for b in range(batch):
        a = 0
        while a < k and drafts[b, a] == best[b, a]:
            a += 1
        want = best[b, :a + 1].tolist() + [-1] * (k - a)
        assert out[b].tolist() == want, \
            (f"one-hot p (greedy) at {best[b].tolist()}, drafts {drafts[b].tolist()}: got {out[b].tolist()}, "
             f"expected {want} (keep drafts equal to p's token, then p's token)")


@pytest.mark.task("rejection_sample")
def test_missing_drafts_draw_from_p(ch07):
    gen = torch.Generator().manual_seed(2)
    n, vocab = 400, 4
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]).expand(n, 3, vocab)
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]).expand(n, 2, vocab)
    out = ch07.rejection_sample(torch.full((n, 2), -1), q, p, generator=gen)
    check_rows(out, torch.full((n, 2), -1), 2)
    zeros = int((out[:, 0] == 0).sum())
    assert 120 < zeros < 280, (f"no draft: the token comes from p_0 = [0.5, 0.5, 0, 0] (q is ignored), but token 0 "
                               f"came {zeros} times in {n}")


@pytest.mark.task("rejection_sample")
def test_missing_deterministic_drafts_draw_from_p(ch07):
    """draft_probs=None and a -1 draft: there is no one-hot q at all (q_a is zero), so the token
    is drawn from p_a itself; the last token of the vocabulary must stay possible."""
    gen = torch.Generator().manual_seed(6)
    n, vocab = 400, 4
    half = [0.5, 0.0, 0.0, 0.5]
    for drafts, p, at, what in [
        (torch.full((n, 2), -1), [half, [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]], 0, "no draft at all: p_0"),
        (torch.tensor([[1, -1]]).expand(n, 2), [[0.0, 1.0, 0.0, 0.0], half, [0.0, 0.0, 1.0, 0.0]], 1,
         "draft 1 kept (p_0's only token), then no draft: p_1"),
    ]:
        out = ch07.rejection_sample(drafts, None, torch.tensor(p).expand(n, 3, vocab), generator=gen)
        check_rows(out, drafts, 2)
        lasts = int((out[:, at] == vocab - 1).sum())
        assert 120 < lasts < 280, (f"one-hot q (draft_probs=None), {what} = {half}: token {vocab - 1} came {lasts} "
                                   f"times in {n}; a -1 draft is not a token, it takes nothing away from p")


@pytest.mark.task("rejection_sample")
def test_a_kept_draft_then_no_draft(ch07):
    gen = torch.Generator().manual_seed(4)
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    for q in (None, torch.tensor([[[0.2, 0.6, 0.2], [0.3, 0.3, 0.4]]])):
        out = ch07.rejection_sample(torch.tensor([[1, -1]]), q, p, generator=gen)
        assert out.tolist() == [[1, 2, -1]], \
            f"draft 1 is p_0's only token (always kept), then no draft: p_1's token 2; got {out.tolist()}"


SAMPLES = 3000
EXACTNESS = {
    # name: (seed, vocab, how q relates to p)
    "random p and q": (0, 6, "random"),
    "q one-hot (n-gram drafts)": (1, 6, "one-hot"),
    "q far from p": (2, 5, "far"),
    "p with impossible tokens": (3, 6, "sparse"),
}


@pytest.mark.task("rejection_sample")
@pytest.mark.parametrize("case", list(EXACTNESS))
def test_emitted_tokens_follow_the_target(ch07, case):
    """The first token is distributed as p_0 whatever q is; where the first draft was kept, the
    second as p_1 (chi-square at p = 1e-4; the generator is seeded: the test is deterministic)."""
    seed, vocab, kind = EXACTNESS[case]
    gen = torch.Generator().manual_seed(seed)
    n, k = SAMPLES, 2
    p, q = dirichlet(gen, k + 1, vocab), dirichlet(gen, k, vocab)
    if kind == "far":
        q = (1.0 - p[:k]) ** 4
        q = q / q.sum(-1, keepdim=True)
    if kind == "sparse":
        p[:, :2] = 0
        p = p / p.sum(-1, keepdim=True)
    if kind == "one-hot":
        drafts = torch.tensor([[int(p[0].argmax()), int(p[1].argmin())]]).expand(n, k)
        out = ch07.rejection_sample(drafts, None, p.expand(n, k + 1, vocab), generator=gen)
    else:
        drafts = draws(q, n, gen)
        out = ch07.rejection_sample(drafts, q.expand(n, k, vocab), p.expand(n, k + 1, vocab), generator=gen)
    check_rows(out, drafts, k)
    check_follows(out[:, 0], p[0], f"{case}: the first emitted token")
    kept = out[:, 0] == drafts[:, 0]
    if kind == "one-hot":
        kept &= out[:, 1] >= 0
    second = out[kept, 1]
    assert len(second) > SAMPLES // 8, f"{case}: only {len(second)} rows kept their first draft"
    check_follows(second, p[1], f"{case}: the second token, where the first draft was kept")


@pytest.mark.task("rejection_sample")
def test_q_equal_p_accepts_every_draft(ch07):
    gen = torch.Generator().manual_seed(9)
    n, k, vocab = SAMPLES, 3, 5
    p = dirichlet(gen, k + 1, vocab)
    drafts = draws(p[:k], n, gen)
    out = ch07.rejection_sample(drafts, p[:k].expand(n, k, vocab), p.expand(n, k + 1, vocab), generator=gen)
    accepted = check_rows(out, drafts, k)
    assert all(a == k for a in accepted), \
        (f"with q = p every draft must be kept (u * q < p for any u < 1); "
         f"{sum(a < k for a in accepted)} rows rejected one")
    check_follows(out[:, k], p[k], "the bonus token (all drafts kept)")


@pytest.mark.task("rejection_sample")
def test_generators_make_rows_reproducible(ch07):
    gen = torch.Generator().manual_seed(21)
    batch, k, vocab = 6, 3, 8
    p, q = dirichlet(gen, batch, k + 1, vocab), dirichlet(gen, batch, k, vocab)
    drafts = torch.stack([torch.multinomial(q[b], 1, generator=gen).squeeze(1) for b in range(batch)])
    seeded = lambda: [torch.Generator().manual_seed(100 + b) for b in range(batch)]  # noqa: E731
    first = ch07.rejection_sample(drafts, q, p, generator=seeded())
    check_rows(first, drafts, k)
    again = ch07.rejection_sample(drafts, q, p, generator=seeded())
    assert torch.equal(first, again), "the same per-row seeds must give the same tokens"
    for b in range(batch):
        alone = ch07.rejection_sample(drafts[b:b + 1], q[b:b + 1], p[b:b + 1],
                                      generator=[torch.Generator().manual_seed(100 + b)])
        assert alone[0].tolist() == first[b].tolist(), \
            (f"row {b} alone gave {alone[0].tolist()}, in the batch {first[b].tolist()}: a row with its own "
             f"generator must draw only from it")
    shared = [ch07.rejection_sample(drafts, q, p, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    assert torch.equal(*shared), "one seeded generator for all rows: the same seed must give the same tokens"
    check_rows(ch07.rejection_sample(drafts, q, p), drafts, k)                       # torch's global RNG
    check_rows(ch07.rejection_sample(drafts, q, p, generator=[None] * batch), drafts, k)


@pytest.mark.task("rejection_sample")
@pytest.mark.parametrize("per_row", [False, True], ids=["generator=None", "a list of None"])
def test_no_generator_uses_torchs_global_rng(ch07, per_row):
    gen = torch.Generator().manual_seed(8)
    batch, k, vocab = 64, 3, 8
    p = dirichlet(gen, 1, k + 1, vocab).expand(batch, k + 1, vocab)                   # the same row, batch times
    q = dirichlet(gen, 1, k, vocab).expand(batch, k, vocab)
    drafts = torch.multinomial(q[0], 1, generator=gen).view(1, k).expand(batch, k)
    generator = [None] * batch if per_row else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        first = ch07.rejection_sample(drafts, q, p, generator=generator)
        second = ch07.rejection_sample(drafts, q, p, generator=generator)
        torch.manual_seed(1234)
        again = ch07.rejection_sample(drafts, q, p, generator=generator)
    check_rows(first, drafts, k)
    assert len({tuple(row) for row in first.tolist()}) > 1, \
        f"{batch} identical rows, no generator: every row came out {first[0].tolist()}; each row must draw new numbers"
    assert not torch.equal(first, second), \
        "no generator: two calls gave the same tokens; each call must draw new numbers from torch's global RNG"
    assert torch.equal(first, again), "no generator: after torch.manual_seed, the same seed must give the same tokens"


# -- ngram -----------------------------------------------------------------------------------
@pytest.mark.task("ngram")
@pytest.mark.parametrize("tokens, k, lo, hi, want, why", [
    ([1, 2, 3, 4], 3, 1, 4, [], "no suffix occurs earlier"),
    ([], 3, 1, 4, [], "an empty sequence"),
    ([5], 3, 1, 4, [], "one token: nothing earlier"),
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, 1, 4, [8, 1], "[1, 2] occurs at 0 and 3: the most recent is followed by 8, 1"),
    ([1, 2, 9, 1, 2, 8, 1, 2], 5, 1, 4, [8, 1, 2], "only 3 tokens follow the match"),
    ([1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3], 3, 1, 4, [7, 9, 2], "[1, 2, 3] (n = 3) beats the more recent [2, 3]"),
    ([1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3], 3, 1, 2, [8, 1, 2], "prompt_lookup_max = 2: [2, 3], most recent at 5"),
    ([5, 6, 7, 5], 3, 1, 4, [6, 7, 5], "only n = 1 matches"),
    ([5, 6, 7, 5], 3, 2, 4, [], "prompt_lookup_min = 2: n = 1 is not tried"),
    ([1, 1, 1, 1], 3, 1, 4, [1], "[1, 1, 1] at 0 (it overlaps the suffix): one token follows it"),
    ([4, 4], 3, 1, 4, [4], "n is at most len - 1"),
    ([3, 1, 2, 3, 1, 2, 3], 4, 3, 3, [1, 2, 3], "n = 3 exactly: [1, 2, 3] at 1 is followed by 1, 2, 3"),
], ids=["no match", "empty", "one token", "most recent", "fewer than k", "longest first", "max", "n = 1",
        "min", "overlap", "short", "min = max"])
def test_propose_ngram_worked_examples(ch07, tokens, k, lo, hi, want, why):
    got = ch07.propose_ngram(list(tokens), k, lo, hi)
    assert isinstance(got, list), f"propose_ngram must return a list, got {type(got).__name__}"
    assert [int(t) for t in got] == want, \
        f"propose_ngram({tokens}, k={k}, min={lo}, max={hi}): {got}, expected {want} ({why})"


@pytest.mark.task("ngram")
def test_propose_ngram_default_bounds(ch07):
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    assert ch07.propose_ngram(tokens, 2) == [6, 1], "defaults prompt_lookup_min=1, prompt_lookup_max=4"


@pytest.mark.task("ngram")
def test_propose_ngram_matches_kvlab_on_random_sequences(ch07):
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randrange(1, 40))]
        k, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        got = ch07.propose_ngram(list(tokens), k, lo, hi)
        want = kvlab_propose_ngram(tokens, k, lo, hi)
        assert [int(t) for t in got] == want, \
            f"propose_ngram({tokens}, k={k}, min={lo}, max={hi}): {got}, expected {want}"


# -- rollback --------------------------------------------------------------------------------
class GuardedPool(BlockPool):
    """A BlockPool whose own truncate and release refuse: the function under test does the work."""

    _freeing = False

    def truncate(self, *args, **kwargs):
        raise AssertionError("don't call pool.truncate: change the pool's state yourself")

    def _release(self, blocks):
        if not self._freeing:
            raise AssertionError("don't call pool._release or pool.free: give the blocks back yourself")
        return super()._release(blocks)

    def free(self, seq_id):          # the pool's own, for the tests' workloads
        self._freeing = True
        try:
            return super().free(seq_id)
        finally:
            self._freeing = False


def state(pool) -> dict:
    return {
        "block_tables": {s: list(t) for s, t in pool.block_tables.items()},
        "seq_lens": dict(pool.seq_lens),
        "ref_counts": list(pool.ref_counts),
        "free_blocks": list(pool.free_blocks),
        "evictable (least recent first)": list(pool.evictable),
        "block_hashes": list(pool.block_hashes),
        "cached_blocks": dict(pool.cached_blocks),
        "seq_tokens": {s: list(t) for s, t in pool.seq_tokens.items()},
        "seq_hashes": {s: list(h) for s, h in pool.seq_hashes.items()},
        "pending_copies": list(pool.pending_copies),
    }


def first_difference(got: dict, want: dict) -> str:
    for key in want:
        if got[key] != want[key]:
            return f"{key}: got {got[key]}, expected {want[key]}"
    return ""


def twin_pools(num_blocks, block_size, caching=False):
    return GuardedPool(num_blocks, block_size, caching), BlockPool(num_blocks, block_size, caching)


def truncate_both(ch07, mine, ref, seq_id, num_tokens):
    """Truncate with yours and with kvlab's; the results and the states must agree."""
    got, want = ch07.truncate(mine, seq_id, num_tokens), ref.truncate(seq_id, num_tokens)
    assert got == want, f"truncate({seq_id!r}, {num_tokens}) returned {got}, expected {want}"
    problem = first_difference(state(mine), state(ref))
    assert not problem, f"after truncate({seq_id!r}, {num_tokens}): {problem}"
    return got


def on_both(pools, method, *args, **kwargs):
    return [getattr(pool, method)(*args, **kwargs) for pool in pools]


@pytest.mark.task("rollback")
def test_truncate_within_a_block(ch07):
    mine, ref = twin_pools(6, 4)
    on_both((mine, ref), "allocate", "a", 7)                  # blocks 0, 1 (3 slots in block 1)
    assert truncate_both(ch07, mine, ref, "a", 7) == [], "cutting to the same length changes nothing"
    assert truncate_both(ch07, mine, ref, "a", 5) == [], "5 tokens still need block 1: nothing to release"
    assert mine.block_tables["a"] == [0, 1] and mine.seq_lens["a"] == 5
    assert truncate_both(ch07, mine, ref, "a", 4) == [1], "4 tokens fit in block 0: block 1 is empty, released"
    assert list(mine.free_blocks) == [2, 3, 4, 5, 1], "a released block goes to the right of the free queue"


@pytest.mark.task("rollback")
def test_truncate_across_blocks(ch07):
    mine, ref = twin_pools(8, 4)
    on_both((mine, ref), "allocate", "a", 14)                 # blocks 0..3
    on_both((mine, ref), "allocate", "b", 3)                  # block 4
    assert truncate_both(ch07, mine, ref, "a", 5) == [2, 3], "14 -> 5 tokens: blocks 2 and 3 (table order) go back"
    assert truncate_both(ch07, mine, ref, "a", 0) == [0, 1], "0 tokens: every block goes back"
    assert mine.block_tables["a"] == [] and mine.seq_lens["a"] == 0, "the sequence stays, with no blocks"
    on_both((mine, ref), "append", "a", 6)
    assert mine.block_tables == ref.block_tables


@pytest.mark.task("rollback")
def test_truncate_a_forked_sequence_keeps_the_other_holder(ch07):
    mine, ref = twin_pools(8, 4)
    on_both((mine, ref), "allocate", "a", 10)                 # blocks 0, 1, 2
    on_both((mine, ref), "fork", "a", "b")
    assert truncate_both(ch07, mine, ref, "b", 3) == [], "a still holds blocks 1 and 2: nothing is released"
    assert mine.ref_counts[:3] == [2, 1, 1] and mine.block_tables["a"] == [0, 1, 2]
    assert truncate_both(ch07, mine, ref, "a", 3) == [1, 2], "now nobody holds 1 and 2"
    on_both((mine, ref), "append", "b", 1)                    # block 0 is shared and partly filled: a copy
    assert mine.block_tables["b"] == [3] and mine.pending_copies == [(0, 3)], "append copied block 0 into block 3"
    assert truncate_both(ch07, mine, ref, "b", 0) == [3], "the copy's block is released..."
    assert mine.pending_copies == [], "...and the copy into it must be dropped from pending_copies"


@pytest.mark.task("rollback")
def test_truncate_keeps_a_copy_another_sequence_needs(ch07):
    mine, ref = twin_pools(8, 4)
    on_both((mine, ref), "allocate", "a", 6)                  # blocks 0, 1 (block 1 partly filled)
    on_both((mine, ref), "fork", "a", "b")
    on_both((mine, ref), "append", "b", 1)                    # b writes into shared block 1: a copy into block 2
    assert mine.block_tables["b"] == [0, 2] and mine.pending_copies == [(1, 2)]
    on_both((mine, ref), "fork", "b", "c")                    # c shares block 2 before the copy ran
    assert truncate_both(ch07, mine, ref, "b", 4) == [], "c still holds block 2: nothing is released"
    assert mine.pending_copies == [(1, 2)], \
        "block 2 was dropped by b but not released (c holds it): the copy into it must stay in pending_copies"
    assert truncate_both(ch07, mine, ref, "c", 4) == [2], "now nobody holds block 2..."
    assert mine.pending_copies == [], "...and the copy into it can go"


@pytest.mark.task("rollback")
def test_released_cached_blocks_become_evictable(ch07):
    mine, ref = twin_pools(8, 4, caching=True)
    prompt = list(range(10, 24))
    on_both((mine, ref), "allocate", "a", 14, prompt, cache=False)    # blocks 0..3; none cached yet
    on_both((mine, ref), "fork", "a", "b")
    on_both((mine, ref), "cache_blocks", "a", 14)                     # full blocks 0, 1, 2 get hashes
    on_both((mine, ref), "free", "a")
    assert truncate_both(ch07, mine, ref, "b", 2) == [1, 2, 3], "b alone holds blocks 1, 2 and 3"
    assert list(mine.evictable) == [2, 1] and list(mine.free_blocks)[-1] == 3, \
        "blocks 1 and 2 have hashes: evictable, the tail (2) first; block 3 has none: the free queue"
    assert mine.seq_tokens["b"] == prompt[:2], "with prefix caching, seq_tokens is cut too"
    assert truncate_both(ch07, mine, ref, "b", 0) == [0]
    assert list(mine.evictable) == [2, 1, 0]


@pytest.mark.task("rollback")
def test_errors_change_nothing(ch07):
    mine, ref = twin_pools(8, 4, caching=True)
    for pool in (mine, ref):
        pool.allocate("a", 10, list(range(10)))                # blocks 0, 1 cached at once; block 2 partial
    before = state(mine)
    for seq, n, error, why in [
        ("x", 3, UnknownSequenceError, "an unknown sequence"),
        ("x", -1, UnknownSequenceError, "the unknown sequence is checked first"),
        ("a", 11, ValueError, "truncate only cuts: 11 > 10 tokens"),
        ("a", -1, ValueError, "a negative count"),
        ("a", 2.0, TypeError, "a count must be an int"),
        ("a", True, TypeError, "True is not a count"),
        ("a", 7, ValueError, "blocks 0 and 1 are in the prefix cache: cutting into them is refused"),
    ]:
        try:
            ch07.truncate(mine, seq, n)
            raised = None
        except NotImplementedError:
            raise
        except Exception as e:      # noqa: BLE001  (the type is checked below)
            raised = e
        assert isinstance(raised, error), \
            f"truncate({seq!r}, {n!r}) raised {raised!r}, expected {error.__name__} ({why})"
        problem = first_difference(state(mine), before)
        assert not problem, f"truncate({seq!r}, {n!r}) raised ({why}) but changed the pool: {problem}"
    assert truncate_both(ch07, mine, ref, "a", 8) == [2], "cutting to the cached blocks' end is fine"


# An operation: (name, which sequence, which other, a count, a flag). "speculate" is the
# engine's pattern: append n drafts (not cached), then cut back to the old length + the kept ones.
OPS = st.tuples(st.sampled_from(["allocate", "append", "fork", "free", "cache", "truncate", "speculate", "speculate"]),
                st.integers(0, 5), st.integers(0, 5), st.integers(0, 9), st.booleans())


def live_id(tokens, which):
    """The ``which``-th live sequence, or (``which`` 5, or none lives) an unknown id."""
    live = sorted(tokens)
    return live[which % len(live)] if live and which < 5 else "unknown"


def new_id(tokens, which, i):
    """A new sequence id, or (``which`` 5) a live one: an error to refuse."""
    return live_id(tokens, 0) if which == 5 and tokens else f"s{i}"


@pytest.mark.task("rollback")
@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(caching=st.booleans(), block_size=st.sampled_from([1, 2, 4]), ops=st.lists(OPS, min_size=10, max_size=40))
def test_random_workload_matches_kvlab(ch07, caching, block_size, ops):
    """Random allocations, appends, forks, frees and truncations: yours and kvlab's pool agree
    after every operation; no block is lost or held twice; cached hashes name kept tokens."""
    mine, ref = twin_pools(16, block_size, caching)
    tokens = {}                                               # the model: each sequence's tokens
    for i, (op, which, other, n, flag) in enumerate(ops):
        seq = new_id(tokens, which, i) if op == "allocate" else live_id(tokens, which)
        child = new_id(tokens, other, i)
        fresh = [(7 * i + j) % 3 for j in range(n)]           # few distinct tokens: cache hits
        length = len(tokens.get(seq, []))
        kept = other % (n + 1)
        if op == "truncate":                                  # cut n tokens off (one too many if n > length)
            n = length - n if n <= length else length + 1

        def cut(pool, num_tokens):
            return ch07.truncate(pool, seq, num_tokens) if pool is mine else pool.truncate(seq, num_tokens)

        calls = {
            "allocate": lambda pool: pool.allocate(seq, n, fresh if caching else None, cache=flag),
            "append": lambda pool: pool.append(seq, n, fresh if caching else None, cache=flag),
            "fork": lambda pool: pool.fork(seq, child),
            "free": lambda pool: pool.free(seq),
            "cache": lambda pool: pool.cache_blocks(seq, min(n, pool.seq_lens.get(seq, 0))),
            "truncate": lambda pool: cut(pool, n),
            "speculate": lambda pool: (pool.append(seq, n, fresh if caching else None, cache=False),
                                       cut(pool, length + kept)),
        }
        results = []
        for pool in (mine, ref):
            try:
                results.append((calls[op](pool), None))
            except (OutOfBlocksError, UnknownSequenceError, ValueError, TypeError) as e:
                results.append((None, type(e).__name__))
        what = f"operation {i}: {op}({seq!r}{', ' + repr(child) if op == 'fork' else ''}, n={n}" + \
            (f", then truncate to {length + kept})" if op == "speculate" else ")")
        assert results[0] == results[1], f"{what} gave {results[0]}, kvlab's pool {results[1]}"
        problem = first_difference(state(mine), state(ref))
        assert not problem, f"{what}: {problem}"
        if results[1][1] is None:
            if op in ("allocate", "append"):
                tokens[seq] = (tokens[seq] if op == "append" else []) + fresh
            elif op == "fork":
                tokens[child] = list(tokens[seq])
            elif op == "free":
                del tokens[seq]
            elif op == "truncate":
                del tokens[seq][n:]
            elif op == "speculate":
                tokens[seq] += fresh[:kept]
        held = [b for table in mine.block_tables.values() for b in table]
        assert all(mine.ref_counts[b] == held.count(b) for b in range(mine.num_blocks)), \
            f"{what}: reference counts {mine.ref_counts} are not the number of tables holding each block"
        idle = set(mine.free_blocks) | set(mine.evictable)
        assert len(idle) == len(mine.free_blocks) + len(mine.evictable) and not idle & set(held) \
            and len(idle) + len(set(held)) == mine.num_blocks, f"{what}: free + used is not every block once"
        for s, toks in tokens.items():
            assert mine.seq_lens[s] == len(toks) and len(mine.block_tables[s]) == blocks_needed(len(toks), block_size)
            if caching:
                hashes = mine.seq_hashes[s]
                assert hashes == hash_blocks(toks, block_size)[:len(hashes)], \
                    f"{what}: sequence {s!r}'s cached hashes don't name its tokens"


# -- the engine ------------------------------------------------------------------------------
PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "for i in range(10):\n    for j in range(10):\n"]


@pytest.fixture(scope="module")
def greedy(one_thread):
    """The engine without speculation: the greedy token ids of PROMPTS, and the sampling parameters."""
    from kvlab import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24)
    outputs = LLM(max_num_seqs=4).generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], params


@pytest.fixture(scope="module")
def speculative(one_thread):
    from kvlab import LLM

    return LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, max_num_seqs=4,
               enable_prefix_caching=True)


def check_in_the_engine(ch07, llm, greedy, piece):
    want, params = greedy
    ch07.use_my_pieces(llm, pieces=(piece,))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise AssertionError(f"the engine failed with your {piece}: {errors[0]}")
    drafted = sum(o.spec_decode_stats.num_draft_tokens for o in outputs)
    kept = sum(o.spec_decode_stats.num_accepted_tokens for o in outputs)
    assert 0 < kept < drafted, f"{drafted} drafts proposed, {kept} kept: the test needs some kept and some rejected"
    for prompt, o, w in zip(PROMPTS, outputs, want):
        got = o.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, w)) if a != b), min(len(got), len(w)))
        assert got == w, (f"with your {piece} in the engine, prompt {prompt!r} gave {len(got)} tokens that differ "
                          f"from greedy decoding without speculation at token {first}")
    assert llm.pool.num_free_blocks == llm.pool.num_blocks, "blocks are still held after every request finished"


@pytest.mark.task("rejection_sample")
def test_your_sampler_in_the_engine_keeps_greedy_output(ch07, speculative, greedy):
    check_in_the_engine(ch07, speculative, greedy, "rejection_sample")


@pytest.mark.task("ngram")
def test_your_proposer_in_the_engine_keeps_greedy_output(ch07, speculative, greedy):
    check_in_the_engine(ch07, speculative, greedy, "propose_ngram")


@pytest.mark.task("rollback")
def test_your_rollback_in_the_engine_keeps_greedy_output(ch07, speculative, greedy):
    check_in_the_engine(ch07, speculative, greedy, "truncate")
