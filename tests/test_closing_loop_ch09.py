"""Chapter 9's closing loop: ``use_my_quantization(llm)`` (kvlab/scaffold/ch09.py) serves an
``LLM(kv_cache_dtype="fp8" | "int8")`` whose every layer writes its new K/V through the
chapter's pieces (``quantize_kv``, or the write kernel in Triton's interpreter on a CPU) and,
with ``quantize``, reads the cache back through ``dequantize_kv``. The reference answers give
the course's engine's greedy tokens; a piece that is wrong changes them; stubs stay the course's.
"""
from collections import Counter

import pytest
import torch

from helpers import closing_loop_fixtures, one_thread, served_tokens  # noqa: F401  (one_thread: a fixture)
from kvlab import LLM, SamplingParams, profile
from kvlab.paging.kv_cache import block_and_offset
from kvlab.scaffold.ch09 import PIECES, my_quantization_user, serve_beside, use_my_preemption_mode

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def add(a, b):", "import os\nimport sys\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
ENGINE = dict(kv_cache_dtype="fp8", num_gpu_blocks=16, block_size=8, max_num_seqs=4, max_model_len=256,
              enforce_eager=True)

reference, answers = closing_loop_fixtures("ch09", ENGINE, PROMPTS, GREEDY)


def stub(*args, **kwargs):
    raise NotImplementedError("not written yet")


def counted(answers, calls: Counter):
    def quantize_kv(x, kv_cache_dtype):
        calls["quantize_kv"] += 1
        return answers.quantize_kv(x, kv_cache_dtype)

    def dequantize_kv(codes, scales):
        calls["dequantize_kv"] += 1
        return answers.dequantize_kv(codes, scales)

    def write(*args):
        calls["kernel"] += 1
        return answers.write_kv_quantized(*args)

    return quantize_kv, dequantize_kv, write


def test_the_reference_quantize_serves_the_engines_tokens(answers, reference):
    calls = Counter()
    llm = LLM(**ENGINE)
    assert my_quantization_user(*counted(answers, calls))(llm, ["quantize"]) == ["quantize"]
    assert served_tokens(llm, PROMPTS, GREEDY) == reference
    layers, steps = llm.model_runner.config.num_layers, llm.scheduler.num_steps
    assert type(llm.model_runner).__name__ == "RunnerWithMyQuantization"
    assert calls["quantize_kv"] == 2 * layers * steps and calls["dequantize_kv"] == 2 * layers * steps
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_the_reference_kernel_serves_the_engines_tokens(answers, reference):
    calls = Counter()
    llm = LLM(**ENGINE)
    assert my_quantization_user(*counted(answers, calls))(llm, ["write_kernel"]) == ["write_kernel"]
    assert served_tokens(llm, PROMPTS, GREEDY) == reference
    assert calls["kernel"] == llm.model_runner.config.num_layers * llm.scheduler.num_steps


def test_int8_through_the_reference_quantize():
    engine = dict(ENGINE, kv_cache_dtype="int8")
    want = served_tokens(LLM(**engine), PROMPTS, GREEDY)
    from kvlab.grading import load_chapter

    llm = LLM(**engine)
    load_chapter("ch09", "solutions").use_my_quantization(llm, ["quantize"])
    assert served_tokens(llm, PROMPTS, GREEDY) == want


def test_a_wrong_piece_changes_the_text(answers, reference):
    """Scales off by 2x (a classic: the exponent one too high), and a write that skips the V rows:
    the engine reads what the pieces stored, so the tokens change (or the text is NaN garbage)."""
    def doubled(x, kv_cache_dtype):
        codes, scales = answers.quantize_kv(x, kv_cache_dtype)
        return codes, scales * 2

    llm = LLM(**ENGINE)
    my_quantization_user(doubled, answers.dequantize_kv, stub)(llm, ["quantize"])
    assert served_tokens(llm, PROMPTS, GREEDY) != reference

    def keys_only(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        # quantise K into its cache, leave V as the wipe left it (NaN scales)
        codes, scales = answers.quantize_kv(key, "fp8")
        keep = slot_mapping >= 0
        k_cache.view(torch.uint8).view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = codes[keep].view(torch.uint8)
        k_scale[block_and_offset(slot_mapping[keep], k_scale.shape[1])] = scales[keep]

    llm = LLM(**ENGINE)
    my_quantization_user(stub, stub, keys_only)(llm, ["write_kernel"])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != reference


def test_stubs_stay_the_courses(reference):
    llm = LLM(**ENGINE)
    use = my_quantization_user(stub, stub, stub)
    assert use(llm) == []
    assert type(llm.model_runner).__name__ == "ModelRunner"
    assert served_tokens(llm, PROMPTS, GREEDY) == reference
    with pytest.raises(ValueError):
        use(LLM(**dict(ENGINE, kv_cache_dtype="auto")), ["quantize"])
    with pytest.raises(ValueError):
        use(llm, ["quantise"])
    assert PIECES == ("quantize", "write_kernel")


# -- serve_beside: what the pieces stored, compared with the course's, step by step -------------
def test_serve_beside_finds_the_reference_identical(answers):
    llm = LLM(**ENGINE)
    my_quantization_user(answers.quantize_kv, answers.dequantize_kv, stub)(llm, ["quantize"])
    found = serve_beside(llm, LLM(**ENGINE), PROMPTS, GREEDY)
    assert found.my_tokens == found.course_tokens and not found.errors
    assert found.layer0_equal and found.first_difference is None
    # every token but each request's last sampled one was written: prompts, then decodes
    prompt_tokens = sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS)
    assert found.slots_checked == prompt_tokens + sum(len(t) - 1 for t in found.my_tokens)
    # On the CPU (float32) the later layers match too; on a GPU the learner's path dequantises in
    # PyTorch and attends in bf16 outside the kernel, so they round differently (0.80 on an H200)
    assert found.later_share == 1.0 if profile.DEVICE == "cpu" else found.later_share > 0.6


def test_serve_beside_sees_a_truncating_int8_quantiser_the_tokens_hide(answers):
    """``.to(torch.int8)`` truncates instead of rounding: the greedy tokens still agree here, but
    layer 0's codes do not, and the first difference is named."""
    def truncating(x, kv_cache_dtype):
        codes, scales = answers.quantize_kv(x, kv_cache_dtype)
        return (x.float() / scales[..., None]).clamp(-127, 127).to(torch.int8), scales

    engine = dict(ENGINE, kv_cache_dtype="int8")
    llm = LLM(**engine)
    my_quantization_user(truncating, answers.dequantize_kv, stub)(llm, ["quantize"])
    found = serve_beside(llm, LLM(**engine), PROMPTS, GREEDY)
    assert not found.layer0_equal
    assert found.first_difference.startswith("K codes differ at layer 0, slot ")


def test_serve_beside_reports_a_failing_piece(answers):
    def crashing(codes, scales):
        return codes.float() * scales       # scales [..., heads] against codes [..., heads, head_dim]

    llm = LLM(**ENGINE)
    my_quantization_user(answers.quantize_kv, crashing, stub)(llm, ["quantize"])
    found = serve_beside(llm, LLM(**ENGINE), PROMPTS, GREEDY)
    assert len(found.errors) == len(PROMPTS) and "RuntimeError" in found.errors[0]
    with pytest.raises(ValueError, match="use_my_quantization"):
        serve_beside(LLM(**ENGINE), LLM(**ENGINE), PROMPTS, GREEDY)


# -- use_my_preemption_mode: the learner's rule picks swap or recompute in the engine -----------
SWAP_ENGINE = dict(num_gpu_blocks=12, block_size=8, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=256,
                   swap_space=0.001, preemption_mode="auto")
SWAP_PROMPTS = [[(7 * i + 3 * n) % 900 + 1 for i in range(n)] for n in (20, 18, 22)]
SWAP_GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("rule, swaps", [("swap", 1), ("recompute", 0)])
def test_the_rule_decides_and_the_tokens_stay(rule, swaps):
    want = served_tokens(LLM(num_gpu_blocks=64, block_size=8, max_num_seqs=3, max_model_len=256), SWAP_PROMPTS,
                         SWAP_GREEDY)
    llm = LLM(**SWAP_ENGINE)
    choices = use_my_preemption_mode(llm, lambda n, bpt, costs, free: rule)
    assert served_tokens(llm, SWAP_PROMPTS, SWAP_GREEDY) == want
    assert choices and all(choice == rule for _, choice in choices)
    assert llm.scheduler.num_preemptions >= 1 and (llm.scheduler.num_swapped_out > 0) == bool(swaps)


def test_a_broken_rule_is_reported_and_the_engine_recomputes():
    def broken(n, bpt, costs, free):
        raise NotImplementedError("not yet")

    llm = LLM(**SWAP_ENGINE)
    choices = use_my_preemption_mode(llm, broken)
    served_tokens(llm, SWAP_PROMPTS, SWAP_GREEDY)
    assert choices and choices[0][1].startswith("error: NotImplementedError")
    assert llm.scheduler.num_swapped_out == 0 and llm.pool.num_free_blocks == llm.pool.num_blocks
    llm = LLM(**SWAP_ENGINE)
    choices = use_my_preemption_mode(llm, lambda *args: "swapp")
    served_tokens(llm, SWAP_PROMPTS, SWAP_GREEDY)
    assert choices[0][1] == "error: returned 'swapp', not 'swap' or 'recompute'"
    with pytest.raises(ValueError, match="swap_space"):
        use_my_preemption_mode(LLM(**dict(SWAP_ENGINE, preemption_mode="swap")), broken)
