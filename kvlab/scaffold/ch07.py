"""Chapter 7, given: the engine's pool and n-gram proposer with your functions plugged in, and
``use_my_pieces(llm)``, which serves a speculative ``LLM`` with them."""
from kvlab.engine.rejection_sampler import rejection_sample as kvlab_rejection_sample
from kvlab.engine.spec_decode import NgramProposer
from kvlab.paging import BlockPool
from kvlab.scaffold import check_pieces

PIECES = ("rejection_sample", "propose_ngram", "truncate")


def pool_with_truncate(truncate) -> type[BlockPool]:
    """The class ``PoolWithMyRollback``: kvlab's ``BlockPool`` whose ``truncate`` is yours."""

    class PoolWithMyRollback(BlockPool):
        """kvlab's ``BlockPool`` with your ``truncate`` (the rollback of rejected drafts) plugged in (given)."""

        def truncate(self, seq_id, num_tokens: int) -> list[int]:
            return truncate(self, seq_id, num_tokens)

    PoolWithMyRollback.__qualname__ = "PoolWithMyRollback"
    return PoolWithMyRollback


def ngram_proposer_with(propose_ngram) -> type[NgramProposer]:
    """The class ``MyNgramProposer``: the engine's n-gram proposer calling your ``propose_ngram``."""

    class MyNgramProposer(NgramProposer):
        """The engine's ``NgramProposer`` with your ``propose_ngram`` plugged in (given)."""

        def propose(self, seqs, room: list[int]):
            c = self.config
            drafts = [propose_ngram(list(s.token_ids), min(r, c.num_speculative_tokens), c.prompt_lookup_min,
                                    c.prompt_lookup_max) if r else [] for s, r in zip(seqs, room)]
            return [[int(t) for t in d] for d in drafts], None

    MyNgramProposer.__qualname__ = "MyNgramProposer"
    return MyNgramProposer


def my_pieces_user(rejection_sample, proposer_class, pool_class):
    """The function ``use_my_pieces``, bound to one implementation's pieces."""

    def use_my_pieces(llm, pieces=PIECES):
        """Serve ``llm`` with your ``pieces`` (a subset of ``PIECES``); the others are kvlab's own.

        ``llm`` must have an n-gram ``speculative_config`` and no request queued (the pool is
        replaced): ``rejection_sample`` becomes ``llm.rejection_sampler``, ``propose_ngram``
        runs in ``llm.proposer``, and ``truncate`` in a fresh pool (``llm.use_pool``).
        Returns ``llm``.
        """
        check_pieces(pieces, PIECES)
        spec = llm.engine_config.speculative_config
        if spec is None or spec.method != "ngram":
            raise ValueError("use_my_pieces needs an LLM with speculative_config={'method': 'ngram', ...}")
        llm.rejection_sampler = rejection_sample if "rejection_sample" in pieces else kvlab_rejection_sample
        llm.proposer = (proposer_class if "propose_ngram" in pieces else NgramProposer)(spec)
        pool = pool_class if "truncate" in pieces else BlockPool
        llm.use_pool(pool(llm.pool.num_blocks, llm.pool.block_size, llm.pool.enable_prefix_caching))
        return llm

    return use_my_pieces
