"""Chapter 3, given: a ``BlockPool`` that runs your ``fork`` and copy-on-write ``append``."""
from kvlab.paging import BlockPool


def pool_with_fork_and_append(fork, append_with_copy_on_write) -> type[BlockPool]:
    """The class ``MyBlockPool``: kvlab's ``BlockPool`` with ``fork`` and ``append`` replaced."""

    class MyBlockPool(BlockPool):
        """kvlab's ``BlockPool`` with ``fork`` and ``append`` replaced by yours (given, not a task).

        Plug it into the chapter's parallel sampling and beam search:
        ``kvlab.workloads.beam_search.beam_search(MyBlockPool(64, 4), prompt_len=6, beam_width=4, steps=8)``.
        """

        def fork(self, parent, child) -> list[int]:
            return fork(self, parent, child)

        def append(self, seq_id, num_tokens: int = 1, token_ids=None) -> list[int]:
            return append_with_copy_on_write(self, seq_id, num_tokens)

    MyBlockPool.__qualname__ = "MyBlockPool"
    return MyBlockPool
