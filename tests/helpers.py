"""Small helpers shared by several test files (imported as ``from helpers import ...``)."""
from __future__ import annotations

import torch
from hypothesis import event
from hypothesis import strategies as st

import kvlab
from kvlab.reference import copy_blocks_ref, write_kv_ref


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in a blink on a few lines of code (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(self):\n    return self.x\n", "import os\nfor i in range(10):\n"] * 4,
                            trainer=trainer)
    return tok


def attempt_unchanged(pool, snapshot, call, expected_exc=None, match=None):
    """Run ``call``; if it raises, check it was expected and left ``snapshot(pool)`` unchanged.

    Returns ``(exception, None)`` or ``(None, result)``.
    """
    before = snapshot(pool)
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - any failure must leave the pool unchanged
        assert snapshot(pool) == before, f"{type(exc).__name__} changed the pool"
        assert expected_exc is not None, f"unexpected {type(exc).__name__}: {exc}"
        assert isinstance(exc, expected_exc), (exc, expected_exc)
        if match is not None:
            assert match in str(exc), (match, str(exc))
        return exc, None
    assert expected_exc is None, f"expected {expected_exc.__name__}, got result {result!r}"
    return None, result


# -- the block-pool tests (test_sharing, test_prefix_cache) --------------------------------------
def snapshot(pool):
    """Everything a failed BlockPool call must leave alone, in a form that compares by value (order
    included). Prefix caching's bookkeeping is in it too (empty, or all None, without caching)."""
    return (
        list(pool.free_blocks),
        list(pool.evictable),
        [(seq_id, list(table)) for seq_id, table in pool.block_tables.items()],
        list(pool.seq_lens.items()),
        list(pool.ref_counts),
        list(pool.pending_copies),
        list(pool.block_hashes),
        list(pool.cached_blocks.items()),
        [(seq_id, list(tokens)) for seq_id, tokens in pool.seq_tokens.items()],
        list(pool.seq_salts.items()),
        [(seq_id, list(hashes)) for seq_id, hashes in pool.seq_hashes.items()],
        list(pool.num_cached_tokens.items()),
    )


class PoolMachineHelpers:
    """What the block-pool state machines share (mixed into a ``RuleBasedStateMachine``).

    They hold ``self.pool``, ``self.model`` (each live sequence's tokens) and a KV store of token
    ids, ``self.k``/``self.v`` of shape ``[num_blocks, block_size, 1, 1]``: K holds a token's id,
    V its negation, -1 and 1 where nothing was written.
    """

    def new_store(self, num_blocks, block_size):
        shape = (num_blocks, block_size, 1, 1)
        self.k = torch.full(shape, -1, dtype=torch.int64)
        self.v = torch.full(shape, 1, dtype=torch.int64)

    def attempt(self, call, expected_exc=None, match=None):
        """Run ``call``; if it raises, check that nothing changed. Returns (exception, result)."""
        return attempt_unchanged(self.pool, snapshot, call, expected_exc, match)

    def write(self, seq, start, tokens):
        """Write ``tokens`` at positions ``start ..`` of ``seq``, through its slot mapping."""
        slots = torch.tensor(self.pool.slot_mapping(seq, start, len(tokens)), dtype=torch.int64)
        ids = torch.tensor(tokens, dtype=torch.int64).view(-1, 1, 1)
        write_kv_ref(ids, -ids, self.k, self.v, slots)

    def holders(self, block):
        return sum(table.count(block) for table in self.pool.block_tables.values())

    def fork_checked(self, parent, child):
        """``pool.fork(parent, child)``, checked: the expected error with nothing changed, or a child
        that holds every block of its parent (one more holder each) and its tokens. Returns the
        child's table, or None if the fork was refused."""
        if parent not in self.model:
            expected, match = kvlab.UnknownSequenceError, "unknown sequence id"
        elif child in self.model:
            expected, match = ValueError, "already exists"
        else:
            expected, match = None, None
        pool, refs_before = self.pool, list(self.pool.ref_counts)
        exc, table = self.attempt(lambda: pool.fork(parent, child), expected, match)
        event(f"fork: {type(exc).__name__ if exc else 'ok'}")
        if exc is not None:
            return None
        assert table == pool.block_table(parent) == pool.block_table(child)   # right after fork: equal
        assert pool.seq_len(child) == pool.seq_len(parent)
        for block in range(pool.num_blocks):
            assert pool.ref_counts[block] == refs_before[block] + table.count(block)
        self.model[child] = list(self.model[parent])
        return table

    def copy_then_write(self, seq, copies, tokens):
        """The engine's order after an append: the copy-on-write copies first, then the new tokens."""
        copy_blocks_ref([self.k, self.v], torch.tensor(copies, dtype=torch.int64).view(-1, 2))
        self.write(seq, len(self.model[seq]), tokens)
        self.model[seq] += tokens

    def draw_n(self, data, seq):
        """Mostly a count that fits the pool's capacity, sometimes one that does not."""
        bs, room = self.pool.block_size, self.pool.capacity - len(self.model[seq])
        sizes = st.sampled_from([*range(1, min(2 * bs + 1, room) + 1), 0])
        if room < 2 * bs + 1:
            sizes = sizes | st.integers(room + 1, room + 3)
        return data.draw(sizes, label="n")
