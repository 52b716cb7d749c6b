"""Chapter 4's closing loop: ``use_my_pieces`` serves the engine with prefix caching from a pool
running the chapter's hashing, lookup and eviction. With the reference answers a second request
hits the first one's prefix and both get the tokens of kvlab's own pool; a stub stays kvlab's."""
import pytest

from kvlab import LLM, SamplingParams
from kvlab.grading import load_chapter
from kvlab.paging import BlockPool
from helpers import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

SHARED = "".join(f"Rule {i}: cite the manual.\n" for i in range(1, 9))     # 64 tokens: 4 blocks
PROMPTS = [SHARED + "User: how do I rotate a key?", SHARED + "User: where is the manual?"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # 7 blocks: the first request takes them all, so the second one evicts the first one's tail
    return LLM(num_gpu_blocks=7, max_num_seqs=2, enable_prefix_caching=True)


def serve(llm) -> list[tuple[int, list[int]]]:
    """The two prompts one after the other: (cached prompt tokens, output tokens) of each."""
    served = []
    for prompt in PROMPTS:
        [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert out.error is None, out.error
        served.append((out.num_cached_tokens, out.outputs[0].token_ids))
    assert llm.pool.num_free_blocks == llm.pool.num_blocks, "blocks still held after the requests finished"
    return served


@pytest.fixture(scope="module")
def reference(llm):
    llm.use_pool(BlockPool(llm.pool.num_blocks, llm.pool.block_size, enable_prefix_caching=True))
    served = serve(llm)
    assert served[0][0] == 0 and served[1][0] >= 3 * llm.pool.block_size, "the second prompt must hit the first's"
    return served


def test_the_reference_pieces_give_the_reference_engines_tokens_and_hits(llm, reference):
    ch04 = load_chapter("ch04", "solutions")
    assert ch04.use_my_pieces(llm) == ["block_hashes", "cached_prefix", "take_free_block", "release"]
    assert type(llm.pool).__name__ == "PoolWithMyPrefixCache"
    assert serve(llm) == reference


def test_stubs_fall_back_to_kvlabs_pieces(llm, reference):
    assert load_chapter("ch04", "exercises").use_my_pieces(llm) == []
    assert serve(llm) == reference


def test_a_stub_falls_back_alone(llm, reference):
    answers, stubs = load_chapter("ch04", "solutions"), load_chapter("ch04", "exercises")
    use_my_pieces = answers.my_pieces_user(stubs.block_hashes, answers.cached_prefix, answers.take_free_block,
                                           stubs.release)
    assert use_my_pieces(llm) == ["cached_prefix", "take_free_block"]
    assert serve(llm) == reference


def test_bad_uses_are_refused(llm):
    use_my_pieces = load_chapter("ch04", "solutions").use_my_pieces
    with pytest.raises(ValueError, match="pieces must be a collection of names among"):
        use_my_pieces(llm, pieces=["fork"])
    uncached = LLM(num_gpu_blocks=8)
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        use_my_pieces(uncached)
