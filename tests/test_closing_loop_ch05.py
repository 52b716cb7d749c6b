"""Chapter 5's closing loop: ``use_my_attention`` serves the engine with an attention backend
built from the chapter's pieces (the given kernel with ``online_softmax_update``,
``causal_tile_bounds``, ``chunked_attention``). With the reference answers it gives the
reference engine's greedy tokens; a piece still a stub stays the course's."""
import types

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (a jit function must see it)

import kvlab  # noqa: F401  (before triton's kernels run: the CPU interpreter without a GPU)
from kvlab import SamplingParams
from kvlab.reference import paged_attention_ref
from kvlab.scaffold import ch05 as given
from helpers import closing_loop_fixtures, one_thread, served_tokens  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n", "class Stack:\n    def push(self, item):"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def stub(*args, **kwargs):
    raise NotImplementedError("not written yet")


@triton.jit
def stub_update(acc, m_i, l_i, s, v):
    raise NotImplementedError("online_softmax_update: not written yet")


STUBS = types.SimpleNamespace(chunked_attention=stub, attention=given.attention_with(stub_update),
                              causal_tile_bounds=stub)


def serve(llm) -> list[list[int]]:
    return served_tokens(llm, PROMPTS, GREEDY)


reference, answers = closing_loop_fixtures("ch05", given.ENGINE_SETTINGS, PROMPTS, GREEDY)


def test_the_backend_equals_the_reference_on_a_paged_step(answers):
    """An extend of 21 new tokens after 16 cached (two query blocks, a causal shift) and a decode,
    pages shuffled, grouped-query heads."""
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, seq_lens, query_lens = 4, 24, [37, 9], [21, 1]
    k_cache, v_cache = (torch.randn(num_blocks, block_size, 2, 16, generator=gen) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen)[:20].reshape(2, 10).int()
    q = torch.randn(sum(query_lens), 4, 16, generator=gen)
    backend = given.attention_backend_with(answers.chunked_attention, answers.attention, answers.causal_tile_bounds)
    got = backend(q, k_cache, v_cache, tables, torch.tensor(seq_lens), torch.tensor(query_lens), 0.25)
    want = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, query_lens, sm_scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_reference_pieces_give_the_reference_engines_tokens(answers, reference):
    assert given.written_pieces(answers) == list(given.PIECES)
    assert serve(answers.use_my_attention(given.PIECES, **given.ENGINE_SETTINGS)) == reference


def test_stubs_are_found_and_fall_back_to_the_courses_pieces(reference):
    assert given.written_pieces(STUBS) == []
    use_my_attention = given.my_attention_user(STUBS.chunked_attention, STUBS.attention, STUBS.causal_tile_bounds)
    assert serve(use_my_attention(given.written_pieces(STUBS), **given.ENGINE_SETTINGS)) == reference


def test_a_stub_plugged_in_fails_the_request_with_its_message(answers):
    use_my_attention = given.my_attention_user(answers.chunked_attention, answers.attention, stub)
    [out] = use_my_attention(given.PIECES, **given.ENGINE_SETTINGS).generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and "NotImplementedError" in out.error


def test_bad_uses_are_refused(answers):
    with pytest.raises(ValueError, match="pieces must be a collection of names among"):
        answers.use_my_attention("chunked_attention")
    with pytest.raises(ValueError, match="pieces must be a collection of names among"):
        answers.use_my_attention(["merge_splits"])
    with pytest.raises(TypeError, match="sets attention_backend itself"):
        answers.use_my_attention(given.PIECES, attention_backend="torch")
