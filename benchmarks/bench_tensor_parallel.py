"""Tensor parallelism: decode throughput at tensor_parallel_size 1 and 2 in one run, the
all-reduce's cost per step, and the cache capacity the second GPU adds.

    python benchmarks/bench_tensor_parallel.py            # 2 GPUs: writes results/tensor_parallel.json
    python benchmarks/bench_tensor_parallel.py --tiny     # the shipped tiny model over gloo (CPU)

* The model: a random-initialised Llama-3-8B-shaped model (as ``bench_engine.py``) in bf16,
  written once as a checkpoint folder (each rank loads its own shard of it).
* Decode: ``LLM(tensor_parallel_size=N)`` with CUDA graphs, ``batch`` prompts of ``prompt``
  random tokens, ``new`` new tokens, greedy; driven step by step, its decode rate is batch / the
  median time of the steps that only decode. TP=1 and TP=2 run the same prompts.
* All-reduce: ``torch.distributed.all_reduce`` of a ``[batch, hidden]`` tensor in the model's
  dtype between 2 processes (NCCL), median of many; times ``2 * layers + 1``, the all-reduces
  of one step (:func:`kvlab.models.parallel.collectives_per_step`).
* Capacity: ``max_num_seqs`` sequences of ``max_model_len`` tokens, chosen so their KV cache
  exceeds one GPU's budget: the blocks each engine sizes for itself (``gpu_memory_utilization``
  0.9, eager), against the blocks they need.

NVLink multicast (NVLS) is left off (``NCCL_NVLS_ENABLE=0``).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from bench_engine import SHAPE  # noqa: E402
from common import print_table, save  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GPU = dict(batch=32, prompt=2048, new=128, capacity_batch=128, capacity_context=8192, dtype=torch.bfloat16)
TINY = dict(batch=8, prompt=64, new=32, capacity_batch=96, capacity_context=2048, dtype=torch.float32)


def build_checkpoint(folder: Path, layers: int) -> Path:
    """A random bf16 8B-shaped model written as a checkpoint folder (weights N(0, 0.02), norms 1)."""
    from kvlab.models import LlamaForCausalLM, ModelConfig, save_model
    from kvlab.models.loader import _skip_init

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, **SHAPE,
                                  "torch_dtype": "bfloat16"})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with _skip_init(), torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    save_model(model, None, config, folder)
    del model
    torch.cuda.empty_cache()
    return folder


def decode(checkpoint, tp: int, batch: int, prompt: int, new: int, dtype, vocab: int) -> dict:
    """Decode tokens/s of ``batch`` sequences at ``tensor_parallel_size=tp``, and their tokens."""
    from kvlab import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=gen).tolist()
    blocks = batch * -(-(prompt + new) // 16) + batch
    llm = LLM(checkpoint, tensor_parallel_size=tp, block_size=16, num_gpu_blocks=blocks, max_num_seqs=batch,
              max_num_batched_tokens=max(4096, prompt), max_model_len=prompt + new + 16, dtype=dtype)
    try:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts]
        steps, done = [], {}
        start = time.perf_counter()
        while llm.has_unfinished_requests():
            t = time.perf_counter()
            done.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
            if all(item.num_new == 1 for item in llm.last_schedule.scheduled):
                steps.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        graphs = llm.model_runner.graphs is not None
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    median = statistics.median(steps)
    return {"tp": tp, "batch": batch, "cuda_graphs": graphs, "decode_tok_s": round(batch / median, 1),
            "step_ms_median": round(median * 1e3, 3), "step_ms_min": round(min(steps) * 1e3, 3),
            "generate_s": round(total, 2), "tokens": [done[i] for i in ids]}


def _time_all_reduce(rank: int, size: int, init: str, backend: str, shape, dtype, repeat: int, results) -> None:
    import datetime

    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    x = torch.randn(shape, device=device).to(dtype)
    times = []
    for i in range(repeat + 20):
        if backend == "nccl":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            seconds = time.perf_counter() - t
        if i >= 20:                       # the first ones set up connections and buffers
            times.append(seconds)
    if rank == 0:
        results.put(statistics.median(times))
    dist.destroy_process_group()


def all_reduce_seconds(size: int, shape, dtype, backend: str, repeat: int = 200) -> float:
    """Median seconds of one all-reduce of ``shape`` between ``size`` fresh processes."""
    from kvlab.engine.tensor_parallel import free_port

    spawn = torch.multiprocessing.get_context("spawn")
    results = spawn.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn.Process(target=_time_all_reduce, args=(r, size, init, backend, shape, dtype, repeat, results))
             for r in range(size)]
    for p in procs:
        p.start()
    seconds = results.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return seconds


def capacity(checkpoint, tp: int, batch: int, context: int, dtype) -> dict:
    """The blocks an engine sizes for itself at ``tp``, against ``batch`` full sequences' need."""
    from kvlab import LLM

    llm = LLM(checkpoint, tensor_parallel_size=tp, max_num_seqs=batch, max_model_len=context, enforce_eager=True,
              dtype=dtype, gpu_memory_utilization=0.9)
    try:
        blocks, kv_bytes = llm.pool.num_blocks, llm.model_runner.kv_cache.nbytes
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    need = batch * -(-context // 16)
    return {"tp": tp, "batch": batch, "context": context, "blocks_needed": need, "blocks": blocks,
            "kv_cache_GiB_per_rank": round(kv_bytes / 2**30, 2), "fits": blocks >= need}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for the JSON (default: results/, not with --tiny)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="the shipped tiny model over gloo on CPUs")
    parser.add_argument("--skip-capacity", action="store_true")
    args = parser.parse_args()
    from kvlab.engine.llm import DEFAULT_MODEL
    from kvlab.models import load_config

    run = TINY if args.tiny else GPU
    if not args.tiny and torch.cuda.device_count() < 2:
        raise SystemExit("this benchmark needs 2 GPUs (or pass --tiny)")
    with tempfile.TemporaryDirectory(prefix="kvlab-tp-") as tmp:
        start = time.perf_counter()
        checkpoint = DEFAULT_MODEL if args.tiny else build_checkpoint(Path(tmp) / "llama-8b-shaped", args.layers)
        config = load_config(checkpoint)
        print(f"checkpoint ready in {time.perf_counter() - start:.0f} s", flush=True)
        rows = [decode(checkpoint, tp, run["batch"], run["prompt"], run["new"], run["dtype"], config.vocab_size)
                for tp in (1, 2)]
        for row in rows:
            print({k: v for k, v in row.items() if k != "tokens"}, flush=True)
        same = [a == b for a, b in zip(rows[0]["tokens"], rows[1]["tokens"])]
        first = [a[:16] == b[:16] for a, b in zip(rows[0]["tokens"], rows[1]["tokens"])]
        backend = "gloo" if args.tiny else "nccl"
        shape = (run["batch"], config.hidden_size)
        per_op = all_reduce_seconds(2, shape, run["dtype"], backend)
        count = 2 * config.num_layers + 1
        step_s = rows[1]["step_ms_median"] / 1e3
        all_reduce = {"backend": backend, "shape": list(shape), "dtype": str(run["dtype"]).removeprefix("torch."),
                      "per_op_us": round(per_op * 1e6, 2), "per_step": count,
                      "per_step_ms": round(per_op * count * 1e3, 3),
                      "share_of_tp2_step": round(per_op * count / step_s, 3)}
        print("all-reduce:", all_reduce, flush=True)
        caps = [] if args.skip_capacity else [capacity(checkpoint, tp, run["capacity_batch"], run["capacity_context"],
                                                       run["dtype"]) for tp in (1, 2)]
        for c in caps:
            print("capacity:", c, flush=True)
    for row in rows:
        del row["tokens"]
    speedup = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
    print_table(rows, ["tp", "batch", "cuda_graphs", "decode_tok_s", "step_ms_median", "generate_s"])
    print(f"TP=2 / TP=1 decode: {speedup:.2f}x; all-reduces take {all_reduce['per_step_ms']} ms of a "
          f"{rows[1]['step_ms_median']} ms step; greedy outputs equal: {sum(same)}/{len(same)} "
          f"(first 16 tokens: {sum(first)}/{len(first)})")
    env = {"torch": torch.__version__, "device": "cpu" if args.tiny else torch.cuda.get_device_name(0),
           "gpus": 0 if args.tiny else torch.cuda.device_count(), "date": time.strftime("%Y-%m-%d"),
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    payload = {"env": env, "tiny": args.tiny, "layers": config.num_layers, "prompt": run["prompt"], "new": run["new"],
               "decode": rows, "tp2_over_tp1": round(speedup, 3), "target": 1.4,
               "greedy_equal": sum(same), "greedy_first16_equal": sum(first), "all_reduce": all_reduce,
               "capacity": caps}
    out = args.out if args.out is not None else (None if args.tiny else str(RESULTS))
    save("tensor_parallel_tiny" if args.tiny else "tensor_parallel", payload, out)


if __name__ == "__main__":
    main()
