"""Chapter 3, given: a ``BlockPool`` that runs your ``fork`` and copy-on-write ``append``, and
``use_my_pieces(llm)``, which serves an ``LLM`` from it (parallel sampling forks every request's samples)."""
from kvlab.paging import BlockPool
from kvlab.scaffold import check_pieces, is_written

PIECES = ("fork", "append_with_copy_on_write")


def pool_with_fork_and_append(fork, append_with_copy_on_write) -> type[BlockPool]:
    """The class ``MyBlockPool``: kvlab's ``BlockPool`` with ``fork`` and ``append`` replaced."""

    class MyBlockPool(BlockPool):
        """kvlab's ``BlockPool`` with ``fork`` and ``append`` replaced by yours (given, not a task).

        Plug it into the chapter's parallel sampling and beam search:
        ``kvlab.workloads.beam_search.beam_search(MyBlockPool(64, 4), prompt_len=6, beam_width=4, steps=8)``.
        It keeps no prefix-cache state: use it without prefix caching.
        """

        def fork(self, parent, child) -> list[int]:
            return fork(self, parent, child)

        def append(self, seq_id, num_tokens: int = 1, token_ids=None, cache: bool = True) -> list[int]:
            return append_with_copy_on_write(self, seq_id, num_tokens)

    MyBlockPool.__qualname__ = "MyBlockPool"
    return MyBlockPool


def _probe_fork(fork) -> None:
    pool = BlockPool(4, 2)
    pool.allocate(0, 3)
    fork(pool, 0, 1)


def _probe_append(append_with_copy_on_write) -> None:
    pool = BlockPool(4, 2)
    pool.allocate(0, 3)
    pool.fork(0, 1)
    append_with_copy_on_write(pool, 1, 1)


def my_pieces_user(fork, append_with_copy_on_write):
    """The function ``use_my_pieces``, bound to one implementation's pieces."""
    mine = {"fork": (fork, BlockPool.fork, _probe_fork),
            "append_with_copy_on_write": (append_with_copy_on_write, BlockPool.append, _probe_append)}

    def use_my_pieces(llm, pieces=None) -> list[str]:
        """Serve ``llm`` from a ``MyBlockPool`` running your ``pieces``; returns those it runs.

        ``pieces``: a subset of ``PIECES``; by default every one you have written (one that
        still raises ``NotImplementedError`` stays kvlab's). ``llm`` must have prefix caching
        off (your functions keep no prefix-cache state) and no request queued: its pool is
        replaced by a fresh one of the same size (``llm.use_pool``).
        """
        if pieces is None:
            pieces = [name for name, (piece, _, probe) in mine.items() if is_written(lambda: probe(piece))]
        check_pieces(pieces, PIECES)
        if llm.pool.enable_prefix_caching:
            raise ValueError("use_my_pieces needs an LLM with enable_prefix_caching=False: "
                             "your fork and append keep no prefix-cache state")
        chosen = {name: (piece if name in pieces else kvlab_piece) for name, (piece, kvlab_piece, _) in mine.items()}
        pool_class = pool_with_fork_and_append(chosen["fork"], chosen["append_with_copy_on_write"])
        llm.use_pool(pool_class(llm.pool.num_blocks, llm.pool.block_size))
        return [name for name in PIECES if name in pieces]

    return use_my_pieces
