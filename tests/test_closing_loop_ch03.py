"""Chapter 3's closing loop: ``use_my_pieces`` serves the engine's parallel sampling from a pool
running the chapter's ``fork`` and copy-on-write ``append``. With the reference answers it gives
the tokens of kvlab's own pool; a piece still a stub stays kvlab's."""
import pytest

from kvlab import LLM, SamplingParams
from kvlab.grading import load_chapter
from kvlab.paging import BlockPool
from helpers import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def fibonacci(n):\n    "            # 10 tokens: the samples share a partly filled block
PARAMS = SamplingParams(n=3, temperature=0.8, seed=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(num_gpu_blocks=32, max_num_seqs=4)


@pytest.fixture(scope="module")
def reference(llm):
    llm.use_pool(BlockPool(llm.pool.num_blocks, llm.pool.block_size))
    [out] = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    assert llm.scheduler.num_copied_blocks > 0, "the prompt must end in a partly filled block"
    return [c.token_ids for c in out.outputs]


def serve(llm) -> list[list[int]]:
    [out] = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    assert out.error is None, out.error
    assert llm.pool.num_free_blocks == llm.pool.num_blocks, "blocks still held after the request finished"
    return [c.token_ids for c in out.outputs]


def test_the_reference_pieces_give_the_reference_engines_tokens(llm, reference):
    ch03 = load_chapter("ch03", "solutions")
    assert ch03.use_my_pieces(llm) == ["fork", "append_with_copy_on_write"]
    assert type(llm.pool).__name__ == "MyBlockPool"
    assert serve(llm) == reference
    assert llm.scheduler.num_copied_blocks == PARAMS.n - 1     # every sample but the last writer copies


def test_stubs_fall_back_to_kvlabs_pieces(llm, reference):
    assert load_chapter("ch03", "exercises").use_my_pieces(llm) == []
    assert serve(llm) == reference


def test_a_stub_falls_back_alone(llm, reference):
    answers, stubs = load_chapter("ch03", "solutions"), load_chapter("ch03", "exercises")
    use_my_pieces = answers.my_pieces_user(answers.fork, stubs.append_with_copy_on_write)
    assert use_my_pieces(llm) == ["fork"]
    assert serve(llm) == reference


def test_bad_uses_are_refused(llm):
    use_my_pieces = load_chapter("ch03", "solutions").use_my_pieces
    with pytest.raises(ValueError, match="pieces must be a collection of names among"):
        use_my_pieces(llm, pieces=["truncate"])
    cached = LLM(num_gpu_blocks=8, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        use_my_pieces(cached)
