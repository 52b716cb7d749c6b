"""Shared helpers of the GPU benchmarks: timing, ceilings, tables, JSON."""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def bench(fn, warmup_ms: float = 50, rep_ms: float = 200) -> float:
    """Median seconds of ``fn()`` on the GPU (CUDA events, via triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3


def bench_rounds(fns: dict, rounds: int = 3, **kwargs) -> dict:
    """Median seconds of each of ``fns`` (name -> fn), timed in turn ``rounds`` times over: a
    clock or temperature drift during the run then lands on every entry alike, not on whichever
    ran last (ratios between kernels of the same run are what the benchmarks report)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn, **kwargs))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def bench_host_loop(fn, repeat: int = 5) -> float:
    """Median seconds of a host-driven loop (many small launches), synchronising around it."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def kernel_seconds(fn, names: tuple[str, ...], reps: int = 20) -> float:
    """Mean device time, in seconds, of the GPU kernels ``fn()`` launches whose names contain one
    of ``names``, with the L2 cache flushed before every call (torch.profiler's kernel records).

    Events around one call (``bench``), even a CUDA-graph replay, also count the time between
    them that no kernel runs: about 10-15 us on an H200 for a graph's launch, a large share of a
    100 us call, and one a step's graph pays once for all its kernels, not per attention call.
    The flush reads 256 MB rather than writing them (``bench``'s flush writes): a written flush
    leaves the L2 full of dirty lines, whose write-back (about 10 us of an H200's DRAM time) the
    timed call would pay, as no call inside a step does."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    fn()
    flush.sum()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.sum()
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages()
                   if e.device_type.name == "CUDA" and any(n in e.key for n in names))
    return total_us / reps / 1e6


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src))


def arguments() -> argparse.ArgumentParser:
    """The command line every benchmark takes: ``--out``, the folder for the JSON results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for the JSON results")
    return parser


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    import triton

    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(f"{r[c]}") for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(f"{r[c]}".rjust(w) for c, w in zip(columns, widths)))


def save(name: str, payload: dict, out_dir: str | None) -> None:
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        path = Path(out_dir) / f"{name}.json"
        path.write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")
