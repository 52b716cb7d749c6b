"""Chunked prefill in the engine: the same greedy tokens whatever the chunk size, prompts longer
than the step's budget served, with prefix caching, preemption and speculation."""
import pytest
import torch

import kvlab
from kvlab.engine import SamplingParams
from kvlab.workloads.code_prompts import load_code_prompts
from helpers import one_thread  # noqa: F401  (a fixture)


pytestmark = pytest.mark.usefixtures("one_thread")


def LLM(**kwargs):      # noqa: N802  (float32 and a fixed cache, on any device)
    kwargs.setdefault("num_gpu_blocks", 512)
    return kvlab.LLM(dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def prompts():
    texts = load_code_prompts()[:3]
    return [texts[0], texts[1][:200], texts[2][:700], texts[0][:300]]     # ~360, ~50, ~190, ~80 tokens


@pytest.fixture(scope="module")
def unchunked(prompts):
    llm = LLM(max_num_seqs=4, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                                       use_tqdm=False)]


def step_through(llm, prompts, check_step) -> dict:
    """Serve ``prompts`` greedily one step at a time, calling ``check_step(last_schedule)`` after
    each; the final output of every request, by id."""
    for p in prompts:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=12))
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
        check_step(llm.last_schedule)
    return outs


def tokens(outs) -> list:
    return [outs[str(i)].outputs[0].token_ids for i in range(len(outs))]


@pytest.mark.parametrize("budget, caching, blocks", [
    (16, False, 512),        # one block per step: every prompt in many chunks
    (64, True, 512),         # prefix caching: the fourth prompt starts with the first's blocks
    (100, False, 34),        # too few blocks for all four: preemption, recomputed in chunks
])
def test_greedy_tokens_do_not_depend_on_chunking(prompts, unchunked, budget, caching, blocks):
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=budget, enable_prefix_caching=caching, num_gpu_blocks=blocks)
    longest = max(len(llm.tokenizer.encode(p).ids) for p in prompts)
    assert longest > budget
    chunks = []

    def check_step(s):
        assert s.num_batched_tokens <= budget
        chunks.extend(item.num_new for item in s.scheduled if item.is_prefill)

    outs = step_through(llm, prompts, check_step)
    assert tokens(outs) == unchunked
    assert max(chunks) <= budget and len(chunks) > len(prompts)
    if blocks < 100:
        assert llm.scheduler.num_preemptions > 0
    if caching:
        assert outs["3"].num_cached_tokens > 0
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_long_prefill_threshold_and_partial_prefills(prompts, unchunked):
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=256, long_prefill_token_threshold=32,
              max_num_partial_prefills=2)

    def check_step(s):
        prefills = [item for item in s.scheduled if item.is_prefill]
        assert all(item.num_new <= 32 for item in prefills)
        assert sum(not item.samples for item in prefills) <= 2

    assert tokens(step_through(llm, prompts, check_step)) == unchunked


def test_chunking_with_speculation(prompts, unchunked):
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, speculative_config={"method": "ngram",
                                                                            "num_speculative_tokens": 3})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == unchunked


def test_static_policy_admits_only_between_batches(prompts):
    llm = LLM(max_num_seqs=2, scheduling_policy="static")
    for p in prompts:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=6))
    batches = []
    while llm.has_unfinished_requests():
        llm.step()
        admitted = {item.seq.request_id for item in llm.last_schedule.scheduled if item.is_prefill}
        if admitted:
            batches.append(admitted)
    assert batches == [{"0", "1"}, {"2", "3"}]


@pytest.mark.parametrize("setting, value, message", [
    ("scheduling_policy", "lifo", "scheduling_policy must be one of"),
    ("max_num_partial_prefills", 0, "max_num_partial_prefills must be >= 1"),
    ("long_prefill_token_threshold", -1, "long_prefill_token_threshold must be >= 0"),
    ("enable_chunked_prefill", "yes", "enable_chunked_prefill must be True or False"),
    ("prefill_priority_after", -0.5, "prefill_priority_after must be None or seconds"),
])
def test_bad_scheduler_settings_are_refused(setting, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        kvlab.EngineConfig(**{setting: value})
