"""Chapter 3 exercises: fork, copy-on-write, and the blocks that sharing saves.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch03                                 # in a terminal
    kvlab.check("ch03")                              # in the notebook
    pytest tests/graded -m ch03 --impl=exercises     # the same tests, raw

Tasks: ``fork`` (fork), ``copy_on_write`` (append_with_copy_on_write), ``sharing_blocks``
(parallel_sampling_blocks). Stuck? ``kvlab.use_solution("ch03")`` swaps in the answer and keeps
yours as ``exercises/ch03_mine.py``.

``fork`` and ``append_with_copy_on_write`` work on a kvlab ``BlockPool`` (without prefix
caching) through its state, the same attributes the pool's own methods use:

* ``pool.block_tables[seq_id]``: the list of physical blocks of a sequence, in order;
* ``pool.seq_lens[seq_id]``: its number of tokens;
* ``pool.ref_counts[block]``: how many sequences hold ``block`` (0: free);
* ``pool.free_blocks``: the free queue (a deque; take from the left);
* ``pool.pending_copies``: ``(src, dst)`` block pairs that copy-on-write has recorded and
  ``copy_blocks`` will copy.

They are graded against ``BlockPool.fork`` and ``BlockPool.append`` on random workloads: the
state after every call, the returned blocks and the exception types must match. Don't call
``pool.fork`` or ``pool.append`` from them: the grader's pool refuses.
"""
from kvlab.errors import OutOfBlocksError, UnknownSequenceError  # noqa: F401  (you will raise these)
from kvlab.paging import BlockPool, blocks_needed  # noqa: F401  (blocks_needed(n, bs) = ceil(n / bs))
from kvlab.paging.block_pool import check_count  # noqa: F401  (TypeError/ValueError for a bad count)
# Given (not a task), shared with solutions/ch03.py: read kvlab/scaffold/ch03.py.
from kvlab.scaffold.ch03 import PIECES, my_pieces_user, pool_with_fork_and_append  # noqa: F401


# -- task fork -------------------------------------------------------------------------------
def fork(pool, parent, child) -> list[int]:
    """Make ``child`` a new sequence that shares every block of ``parent``; return its table.

    * every block of the parent gains a holder: its reference count goes up by one;
    * the child gets its *own* list with the same block ids (appending to one sequence must
      not grow the other) and the parent's length;
    * errors, checked in this order and before anything changes: ``UnknownSequenceError`` if
      ``parent`` is not in the pool, ``ValueError`` if ``child`` already is.
    """
    raise NotImplementedError("fork: copy the parent's table and length to the child, and add one "
                              "to the reference count of each of its blocks")


# -- task copy_on_write ----------------------------------------------------------------------
def append_with_copy_on_write(pool, seq_id, num_tokens: int = 1) -> list[int]:
    """Grow ``seq_id`` by ``num_tokens`` slots, like ``BlockPool.append``; return the blocks taken.

    * Copy-on-write: if ``num_tokens > 0`` and the last block is partly filled
      (``seq_len % block_size != 0``) and shared (reference count > 1), the new tokens must not
      land in it. Take a free block, put it in place of the last one in the table, drop one
      reference to the old block, and record ``(old, new)`` in ``pool.pending_copies``. The
      step runs its copies all at once: if ``old`` is itself the destination of a copy still
      pending (its data is not there yet), record that copy's source instead of ``old``.
    * Then take blocks for the growth as in chapter 2: only when the last block is full.
    * Return the copy's block first (if any), then the new blocks, in the order taken.
    * ``pool._take_free_block()`` pops the left of the free queue and sets its reference
      count to 1; it does not check that a block is free: count first.
    * Errors, before anything changes, in this order: TypeError/ValueError for a count that is
      not an int >= 0 (``check_count`` raises those), ``UnknownSequenceError``, ValueError if
      the new length exceeds the pool (``num_blocks * block_size`` slots), and
      ``OutOfBlocksError`` if fewer blocks are free than needed (the copy needs one too).
    """
    raise NotImplementedError("append_with_copy_on_write: is the last block partly filled and shared? "
                              "Then swap in a private block and record (old, new) in pool.pending_copies")


# -- task sharing_blocks ---------------------------------------------------------------------
def parallel_sampling_blocks(prompt_len: int, gen_len: int, n: int, block_size: int) -> tuple[int, int]:
    """Blocks in use when ``n`` samples of one prompt have generated ``gen_len >= 1`` tokens each.

    Returns ``(with_sharing, without_sharing)``. With sharing, as
    ``kvlab.workloads.beam_search.parallel_sampling`` runs it: sample 0 holds the ``prompt_len >= 1``
    prompt tokens, samples 1..n-1 fork it, then each sample appends one token per step.
    Without sharing: ``n`` independent sequences, each with its own copy of the prompt.
    Think about the prompt's last block when it is only partly filled.
    """
    raise NotImplementedError("parallel_sampling_blocks: which prompt blocks stay shared, and how many "
                              "blocks does each sample end up holding alone?")


# Given: kvlab's BlockPool with fork and append replaced by yours. Plug it into the chapter's
# beam search: kvlab.workloads.beam_search.beam_search(MyBlockPool(64, 4), prompt_len=6, beam_width=4, steps=8).
MyBlockPool = pool_with_fork_and_append(fork, append_with_copy_on_write)

# Given: use_my_pieces(llm) serves an LLM from a pool running your fork and append (the
# engine forks the n samples of a request); returns which of your pieces it runs.
use_my_pieces = my_pieces_user(fork, append_with_copy_on_write)
