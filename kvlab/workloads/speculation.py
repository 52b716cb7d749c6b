"""What chapter 7 runs and measures: speculative decoding's arithmetic, sampler exactness, and
the engine's speculation recorded step by step.

* :func:`expected_tokens_per_step`, :func:`expected_speedup`, :func:`verify_roofline`,
  :func:`roofline_speedup`: the formulas the chapter tests (claims 14 and 16);
* :func:`chi_square`, :func:`first_token_test`, :func:`seed_pseudo_code`: is a rejection
  sampler exact? (claim 15);
* :func:`acceptance_by_position`, :func:`conditional_acceptance`, :func:`acceptance_sweep`:
  acceptance measured on a real :class:`~kvlab.engine.LLM`;
* :func:`record_speculation`: one request driven step by step, with its drafts, what was kept,
  and the block table before and after the rollback (drawn by :mod:`kvlab.viz.speculative`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.accounting import get_spec, kv_bytes, dtype_bytes
from kvlab.paging.block_pool import blocks_needed, slot_mapping

# Ceilings measured on the H200 (DESIGN.md, benchmarks/RESULTS.md): device copy, bf16 8192^3 matmul.
H200_COPY_BYTES_PER_S = 4.25e12
H200_BF16_FLOPS = 693e12


# -- the formulas ----------------------------------------------------------------------------
def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a verification step emits on average when each of ``k`` drafts is kept
    independently with probability ``alpha``: 1 + α + ... + α^k = (1 − α^(k+1)) / (1 − α)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Wall-clock speedup over plain decoding when a draft forward costs ``c`` target steps and
    verifying k + 1 tokens costs one: tokens per step / (k·c + 1)."""
    return expected_tokens_per_step(alpha, k) / (k * c + 1)


@dataclass(frozen=True)
class StepCost:
    """The roofline of one forward: bytes it must read, FLOPs it must do, and the time of each."""

    batch: int
    query_tokens: int
    bytes: float
    flops: float
    memory_ms: float
    compute_ms: float

    @property
    def ms(self) -> float:
        """The roofline bound: the slower of streaming the bytes and doing the FLOPs."""
        return max(self.memory_ms, self.compute_ms)

    @property
    def intensity(self) -> float:
        """FLOPs per byte read."""
        return self.flops / self.bytes


def verify_roofline(spec="llama-3-8b", batch: int = 1, query_tokens: int = 1, context: int = 2048,
                    bytes_per_s: float = H200_COPY_BYTES_PER_S, flops_per_s: float = H200_BF16_FLOPS,
                    dtype: str = "bf16") -> StepCost:
    """The roofline cost of a step of ``query_tokens`` new tokens for each of ``batch`` sequences
    with ``context`` cached tokens. Bytes: every weight once (the input embedding only for the
    rows looked up, so not at all when the LM head has its own matrix) plus each sequence's KV.
    FLOPs: 2 per weight per token, plus 4·heads·head_dim per cached token per layer (QKᵀ and PV)."""
    spec = get_spec(spec)
    lookup_only = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    matmul_params = spec.num_params - lookup_only
    tokens = batch * query_tokens
    read = matmul_params * dtype_bytes(dtype) + kv_bytes(spec, context + query_tokens, batch, dtype)
    attention = 4 * spec.num_heads * spec.head_dim * (context + query_tokens) * spec.num_layers
    flops = tokens * (2 * matmul_params + attention)
    return StepCost(batch, query_tokens, read, flops, read / bytes_per_s * 1e3, flops / flops_per_s * 1e3)


def roofline_speedup(alpha: float, k: int, batch: int, spec="llama-3-8b", context: int = 2048, **ceilings) -> float:
    """Speedup of speculation with free drafts (n-gram) at ``batch``: tokens per step over the
    roofline cost of a (k + 1)-token step relative to a 1-token step."""
    ratio = (verify_roofline(spec, batch, k + 1, context, **ceilings).ms
             / verify_roofline(spec, batch, 1, context, **ceilings).ms)
    return expected_tokens_per_step(alpha, k) / ratio


# -- is a sampler exact? -------------------------------------------------------------------------
@dataclass(frozen=True)
class ChiSquare:
    """Pearson's test of samples against a distribution; ``p_value`` near 0 means "not from it"."""

    statistic: float
    dof: int
    p_value: float
    num_samples: int

    def passes(self, level: float = 1e-3) -> bool:
        return self.p_value > level


def chi_square(samples, probs) -> ChiSquare:
    """Test token ids ``samples`` against ``probs`` [V]. A token of probability 0 fails outright."""
    samples = torch.as_tensor(samples).long().flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs / probs.sum() * len(samples)
    keep = expected > 0
    dof = int(keep.sum()) - 1
    if counts[~keep].sum() > 0:
        return ChiSquare(math.inf, dof, 0.0, len(samples))
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    if dof == 0:
        return ChiSquare(stat, 0, 1.0, len(samples))
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return ChiSquare(stat, dof, p_value, len(samples))


def first_token_test(sampler, p, q=None, draft_token: int = 0, num_samples: int = 20_000,
                     seed: int = 0) -> tuple[ChiSquare, float]:
    """Run ``sampler`` (:func:`~kvlab.engine.rejection_sampler.rejection_sample`'s signature) on
    ``num_samples`` independent rows of one draft each, drafts drawn from ``q`` [V] (or always
    ``draft_token`` when ``q`` is None: a deterministic, one-hot draft). The first emitted token
    must be distributed as ``p`` [V]. Returns its chi-square test and the mean number of tokens
    a row emitted (1 + the share of drafts kept, for an exact sampler with its bonus token)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.as_tensor(p, dtype=torch.float32)
    if q is None:
        drafts = torch.full((num_samples, 1), draft_token, dtype=torch.long)
        draft_probs = None
    else:
        q = torch.as_tensor(q, dtype=torch.float32)
        drafts = torch.multinomial(q, num_samples, replacement=True, generator=gen)[:, None]
        draft_probs = q.expand(num_samples, 1, len(q))
    target = p.expand(num_samples, 2, len(p))           # position 1, and the bonus position
    out = sampler(drafts, draft_probs, target, generator=gen)
    return chi_square(out[:, 0], p), float((out >= 0).sum(dim=1).double().mean())


def seed_pseudo_code(draft_token_ids, draft_probs, target_probs, generator=None) -> torch.Tensor:
    """The seed article's step (claim 15) as written, with ``rejection_sample``'s signature:
    accept with min(1, p/q); at a rejection, draw from ``p − min(p, q)`` *as if it summed to
    1* (inverse CDF: a uniform lands past its total mass, on the last token); when every draft
    is kept, no bonus token (the pseudo-code has none: ``-1`` there)."""
    drafts = draft_token_ids.long()
    batch, k = drafts.shape
    p = target_probs.float()
    q = torch.zeros_like(p[:, :k]).scatter_(2, drafts[..., None], 1.0) if draft_probs is None else draft_probs.float()
    index = drafts[..., None]
    u = torch.rand(batch, k, generator=generator)
    accepted = u * q.gather(2, index).squeeze(2) < p[:, :k].gather(2, index).squeeze(2)
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)
    out = torch.full((batch, k + 1), -1, dtype=torch.long)
    rows = torch.arange(batch)
    for i in range(k):
        out[:, i] = torch.where(num_accepted > i, drafts[:, i], out[:, i])
    stop = num_accepted.clamp(max=k - 1)
    residual = p[rows, stop] - torch.minimum(p[rows, stop], q[rows, stop])   # not normalised
    u2 = torch.rand(batch, 1, generator=generator)
    token = torch.searchsorted(residual.cumsum(dim=1), u2, right=True).squeeze(1).clamp(max=p.shape[-1] - 1)
    rejected = num_accepted < k
    out[rows[rejected], num_accepted[rejected]] = token[rejected]
    return out


# -- acceptance on the engine ------------------------------------------------------------------
def acceptance_by_position(stats) -> list[float]:
    """P(the i-th draft is kept), i = 1..k, from a :class:`~kvlab.engine.sequence.SpecDecodeStats`:
    the share of verification steps that kept at least i drafts."""
    return [a / stats.num_drafts for a in stats.accepted_per_position] if stats.num_drafts else []


def conditional_acceptance(by_position) -> list[float]:
    """P(i-th draft kept | (i − 1)-th kept): constant (= α) if drafts were kept independently."""
    out, before = [], 1.0
    for share in by_position:
        out.append(share / before if before > 0 else math.nan)
        before = share
    return out


def acceptance_sweep(prompts, ks, max_tokens: int = 32, method: str = "draft_model", **llm_settings) -> dict:
    """Greedy generation of ``prompts`` with ``k`` drafts per step, for each ``k`` of ``ks``
    (the first must be 1: it gives α). Returns the benchmark JSON's ``tiny_pair`` fields:
    ``alpha_k1``, ``k``, ``measured_tokens_per_step``, ``predicted_tokens_per_step`` (the
    formula at α) and ``acceptance_by_position`` {k: P(i-th draft kept)}, plus ``acceptance_rate``
    and ``num_steps`` (verification steps) per k."""
    from kvlab.engine import LLM, SamplingParams

    ks = list(ks)
    if not ks or ks[0] != 1:
        raise ValueError(f"ks must start with 1 (alpha is the acceptance rate at k = 1), got {ks}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stats = {}
    for k in ks:
        llm = LLM(speculative_config={"method": method, "num_speculative_tokens": k}, **llm_settings)
        llm.generate(list(prompts), params, use_tqdm=False)
        stats[k] = llm.spec_decode_stats
    alpha = stats[1].acceptance_rate
    return {"alpha_k1": alpha, "k": tuple(ks),
            "measured_tokens_per_step": tuple(stats[k].mean_acceptance_length for k in ks),
            "predicted_tokens_per_step": tuple(expected_tokens_per_step(alpha, k) for k in ks),
            "acceptance_by_position": {k: tuple(acceptance_by_position(stats[k])) for k in ks},
            "acceptance_rate": {k: stats[k].acceptance_rate for k in ks},
            "num_steps": {k: stats[k].num_drafts for k in ks}}


# -- one request, step by step -------------------------------------------------------------------
@dataclass(frozen=True)
class SpecStep:
    """What one engine step did to one sequence. Positions count from 0; a verification step
    computes position ``start`` (the last token sampled) and the drafts after it."""

    index: int
    kind: str                  # "prefill", "decode" (no drafts this step) or "verify"
    tokens_before: tuple       # the sequence's tokens when the step began
    drafts: tuple              # draft token ids verified (-1: a padding slot, no draft)
    num_accepted: int
    emitted: tuple             # tokens appended: the kept drafts, then the target's own
    start: int
    block_table: tuple         # while the step ran: the drafts' slots booked
    seq_len: int               # tokens in the cache while the step ran, drafts included
    block_table_after: tuple   # after the rollback (empty once the sequence has finished)
    kept_len: int              # tokens in the cache after the rollback
    finished: bool
    num_blocks: int
    block_size: int
    other_blocks: tuple = ()   # blocks other sequences held after the step

    @property
    def rejected_positions(self) -> range:
        return range(self.start + 1 + self.num_accepted, self.seq_len) if self.kind == "verify" else range(0)

    @property
    def rejected_slots(self) -> list[int]:
        """Cache slots written during verification whose tokens were not kept."""
        n = len(self.rejected_positions)
        return slot_mapping(list(self.block_table), self.seq_len - n, n, self.block_size) if n else []

    @property
    def freed_blocks(self) -> tuple:
        """Blocks the rollback gave back: those the kept tokens no longer reach."""
        return self.block_table[blocks_needed(self.kept_len, self.block_size):]


def record_speculation(llm, prompt, sampling_params=None, max_steps: int = 16) -> list[SpecStep]:
    """Add ``prompt`` to ``llm`` (built with a ``speculative_config``) and run up to
    ``max_steps`` steps, recording each step of that request (aborted after the last one if
    still running). Other requests may run alongside; their blocks appear as ``other_blocks``."""
    if llm.proposer is None:
        raise ValueError("record_speculation needs an LLM built with a speculative_config")
    request_id = llm.add_request(prompt, sampling_params)
    seq = llm.requests[request_id].seqs[0]
    steps = []
    for _ in range(max_steps):
        if seq.is_finished:
            break
        before = tuple(seq.token_ids)
        llm.step()
        item = next((s for s in llm.last_schedule.scheduled if s.seq is seq), None)
        if item is None:
            continue
        drafts = tuple(item.spec_token_ids)
        kept = seq.num_computed_tokens
        kind = "prefill" if item.is_prefill else "verify" if drafts else "decode"
        pool = llm.pool
        others = {b for s, table in pool.block_tables.items() if s != seq.seq_id for b in table}
        steps.append(SpecStep(len(steps), kind, before, drafts, kept - (item.seq_len - len(drafts)),
                              tuple(seq.token_ids[len(before):]), item.start, tuple(item.block_table),
                              item.seq_len, tuple(pool.block_table(seq.seq_id)) if seq.seq_id in pool else (),
                              kept, seq.is_finished, pool.num_blocks, pool.block_size, tuple(sorted(others))))
    if not seq.is_finished:
        llm.abort_request(request_id)
    return steps

