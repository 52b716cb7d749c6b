"""Decode steps replayed as CUDA graphs (GPU only): the same tokens as eager steps, and padding
rows that write nowhere."""
import pytest
import torch

import kvlab  # noqa: F401  (profile first)
from kvlab import LLM, SamplingParams, profile

pytestmark = pytest.mark.skipif(profile.DEVICE != "cuda", reason="CUDA graphs need a GPU")

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "def fib(n):",
           "with open(path) as f:", "try:\n    import json", "return self.", "if __name__ == '__main__':",
           "    def __init__(self", "x = [", "@property\n"]


def near_tie(model, prompt_ids, common, tol=1e-3) -> bool:
    """Whether the two best next tokens after ``prompt_ids + common`` score within ``tol``
    (relative) of each other, by a no-cache forward: where bf16 rounding may pick either."""
    ids = torch.tensor(prompt_ids + common, device="cuda")
    with torch.inference_mode():
        top = model.compute_logits(model(ids, torch.arange(len(ids), device="cuda"))[-1]).float().topk(2).values
    return float(top[0] - top[1]) <= tol * max(1.0, abs(float(top[0])))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_give_the_eager_tokens(dtype):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(dtype=dtype, enforce_eager=eager, max_num_seqs=16, num_gpu_blocks=512)
        assert (llm.model_runner.graphs is None) == eager
        runs[eager] = llm.generate(PROMPTS, params, use_tqdm=False)
    model = llm.model
    diverged = []
    for e, g in zip(runs[True], runs[False]):
        a, b = e.outputs[0].token_ids, g.outputs[0].token_ids
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            diverged.append((e.prompt, first, near_tie(model, e.prompt_token_ids, a[:first])))
    print(f"{dtype}: {len(diverged)} of {len(PROMPTS)} sequences diverge: {diverged}")
    if dtype == "float32":
        assert not diverged
    else:
        assert all(tie for _, _, tie in diverged), diverged


def changed_slots(now, before):
    """``[num_slots]`` bool: slots whose K (or V) differs in any layer (NaN equals NaN)."""
    layers, blocks, block_size, heads, dim = now.shape
    a, b = now.reshape(layers, blocks * block_size, heads * dim), before.reshape(layers, blocks * block_size, -1)
    return ((a != b) & ~(a.isnan() & b.isnan())).any(-1).any(0)


def test_a_padded_replay_writes_only_its_sequences_slots():
    """Three sequences decode in the bucket of four: the padding row writes no slot, and no
    slot but the three new tokens' changes."""
    llm = LLM(dtype="float32", max_num_seqs=4, num_gpu_blocks=64)
    for p in PROMPTS[:3]:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.step()                                          # the prefill, eager
    cache = llm.model_runner.kv_cache
    used = {b for item in llm.last_schedule.scheduled for b in item.block_table}
    free = sorted(set(range(cache.num_blocks)) - used)
    cache.k[:, free] = float("nan")                     # poison every block no sequence holds
    before_k, before_v = cache.k.clone(), cache.v.clone()
    llm.step()                                          # a decode step: replayed in bucket 4
    out = llm.last_schedule
    assert len(out.scheduled) == 3 and llm.model_runner.graphs.bucket(3) == 4
    written = set(out.slot_mapping())
    slots = set((changed_slots(cache.k, before_k) | changed_slots(cache.v, before_v)).nonzero().flatten().tolist())
    assert slots == written
    assert torch.isnan(cache.k[:, free]).all()


def test_a_backend_that_reads_back_runs_eagerly():
    """Only a backend marked cuda_graph_safe is captured: the reference reads lengths to the host."""
    llm = LLM(dtype="float32", max_num_seqs=4, num_gpu_blocks=64, attention_backend="reference")
    assert llm.model_runner.graphs is None
    [out] = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_uniform_steps_replay_their_own_graphs():
    """A step of q = 3 new tokens per sequence (speculative verification's shape) replays a graph
    captured for q = 3, through paged_prefill, and gives the eager step's logits."""
    from kvlab.engine.scheduler import ScheduledSequence, SchedulerOutput
    from kvlab.engine.sequence import Sequence

    results = []
    for eager in (True, False):
        llm = LLM(dtype="float32", max_num_seqs=4, num_gpu_blocks=64, enforce_eager=eager)
        llm.model_runner.capture_uniform_graphs(3)
        assert bool(llm.model_runner.uniform_graphs) == (not eager)
        pool, prefill, verify = llm.pool, [], []
        for i, prompt in enumerate([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]):
            seq = Sequence(i, str(i), prompt)
            pool.allocate(i, len(prompt))
            table = pool.block_table(i)
            prefill.append(ScheduledSequence(seq, 0, len(prompt) - 3, block_table=table))   # eager, both runs
            verify.append(ScheduledSequence(seq, len(prompt) - 3, 3, block_table=table))
        llm.model_runner.compute_logits(SchedulerOutput(scheduled=prefill, block_size=pool.block_size))
        assert (llm.model_runner._graphs_for([3, 3]) is None) == eager
        results.append(llm.model_runner.compute_logits(SchedulerOutput(scheduled=verify, block_size=pool.block_size)))
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
