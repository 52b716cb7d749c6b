"""Rejection sampling: keep a draft's tokens while they are as likely as the target says.

A cheap proposer guesses ``k`` tokens ``d_1 .. d_k``, drawn from its distributions ``q_i``;
one forward of the target scores all ``k + 1`` positions, giving ``p_1 .. p_{k+1}``. Walking
the drafts in order (Leviathan et al. 2023, Chen et al. 2023):

* accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``;
* at the first rejection, draw the replacement from the *residual* ``max(0, p_i - q_i)``,
  normalised, and stop;
* if all ``k`` were accepted, draw a *bonus* token from ``p_{k+1}``.

Each emitted token is then distributed exactly as the target alone would draw it: where
``q_i`` underestimates ``p_i`` the draft is always kept; where it overestimates, the excess is
rejected and the residual refills exactly the missing mass. A step emits between 1 and k + 1
tokens and never a token the target would not have produced.

Deterministic drafts (n-gram lookup) have ``q_i`` one-hot at ``d_i``: the draft is kept with
probability ``p_i(d_i)``, and the residual is ``p_i`` with ``d_i`` removed. Greedy decoding is
the case where every ``p_i`` is one-hot at the target's argmax: a draft is kept iff it equals
that argmax, and the replacement is the argmax.
"""
from __future__ import annotations

import torch

NO_DRAFT = -1   # a draft slot with no token (fewer drafts than k): rejected, replaced from p


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator=None) -> torch.Tensor:
    """The tokens a speculative step emits, per row: the accepted drafts, one more token, then -1.

    ``draft_token_ids`` [B, k] (int; ``-1`` where a row has fewer than k drafts);
    ``draft_probs`` [B, k, V], the distributions the drafts were drawn from, or None for
    deterministic drafts (one-hot ``q``); ``target_probs`` [B, k + 1, V], the target's
    distributions at each draft position and after the last (already shaped by temperature,
    top-k and top-p: see :func:`kvlab.engine.sampler.sampling_probs`).
    ``generator``: None (torch's global RNG), one ``torch.Generator``, or one (or None) per row.
    Returns a LongTensor [B, k + 1]; row ``b`` holds ``a_b`` accepted drafts, then the
    replacement or bonus token, then ``-1`` padding.
    """
    drafts, q, p = _check(draft_token_ids, draft_probs, target_probs)
    batch, k = drafts.shape
    has_draft = drafts != NO_DRAFT
    index = drafts.clamp(min=0).unsqueeze(-1)
    p_draft = p[:, :k].gather(2, index).squeeze(2)
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, index).squeeze(2)
    u = _uniform(batch, k, generator, p.device)
    # u < p/q, written without the division: q(d) > 0 for any token the drafter drew
    accepted = has_draft & (u * q_draft < p_draft)
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)               # up to the first rejection
    rows = torch.arange(batch, device=p.device)
    last = p[rows, num_accepted].clone()                                  # p at the stopping position
    stopped_early = num_accepted < k
    if stopped_early.any():
        at = num_accepted.clamp(max=k - 1)
        q_stop = _draft_dist_at(q, drafts, rows, at, p.shape[-1])
        residual = (last - q_stop).clamp(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        # a rejected draft leaves mass > 0 behind; guard rounding (and "no draft": q_stop = 0)
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), last)
        last = torch.where(stopped_early[:, None], residual, last)
    return _emit(drafts, num_accepted, _draw(last, generator))


def greedy_accept(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """:func:`rejection_sample` of one row when every target distribution is one-hot (greedy
    decoding), on the host: keep drafts while they equal the target's choice, then emit the
    target's token. ``target_token_ids`` has one more entry than the drafts."""
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_token_ids[accepted]:
        accepted += 1
    return [int(t) for t in target_token_ids[:accepted + 1]]


def _emit(drafts, num_accepted, extra) -> torch.Tensor:
    """Rows of ``num_accepted`` drafts, then ``extra``, then -1."""
    batch, k = drafts.shape
    out = torch.full((batch, k + 1), NO_DRAFT, dtype=torch.long, device=drafts.device)
    keep = torch.arange(k, device=drafts.device)[None, :] < num_accepted[:, None]
    out[:, :k] = torch.where(keep, drafts, out[:, :k])
    out[torch.arange(batch, device=drafts.device), num_accepted] = extra.long()
    return out


def _check(drafts, q, p):
    if not isinstance(drafts, torch.Tensor) or drafts.dim() != 2 or drafts.dtype.is_floating_point:
        raise TypeError("draft_token_ids must be an integer tensor [batch, k]")
    batch, k = drafts.shape
    if not isinstance(p, torch.Tensor) or p.dim() != 3 or p.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [batch, k + 1, vocab] = [{batch}, {k + 1}, V], "
                         f"got {tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
    vocab = p.shape[2]
    if q is not None and (not isinstance(q, torch.Tensor) or tuple(q.shape) != (batch, k, vocab)):
        raise ValueError(f"draft_probs must be None or [batch, k, vocab] = [{batch}, {k}, {vocab}], "
                         f"got {tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if k and (drafts.min() < NO_DRAFT or drafts.max() >= vocab):
        raise ValueError(f"draft_token_ids must be token ids in 0..{vocab - 1} (or -1 for no draft)")
    p = p.float()
    return drafts.to(p.device).long(), None if q is None else q.to(p.device).float(), p


def _draft_dist_at(q, drafts, rows, at, vocab):
    """The drafter's distribution at position ``at[b]`` of each row ([B, V]); one-hot for
    deterministic drafts, zero where the row had no draft."""
    token = drafts[rows, at]
    if q is not None:
        dist = q[rows, at]
    else:
        dist = torch.zeros(len(rows), vocab, device=drafts.device)
        dist.scatter_(1, token.clamp(min=0)[:, None], 1.0)
    return dist * (token != NO_DRAFT)[:, None]


def _per_row(generator, batch):
    if generator is None or isinstance(generator, torch.Generator):
        return None, generator
    generators = list(generator)
    if len(generators) != batch:
        raise ValueError(f"generator must be None, a torch.Generator, or one per row ({batch}), "
                         f"got {len(generators)}")
    return generators, None


def _uniform(batch, k, generator, device) -> torch.Tensor:
    """[B, k] uniforms in [0, 1); a row with its own generator draws its own."""
    rows, shared = _per_row(generator, batch)
    if rows is None:
        return torch.rand(batch, k, generator=shared, device=device)
    return torch.stack([torch.rand(k, generator=g, device=device) for g in rows]) if batch else \
        torch.empty(0, k, device=device)


def _draw(probs, generator) -> torch.Tensor:
    """One token per row of ``probs`` [B, V]."""
    rows, shared = _per_row(generator, probs.shape[0])
    if rows is None:
        return torch.multinomial(probs, 1, generator=shared).squeeze(1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, rows)])
