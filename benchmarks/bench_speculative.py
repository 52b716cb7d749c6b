"""Speculative decoding on the GPU: what verification costs, and what it buys.

    python benchmarks/bench_speculative.py [--out DIR]
    python benchmarks/bench_speculative.py --smoke      # tiny shapes, few prompts: checks the script (CPU too)

1. **Verification cost** (Llama-3-8B-shaped random bf16 model, 2,048 cached tokens per
   sequence): the GPU time of one step of q = 1..16 query tokens per sequence at batch 1, 8 and
   32, each replayed from its CUDA graph (CUDA-event median), through the engine's default
   Triton backend (small uniform steps verify through ``paged_decode``) and through
   ``paged_prefill`` alone. Also the whole engine step (host included) at batch 1 for q = 1 and 6.
2. **The shipped tiny pair** (kvlab-tiny-target, kvlab-tiny-draft), greedy, on the held-out code
   prompts (:mod:`kvlab.workloads.code_prompts`): acceptance per position, α from k = 1, tokens
   per step for k = 1..8 against (1 − α^(k+1)) / (1 − α).
3. **End to end at batch 1**: tokens/s of ``generate`` over the prompts, one at a time, without
   speculation, with n-gram and with draft-model speculation; the draft's cost ratio c (one
   draft forward / one target step, graph replays) explains the draft's speedup.
4. **Speedup against batch size** (claim 16): the tiny pair end to end at batch 1..32, and the
   8B-shaped model's predicted speedup from its measured verification cost and α.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from kvlab import profile  # noqa: E402

SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False, num_hidden_layers=32)
SHAPE_SMOKE = dict(SHAPE_8B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, vocab_size=1024, num_hidden_layers=2)


def synchronize():
    if profile.DEVICE == "cuda":
        torch.cuda.synchronize()


def gpu_time(fn) -> float:
    """Median seconds of ``fn()``: CUDA events on a GPU, the wall clock on a CPU."""
    if profile.DEVICE == "cuda":
        from common import bench

        return bench(fn)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_model(shape: dict):
    from kvlab.models import LlamaForCausalLM, ModelConfig
    from kvlab.models.loader import _skip_init

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **shape})
    with _skip_init():
        model = LlamaForCausalLM(config)
    dtype = torch.bfloat16 if profile.DEVICE == "cuda" else torch.float32
    model = model.to(device=profile.DEVICE, dtype=dtype)
    gen = torch.Generator(device=profile.DEVICE).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02, generator=gen)
    return model.eval()


# -- 1. verification cost ------------------------------------------------------------------------
def verify_cost(model, batches, query_lens, context: int) -> dict:
    """Step time by (batch, q) for the default backend and for paged_prefill alone."""
    from kvlab.engine.model_runner import ModelRunner
    from kvlab.models import backends

    blocks_per_seq = -(-(context + max(query_lens)) // 16)
    result = {"context": context, "batches": batches, "query_tokens": query_lens}
    for name, split_kv in (("step_ms", True), ("step_ms_prefill_kernel", False)):
        backends.SPLIT_KV_VERIFY = split_kv
        runner = ModelRunner(model, num_gpu_blocks=max(batches) * blocks_per_seq + 1, max_num_seqs=max(batches),
                             max_model_len=context + max(query_lens), cudagraph_batch_sizes=batches,
                             enforce_eager=profile.DEVICE != "cuda")
        table = {str(b): [] for b in batches}
        for q in query_lens:
            for b in batches:
                table[str(b)].append(round(step_time(runner, b, q, context, blocks_per_seq) * 1e3, 4))
            runner.uniform_graphs.clear()
        result[name] = table
        del runner
        if profile.DEVICE == "cuda":
            torch.cuda.empty_cache()
    backends.SPLIT_KV_VERIFY = True
    return result


def step_time(runner, batch: int, q: int, context: int, blocks_per_seq: int) -> float:
    """Seconds of one step of ``q`` new tokens for ``batch`` sequences of ``context`` cached tokens."""
    tables = torch.randperm(batch * blocks_per_seq).view(batch, -1).tolist()
    starts = [context] * batch
    ids = torch.randint(0, runner.config.vocab_size, (batch * q,)).tolist()
    positions = [context + j for _ in range(batch) for j in range(q)]
    slots = [t[(context + j) // 16] * 16 + (context + j) % 16 for t in tables for j in range(q)]
    rows = list(range(batch * q))
    if q > 1:
        runner.capture_uniform_graphs(q)

    def step():
        runner.run(ids, positions, tables, starts, [q] * batch, slots, rows)

    step()
    synchronize()
    graphs = runner.graphs if q == 1 else runner.uniform_graphs.get(q)
    if graphs is not None and graphs.bucket(batch) == batch:
        graph, _ = graphs.graphs[batch]
        return gpu_time(graph.replay)         # inputs already in the buffers from step()
    return gpu_time(step)


def engine_step_ms(model, context: int, q: int) -> float:
    """Median wall time of whole engine steps (host included) at batch 1: decode (q = 1) or
    verification of q - 1 drafts (n-gram on a repeating prompt, so every step verifies)."""
    from kvlab import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": q - 1} if q > 1 else None
    llm = LLM(model, num_gpu_blocks=-(-(context + 300) // 16) + 2, max_num_seqs=1, max_model_len=context + 300,
              speculative_config=spec)
    motif = torch.randint(1, model.config.vocab_size, (32,)).tolist()
    prompt = (motif * (context // 32 + 1))[:context]
    llm.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    times = []
    while llm.has_unfinished_requests():
        start = time.perf_counter()
        llm.step()
        if all(not s.is_prefill for s in llm.last_schedule.scheduled):
            times.append(time.perf_counter() - start)
    del llm
    return statistics.median(times) * 1e3


# -- 2 and 3: the tiny pair ----------------------------------------------------------------------
def tiny_engine(batch: int, spec=None):
    """The shipped tiny target (and draft), warmed up; a fixed cache so several fit on one GPU."""
    from kvlab import LLM, SamplingParams

    llm = LLM(max_num_seqs=batch, num_gpu_blocks=2048, speculative_config=spec)
    llm.generate(["def f(x):"] * batch, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return llm


def timed_generate(llm, prompts, max_tokens: int) -> dict:
    """One greedy ``generate`` over ``prompts``: tokens/s, outputs and speculation statistics."""
    from kvlab import SamplingParams
    from kvlab.engine.sequence import SpecDecodeStats

    llm.reset_prefix_cache()
    if llm.spec_decode_stats is not None:
        llm.spec_decode_stats = SpecDecodeStats()
    synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 3), "tokens": tokens,
           "outputs": [o.outputs[0].token_ids for o in outs]}
    s = llm.spec_decode_stats
    if s is not None:
        row.update(k=llm.engine_config.speculative_config.num_speculative_tokens,
                   tokens_per_step=round(s.mean_acceptance_length, 4), acceptance_rate=round(s.acceptance_rate, 4),
                   num_drafts=s.num_drafts,
                   acceptance_by_position=[round(a / s.num_drafts, 4) for a in s.accepted_per_position])
    return row


def compare(prompts, max_tokens: int, batch: int, specs: dict, repeats: int = 3) -> dict:
    """Each configuration's median run of ``repeats``, the runs interleaved (so drift in the
    machine's speed hits all alike); ``specs`` maps a name to a speculative_config or None."""
    engines = {name: tiny_engine(batch, spec) for name, spec in specs.items()}
    runs = {name: [] for name in specs}
    for _ in range(repeats):
        for name, llm in engines.items():
            runs[name].append(timed_generate(llm, prompts, max_tokens))
    del engines
    if profile.DEVICE == "cuda":
        torch.cuda.empty_cache()
    result = {}
    for name, rows in runs.items():
        best = sorted(rows, key=lambda r: r["tok_s"])[len(rows) // 2]
        result[name] = dict(best, tok_s_runs=[r["tok_s"] for r in rows])
    return result


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """(1 − α^(k+1)) / (1 − α): drafts accepted independently with probability α."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def tiny_pair(prompts, max_tokens: int, ks, batch: int) -> dict:
    rows = compare(prompts, max_tokens, batch,
                   {k: {"method": "draft_model", "num_speculative_tokens": k} for k in ks}, repeats=1)
    alpha = rows[ks[0]]["acceptance_rate"]
    return {"method": "draft_model", "alpha_k1": alpha, "k": list(ks),
            "measured_tokens_per_step": [rows[k]["tokens_per_step"] for k in ks],
            "predicted_tokens_per_step": [round(expected_tokens_per_step(alpha, k), 4) for k in ks],
            "acceptance_by_position": {str(k): rows[k]["acceptance_by_position"] for k in ks}}


def draft_cost_ratio(context: int = 512) -> float:
    """c: one draft forward / one target decode step, both graph replays (or eager on a CPU), batch 1."""
    from kvlab.engine.model_runner import ModelRunner
    from kvlab.engine.spec_decode import DEFAULT_DRAFT_MODEL
    from kvlab.models import load_model

    times = []
    for path in (DEFAULT_DRAFT_MODEL, DEFAULT_DRAFT_MODEL.parent / "kvlab-tiny-target"):
        model, _, _ = load_model(path, device=profile.DEVICE)
        runner = ModelRunner(model, num_gpu_blocks=64, max_num_seqs=1, max_model_len=1024, cudagraph_batch_sizes=[1])
        times.append(step_time(runner, 1, 1, context, 40))
    return times[0] / times[1]


def end_to_end(prompts, max_tokens: int, batch: int, ngram_ks, draft_ks) -> dict:
    specs = {"baseline": None, **{("ngram", k): {"method": "ngram", "num_speculative_tokens": k} for k in ngram_ks},
             **{("draft_model", k): {"method": "draft_model", "num_speculative_tokens": k} for k in draft_ks}}
    rows = compare(prompts, max_tokens, batch, specs)
    base = rows.pop("baseline")
    out = {"batch": batch, "num_prompts": len(prompts), "max_tokens": max_tokens, "baseline_tok_s": base["tok_s"],
           "baseline_tok_s_runs": base["tok_s_runs"]}
    for method in ("ngram", "draft_model"):
        runs = []
        for (m, k), row in rows.items():
            if m == method:
                row["same_output"] = row.pop("outputs") == base["outputs"]
                row["speedup"] = round(row["tok_s"] / base["tok_s"], 3)
                runs.append(row)
        out[method] = max(runs, key=lambda r: r["tok_s"])
        out[f"{method}_by_k"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few prompts (any device)")
    parser.add_argument("--reuse", default=None, help="take sections 1's numbers from this earlier JSON")
    args = parser.parse_args()
    from common import save
    from kvlab.workloads.code_prompts import load_code_prompts

    smoke = args.smoke
    result = {"device": torch.cuda.get_device_name() if profile.DEVICE == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d"), "smoke": smoke}

    def checkpoint(key, value):
        result[key] = value
        print(key, {k: v for k, v in value.items() if k != "outputs"} if isinstance(value, dict) else value,
              flush=True)
        save("speculative" if not smoke else "speculative_smoke", result, args.out)

    batches, qs, context = ([1, 2], [1, 2, 6], 64) if smoke else ([1, 8, 32], list(range(1, 17)), 2048)
    if args.reuse:
        earlier = json.loads(Path(args.reuse).read_text())
        for key in ("verify_cost", "verify_ratio_k5_b1", "engine_step_b1_ms"):
            checkpoint(key, earlier[key])
        result["verify_cost_date"] = earlier["date"]
        cost = earlier["verify_cost"]
    else:
        model = random_model(SHAPE_SMOKE if smoke else SHAPE_8B)
        cost = verify_cost(model, batches, qs, context)
        cost["model"] = "Llama-3-8B-shaped, random bf16" if not smoke else "smoke"
        checkpoint("verify_cost", cost)
        one, six = cost["step_ms"]["1"][qs.index(1)], cost["step_ms"]["1"][qs.index(6)]
        checkpoint("verify_ratio_k5_b1", round(six / one, 4))
        checkpoint("engine_step_b1_ms", {"q1": round(engine_step_ms(model, context, 1), 4),
                                         "q6": round(engine_step_ms(model, context, 6), 4)})
        del model
        if profile.DEVICE == "cuda":
            torch.cuda.empty_cache()

    prompts = load_code_prompts()[:4 if smoke else 50]
    tokens = 16 if smoke else 128
    checkpoint("tiny_pair", tiny_pair(prompts, tokens, [1, 2, 3] if smoke else list(range(1, 9)),
                                      batch=4 if smoke else 16))
    c = draft_cost_ratio()
    e2e = end_to_end(prompts, tokens, 1, [2, 4] if smoke else [2, 4, 6, 8], [2] if smoke else [2, 3, 4, 6])
    e2e["draft_model"]["cost_ratio_c"] = round(c, 4)
    e2e["draft_model"]["alpha"] = result["tiny_pair"]["alpha_k1"]
    checkpoint("end_to_end", e2e)

    sweep = {"batch": [1, 4] if smoke else [1, 2, 4, 8, 16, 32], "ngram": [], "draft_model": []}
    k_ngram, k_draft = e2e["ngram"]["k"], e2e["draft_model"]["k"]
    for b in sweep["batch"]:
        rows = compare(prompts, tokens // 2, b, {"none": None,
                                                 "ngram": {"method": "ngram", "num_speculative_tokens": k_ngram},
                                                 "draft_model": {"method": "draft_model",
                                                                 "num_speculative_tokens": k_draft}}, repeats=1)
        for method in ("ngram", "draft_model"):
            sweep[method].append(round(rows[method]["tok_s"] / rows["none"]["tok_s"], 3))
    # the 8B-shaped model: tokens per step at the tiny pair's alpha / the step's cost ratio
    alpha = result["tiny_pair"]["alpha_k1"]
    k = 5
    sweep["predicted_8b"] = {"alpha": alpha, "k": k, "batch": batches,
                             "speedup": [round(expected_tokens_per_step(alpha, k) / (
                                 cost["step_ms"][str(b)][qs.index(k + 1)] / cost["step_ms"][str(b)][qs.index(1)]), 3)
                                 for b in batches] if k + 1 in qs else None}
    checkpoint("batch_speedup", sweep)


if __name__ == "__main__":
    main()
