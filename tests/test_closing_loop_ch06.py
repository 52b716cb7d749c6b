"""Chapter 6's closing loop: ``use_my_decoding`` serves the engine with an attention backend
built from the chapter's pieces (``split_ranges`` and ``split_pages`` cut and read each decode's
splits, ``merge_splits_kernel`` merges them, ``merge_splits`` merges a prompt chunk's prefix and
new tokens). With the reference answers it gives the reference engine's greedy tokens; a piece
still a stub stays the course's."""
import types

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (a jit function must see it)

import kvlab  # noqa: F401  (before triton's kernels run: the CPU interpreter without a GPU)
from kvlab import SamplingParams
from kvlab.reference import paged_attention_ref
from kvlab.scaffold import ch06 as given
from helpers import closing_loop_fixtures, one_thread, served_tokens  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n", "class Stack:\n    def push(self, item):"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def stub(*args, **kwargs):
    raise NotImplementedError("not written yet")


@triton.jit
def stub_kernel(partial_ptr, lse_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    raise NotImplementedError("merge_splits_kernel: not written yet")


STUBS = types.SimpleNamespace(split_ranges=stub, split_pages=stub, merge_splits=stub,
                              merge_with_kernel=given.merge_with(stub_kernel))


def serve(llm) -> list[list[int]]:
    return served_tokens(llm, PROMPTS, GREEDY)


reference, answers = closing_loop_fixtures("ch06", given.ENGINE_SETTINGS, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def backend(answers):
    return given.decoding_backend_with(answers.split_ranges, answers.split_pages, answers.merge_splits,
                                       answers.merge_with_kernel)


def paged_step(seq_lens, query_lens):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(24, 4, 2, 16, generator=gen) for _ in range(2))     # pages of 4 tokens
    tables = torch.randperm(24, generator=gen)[:20].reshape(2, 10).int()
    q = torch.randn(sum(query_lens), 4, 16, generator=gen)
    want = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, query_lens, sm_scale=0.25)
    return (q, k_cache, v_cache, tables, torch.tensor(seq_lens), torch.tensor(query_lens), 0.25), want


def test_a_decode_step_equals_the_reference(backend):
    """37 tokens: 3 splits of 16 hold tokens, the 4th is empty; 5 tokens: one split holds them all."""
    args, want = paged_step([37, 5], [1, 1])
    torch.testing.assert_close(backend(*args, phase="decode"), want, rtol=1e-5, atol=1e-5)


def test_a_prompt_chunk_step_equals_the_reference(backend):
    """21 new tokens after 16 cached (two splits merged), and a first chunk (an empty prefix)."""
    args, want = paged_step([37, 9], [21, 9])
    torch.testing.assert_close(backend(*args), want, rtol=1e-5, atol=1e-5)


def test_the_reference_pieces_give_the_reference_engines_tokens(answers, reference):
    assert given.written_pieces(answers) == list(given.PIECES)
    assert serve(answers.use_my_decoding(given.PIECES, **given.ENGINE_SETTINGS)) == reference


def test_stubs_are_found_and_fall_back_to_the_courses_pieces(reference):
    assert given.written_pieces(STUBS) == []
    use_my_decoding = given.my_decoding_user(STUBS.split_ranges, STUBS.split_pages, STUBS.merge_splits,
                                             STUBS.merge_with_kernel)
    llm = use_my_decoding(given.written_pieces(STUBS), **given.ENGINE_SETTINGS)
    assert serve(llm) == reference


def test_a_stub_plugged_in_fails_the_request_with_its_message(answers):
    use_my_decoding = given.my_decoding_user(answers.split_ranges, stub, answers.merge_splits,
                                             answers.merge_with_kernel)
    [out] = use_my_decoding(given.PIECES, **given.ENGINE_SETTINGS).generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and "NotImplementedError" in out.error


def test_missing_pages_and_splits_are_named():
    cache = torch.zeros(8, 4, 1, 16)
    with pytest.raises(ValueError, match="split_pages gave 1 pages for positions 2..6, which span 2 pages of 4"):
        given.read_positions(cache, [3], 2, 7)
    assert given.read_positions(cache, [], 5, 5).shape == (0, 1, 16)
    backend = given.decoding_backend_with(lambda *args: [(0, 5)], None, None, None)
    args, _ = paged_step([5, 5], [1, 1])
    with pytest.raises(ValueError, match=r"split_ranges\(5, 4, 16\) gave 1 ranges, expected 4"):
        backend(*args, phase="decode")


def test_bad_uses_are_refused(answers):
    with pytest.raises(ValueError, match="pieces must be a collection of names among"):
        answers.use_my_decoding("merge_splits")
    with pytest.raises(ValueError, match="pieces must be a collection of names among"):
        answers.use_my_decoding(["chunked_attention"])
    with pytest.raises(TypeError, match="sets attention_backend itself"):
        answers.use_my_decoding(given.PIECES, attention_backend="torch")
