"""Chapter 7's logic and pictures: the formulas, sampler exactness, speculation recorded on the
engine, its frames, and the GPU benchmark's reader and plots."""
import json
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import kvlab  # noqa: E402,F401  (profile first)
from kvlab import benchmark_results as br  # noqa: E402
from kvlab.engine import LLM, SamplingParams  # noqa: E402
from kvlab.engine.rejection_sampler import rejection_sample  # noqa: E402
from kvlab.engine.sequence import SpecDecodeStats  # noqa: E402
from kvlab.paging.block_pool import blocks_needed  # noqa: E402
from kvlab.viz.speculative import (  # noqa: E402
    NO_GPU,
    draw_speculation_frame,
    missing_gpu_note,
    plot_acceptance,
    plot_batch_speedup,
    plot_tokens_per_step,
    plot_verify_cost,
    speculation_frames,
    speculation_stepper,
    token_piece,
)
from kvlab.workloads.speculation import (  # noqa: E402
    acceptance_by_position,
    acceptance_sweep,
    chi_square,
    conditional_acceptance,
    expected_speedup,
    expected_tokens_per_step,
    first_token_test,
    record_speculation,
    roofline_speedup,
    seed_pseudo_code,
    verify_roofline,
)
from helpers import one_thread  # noqa: F401  (a fixture)

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
PAYLOAD = {
    "device": "NVIDIA H200", "date": "2026-12-01",
    "verify_cost": {"model": "Llama-3-8B-shaped, bf16", "context": 2048, "graphs": True, "batches": [1, 8],
                    "query_tokens": [1, 2, 6], "step_ms": {"1": [4.0, 4.1, 4.3], "8": [4.5, 4.8, 6.0]}},
    "verify_ratio_k5_b1": 1.07,
    "tiny_pair": {"alpha_k1": 0.6, "k": [1, 2], "measured_tokens_per_step": [1.6, 2.0],
                  "predicted_tokens_per_step": [1.6, 1.96], "acceptance_by_position": {"2": [0.62, 0.38]}},
    "end_to_end": {"num_prompts": 50, "max_tokens": 128, "baseline_tok_s": 300.0,
                   "ngram": {"k": 4, "tok_s": 480.0, "speedup": 1.6, "tokens_per_step": 2.1},
                   "draft_model": {"k": 4, "tok_s": 390.0, "speedup": 1.3, "tokens_per_step": 2.4, "alpha": 0.6,
                                   "cost_ratio_c": 0.3}},
    "batch_speedup": {"batch": [1, 2, 4, 8], "ngram": [1.6, 1.5, 1.3, 1.1], "draft_model": [1.3, 1.2, 1.0, 0.8]},
}


pytestmark = pytest.mark.usefixtures("one_thread")


# -- formulas ----------------------------------------------------------------------------------
def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.6, 5) == pytest.approx(2.38336)        # claim 14: not "about 3"
    assert expected_tokens_per_step(0.0, 7) == 1.0 and expected_tokens_per_step(1.0, 7) == 8.0
    for alpha in (0.1, 0.5, 0.9):
        assert expected_tokens_per_step(alpha, 4) == pytest.approx(sum(alpha ** i for i in range(5)))
        assert expected_tokens_per_step(alpha, 200) == pytest.approx(1 / (1 - alpha))
    assert expected_speedup(0.6, 5, 0.0) == expected_tokens_per_step(0.6, 5)
    assert expected_speedup(0.6, 5, 0.1) == pytest.approx(2.38336 / 1.5)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 3)


def test_roofline_of_an_8b_step():
    one, six = verify_roofline("llama-3-8b", 1, 1), verify_roofline("llama-3-8b", 1, 6)
    assert 14e9 < one.bytes < 17e9                                   # bf16 weights + 2K tokens of KV
    assert one.memory_ms > 10 * six.compute_ms                       # batch 1: far from compute-bound
    assert six.ms / one.ms == pytest.approx(1.0, abs=1e-3)
    assert six.intensity == pytest.approx(6 * one.intensity, rel=0.01)
    big = verify_roofline("llama-3-8b", 32, 16)
    assert big.compute_ms > big.memory_ms                            # 512 tokens a step: compute-bound
    assert roofline_speedup(0.6, 5, 1) == pytest.approx(expected_tokens_per_step(0.6, 5), rel=1e-3)
    speedups = [roofline_speedup(0.6, 5, b) for b in (1, 32, 128, 512)]
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] < 1.5   # pays less as the batch grows


# -- exactness ---------------------------------------------------------------------------------
def test_chi_square():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    good = chi_square(torch.multinomial(p, 20_000, replacement=True, generator=gen), p)
    assert good.dof == 2 and good.passes()
    bad = chi_square(torch.multinomial(torch.tensor([0.4, 0.4, 0.2]), 20_000, replacement=True, generator=gen), p)
    assert not bad.passes()
    assert chi_square(torch.tensor([3, 0]), p).p_value == 0.0          # a token of probability 0
    assert chi_square(torch.zeros(10, dtype=torch.long), torch.tensor([1.0, 0.0])).p_value == 1.0


@pytest.mark.parametrize("q", ["random", "one-hot", "equal"])
def test_the_engine_sampler_passes_and_the_seed_pseudo_code_fails(q):
    torch.manual_seed(1)
    p = torch.distributions.Dirichlet(torch.ones(6)).sample()
    qs = {"random": torch.distributions.Dirichlet(torch.ones(6)).sample(), "one-hot": None, "equal": p}
    test, tokens = first_token_test(rejection_sample, p, qs[q], draft_token=2, seed=2)
    assert test.passes()
    kept = float(torch.minimum(p, qs[q]).sum()) if qs[q] is not None else float(p[2])
    assert tokens == pytest.approx(1 + kept, abs=0.02)                 # each kept draft adds a token
    seed_test, seed_tokens = first_token_test(seed_pseudo_code, p, qs[q], draft_token=2, seed=2)
    assert seed_tokens == 1.0                                          # no bonus token
    if q != "equal":                                                   # q = p never rejects
        assert not seed_test.passes()


# -- acceptance ----------------------------------------------------------------------------------
def test_acceptance_by_position():
    stats = SpecDecodeStats()
    for kept in (0, 1, 3, 3):
        stats.record([5, 6, 7], kept)
    assert acceptance_by_position(stats) == [0.75, 0.5, 0.5]
    assert conditional_acceptance([0.75, 0.5, 0.5]) == pytest.approx([0.75, 2 / 3, 1.0])
    assert 1 + sum(acceptance_by_position(stats)) == pytest.approx(stats.mean_acceptance_length)
    assert acceptance_by_position(SpecDecodeStats()) == []
    assert math.isnan(conditional_acceptance([0.0, 0.0])[1])


def test_acceptance_sweep():
    sweep = acceptance_sweep([PROMPT], (1, 2), max_tokens=8, max_num_seqs=1, max_model_len=64)
    assert sweep["k"] == (1, 2) and 0 <= sweep["alpha_k1"] <= 1
    assert sweep["measured_tokens_per_step"][0] == pytest.approx(1 + sweep["alpha_k1"])
    assert sweep["predicted_tokens_per_step"][1] == pytest.approx(expected_tokens_per_step(sweep["alpha_k1"], 2))
    assert len(sweep["acceptance_by_position"][2]) == 2 and sweep["num_steps"][1] > 0
    with pytest.raises(ValueError, match="start with 1"):
        acceptance_sweep([PROMPT], (2, 4))


# -- a generation, step by step ------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded():
    # float32 (the CPU profile's dtype anyway): the run is compared token for token with a plain
    # one below, and in bf16 on a GPU a verification step and a decode step can round a near-tie apart
    llm = LLM(num_gpu_blocks=24, block_size=4, max_num_seqs=1, max_model_len=96, dtype="float32",
              speculative_config={"method": "draft_model", "num_speculative_tokens": 4})
    steps = record_speculation(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16), max_steps=20)
    return llm, steps


def test_record_speculation(recorded):
    llm, steps = recorded
    assert steps[0].kind == "prefill" and steps[-1].finished and not llm.has_unfinished_requests()
    assert llm.pool.num_free_blocks == llm.pool.num_blocks                  # nothing leaked
    for s in steps[1:]:
        assert s.kind == "verify" and len(s.drafts) == 4
        assert s.emitted[:s.num_accepted] == s.drafts[:s.num_accepted]      # kept drafts first
        assert s.kept_len == s.start + 1 + s.num_accepted
        assert len(s.rejected_slots) == 4 - s.num_accepted
        if not s.finished:
            assert s.block_table_after == s.block_table[:blocks_needed(s.kept_len, s.block_size)]
            assert not set(s.freed_blocks) & set(s.block_table_after)
    assert any(s.freed_blocks for s in steps)                               # some rollback freed a block
    for s, after in zip(steps, steps[1:]):
        assert s.tokens_before + s.emitted == after.tokens_before
    plain = LLM(max_num_seqs=1, max_model_len=96, dtype="float32").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].token_ids
    generated = steps[-1].tokens_before + steps[-1].emitted
    assert list(generated[len(steps[0].tokens_before):]) == list(plain)


def test_record_speculation_needs_a_speculative_engine():
    with pytest.raises(ValueError, match="speculative_config"):
        record_speculation(LLM(max_num_seqs=1, max_model_len=64), PROMPT)


def test_ngram_padding_and_early_stop():
    llm = LLM(num_gpu_blocks=32, block_size=4, max_num_seqs=1, max_model_len=96,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    steps = record_speculation(llm, "a b c a b c a b c a b", SamplingParams(temperature=0, max_tokens=40),
                               max_steps=3)
    assert len(steps) == 3 and not llm.has_unfinished_requests()             # aborted after max_steps
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_frames(recorded):
    llm, steps = recorded
    frames = speculation_frames(steps, token_piece(llm.get_tokenizer()))
    assert len(frames) == 1 + 3 * (len(steps) - 1)
    assert [f.phase for f in frames[:4]] == ["prefill", "draft", "verify", "rollback"]
    for step, (draft, verify, rollback) in zip(steps[1:], zip(frames[1::3], frames[2::3], frames[3::3])):
        assert draft.slots.count("draft") == 4 and verify.slots.count("rejected") == 4 - step.num_accepted
        assert verify.slots.count("accepted") == step.num_accepted
        assert "rejected" not in rollback.slots and rollback.freed == step.freed_blocks
        assert len(rollback.slots) == len(rollback.table) * step.block_size
        if not step.finished:                 # max_tokens may cut the last step's tokens short
            assert [state for _, state in verify.emitted][-1] == "target"
    fig = draw_speculation_frame(frames[3])
    assert isinstance(fig, Figure) and "rollback" in frames[3].caption


def test_token_piece_shows_whitespace(recorded):
    llm, _ = recorded
    piece = token_piece(llm.get_tokenizer())
    ids = llm.get_tokenizer().encode("\n    return").ids
    assert "↵" in "".join(piece(i) for i in ids) and "·" in "".join(piece(i) for i in ids)
    assert piece(-1) == "∅"


def test_stepper(recorded):
    pytest.importorskip("ipywidgets")
    llm, steps = recorded
    assert speculation_stepper(speculation_frames(steps[:2]), title="demo") is not None


# -- the GPU benchmark ---------------------------------------------------------------------------
def test_reader_and_plots(tmp_path):
    path = tmp_path / br.SPECULATIVE_JSON
    path.write_text(json.dumps(PAYLOAD))
    bench = br.read_speculative_benchmark(path)
    assert bench.problems == {} and bench.device == "NVIDIA H200"
    assert bench.verify_cost["step_ms"][8] == (4.5, 4.8, 6.0) and bench.verify_ratio(8, 6) == pytest.approx(6 / 4.5)
    assert bench.tiny_pair["acceptance_by_position"][2] == (0.62, 0.38)
    assert all(missing_gpu_note(bench, s) is None for s in br.SPECULATIVE_SECTIONS)
    for fig in (plot_verify_cost(bench), plot_tokens_per_step({"H200": bench.tiny_pair}),
                plot_acceptance({"k = 2": bench.tiny_pair["acceptance_by_position"][2]}, 0.6),
                plot_batch_speedup(bench)):
        assert isinstance(fig, Figure)
    assert br.read_speculative_benchmark(tmp_path / "missing.json") is None
    assert missing_gpu_note(None, "verify_cost") == NO_GPU


def test_reader_degrades_section_by_section():
    payload = {key: value for key, value in PAYLOAD.items() if key not in ("verify_ratio_k5_b1", "tiny_pair")}
    payload["batch_speedup"] = {"batch": [1, 2], "ngram": [1.5]}                 # one value short
    bench = br.speculative_benchmark(payload)
    assert bench.verify_ratio_k5_b1 == pytest.approx(4.3 / 4.0)                  # derived from verify_cost
    assert bench.tiny_pair is None and "not in the file" in bench.why_missing("tiny_pair")
    assert bench.batch_speedup is None and "malformed" in bench.why_missing("batch_speedup")
    assert bench.end_to_end["ngram"]["speedup"] == 1.6
    with pytest.raises(ValueError, match="section"):
        bench.why_missing("nope")
    with pytest.raises(TypeError):
        br.speculative_benchmark([])
