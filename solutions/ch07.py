"""Chapter 7 answers: the same names and signatures as ``exercises/ch07.py``."""
import torch

from kvlab.errors import UnknownSequenceError
from kvlab.paging import BlockPool, blocks_needed
from kvlab.paging.block_pool import check_count
# Given (not a task), shared with exercises/ch07.py: read kvlab/scaffold/ch07.py.
from kvlab.scaffold.ch07 import PIECES, my_pieces_user, ngram_proposer_with, pool_with_truncate  # noqa: F401

NO_DRAFT = -1


# -- task accept -----------------------------------------------------------------------------
def num_accepted(draft_token_ids, draft_probs, target_probs, uniforms) -> int:
    accepted = 0
    for i, d in enumerate(draft_token_ids.tolist()):
        if d == NO_DRAFT:
            break
        q = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if not float(uniforms[i]) * q < float(target_probs[i, d]):
            break
        accepted += 1
    return accepted


# -- task residual ---------------------------------------------------------------------------
def residual_distribution(target_probs, draft_probs) -> torch.Tensor:
    residual = (target_probs - draft_probs).clamp(min=0)
    mass = residual.sum()
    if mass <= 0:
        return target_probs.clone()
    return residual / mass


# -- task rejection_sample -------------------------------------------------------------------
def rejection_sample(draft_token_ids, draft_probs, target_probs, generator=None) -> torch.Tensor:
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    rows = []
    for b in range(batch):
        g = generator[b] if isinstance(generator, (list, tuple)) else generator
        drafts, p = draft_token_ids[b], target_probs[b].float()
        q = None if draft_probs is None else draft_probs[b].float()
        a = num_accepted(drafts, q, p, torch.rand(k, generator=g))
        if a == k:
            dist = p[k]                                    # every draft kept: the bonus token
        elif drafts[a] == NO_DRAFT:
            dist = p[a]                                    # no draft here: q_a is all zeros
        elif q is None:
            dist = residual_distribution(p[a], torch.nn.functional.one_hot(drafts[a], vocab).float())
        else:
            dist = residual_distribution(p[a], q[a])
        token = int(torch.multinomial(dist, 1, generator=g))
        rows.append(drafts[:a].tolist() + [token] + [NO_DRAFT] * (k - a))
    return torch.tensor(rows, dtype=torch.long).view(batch, k + 1)


# -- task ngram ------------------------------------------------------------------------------
def propose_ngram(token_ids, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                  prompt_lookup_max: int = 4) -> list[int]:
    tokens = [int(t) for t in token_ids]
    length = len(tokens)
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(length - n - 1, -1, -1):        # most recent first; ends before the last token
            if tokens[start:start + n] == suffix:
                follow = start + n
                return tokens[follow:follow + num_speculative_tokens]
    return []


# -- task rollback ---------------------------------------------------------------------------
def truncate(pool: BlockPool, seq_id, num_tokens: int) -> list[int]:
    if seq_id not in pool.block_tables:
        raise UnknownSequenceError(f"unknown sequence id {seq_id!r}")
    check_count("num_tokens", num_tokens)
    length = pool.seq_lens[seq_id]
    if num_tokens > length:
        raise ValueError(f"num_tokens={num_tokens} is more than sequence {seq_id!r}'s {length} tokens")
    cached = len(pool.seq_hashes[seq_id]) * pool.block_size if pool.enable_prefix_caching else 0
    if num_tokens < cached:
        raise ValueError(f"cannot cut sequence {seq_id!r} to {num_tokens} tokens: its first {cached} are cached")
    table = pool.block_tables[seq_id]
    keep = blocks_needed(num_tokens, pool.block_size)
    dropped = table[keep:]
    del table[keep:]
    pool.seq_lens[seq_id] = num_tokens
    if pool.enable_prefix_caching:
        del pool.seq_tokens[seq_id][num_tokens:]
    released = []
    for block in dropped:
        pool.ref_counts[block] -= 1
        if pool.ref_counts[block] == 0:
            released.append(block)
    for block in reversed(released):
        if pool.block_hashes[block] is not None:
            pool.evictable[block] = None
    pool.free_blocks.extend(b for b in released if pool.block_hashes[b] is None)
    pool.pending_copies = [(src, dst) for src, dst in pool.pending_copies if dst not in released]
    return released


# Given: kvlab's pool and n-gram proposer calling your truncate and propose_ngram, and
# use_my_pieces(llm, pieces=PIECES), which serves a speculative LLM with your pieces.
PoolWithMyRollback = pool_with_truncate(truncate)
MyNgramProposer = ngram_proposer_with(propose_ngram)
use_my_pieces = my_pieces_user(rejection_sample, MyNgramProposer, PoolWithMyRollback)
