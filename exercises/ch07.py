"""Chapter 7 exercises: speculative decoding.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch07                                 # in a terminal
    kvlab.check("ch07")                              # in the notebook
    pytest tests/graded -m ch07 --impl=exercises     # the same tests, raw

Tasks: ``accept`` (num_accepted), ``residual`` (residual_distribution), ``rejection_sample``
(the whole sampler: accept, residual, bonus), ``ngram`` (propose_ngram), ``rollback``
(truncate). Each is graded on its own, then in the real engine: greedy output with your piece
plugged in (``use_my_pieces``) must equal greedy output without speculation, token for token.
Stuck? ``kvlab.use_solution("ch07")`` swaps in the answer and keeps yours as
``exercises/ch07_mine.py``.

The sampler's notation: ``k`` drafts ``d_0 .. d_{k-1}`` of one sequence, drawn from the
proposer's distributions ``q_i`` (``[V]`` each); one target forward gives ``p_0 .. p_k``
(``p_i`` is the target's distribution of the token at draft position ``i``; ``p_k`` the one
after the last draft). A draft of ``-1`` means "no draft here" (the n-gram proposer found fewer
than k). ``draft_probs=None`` means deterministic drafts: ``q_i`` is one-hot at ``d_i``.
"""
import torch

from kvlab.errors import UnknownSequenceError  # noqa: F401  (you will raise it)
from kvlab.paging import BlockPool, blocks_needed  # noqa: F401  (blocks_needed(n, bs) = ceil(n / bs))
from kvlab.paging.block_pool import check_count  # noqa: F401  (TypeError/ValueError for a bad count)
# Given (not a task), shared with solutions/ch07.py: read kvlab/scaffold/ch07.py.
from kvlab.scaffold.ch07 import PIECES, my_pieces_user, ngram_proposer_with, pool_with_truncate  # noqa: F401

NO_DRAFT = -1


# -- task accept -----------------------------------------------------------------------------
def num_accepted(draft_token_ids, draft_probs, target_probs, uniforms) -> int:
    """How many leading drafts of one sequence are accepted, given the uniform draws ``uniforms``.

    ``draft_token_ids``: LongTensor [k] (``-1``: no draft); ``draft_probs``: [k, V] (``q_i`` in
    row ``i``) or None (one-hot ``q``); ``target_probs``: [k + 1, V] (only rows 0..k-1 are
    read here); ``uniforms``: [k] floats in [0, 1).

    Walk ``i = 0, 1, ...``: draft ``d_i`` is accepted iff ``uniforms[i] * q_i(d_i) < p_i(d_i)``
    (that is ``u < p/q`` without dividing; ``q_i(d_i) = 1`` when ``draft_probs`` is None). Stop
    at the first rejection or ``-1``: later drafts don't count even if they would pass.

    Graded: ``kvlab grade ch07`` (task ``accept``).
    """
    raise NotImplementedError("num_accepted: for each draft in order, stop at -1 or when "
                              "uniforms[i] * q_i(d_i) >= p_i(d_i); count the ones before")


# -- task residual ---------------------------------------------------------------------------
def residual_distribution(target_probs, draft_probs) -> torch.Tensor:
    """The distribution of the replacement token after a rejection: ``max(0, p - q)``, normalised.

    ``target_probs`` ``p`` and ``draft_probs`` ``q``: [V] float tensors (probabilities); don't
    change them. Returns a new [V] float tensor summing to 1. If ``max(0, p - q)`` sums to 0
    (``q`` equals ``p``: a rejection then happens only by rounding), return ``p`` itself.

    Graded: ``kvlab grade ch07`` (task ``residual``).
    """
    raise NotImplementedError("residual_distribution: (p - q).clamp(min=0), divided by its sum; p if the sum is 0")


# -- task rejection_sample -------------------------------------------------------------------
def rejection_sample(draft_token_ids, draft_probs, target_probs, generator=None) -> torch.Tensor:
    """The tokens one speculative step emits, per sequence: the accepted drafts, one more token, then -1.

    ``draft_token_ids``: LongTensor [B, k] (``-1`` pads rows with fewer drafts);
    ``draft_probs``: [B, k, V] or None (deterministic drafts: one-hot ``q``);
    ``target_probs``: [B, k + 1, V]; ``generator``: None (torch's global RNG), one
    ``torch.Generator`` for all rows, or a list of one generator (or None) per row. Returns a
    LongTensor [B, k + 1]; row ``b`` is:

    * the ``a`` accepted drafts (``num_accepted`` with ``k`` uniforms drawn with the row's
      generator, ``torch.rand(k, generator=g)``);
    * then one token drawn (``torch.multinomial(dist, 1, generator=g)``) from
      ``dist = residual_distribution(p_a, q_a)`` if ``a < k`` (``q_a`` one-hot at ``d_a`` when
      ``draft_probs`` is None; all zeros where ``d_a`` is ``-1``: the replacement is drawn
      from ``p_a``), or from ``p_k`` if all ``k`` were accepted (the *bonus* token);
    * then ``-1`` up to ``k + 1`` entries.

    A row with its own generator must draw only from it, so its tokens don't depend on the
    other rows (per-request seeds). Every emitted token is then distributed exactly as the
    target would draw it alone; when ``q = p`` every draft is accepted.

    Graded: ``kvlab grade ch07`` (task ``rejection_sample``, by chi-square tests, and in the engine).
    """
    raise NotImplementedError("rejection_sample: per row, a = num_accepted(...); then draw from "
                              "residual_distribution(p[a], q[a]) (a < k) or p[k]; pad with -1")


# -- task ngram ------------------------------------------------------------------------------
def propose_ngram(token_ids, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                  prompt_lookup_max: int = 4) -> list[int]:
    """Drafts for a sequence from its own tokens (prompt lookup): a list of at most
    ``num_speculative_tokens`` ints.

    ``token_ids``: the sequence so far (a list of ints: prompt and output). For ``n`` from
    ``min(prompt_lookup_max, len(token_ids) - 1)`` down to ``prompt_lookup_min`` (the longest
    first): look for the last ``n`` tokens earlier in the sequence, as a window that ends
    before the last token. If found, take its *most recent* occurrence and return the tokens
    that followed it, up to ``num_speculative_tokens`` of them (fewer if the sequence ends
    first). If no ``n`` matches, return ``[]``.

    Example: ``[1, 2, 9, 1, 2, 8, 1, 2]``, k = 2: ``[1, 2]`` occurs at 0 and 3; the most recent
    is followed by ``[8, 1]``.

    Graded: ``kvlab grade ch07`` (task ``ngram``, against kvlab's ``propose_ngram`` and in the engine).
    """
    raise NotImplementedError("propose_ngram: for n from the longest down, find the last window "
                              "tokens[i:i + n] == tokens[-n:] with i + n < len(tokens); return what follows")


# -- task rollback ---------------------------------------------------------------------------
def truncate(pool: BlockPool, seq_id, num_tokens: int) -> list[int]:
    """Cut ``seq_id`` back to its first ``num_tokens`` tokens, like ``BlockPool.truncate``;
    return the blocks nobody holds any more.

    Verification wrote K/V for every draft; the rejected ones' slots are given back here. Work on
    the pool's state (don't call ``pool.truncate``, ``pool.free`` or ``pool._release``):

    * errors, checked in this order and before anything changes: ``UnknownSequenceError`` if
      ``seq_id`` is not in ``pool.block_tables``; TypeError/ValueError for a count that is not
      an int >= 0 (``check_count("num_tokens", num_tokens)``); ValueError if ``num_tokens`` is
      more than the sequence's length (``pool.seq_lens``); with prefix caching
      (``pool.enable_prefix_caching``), ValueError if ``num_tokens`` is less than
      ``len(pool.seq_hashes[seq_id]) * pool.block_size``: those blocks are registered in the
      prefix cache under hashes of their tokens, and cutting into them would break the promise;
    * keep the first ``blocks_needed(num_tokens, block_size)`` blocks of the table (a partly
      filled last block stays) and drop the rest; set the length to ``num_tokens``; with prefix
      caching, also cut ``pool.seq_tokens[seq_id]`` to ``num_tokens`` tokens;
    * release the dropped blocks as ``free`` does: each loses one reference
      (``pool.ref_counts``; a block another sequence shares after ``fork`` keeps its other
      holder); those reaching 0 are released, returned in table order. A released block with
      a hash (``pool.block_hashes[b] is not None``) stays cached: add it to the end of
      ``pool.evictable`` (an OrderedDict, ``block -> None``), last block first. The others go to
      the right of ``pool.free_blocks``, in table order. Drop from ``pool.pending_copies`` the
      ``(src, dst)`` pairs whose ``dst`` was released (a copy-on-write into a block given back).

    Graded: ``kvlab grade ch07`` (task ``rollback``, against ``BlockPool.truncate`` and in the engine).
    """
    raise NotImplementedError("truncate: check, keep blocks_needed(num_tokens, block_size) blocks, "
                              "ref_counts -= 1 on the dropped ones; released blocks go to evictable or free_blocks")


# Given: kvlab's pool and n-gram proposer calling your truncate and propose_ngram, and
# use_my_pieces(llm, pieces=PIECES), which serves a speculative LLM with your pieces.
PoolWithMyRollback = pool_with_truncate(truncate)
MyNgramProposer = ngram_proposer_with(propose_ngram)
use_my_pieces = my_pieces_user(rejection_sample, MyNgramProposer, PoolWithMyRollback)
