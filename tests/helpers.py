"""Small helpers shared by several test files (imported as ``from helpers import ...``)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st

import kvlab
from kvlab.errors import OutOfBlocksError, UnknownSequenceError
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


# -- the graded pool tests (graded test_ch03, test_ch04) -------------------------------------------
def first_difference(got: dict, want: dict) -> str:
    """The first entry of ``want`` (a pool's state) that ``got`` differs in, in words; "" if none."""
    for key in want:
        if got[key] != want[key]:
            return f"{key}: got {got[key]}, expected {want[key]}"
    return ""


def outcome(op, *args):
    """(result, None) or (None, exception type) of calling op."""
    try:
        return op(*args), None
    except (OutOfBlocksError, UnknownSequenceError, ValueError, TypeError) as e:
        return None, type(e)


# -- block tables (graded test_ch02, test_ch06) -----------------------------------------------------
def random_span(rng, block_sizes, num_ids, max_blocks):
    """A random ``(block_table, block_size, start, end)``: 1 to ``max_blocks`` distinct block ids
    below ``num_ids``, one of ``block_sizes``, and ``0 <= start <= end <=`` the table's slots."""
    block_size = rng.choice(block_sizes)
    table = rng.sample(range(num_ids), rng.randint(1, max_blocks))
    start = rng.randint(0, len(table) * block_size)
    return table, block_size, start, rng.randint(start, len(table) * block_size)


# -- FlashAttention's causal tiles (test_kernel_plan, graded test_ch05) ---------------------------
def brute_force_bounds(start_m, len_q, len_k, block_m, block_n, causal):
    """``causal_tile_bounds`` by enumerating which keys each real query of the block sees."""
    shift = len_k - len_q
    rows = range(start_m, min(start_m + block_m, len_q))
    sees = [[not causal or key <= row + shift for key in range(len_k)] for row in rows]
    seen_by_all = next((key for key in range(len_k) if not all(r[key] for r in sees)), len_k)
    end = 1 + max(key for r in sees for key in range(len_k) if r[key])
    return seen_by_all // block_n * block_n, end


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


def check_free(pool, seq, released):
    """``pool.free(seq)`` returns ``released`` (the blocks nobody else holds) and appends exactly
    those, in that order, to the free list; ``seq`` is gone."""
    free_before = list(pool.free_blocks)
    assert pool.free(seq) == released
    assert list(pool.free_blocks) == free_before + released
    assert seq not in pool


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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: torch's intra-op threads cost more than they save (much more on 2 cores).
    Import it into a test module (``from helpers import one_thread``) to use it there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def scattered_tables(lens, block_size: int, spare_blocks: int, gen) -> tuple[int, torch.Tensor]:
    """Block tables for sequences of ``lens`` tokens whose pages are scattered over a pool of
    their blocks plus ``spare_blocks``: ``(num_blocks, tables)``, tables int32 on the CPU with one
    unused column."""
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(blocks) + 1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    return num_blocks, tables


def served_tokens(llm, prompts, params) -> list[list[int]]:
    """The token ids ``llm`` generates for ``prompts``, every request finished without an error."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(prompts)
    return [o.outputs[0].token_ids for o in outs]


def closing_loop_fixtures(chapter: str, settings: dict, prompts, params):
    """A chapter's closing-loop fixtures: ``reference`` (the course's engine's tokens for
    ``prompts``) and ``answers`` (``solutions/chNN.py``)."""
    from kvlab import LLM
    from kvlab.grading import load_chapter

    @pytest.fixture(scope="module")
    def reference():
        return served_tokens(LLM(**settings), prompts, params)

    @pytest.fixture(scope="module")
    def answers():
        return load_chapter(chapter, "solutions")

    return reference, answers
