"""Swap or recompute: what each costs on the GPU, and where they cross (chapter 9).

    python benchmarks/bench_offload.py [--out DIR] [--layers 32]

On a Llama-3-8B-shaped cache (bf16, 32 layers x 8 KV heads x 128, blocks of 16 tokens:
128 KiB a token):

* **pinned copies**: the host<->device rate of one 1 GiB pinned buffer, each way (the ceiling);
* **the engine's transfers**: :class:`kvlab.engine.offload.HostKVCache` swapping out and back
  in the shuffled blocks of one sequence of 512 .. 32K tokens (gather into one staging
  buffer, one copy), checked byte for byte, as a fraction of the pinned rate;
* **overlap**: a swap-out of 16K tokens beside 30 ms of matrix products on the compute
  stream, alone and together, with the timeline of both streams;
* **recompute**: ``LLM.generate`` of one prompt of 512 .. 16K tokens (chunked prefill, the
  engine's defaults) on the random-weight 8B-shaped model, one new token;
* the fitted :class:`~kvlab.engine.offload.PreemptionCosts` and the crossover length.

Writes ``offload.json``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from common import arguments, bench_host_loop, environment, print_table, save  # noqa: E402
from kvlab.engine.offload import (HostKVCache, PreemptionCosts, crossover_tokens, model_costs,  # noqa: E402
                                  recompute_seconds, swap_seconds)
from kvlab.paging.kv_cache import allocate_kv_cache  # noqa: E402

SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=32768,
             rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
BLOCK = 16
SWAP_TOKENS = [512, 2048, 8192, 32768]
PREFILL_TOKENS = [512, 2048, 8192, 16384]


def pinned_rates(nbytes: int = 1 << 30) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = nbytes / bench_host_loop(lambda: host.copy_(dev, non_blocking=True))
    h2d = nbytes / bench_host_loop(lambda: dev.copy_(host, non_blocking=True))
    return {"device_to_host_GBps": round(d2h / 1e9, 1), "host_to_device_GBps": round(h2d / 1e9, 1)}


def transfers(layers: int, pinned: dict) -> tuple[list[dict], HostKVCache]:
    cache = allocate_kv_cache(layers, max(SWAP_TOKENS) // BLOCK * 2, BLOCK, 8, 128, dtype=torch.bfloat16, device="cuda")
    for t in cache.block_tensors():
        t.normal_()
    host = HostKVCache(cache, max(SWAP_TOKENS) // BLOCK)
    rows = []
    for tokens in SWAP_TOKENS:
        n = tokens // BLOCK
        blocks = torch.randperm(cache.num_blocks)[:n].tolist()
        back = torch.randperm(cache.num_blocks)[:n].tolist()
        run = list(range(n))
        want = [t[:, blocks].clone() for t in cache.block_tensors()]
        out_s = bench_host_loop(lambda: host.swap_out(blocks, run))
        in_s = bench_host_loop(lambda: host.swap_in(run, back))
        same = all(torch.equal(t[:, back], w) for t, w in zip(cache.block_tensors(), want))
        nbytes = n * host.bytes_per_block
        rows.append({"tokens": tokens, "MiB": nbytes >> 20, "out_ms": round(out_s * 1e3, 2), "in_ms": round(in_s * 1e3, 2),
                     "out_GBps": round(nbytes / out_s / 1e9, 1), "in_GBps": round(nbytes / in_s / 1e9, 1),
                     "out_vs_pinned": round(nbytes / out_s / 1e9 / pinned["device_to_host_GBps"], 2),
                     "in_vs_pinned": round(nbytes / in_s / 1e9 / pinned["host_to_device_GBps"], 2),
                     "bytes_equal": same})
        del want
    return rows, host


def overlap(host: HostKVCache, tokens: int = 16384) -> dict:
    """A swap-out beside compute: how much of the transfer hides behind it."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    reps = max(1, round(0.030 / bench_host_loop(lambda: a @ a)))
    compute = lambda: [a @ a for _ in range(reps)]           # noqa: E731  (~30 ms)
    n = tokens // BLOCK
    blocks, run = torch.randperm(host.kv_cache.num_blocks)[:n].tolist(), list(range(n))
    alone_compute = bench_host_loop(compute, 3)
    alone_swap = bench_host_loop(lambda: host.swap_out(blocks, run), 3)
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    t0 = main.record_event(torch.cuda.Event(enable_timing=True))
    wall = time.perf_counter()
    host.swap_out(blocks, run)
    gathered = main.record_event(torch.cuda.Event(enable_timing=True))   # main waited for the gather
    compute()
    computed = main.record_event(torch.cuda.Event(enable_timing=True))
    copied = host.stream.record_event(torch.cuda.Event(enable_timing=True))
    torch.cuda.synchronize()
    together = time.perf_counter() - wall
    ms = lambda e: round(t0.elapsed_time(e), 2)                # noqa: E731
    timeline = [{"stream": "compute", "op": "wait for the gather", "start_ms": 0.0, "end_ms": ms(gathered)},
                {"stream": "compute", "op": "matrix products", "start_ms": ms(gathered), "end_ms": ms(computed)},
                {"stream": "copy", "op": "gather into staging", "start_ms": 0.0, "end_ms": ms(gathered)},
                {"stream": "copy", "op": "device to host", "start_ms": ms(gathered), "end_ms": ms(copied)}]
    hidden = (alone_compute + alone_swap - together) / alone_swap
    return {"tokens": tokens, "compute_alone_ms": round(alone_compute * 1e3, 2),
            "swap_out_alone_ms": round(alone_swap * 1e3, 2), "together_ms": round(together * 1e3, 2),
            "share_of_transfer_hidden": round(hidden, 2), "timeline": timeline}


def recompute(layers: int) -> tuple[list[dict], object]:
    from kvlab.engine import LLM, SamplingParams
    from kvlab.models import LlamaForCausalLM, ModelConfig

    config = ModelConfig.from_hf(dict(SHAPE, num_hidden_layers=layers))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"), torch.no_grad():
            model = LlamaForCausalLM(config).eval()
            for p in model.parameters():
                p.normal_(0, 0.02)
    finally:
        torch.set_default_dtype(default)
    model.rotary.tables(torch.device("cuda"))
    llm = LLM(model, block_size=BLOCK, num_gpu_blocks=max(PREFILL_TOKENS) // BLOCK + 8, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for tokens in PREFILL_TOKENS:
        ids = torch.randint(0, 128000, (tokens,)).tolist()
        warm = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)
        if warm[0].error is not None:                  # a failed step ends a request fast: no timing
            raise RuntimeError(f"the {tokens}-token prefill failed: {warm[0].error}")
        seconds = bench_host_loop(lambda: llm.generate(prompt_token_ids=[ids], sampling_params=params,
                                                       use_tqdm=False), 3)
        rows.append({"tokens": tokens, "prefill_ms": round(seconds * 1e3, 2),
                     "us_per_token": round(seconds / tokens * 1e6, 2)})
    del llm
    torch.cuda.empty_cache()
    return rows, config


def fit(xs: list[float], ys: list[float], basis) -> list[float]:
    """Least-squares coefficients of ``ys ~ sum(c_i * basis(x)_i)``."""
    a = torch.tensor([basis(x) for x in xs], dtype=torch.float64)
    return torch.linalg.lstsq(a, torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()


def main() -> None:
    parser = arguments()
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    env = environment()
    pinned = pinned_rates()
    print(env, pinned, flush=True)
    swap_rows, host = transfers(args.layers, pinned)
    print_table(swap_rows, list(swap_rows[0]))
    timeline = overlap(host)
    print({k: v for k, v in timeline.items() if k != "timeline"}, flush=True)
    bytes_per_token = host.bytes_per_block // BLOCK
    del host
    torch.cuda.empty_cache()
    prefill_rows, config = recompute(args.layers)
    print_table(prefill_rows, list(prefill_rows[0]))

    # one transfer: latency + bytes / bandwidth (out and in averaged); a prefill: a * n + b * n^2
    per_transfer = [(r["out_ms"] + r["in_ms"]) / 2e3 for r in swap_rows]
    latency, seconds_per_byte = fit([r["tokens"] * bytes_per_token for r in swap_rows], per_transfer,
                                    lambda x: (1.0, x))
    linear, quadratic = fit([r["tokens"] for r in prefill_rows], [r["prefill_ms"] / 1e3 for r in prefill_rows],
                            lambda n: (n, n * n))
    costs = PreemptionCosts(bandwidth=1 / seconds_per_byte, latency=max(latency, 0.0), prefill_per_token=linear,
                            prefill_per_token_sq=max(quadratic, 0.0))
    flops_per_token = model_costs(config, 1.0, 0.0, 1.0).prefill_per_token
    crossover = crossover_tokens(bytes_per_token, costs)
    ladder = [{"tokens": n, "swap_ms": round(swap_seconds(n, bytes_per_token, costs) * 1e3, 3),
               "recompute_ms": round(recompute_seconds(n, costs) * 1e3, 3)} for n in (16, 64, 256, 1024, 4096, 16384)]
    print_table(ladder, list(ladder[0]))
    print(f"costs {costs}; crossover {crossover} tokens; prefill at {flops_per_token / linear / 1e12:.0f} TFLOP/s "
          "of weight FLOPs")
    save("offload", {"env": env, "pinned": pinned, "bytes_per_token": bytes_per_token, "transfers": swap_rows,
                     "overlap": timeline, "recompute": prefill_rows,
                     "costs": {"bandwidth": costs.bandwidth, "latency": costs.latency,
                               "prefill_per_token": costs.prefill_per_token,
                               "prefill_per_token_sq": costs.prefill_per_token_sq,
                               "flops_per_s": flops_per_token / linear},
                     "crossover_tokens": crossover, "ladder": ladder}, args.out)


if __name__ == "__main__":
    main()
