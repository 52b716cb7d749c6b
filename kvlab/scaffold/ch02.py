"""Chapter 2, given: the block pool's state, the launcher of the write-KV kernel, and
``use_my_pieces(llm)``, which serves an ``LLM`` with your pool, slot mapping and kernel."""
from collections import deque

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import triton

from kvlab.errors import UnknownSequenceError
from kvlab.scaffold import check_pieces, is_written


class BlockPoolState:
    """The state of ``BlockPool`` and its given methods; the tasks are ``allocate``, ``append``, ``free``.

    ``free_blocks`` holds the ids of free blocks (take from the left, return to the right);
    ``block_tables[seq_id]`` lists a sequence's physical blocks in order; ``seq_lens[seq_id]``
    counts its tokens.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = deque(range(num_blocks))
        self.block_tables: dict = {}
        self.seq_lens: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def block_table(self, seq_id) -> list[int]:
        if seq_id not in self.block_tables:
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r}")
        return list(self.block_tables[seq_id])


def write_kv_with(write_kv_kernel):
    """``write_kv(key, value, k_cache, v_cache, slot_mapping)``, launching ``write_kv_kernel``."""

    def write_kv(key, value, k_cache, v_cache, slot_mapping):
        """Launch the kernel: key/value [num_tokens, num_kv_heads, head_dim] into the caches."""
        num_tokens, row = key.shape[0], key.shape[1] * key.shape[2]
        block = min(triton.next_power_of_2(row), 2048)
        grid = (num_tokens, triton.cdiv(row, block))
        write_kv_kernel[grid](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                              ROW=row, BLOCK=block)

    return write_kv


# -- your pieces in the engine ------------------------------------------------------------------
PIECES = ("block_pool", "slot_mapping", "write_kv_kernel")


def engine_pool_on(block_pool_class):
    """The class ``EnginePoolOnMyAllocator``: your ``BlockPool``, answering the rest of what the
    engine's scheduler asks a pool as a pool without sharing or prefix caching does."""

    class EnginePoolOnMyAllocator(block_pool_class):
        """Your ``allocate``, ``append`` and ``free`` book every block the engine uses (given).

        The engine passes each sequence's tokens along (a prefix-caching pool hashes them);
        without prefix caching nothing needs them and nothing is ever found cached. Sharing
        blocks (``n > 1`` samples, chapter 3) and rolling drafts back (chapter 7) are not here."""

        enable_prefix_caching = False

        def __init__(self, num_blocks: int, block_size: int = 16):
            super().__init__(num_blocks, block_size)
            self.num_cached_tokens = {}          # prompt tokens found in the prefix cache: none

        def allocate(self, seq_id, num_tokens, token_ids=None, salt=None, cache=True):
            return super().allocate(seq_id, num_tokens)

        def append(self, seq_id, num_tokens=1, token_ids=None, cache=True):
            return super().append(seq_id, num_tokens)

        def __contains__(self, seq_id) -> bool:
            return seq_id in self.block_tables

        @property
        def num_used_blocks(self) -> int:
            return self.num_blocks - self.num_free_blocks

        def seq_len(self, seq_id) -> int:
            self.block_table(seq_id)             # raises for an unknown id
            return self.seq_lens[seq_id]

        def can_append(self, seq_id, num_tokens: int = 1) -> bool:
            needed = -(-(self.seq_len(seq_id) + num_tokens) // self.block_size) - len(self.block_tables[seq_id])
            return needed <= self.num_free_blocks

        def computed_blocks(self, token_ids, salt=None) -> list[int]:
            return []                            # no prefix cache, no hit

        def cache_blocks(self, seq_id, num_computed_tokens: int) -> None:
            pass                                 # no prefix cache, nothing to register

        def take_copies(self) -> list[tuple[int, int]]:
            return []                            # no sharing, no copy-on-write

        def reset_prefix_cache(self) -> bool:
            return self.num_used_blocks == 0

        def fork(self, parent, child):
            raise NotImplementedError("this pool shares no blocks: n > 1 samples need chapter 3's fork")

        def truncate(self, seq_id, num_tokens):
            raise NotImplementedError("this pool has no rollback: speculative decoding needs chapter 7's")

    EnginePoolOnMyAllocator.__qualname__ = "EnginePoolOnMyAllocator"
    return EnginePoolOnMyAllocator


def runner_with(slot_mapping=None, write_kv=None):
    """The class ``RunnerWithMyPieces``: the engine's ``ModelRunner`` whose steps take their slots
    from your ``slot_mapping`` and write every layer's new K/V with your ``write_kv`` (None: the
    engine's own)."""
    import torch

    from kvlab.engine.model_runner import ModelRunner
    from kvlab.models.context import build_attention_context

    class RunnerWithMyPieces(ModelRunner):
        """kvlab's ``ModelRunner`` with your slot mapping and your K/V write in every step (given).

        Each layer of the model computes the step's new K and V, has the engine write them at
        the step's slots, then attends through the block tables. With your ``write_kv`` the
        attention is wrapped: it first wipes those slots (NaN) and lets your kernel write them
        again, so every key and value the model attends to is one your kernel wrote; a row it
        misses stays NaN and the text falls apart. Steps run eagerly (a CUDA graph would replay
        the engine's own step)."""

        def forward(self, ids, positions, tables, starts, query_lens, slots):
            if slot_mapping is not None:          # yours, in place of the engine's `slots`
                slots = [s for table, start, n in zip(tables, starts, query_lens)
                         for s in slot_mapping(table, start, n, self.block_size)]
            if write_kv is None:
                return super().forward(ids, positions, tables, starts, query_lens, slots)
            where = torch.tensor(slots, dtype=torch.int64, device=self.device)
            engine_attention = self.backend

            def write_then_attend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *,
                                  k_new, v_new):
                for cache in (k_cache, v_cache):  # forget what the engine's own write put there
                    cache.view(-1, *cache.shape[2:])[where] = float("nan")
                write_kv(k_new, v_new, k_cache, v_cache, where)     # your kernel: this layer's new K/V
                return engine_attention(q, k_cache, v_cache, sm_scale, ctx, k_new=k_new, v_new=v_new)

            ctx = build_attention_context(self.kv_cache, tables, starts, query_lens, slots,
                                          backend=write_then_attend)
            as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
            return self.model(as_tensor(ids), as_tensor(positions), ctx)

    RunnerWithMyPieces.__qualname__ = "RunnerWithMyPieces"
    return RunnerWithMyPieces


def my_pieces_user(block_pool_class, slot_mapping, write_kv):
    """The function ``use_my_pieces``, bound to one implementation's pieces."""

    def probe_kernel():
        import torch

        from kvlab.profile import DEVICE

        row = torch.zeros(1, 1, 2, device=DEVICE)
        write_kv(row, row, torch.zeros(1, 2, 1, 2, device=DEVICE), torch.zeros(1, 2, 1, 2, device=DEVICE),
                 torch.zeros(1, dtype=torch.int64, device=DEVICE))

    probes = {"block_pool": lambda: block_pool_class(4, 2).allocate("s", 3),
              "slot_mapping": lambda: slot_mapping([0], 0, 1, 2),
              "write_kv_kernel": probe_kernel}

    def use_my_pieces(llm, pieces=None) -> list[str]:
        """Serve ``llm`` with your ``pieces``; returns those it runs (the others stay kvlab's).

        ``pieces``: a subset of ``PIECES``; by default every one you have written (one that still
        raises ``NotImplementedError`` stays kvlab's). ``block_pool``: a pool of your class books
        every block (``llm.use_pool``); ``slot_mapping``: each step's slots come from your
        function; ``write_kv_kernel``: your kernel writes every layer's new K/V (in Triton's
        interpreter on a CPU: keep the cache and the generation small). ``llm`` must have prefix
        caching and speculative decoding off and no request queued.
        """
        if pieces is None:
            pieces = [name for name, probe in probes.items() if is_written(probe)]
        check_pieces(pieces, PIECES)
        if llm.has_unfinished_requests():
            raise RuntimeError("use_my_pieces: the pool and the runner can only be replaced while no request is queued")
        c = llm.engine_config
        if c.enable_prefix_caching or c.speculative_config is not None:
            raise ValueError("use_my_pieces needs an LLM with enable_prefix_caching=False and no speculative_config: "
                             "chapter 2's pool has no prefix cache and no rollback")
        if "slot_mapping" in pieces or "write_kv_kernel" in pieces:
            r = llm.model_runner
            settings = dict(block_size=r.block_size, num_gpu_blocks=r.num_blocks, max_model_len=r.max_model_len,
                            attention_backend=r.backend, enforce_eager=True)
            llm.model_runner = r = None           # the old cache goes before the new one is made
            runner = runner_with(slot_mapping if "slot_mapping" in pieces else None,
                                 write_kv if "write_kv_kernel" in pieces else None)
            llm.model_runner = runner(llm.model, **settings)
        if "block_pool" in pieces:
            llm.use_pool(engine_pool_on(block_pool_class)(llm.model_runner.num_blocks, c.block_size))
        return [name for name in PIECES if name in pieces]

    return use_my_pieces
