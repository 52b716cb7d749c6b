"""kvlab.LLM against transformers' generate: decode throughput on a Llama-3-8B-shaped model.

    python benchmarks/bench_engine.py [--out DIR] [--layers 32] [--batches 1,32]
    python benchmarks/bench_engine.py --tiny-only        # the shipped tiny model (CPU or GPU)

One random-initialised Llama-3-8B-shaped model (32 layers, hidden 4096, 32 query / 8 KV heads
of 128, MLP 14336, vocabulary 128256) in bf16, shared by both engines (kvlab's model holds
the same weight tensors). Prompts: random token ids, 2,048 per sequence; 256 new tokens,
greedy, no early stop.

* transformers: ``generate(cache_implementation="static", disable_compile=True)`` with SDPA
  attention, eager like kvlab (no automatic torch.compile of the decode step).
  Decode tokens/s = batch * 255 / (time for 256 new tokens - time for 1).
* kvlab: ``LLM`` with the Triton backend (paged_prefill, paged_decode), with CUDA graphs (the
  default) and with ``enforce_eager=True``; driven step by step, its decode rate is batch / the
  median time of the steps that only decode.
* ``generate`` wall clock: batch * 256 new tokens / the whole call's time, prefill included.
* the shipped tiny model: ``LLM()`` on 9 short code prompts, 32 new tokens each, greedy,
  tokens/s of the median of 5 ``generate`` calls (the same workload as on a CPU). On Linux it
  also reports how idle the machine was: the load average before, and the share of the CPUs
  that other processes (and, in a VM, the host: steal time) took during the runs.
* the roofline: a decode step must read every weight but the embedding table once, plus
  the batch's K/V; at the measured copy bandwidth that takes ``bytes / bandwidth``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from common import copy_bandwidth, environment, print_table, save  # noqa: E402

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False)
PROMPT, NEW = 2048, 256
DEVICE = "cuda"


def build_models(layers: int):
    """(transformers model, kvlab model) sharing one set of random bf16 weights on the GPU."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from kvlab.models import LlamaForCausalLM, ModelConfig
    from kvlab.models.loader import _skip_init

    hf_config = LlamaConfig(num_hidden_layers=layers, **SHAPE)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            hf = HFLlama(hf_config).eval()
    finally:
        torch.set_default_dtype(default)
    with _skip_init():
        model = LlamaForCausalLM(ModelConfig.from_hf(hf_config.to_dict()))
    missing, _ = model.load_state_dict(hf.state_dict(), strict=False, assign=True)
    if missing:
        raise RuntimeError(f"kvlab's model lacks {missing[:3]}")
    model.rotary.tables(torch.device(DEVICE))
    return hf, model.eval()


def check_same_logits(hf, model) -> float:
    """Max |difference| of the two models' logits on one short prompt (bf16 noise only)."""
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 64), device=DEVICE)
    with torch.inference_mode():
        ref = hf(ids).logits[0].float()
        ours = model.compute_logits(model(ids[0], torch.arange(64, device=DEVICE))).float()
    return float((ref - ours).abs().max() / ref.abs().max())


def time_hf(hf, prompts: torch.Tensor, new: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, cache_implementation="static", pad_token_id=0,
                          disable_compile=True)
    torch.cuda.synchronize()
    assert out.shape[1] == prompts.shape[1] + new
    return time.perf_counter() - start


def run_kvlab(model, prompts: list[list[int]], new: int, eager: bool = False) -> tuple[float, list[float]]:
    """Total seconds and the seconds of each decode-only step of one generate, stepped by hand."""
    from kvlab.engine import LLM, RequestOutputKind, SamplingParams

    batch = len(prompts)
    blocks = batch * -(-(PROMPT + NEW) // 16) + batch
    llm = LLM(model, block_size=16, num_gpu_blocks=blocks, max_num_seqs=batch, max_num_batched_tokens=16384,
              enforce_eager=eager)
    # only the finished outputs are kept (as generate does): no text decoded in between
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for ids in prompts:
        llm.add_request({"prompt_token_ids": ids}, params)
    decode_steps = []
    outputs = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        t = time.perf_counter()
        outputs += [o for o in llm.step() if o.finished]
        if all(item.num_new == 1 for item in llm.last_schedule.scheduled):
            decode_steps.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    assert len(outputs) == batch and all(len(o.outputs[0].token_ids) == new for o in outputs)
    del llm
    torch.cuda.empty_cache()
    return total, decode_steps


def decode_breakdown(model, batch: int, context: int) -> dict:
    """Where a graph-replayed decode step's time goes: the replay alone (GPU time: every layer's
    kernels, K/V of ``context`` tokens per sequence read, nothing written), the matrix products
    alone (the same shapes through cuBLAS, and through cuBLASLt), and their weight bandwidth."""
    import torch.nn.functional as F

    from common import bench
    from kvlab.engine import LLM

    blocks_per_seq = -(-context // 16)
    llm = LLM(model, block_size=16, num_gpu_blocks=batch * blocks_per_seq + 1, max_num_seqs=batch,
              max_num_batched_tokens=16384)
    graphs = llm.model_runner.graphs
    graphs.seq_lens[:batch] = context
    graphs.block_tables[:batch, :blocks_per_seq] = torch.randperm(batch * blocks_per_seq, device=DEVICE).view(
        batch, -1).int()
    graphs.slot_mapping[:batch] = -1
    graph, _ = graphs.graphs[graphs.bucket(batch)]
    replay = bench(graph.replay)
    layer = model.model.layers[0]
    weights = [layer.self_attn.qkv[0], layer.self_attn.o_proj.weight, layer.mlp.gate_up[0], layer.mlp.down_proj.weight]
    x = {w.shape[1]: torch.randn(batch, w.shape[1], device=DEVICE, dtype=w.dtype) for w in weights}
    x[model.lm_head.weight.shape[1]] = torch.randn(batch, model.lm_head.weight.shape[1], device=DEVICE,
                                                   dtype=model.lm_head.weight.dtype)
    row = {"batch": batch, "context": context, "replay_ms": round(replay * 1e3, 3)}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        per_layer = [bench(lambda w=w: F.linear(x[w.shape[1]], w)) for w in weights]
        head = bench(lambda: F.linear(x[model.lm_head.weight.shape[1]], model.lm_head.weight))
        total = sum(per_layer) * len(model.model.layers) + head
        nbytes = sum(w.numel() * w.element_size() for w in weights) * len(model.model.layers) \
            + model.lm_head.weight.numel() * 2
        row[f"{library}_gemms_ms"] = round(total * 1e3, 3)
        row[f"{library}_gemm_TBps"] = round(nbytes / total / 1e12, 2)
        row[f"{library}_per_layer_us"] = [round(t * 1e6, 1) for t in per_layer]
    torch.backends.cuda.preferred_blas_library("cublas")
    del llm
    torch.cuda.empty_cache()
    return row


TINY_PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "def fib(n):",
                "with open(path) as f:", "try:\n    import json", "return self.", "if __name__ == '__main__':"]


def cpu_counters() -> tuple[float, float, float, float] | None:
    """(wall s, CPU s all processes used, CPU s stolen by a VM's host, CPU s this process used), or
    None where ``/proc/stat`` is missing."""
    try:
        import resource

        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (ImportError, OSError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(fields[:3]) + sum(fields[5:7])          # user, nice, system, irq, softirq
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy / tick, fields[7] / tick, own.ru_utime + own.ru_stime


def machine_state(before, after) -> dict:
    """How idle the machine was between two ``cpu_counters``: the shares of all its CPUs that
    other processes and the host (steal) took."""
    if before is None or after is None:
        return {}
    wall = (after[0] - before[0]) * (os.cpu_count() or 1)
    others = (after[1] - before[1]) - (after[3] - before[3])
    return {"other_processes_cpu_share": round(max(others, 0.0) / wall, 3),
            "steal_cpu_share": round((after[2] - before[2]) / wall, 3)}


def tiny_model_rate(repeat: int = 5) -> dict:
    """Tokens/s of the shipped tiny model on this machine's profile (median of ``repeat`` runs)."""
    from kvlab import LLM, SamplingParams, profile

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(TINY_PROMPTS, params, use_tqdm=False)                  # warm-up
    before = cpu_counters()
    times = []
    for _ in range(repeat):
        if profile.DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    state = machine_state(before, cpu_counters())
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # Every run's rate too: on a shared 2-core machine they spread by a third from one minute to the next.
    return {"device": profile.DEVICE, "prompts": len(TINY_PROMPTS), "new_tokens": 32,
            "tok_s": round(tokens / statistics.median(times), 1), "median_s": round(statistics.median(times), 3),
            "runs_tok_s": [round(tokens / t) for t in times], "threads": torch.get_num_threads(),
            "load_average_before": None if load is None else round(load, 2), **state}


def step_bytes(model_bytes: int, batch: int, context: int, layers: int) -> int:
    kv_per_token = layers * 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 2
    return model_bytes + batch * context * kv_per_token


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tiny-only", action="store_true", help="only the shipped tiny model (runs on a CPU)")
    args = parser.parse_args()
    if args.tiny_only:
        print(tiny_model_rate())
        return
    env = environment()
    import transformers

    env["transformers"] = transformers.__version__
    bandwidth = copy_bandwidth()
    tiny = tiny_model_rate()
    print(f"shipped tiny model on the GPU: {tiny}", flush=True)
    hf, model = build_models(args.layers)
    rel_err = check_same_logits(hf, model)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n)
    print(f"{args.layers} layers, {sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B parameters; "
          f"logits agree to {rel_err:.1e} (relative); copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    # warm-up: compile the Triton kernels, settle cuBLAS
    warm = torch.randint(0, SHAPE["vocab_size"], (2, PROMPT), device=DEVICE)
    run_kvlab(model, warm.tolist(), 4)
    run_kvlab(model, warm.tolist(), 4, eager=True)
    time_hf(hf, warm, 4)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(0, SHAPE["vocab_size"], (batch, PROMPT), device=DEVICE)
        time_hf(hf, prompts, 2)                                  # warm-up at this batch size
        hf_1, hf_all = time_hf(hf, prompts, 1), time_hf(hf, prompts, NEW)
        hf_decode = batch * (NEW - 1) / (hf_all - hf_1)
        total, steps = run_kvlab(model, prompts.tolist(), NEW)
        eager_total, eager_steps = run_kvlab(model, prompts.tolist(), NEW, eager=True)
        kvlab_decode = batch / statistics.median(steps)
        roofline = batch / (step_bytes(weight_bytes, batch, PROMPT + NEW // 2, args.layers) / bandwidth)
        rows.append({"batch": batch, "hf_decode_tok_s": round(hf_decode, 1),
                     "kvlab_decode_tok_s": round(kvlab_decode, 1),
                     "kvlab_eager_decode_tok_s": round(batch / statistics.median(eager_steps), 1),
                     "kvlab_vs_hf": round(kvlab_decode / hf_decode, 2), "roofline_tok_s": round(roofline, 1),
                     "kvlab_of_roofline": round(kvlab_decode / roofline, 2),
                     "hf_of_roofline": round(hf_decode / roofline, 2),
                     "hf_generate_tok_s": round(batch * NEW / hf_all, 1),
                     "kvlab_generate_tok_s": round(batch * NEW / total, 1),
                     "kvlab_eager_generate_tok_s": round(batch * NEW / eager_total, 1),
                     "generate_vs_hf": round(hf_all / total, 2),
                     "hf_total_s": round(hf_all, 2), "kvlab_total_s": round(total, 2),
                     "kvlab_step_ms_median": round(statistics.median(steps) * 1e3, 2),
                     "kvlab_eager_step_ms_median": round(statistics.median(eager_steps) * 1e3, 2),
                     "kvlab_step_ms_min": round(min(steps) * 1e3, 2)})
        print(rows[-1], flush=True)
    breakdown = [decode_breakdown(model, r["batch"], PROMPT + NEW // 2) for r in rows]
    for b in breakdown:
        print("decode step breakdown:", b, flush=True)
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}")
    print_table(rows, ["batch", "hf_decode_tok_s", "kvlab_decode_tok_s", "kvlab_eager_decode_tok_s", "roofline_tok_s",
                       "kvlab_of_roofline", "kvlab_vs_hf", "hf_generate_tok_s", "kvlab_generate_tok_s",
                       "generate_vs_hf", "kvlab_step_ms_median"])
    save("engine", {"env": env, "layers": args.layers, "prompt": PROMPT, "new_tokens": NEW, "logits_rel_err": rel_err,
                    "copy_bandwidth_Bps": bandwidth, "weight_bytes_read_per_step": weight_bytes, "rows": rows,
                    "tiny_model": tiny, "decode_breakdown": breakdown},
         args.out)

if __name__ == "__main__":
    main()
