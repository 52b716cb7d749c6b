"""Chapter 2's pieces in the real engine: ``use_my_pieces(llm)`` (kvlab/scaffold/ch02.py).

The reference answers (``solutions/ch02.py``) plugged into ``kvlab.LLM`` must give the engine's
own greedy tokens, and the engine must really run them: every block booked by the pool class,
every step's slots from the slot mapping, every layer of every step written by the kernel (in
Triton's interpreter on a CPU). A broken piece must change the text, so a pass means the pieces
did the work. Stubs leave the engine its own pieces, as the notebook's cell relies on.
"""
from collections import Counter

import pytest
from helpers import one_thread  # noqa: F401  (fixture)

from kvlab import LLM, SamplingParams
from kvlab.grading import load_chapter
from kvlab.scaffold.ch02 import PIECES, my_pieces_user

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "for i in range(10):\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
# 16 blocks of 8 slots hold all three sequences at once: no preemption, so each is allocated once
ENGINE = dict(num_gpu_blocks=16, block_size=8, max_num_seqs=4, max_model_len=256, enforce_eager=True)


def serve(llm) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not [o.error for o in outputs if o.error], [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def solutions():
    return load_chapter("ch02", "solutions")


@pytest.fixture(scope="module")
def engine_tokens(one_thread):  # noqa: F811
    return serve(LLM(**ENGINE))


def counted(solutions, calls: Counter):
    """The reference pieces, each counting its calls."""

    class CountingPool(solutions.BlockPool):
        def allocate(self, seq_id, num_tokens):
            calls["allocate"] += 1
            return super().allocate(seq_id, num_tokens)

        def append(self, seq_id, num_tokens=1):
            calls["append"] += 1
            return super().append(seq_id, num_tokens)

        def free(self, seq_id):
            calls["free"] += 1
            return super().free(seq_id)

    def slot_mapping(*args):
        calls["slot_mapping"] += 1
        return solutions.slot_mapping(*args)

    def write_kv(*args):
        calls["write_kv"] += 1
        return solutions.write_kv(*args)

    return CountingPool, slot_mapping, write_kv


def test_the_reference_pieces_run_the_engine_token_for_token(solutions, engine_tokens):
    calls = Counter()
    pool_class, slot_mapping, write_kv = counted(solutions, calls)
    llm = LLM(**ENGINE)
    assert my_pieces_user(pool_class, slot_mapping, write_kv)(llm) == list(PIECES)
    calls.clear()                                   # forget the calls that found the pieces written
    assert serve(llm) == engine_tokens
    assert isinstance(llm.pool, pool_class) and type(llm.model_runner).__name__ == "RunnerWithMyPieces"
    assert llm.pool.num_free_blocks == llm.pool.num_blocks, "blocks are still held after every request finished"
    steps, layers = llm.scheduler.num_steps, llm.config.num_layers
    assert calls["allocate"] == calls["free"] == len(PROMPTS)
    assert calls["append"] >= GREEDY.max_tokens - 1
    assert calls["slot_mapping"] >= steps          # once per scheduled sequence of each step
    assert calls["write_kv"] == steps * layers     # every layer of every step


def test_the_solutions_module_binds_use_my_pieces(solutions, engine_tokens):
    llm = LLM(**ENGINE)
    assert solutions.use_my_pieces(llm, ["block_pool"]) == ["block_pool"]
    assert isinstance(llm.pool, solutions.BlockPool) and type(llm.model_runner).__name__ == "ModelRunner"
    assert serve(llm) == engine_tokens


def test_a_kernel_that_writes_nothing_changes_the_text(solutions, engine_tokens):
    """The engine's own write does not cover for the learner's: their slots are wiped first."""
    llm = LLM(**ENGINE)
    use = my_pieces_user(solutions.BlockPool, solutions.slot_mapping, lambda *args: None)
    assert use(llm, ["write_kv_kernel"]) == ["write_kv_kernel"]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got != engine_tokens


def test_a_wrong_slot_mapping_changes_the_text(solutions, engine_tokens):
    def mirrored(table, start, num_tokens, block_size):   # each block's slots in reverse order
        return [table[p // block_size] * block_size + block_size - 1 - p % block_size
                for p in range(start, start + num_tokens)]

    llm = LLM(**ENGINE)
    my_pieces_user(solutions.BlockPool, mirrored, solutions.write_kv)(llm, ["slot_mapping"])
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got != engine_tokens


def test_same_outputs_names_the_error_or_the_first_difference(solutions, capsys):
    """The notebooks' verdict: a piece that raises inside the engine fails its step, and the
    error is printed; a piece that runs but is wrong is shown at its first different token."""
    from kvlab.scaffold import same_outputs

    want = LLM(**ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)

    def broken(table, start, num_tokens, block_size):
        raise IndexError("my slot_mapping is off by one")

    llm = LLM(**ENGINE)
    my_pieces_user(solutions.BlockPool, broken, solutions.write_kv)(llm, ["slot_mapping"])
    assert not same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want)
    printed = capsys.readouterr().out
    assert printed.count("IndexError: my slot_mapping is off by one") == 1   # each error once
    assert same_outputs(want, want) and capsys.readouterr().out == ""
    other = LLM(**ENGINE).generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=8), use_tqdm=False)
    assert not same_outputs(other, want)
    assert "request 0, sample 0 differs first at token" in capsys.readouterr().out


def test_stubs_leave_the_engine_its_own_pieces():
    llm = LLM(**ENGINE)
    pool, runner = llm.pool, llm.model_runner
    assert load_chapter("ch02", "exercises").use_my_pieces(llm) == []
    assert llm.pool is pool and llm.model_runner is runner


def test_refuses_what_chapter_2s_pool_cannot_do(solutions):
    for settings in ({"enable_prefix_caching": True},
                     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}):
        with pytest.raises(ValueError, match="enable_prefix_caching=False"):
            solutions.use_my_pieces(LLM(**ENGINE, **settings))
    with pytest.raises(ValueError, match="pieces must be a collection of names among"):
        solutions.use_my_pieces(LLM(**ENGINE), ["fork"])
