"""Chapter 8's serving experiment: static vs continuous vs continuous + chunked prefill, on a
Poisson request trace replayed in real time.

    python benchmarks/bench_serving.py [--out benchmarks/results] [--layers 32] [--requests 300] [--load 0.9]
    python benchmarks/bench_serving.py --tiny [--out DIR]    # the shipped tiny model, scaled down (CPU, < 1 min)

Chapter 8's headline run (results/serving_mixed.json; ~8 minutes on an H200), a trace with both
long prompts and long answers, at the capacity measured on its own requests:

    python benchmarks/bench_serving.py --requests 200 --load 1.0 --long-share 0.3 --long-answer-share 0.1 \
        --long-answer-lengths 1024,2048 --capacity-requests 0 --no-static-capacity --budgets 512 \
        --only static,chunked-512 --name serving_mixed

* The model: bench_engine.py's random Llama-3-8B shape in bf16, with ``max_position_embeddings``
  = 32,768 (Llama 3.1's context) so that 16K-token prompts fit. ``--tiny``: the shipped tiny
  model (``LLM()``'s, context 2,048) and every length of the mix scaled by ``--scale``.
* The trace (:func:`kvlab.workloads.serving.poisson_trace`): ``--requests`` Poisson arrivals,
  :class:`~kvlab.workloads.serving.LengthMix`'s defaults (chats of 50-1,000 prompt and 50-400
  output tokens, 10% prompts of 8K-16K tokens), seed ``--seed``; greedy, no early stop.
  ``--output-lengths LO,HI`` redraws every answer in LO-HI; ``--long-answer-share S`` makes a
  share S of the answers long (``--long-answer-lengths``, 1,024-2,048 tokens): the long tail
  of answer lengths that a static batch waits on.
* Its rate: ``--load`` times the continuous engine's capacity, measured first by serving
  ``--capacity-requests`` requests of the same mix (seed + 1) that all arrive at once:
  requests / time to serve them all. ``--capacity-requests 0``: the burst is the trace's own
  requests, so the load is relative to exactly this trace's work (a small trace's mix varies
  with its seed, and a capacity measured on other requests of the mix can be far off). Static
  batching's capacity on the same burst is measured too (``static_capacity_req_s``; not with
  ``--no-static-capacity``): the two policies' throughput with the queue never empty.
* The configurations (:func:`configs`): ``LLM`` settings each. "static" batches by admission
  (a batch of up to ``max_num_seqs`` requests runs to completion before the next starts).
  Settings the engine does not know yet are refused with a TypeError: that row is skipped,
  and says why.
* Reported per configuration: TTFT and ITL p50/p99, output and total tokens/s, the share of
  decoding steps that also computed more than ``--long-prefill`` prompt tokens ("a decode
  waited behind a long prefill"), preemptions.
* A :class:`~kvlab.workloads.serving.StepCostModel` fitted on the continuous run's steps, its
  relative error on every run's steps, and every configuration replayed in virtual time with
  it (:func:`~kvlab.workloads.replay.simulate`), beside the measured numbers.
"""
from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from common import print_table, save  # noqa: E402
from kvlab.workloads.replay import replay_realtime, scheduler_factory_like, simulate  # noqa: E402
from kvlab.workloads.serving import LONG_PREFILL_TOKENS, LengthMix, StepCostModel, poisson_trace  # noqa: E402

CONTEXT = 32768                      # Llama 3.1's context: 16K prompts fit
RESULTS = Path(__file__).resolve().parent / "results"
BUDGETS = (512, 2048, 8192)          # max_num_batched_tokens of the chunked runs
# settings that only restate what today's engine does: dropped if LLM does not know them yet
TODAY = {"enable_chunked_prefill": False, "scheduling_policy": "fcfs"}


def configs(context: int, budgets) -> list[dict]:
    """The configurations compared: a name, ``LLM`` settings, and static admission or not."""
    whole = {"enable_chunked_prefill": False, "max_num_batched_tokens": context}
    middle = sorted(budgets)[len(budgets) // 2]
    return [{"name": "static", "static": False, "settings": {**whole, "scheduling_policy": "static"}},
            {"name": "continuous", "static": False, "settings": whole},
            *({"name": f"chunked-{b}", "static": False,
               "settings": {"enable_chunked_prefill": True, "max_num_batched_tokens": b}} for b in budgets),
            # the seed's fairness rule: a prompt waiting over 100 ms goes before the decodes
            {"name": f"chunked-{middle}-fair", "static": False,
             "settings": {"enable_chunked_prefill": True, "max_num_batched_tokens": middle,
                          "prefill_priority_after": 0.1}}]


def build_model(layers: int, device: str = "cuda", **shape):
    """bench_engine.py's 8B shape (``shape`` overrides fields), random bf16 weights on ``device``."""
    from bench_engine import SHAPE

    from kvlab.models import LlamaForCausalLM, ModelConfig
    from kvlab.models.loader import _skip_init

    fields = {**SHAPE, "max_position_embeddings": CONTEXT, **shape}
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, **fields})
    with _skip_init():
        model = LlamaForCausalLM(config)
    gen = torch.Generator(device).manual_seed(0)
    state = {}
    for name, t in model.state_dict().items():
        w = torch.empty(t.shape, dtype=torch.bfloat16, device=device)
        state[name] = w.fill_(1.0) if name.endswith("norm.weight") else w.normal_(0.0, 0.02, generator=gen)
    model.load_state_dict(state, assign=True)
    model.rotary.tables(torch.device(device))
    return model.eval()


def make_llm(model, tokenizer, base: dict, settings: dict):
    """``LLM(model, **base, **settings)``; settings the engine does not know that only restate
    today's behaviour (:data:`TODAY`) are dropped; any other unknown one raises TypeError."""
    from kvlab import LLM, EngineConfig

    try:
        return LLM(model, tokenizer, **base, **settings)
    except TypeError:
        unknown = set(settings) - set(EngineConfig.__dataclass_fields__)
        if not unknown or any(k not in TODAY or settings[k] != TODAY[k] for k in unknown):
            raise
        return LLM(model, tokenizer, **base, **{k: v for k, v in settings.items() if k not in unknown})


def free_memory() -> None:
    """Give a deleted engine's KV cache and graphs back to the GPU before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def burst(n: int, seed: int, mix: LengthMix) -> list:
    """``n`` requests of ``mix``, all arriving at time 0."""
    return [replace(r, arrival_time=0.0) for r in poisson_trace(n, 1.0, seed, mix)]


def measure_capacity(model, tokenizer, base: dict, settings: dict, requests: list) -> float:
    """Requests/s of an engine with ``settings`` serving ``requests`` (a burst): requests served / time
    to serve them all. (The first call also compiles the kernels' variants: a warm-up.)"""
    llm = make_llm(model, tokenizer, base, settings)
    result = replay_realtime(llm, requests)
    del llm
    free_memory()
    return result.summary().num_finished / result.duration


def run_config(model, tokenizer, base: dict, cfg: dict, trace, args) -> tuple[dict, object, dict | None]:
    """Replay ``trace`` on one configuration: its row, its result, what simulate needs (or a
    skipped row, None, None)."""
    try:
        llm = make_llm(model, tokenizer, base, cfg["settings"])
    except TypeError as e:
        print(f"skipped {cfg['name']}: the engine refuses its settings {cfg['settings']}: {e}", flush=True)
        return {"name": cfg["name"], "settings": cfg["settings"], "skipped": str(e)}, None, None
    replay = {"factory": scheduler_factory_like(llm.scheduler), "num_blocks": llm.pool.num_blocks,
              "block_size": llm.pool.block_size}
    result = replay_realtime(llm, trace, seed=args.seed, static=cfg["static"], long_prefill_threshold=args.long_prefill)
    del llm
    free_memory()
    row = {"name": cfg["name"], "static": cfg["static"], "settings": cfg["settings"], **result.summary().as_dict(),
           "preemptions": result.num_preemptions, "steps": len(result.steps),
           "ttft_s": [None if t.ttft is None else round(t.ttft, 5) for t in result.timings],
           "itl_quantiles_s": np.round(np.percentile([g for t in result.timings for g in t.itls] or [np.nan],
                                                     np.arange(101)), 6).tolist()}
    print({k: v for k, v in row.items() if k not in ("ttft_s", "itl_quantiles_s")}, flush=True)
    return row, result, replay


def fit_and_replay(rows: list[dict], results: dict, replays: dict, trace, args) -> dict | None:
    """Fit the step-cost model on the continuous run; add each run's fit error and simulated summary."""
    if "continuous" not in results:
        return None
    model = StepCostModel.fit(results["continuous"].cost_samples())
    for row in rows:
        name = row["name"]
        if name not in results:
            continue
        errors = model.relative_errors(results[name].cost_samples())
        row["cost_model_rel_err_p50"] = float(np.median(errors))
        row["cost_model_rel_err_p90"] = float(np.percentile(errors, 90))
        r = replays[name]
        sim = simulate(trace, r["factory"], model, num_blocks=r["num_blocks"], block_size=r["block_size"],
                       static=row["static"], long_prefill_threshold=args.long_prefill)
        row["simulated"] = sim.summary().as_dict()
    return model.to_json()


def table(rows: list[dict]) -> None:
    ms = lambda v: "-" if v is None else round(v * 1e3, 1)          # noqa: E731
    shown = [{"config": r["name"], "failed": r["num_failed"], "TTFT p50 ms": ms(r["ttft_p50"]),
              "TTFT p99 ms": ms(r["ttft_p99"]), "ITL p50 ms": ms(r["itl_p50"]), "ITL p99 ms": ms(r["itl_p99"]),
              "out tok/s": round(r["output_throughput"], 1), "total tok/s": round(r["total_throughput"], 1),
              "behind long prefill": round(r["decode_behind_long_prefill"], 3),
              "sim ITL p99 ms": ms(r.get("simulated", {}).get("itl_p99"))}
             for r in rows if "skipped" not in r]
    if shown:
        print_table(shown, list(shown[0]))


def environment(tiny: bool) -> dict:
    from kvlab import profile

    env = {"device": profile.DEVICE, "torch": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d")}
    if not tiny:
        from common import environment as gpu_environment

        env.update(gpu_environment())
    return env


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="folder for serving.json (default: benchmarks/results; "
                                                    "with --tiny: none)")
    parser.add_argument("--tiny", action="store_true", help="the shipped tiny model, scaled-down trace (CPU)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (300; --tiny: 16)")
    parser.add_argument("--capacity-requests", type=int, default=None,
                        help="burst measuring capacity (200; 16); 0: the trace's own requests")
    parser.add_argument("--static-capacity", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure static batching's capacity on the burst (default: yes)")
    parser.add_argument("--load", type=float, default=0.9, help="arrival rate as a fraction of the capacity")
    parser.add_argument("--scale", type=float, default=None, help="lengths of the mix times this (1; --tiny: 1/16)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="(64; --tiny: 8)")
    parser.add_argument("--budgets", default=None, help="chunked runs' max_num_batched_tokens "
                                                        "(512,2048,8192 times --scale)")
    parser.add_argument("--long-prefill", type=int, default=None,
                        help="prefill tokens of a step that make its decodes wait behind a long prefill "
                             "(2048 times --scale)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-share", type=float, default=None, help="share of long prompts (the mix's default)")
    parser.add_argument("--output-lengths", default=None,
                        help="LO,HI: every answer's length bounds, chats and long prompts (the mix's default)")
    parser.add_argument("--long-answer-share", type=float, default=None,
                        help="share of requests whose answer is long (the mix's default: 0)")
    parser.add_argument("--long-answer-lengths", default=None, help="LO,HI: a long answer's length bounds (1024,2048)")
    parser.add_argument("--only", default=None, help="comma-separated config names to run (default: all)")
    parser.add_argument("--name", default="serving", help="the JSON's name: NAME.json")
    args = parser.parse_args(argv)
    defaults = dict(requests=16, capacity_requests=16, scale=1 / 16, max_num_seqs=8) if args.tiny else \
        dict(requests=300, capacity_requests=200, scale=1.0, max_num_seqs=64)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.budgets is None:
        args.budgets = ",".join(str(max(args.max_num_seqs, round(b * args.scale))) for b in BUDGETS)
    if args.long_prefill is None:
        args.long_prefill = max(1, round(LONG_PREFILL_TOKENS * args.scale))
    if args.out is None and not args.tiny:
        args.out = str(RESULTS)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.tiny:
        from kvlab.engine.llm import DEFAULT_MODEL
        from kvlab.models import load_model

        model, tokenizer, _ = load_model(DEFAULT_MODEL, require_tokenizer=False)
        context = model.config.max_position_embeddings
    else:
        model, tokenizer, context = build_model(args.layers), None, CONTEXT
    mix = LengthMix().scaled(args.scale)
    if args.long_share is not None:
        mix = replace(mix, long_share=args.long_share)
    if args.output_lengths is not None:
        lo, hi = (max(1, round(int(n) * args.scale)) for n in args.output_lengths.split(","))
        mix = replace(mix, short_output=(lo, hi), long_output=(lo, hi))
    if args.long_answer_share is not None:
        mix = replace(mix, long_answer_share=args.long_answer_share)
    if args.long_answer_lengths is not None:
        lo, hi = (max(1, round(int(n) * args.scale)) for n in args.long_answer_lengths.split(","))
        mix = replace(mix, long_answer=(lo, hi))
    if mix.max_tokens > context:
        raise SystemExit(f"the mix reaches {mix.max_tokens} tokens, more than the model's context {context}")
    base = {"max_num_seqs": args.max_num_seqs, "max_model_len": context}
    if not args.tiny:     # a fixed cache (60 GB of K/V): sizing it would probe a whole-context step
        base["num_gpu_blocks"] = 30_000
    runs = configs(context, [int(b) for b in args.budgets.split(",")])
    if args.only:
        runs = [c for c in runs if c["name"] in args.only.split(",") or c["name"] == "continuous"]
    continuous = next(c for c in runs if c["name"] == "continuous")["settings"]
    measure_capacity(model, tokenizer, base, continuous, burst(8, args.seed + 2, mix))     # a warm-up
    bursting = burst(args.requests, args.seed, mix) if args.capacity_requests == 0 else \
        burst(args.capacity_requests, args.seed + 1, mix)
    capacity = measure_capacity(model, tokenizer, base, continuous, bursting)
    # each policy's capacity on the same burst: throughput with the queue never empty
    static = next((c for c in runs if c["name"] == "static"), None)
    static_capacity = None if static is None or not args.static_capacity else \
        measure_capacity(model, tokenizer, base, static["settings"], bursting)
    rate = args.load * capacity
    trace = poisson_trace(args.requests, rate, args.seed, mix)
    print(f"capacity {capacity:.2f} requests/s (static batching: {static_capacity}); trace of {args.requests} requests at {rate:.2f}/s "
          f"(load {args.load}), {sum(r.prompt_len > mix.short_prompt[1] for r in trace)} long prompts", flush=True)
    rows, results, replays = [], {}, {}
    payload = {"env": environment(args.tiny), "model": "tiny" if args.tiny else f"8B-shaped, {args.layers} layers",
               "context": context, "engine": base,
               "trace": {"requests": args.requests, "rate_req_s": rate, "load": args.load, "seed": args.seed,
                         "capacity_req_s": capacity, "capacity_requests": args.capacity_requests,
                         "static_capacity_req_s": static_capacity,
                         "mix": asdict(mix)},
               "long_prefill_tokens": args.long_prefill, "rows": rows, "cost_model": None}
    for cfg in runs:
        row, result, replay = run_config(model, tokenizer, base, cfg, trace, args)
        rows.append(row)
        if result is not None:
            results[cfg["name"]], replays[cfg["name"]] = result, replay
        save(args.name, payload, args.out)          # what is measured so far survives a time limit
    payload["cost_model"] = fit_and_replay(rows, results, replays, trace, args)
    table(rows)
    save(args.name, payload, args.out)
    return payload


if __name__ == "__main__":
    main()
