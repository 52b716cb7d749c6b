"""What the argument checks cost: each kernel called with its defaults against the engine's call.

    python benchmarks/bench_default_calls.py [--out DIR]

The default call (``validate=True``, no hints) checks every argument first: metadata on the
host, and every rule on the data's values in one check kernel whose few numbers the host reads
back once (``kvlab.kernels.checks``). The engine's call (``validate=False``, with the hints the
engine passes) checks nothing and reads nothing. The bound the checks must keep: a default
call at most 1.2x the engine's where that takes >= 100 us, else at most 20 us more.

A timing loop calls a launcher again and again on the same tensors; the checks remember the
calls that passed, for unchanged tensors (``checks.remembered``), so only the first call of the
loop is checked and waits for a read. ``default_us`` is that loop's time, the one the bound is for;
``new_inputs_us`` forgets the checks before every call: a call on tensors never seen or
changed since, which always reads (the metadata checks and the rules run in both).

Times are medians of ``triton.testing.do_bench`` (CUDA events; ``common.bench``), the three
calls timed in turn, five rounds (``common.bench_rounds``). A call that
reads nothing back is enqueued while the GPU is still busy with do_bench's cache flush, so its
time is mostly the GPU's; the default call waits for its read, so its time also holds the host
work after the read. ``host_us`` gives the wall time per call of 200 calls in a row, what an
eager Python loop sees.

bf16, 32 query / 8 KV heads, head_dim 128, pages of 16 tokens, block tables shuffled.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from common import arguments, bench_rounds, environment, print_table, save  # noqa: E402
from kvlab.kernels import copy_blocks, flash_attention, paged_decode, paged_prefill, write_kv  # noqa: E402
from kvlab.kernels.checks import forget_checks  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
RATIO_BOUND, SLACK_US, LONG_US = 1.2, 20.0, 100.0


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def paged_cache(lens):
    """K/V caches with every sequence's pages shuffled over the pool; int32 tables and lengths."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks)
    k_cache, v_cache = randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM), randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM)
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def decode_case(batch, seq_len):
    k_cache, v_cache, tables, seq_lens = paged_cache([seq_len] * batch)
    q = randn(batch, HEADS, DIM)
    default = lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens)  # noqa: E731
    # The engine (kvlab.models.backends) passes max_seq_len; under CUDA graphs num_splits too.
    engine = lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, max_seq_len=seq_len,  # noqa: E731
                                  validate=False)
    return default, engine


def prefill_case(num_seqs=4, new=1024, prefix=1024):
    k_cache, v_cache, tables, seq_lens = paged_cache([prefix + new] * num_seqs)
    query_lens = torch.full((num_seqs,), new, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device="cuda")
    q, k_new, v_new = randn(num_seqs * new, HEADS, DIM), randn(num_seqs * new, KV_HEADS, DIM), \
        randn(num_seqs * new, KV_HEADS, DIM)
    default = lambda: paged_prefill(q, k_cache, v_cache, tables, seq_lens, query_lens,  # noqa: E731
                                    k_new=k_new, v_new=v_new)
    engine = lambda: paged_prefill(q, k_cache, v_cache, tables, seq_lens, query_lens, k_new=k_new,  # noqa: E731
                                   v_new=v_new, max_query_len=new, cu_query_lens=cu, validate=False)
    return default, engine


def flash_case(num_seqs=4, seq_len=1024):
    q, k, v = randn(num_seqs * seq_len, HEADS, DIM), randn(num_seqs * seq_len, KV_HEADS, DIM), \
        randn(num_seqs * seq_len, KV_HEADS, DIM)
    cu = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device="cuda")
    default = lambda: flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)  # noqa: E731
    engine = lambda: flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len,  # noqa: E731
                                     validate=False)
    return default, engine


def write_kv_case(num_tokens, num_blocks=4096):
    k_cache, v_cache = randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM), randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM)
    key, value = randn(num_tokens, KV_HEADS, DIM), randn(num_tokens, KV_HEADS, DIM)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    default = lambda: write_kv(key, value, k_cache, v_cache, slots)  # noqa: E731
    engine = lambda: write_kv(key, value, k_cache, v_cache, slots, validate=False)  # noqa: E731
    return default, engine


def copy_blocks_case(num_pairs=16, num_layers=32, num_blocks=512):
    caches = [randn(num_layers, num_blocks, BLOCK_SIZE, KV_HEADS, DIM) for _ in range(2)]
    perm = torch.randperm(num_blocks, device="cuda")
    pairs = torch.stack([perm[:num_pairs], perm[num_pairs:2 * num_pairs]], dim=1).contiguous()
    default = lambda: copy_blocks(caches, pairs)  # noqa: E731
    engine = lambda: copy_blocks(caches, pairs, validate=False)  # noqa: E731
    return default, engine


CASES = [
    ("paged_decode", "B1x1K", lambda: decode_case(1, 1024)),
    ("paged_decode", "B32x32K", lambda: decode_case(32, 32768)),
    ("paged_decode", "B1x128K", lambda: decode_case(1, 131072)),
    ("paged_prefill", "4x1K new on 1K prefix, k_new", prefill_case),
    ("flash_attention", "packed 4x1K", flash_case),
    ("write_kv", "32 tokens", lambda: write_kv_case(32)),
    ("write_kv", "4096 tokens", lambda: write_kv_case(4096)),
    ("copy_blocks", "16 pairs x 32 layers", copy_blocks_case),
]


def host_us(fn, calls: int = 200) -> float:
    """Wall time per call of ``calls`` calls in a row (an eager loop), GPU work included."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    args = arguments().parse_args()
    env = environment()
    rows = []
    for kernel, shape, make in CASES:
        default, engine = make()
        default(), engine()                              # compile, and check the defaults accept the inputs
        torch.cuda.synchronize()
        new_inputs = lambda: (forget_checks(), default())  # noqa: E731
        # in turn, 5 rounds, medians: the small calls are host-bound, and the host's pace drifts
        times = bench_rounds({"engine": engine, "default": default, "new": new_inputs}, rounds=5)
        engine_us, default_us, new_us = (times[k] * 1e6 for k in ("engine", "default", "new"))
        ratio, extra = default_us / engine_us, default_us - engine_us
        holds = ratio <= RATIO_BOUND if engine_us >= LONG_US else extra <= SLACK_US
        row = {"kernel": kernel, "shape": shape, "engine_us": round(engine_us, 1), "default_us": round(default_us, 1),
               "ratio": round(ratio, 2), "extra_us": round(extra, 1),
               "bound": f"<= {RATIO_BOUND}x" if engine_us >= LONG_US else f"<= +{SLACK_US:.0f} us",
               "holds": "yes" if holds else "NO", "new_inputs_us": round(new_us, 1),
               "engine_host_us": round(host_us(engine), 1), "default_host_us": round(host_us(default), 1)}
        print(row, flush=True)
        rows.append(row)
        del default, engine
        torch.cuda.empty_cache()
    print(f"\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}")
    print_table(rows, list(rows[0]))
    save("default_calls", {"env": env, "bound": {"ratio": RATIO_BOUND, "slack_us": SLACK_US, "long_us": LONG_US},
                           "rows": rows}, args.out)


if __name__ == "__main__":
    main()
