"""paged_decode on the GPU: split vs non-split vs PyTorch peers, as effective KV bandwidth.

    python benchmarks/bench_paged_decode.py [--out DIR] [--sweep] [--no-chapter]

bf16, 32 query heads over 8 KV heads, head dim 128, block size 16, block tables shuffled.
Bytes counted: K and V of every cached token, read once. Peers in the same run: SDPA with the
cuDNN and the flash backends on *contiguous* K/V (no paging: the ceiling a paged kernel aims
at), gather-then-SDPA (copy each sequence's pages into a contiguous tensor, then flash SDPA),
and the device-to-device copy rate. Small shapes are also timed as CUDA-graph replays, which
leave out the launch gaps. (``rows`` of the JSON: chapter 6's table, which notebook 06 plots;
``--no-chapter`` skips it.)

Medium batches (``medium`` in the JSON): the engine's call (``validate=False``, the split
count from ``choose_num_splits``) against cuDNN SDPA on contiguous K/V, at batch x context
from 1x32K to 32x32K. ``--sweep`` also times, for each of those shapes, every split count of
SPLIT_COUNTS with every tile of TILES and every (num_warps, num_stages) of LAUNCHES, and
reports the best (``sweep`` in the JSON: every config; ``best``: the winner per shape, beside
what ``choose_num_splits`` picked). Every output is poisoned (NaN) before the call that fills
it, and checked against cuDNN's before it is timed.

``--kv-cache-dtype fp8[,int8]`` (``quantized`` in the JSON): the engine's call over a quantised
copy of the same cache (values and a float32 scale per token and KV head) against the bf16
call, at QUANT_SHAPES; each output is checked against cuDNN on the dequantised K/V first. Both
calls are timed eagerly (``time_vs_bf16``), as CUDA-graph replays (``graph_time_vs_bf16``: without
the host's launch time) and by their kernels' device time (``kernel_time_vs_bf16``, torch.profiler,
L2 flushed before each call: without the graph's launch either, as inside a step's graph).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import kvlab  # noqa: E402,F401
from common import arguments, bench, copy_bandwidth, environment, kernel_seconds, print_table, save  # noqa: E402
from kvlab.kernels import paged_decode  # noqa: E402
from kvlab.kernels.paged_decode import choose_num_splits  # noqa: E402
from kvlab.reference import paged_attention_ref  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 32, 8, 128, 16
SHAPES = [(32, 32768), (1, 131072), (1, 32768), (4, 32768), (8, 8192), (1, 1024), (32, 1024)]
MEDIUM_SHAPES = [(2, 8192), (2, 32768), (4, 8192), (4, 32768), (8, 8192), (8, 32768), (16, 8192), (16, 32768),
                 (1, 32768), (1, 131072), (32, 32768)]
SPLIT_COUNTS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
TILES = [64, 128]                                   # BLOCK_N
LAUNCHES = [(4, 2), (4, 3), (8, 2), (8, 3)]         # (num_warps, num_stages)
QUANT_SHAPES = [(32, 32768), (1, 131072), (8, 8192), (1, 32768), (32, 1024)]
MAX_ERROR = 3e-2                                    # bf16: max |paged_decode - cuDNN| allowed before timing


def make_batch(batch: int, seq_len: int, block_size: int = BLOCK_SIZE, shuffled: bool = True):
    """A random bf16 batch of ``seq_len`` tokens a sequence: its pages shuffled over the pool (or in order)."""
    blocks = seq_len // block_size
    num_blocks = batch * blocks
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    ids = torch.randperm(num_blocks, device="cuda") if shuffled else torch.arange(num_blocks, device="cuda")
    tables = ids.view(batch, blocks).to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, tables, seq_lens


def contiguous_kv(k_cache, v_cache, tables):
    """[batch, KV_HEADS, seq_len, DIM] copies of every sequence's pages, in order."""
    batch, blocks = tables.shape
    k = k_cache[tables.long()].view(batch, blocks * BLOCK_SIZE, KV_HEADS, DIM).transpose(1, 2).contiguous()
    v = v_cache[tables.long()].view(batch, blocks * BLOCK_SIZE, KV_HEADS, DIM).transpose(1, 2).contiguous()
    return k, v


def sdpa(q, k, v, backend):
    """One query per sequence against contiguous K/V with GQA (enable_gqa: no K/V repeat)."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


def graph_seconds(fn) -> float:
    """Median seconds of one replay of a CUDA graph that captured ``fn``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()                                           # warm up (compile, allocate) off the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def check(q, k_cache, v_cache, tables, seq_lens) -> float:
    """Relative error of paged_decode (auto splits) against the float32 reference."""
    if q.shape[0] * int(seq_lens[0]) > 1 << 21:      # the reference loops in Python: keep it small
        q, tables, seq_lens = q[:1], tables[:1, :2048 // BLOCK_SIZE], torch.full_like(seq_lens[:1], 2048)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens.tolist(), dtype=torch.float32)
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens)
    return float((out.float() - ref).norm() / ref.norm())


def kv_tbps(batch: int, seq_len: int, seconds: float) -> float:
    """Effective bandwidth: K and V bytes (bf16) of every cached token / time, in TB/s."""
    return 2 * batch * seq_len * KV_HEADS * DIM * 2 / seconds / 1e12


def checked_seconds(fn, out, want, warmup_ms=50, rep_ms=200):
    """Median seconds of ``fn()``, which writes ``out``; first ``out`` is poisoned and the output
    checked against ``want``. Returns a string instead when the output is wrong or the call fails
    (a config that does not compile, say)."""
    try:
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        error = float((out.float() - want.float()).abs().max())   # NaN (a row not written) fails too
        if not error <= MAX_ERROR:
            return f"wrong (max error {error:.1e})"
        return bench(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
    except Exception as e:  # noqa: BLE001  (a config that fails is a result too)
        return f"error: {type(e).__name__}: {str(e)[:60]}"


def medium(batch: int, seq_len: int, num_sms: int, sweep: bool) -> tuple[dict, list[dict], dict | None]:
    """One medium shape: the engine's call and cuDNN SDPA; with ``sweep`` every config too."""
    q, k_cache, v_cache, tables, seq_lens = make_batch(batch, seq_len)
    k, v = contiguous_kv(k_cache, v_cache, tables)
    want = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)
    splits = choose_num_splits(batch, KV_HEADS, seq_len, num_sms)
    out = torch.empty_like(q)
    engine = checked_seconds(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, splits, validate=False,
                                                  out=out), out, want)
    cudnn = bench(lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION))
    row = {"batch": batch, "seq_len": seq_len, "num_splits": splits,
           "engine_TBps": round(kv_tbps(batch, seq_len, engine), 2) if isinstance(engine, float) else engine,
           "cudnn_TBps": round(kv_tbps(batch, seq_len, cudnn), 2),
           "engine_us": round(engine * 1e6, 1) if isinstance(engine, float) else "-",
           "cudnn_us": round(cudnn * 1e6, 1)}
    row["vs_cudnn"] = round(cudnn / engine, 2) if isinstance(engine, float) else "-"
    print(row, flush=True)
    configs, best = [], None
    if sweep:
        for num_splits, block_n, (warps, stages) in itertools.product(SPLIT_COUNTS, TILES, LAUNCHES):
            call = lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits,  # noqa: E731
                                        validate=False, out=out, block_n=block_n, num_warps=warps, num_stages=stages)
            seconds = checked_seconds(call, out, want, warmup_ms=20, rep_ms=80)
            config = {"batch": batch, "seq_len": seq_len, "num_splits": num_splits, "block_n": block_n,
                      "num_warps": warps, "num_stages": stages}
            if isinstance(seconds, float):
                config.update(us=round(seconds * 1e6, 1), TBps=round(kv_tbps(batch, seq_len, seconds), 2))
                if best is None or config["us"] < best["us"]:
                    best = config
            else:
                config.update(us="-", TBps=seconds)
            configs.append(config)
        if best is not None:
            best = dict(best, cudnn_TBps=row["cudnn_TBps"], vs_cudnn=round(row["cudnn_us"] / best["us"], 2),
                        chosen_splits=splits, chosen_TBps=row["engine_TBps"],
                        chosen_vs_best=round(best["us"] / row["engine_us"], 2)
                        if isinstance(row["engine_us"], float) else "-")
            print("best:", best, flush=True)
    del q, k_cache, v_cache, tables, seq_lens, k, v, want, out
    torch.cuda.empty_cache()
    return row, configs, best


def chapter_rows() -> list[dict]:
    """Chapter 6's table (notebook 06 plots it): split, non-split and every peer per shape."""
    rows = []
    for batch, seq_len in SHAPES:
        q, k_cache, v_cache, tables, seq_lens = make_batch(batch, seq_len)
        kv_bytes = 2 * batch * seq_len * KV_HEADS * DIM * 2
        k, v = contiguous_kv(k_cache, v_cache, tables)
        qh = q.contiguous()
        out = torch.empty_like(q)
        runs = {
            "split": lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, max_seq_len=seq_len,
                                          validate=False, out=out),
            "non_split": lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=1,
                                              max_seq_len=seq_len, validate=False, out=out),
            "cudnn_contig": lambda: sdpa(qh, k, v, SDPBackend.CUDNN_ATTENTION),
            "flash_contig": lambda: sdpa(qh, k, v, SDPBackend.FLASH_ATTENTION),
            "gather_sdpa": lambda: sdpa(qh, *contiguous_kv(k_cache, v_cache, tables), SDPBackend.FLASH_ATTENTION),
        }
        row = {"batch": batch, "seq_len": seq_len, "rel_err": f"{check(q, k_cache, v_cache, tables, seq_lens):.1e}"}
        for name, fn in runs.items():
            try:
                seconds = bench(fn)
                row[f"{name}_TBps"] = round(kv_bytes / seconds / 1e12, 2)
            except RuntimeError as e:                     # a backend that refuses the shape
                row[f"{name}_TBps"] = f"n/a ({str(e)[:30]})"
        row["split_us"] = round(bench(runs["split"]) * 1e6, 1)
        if batch * seq_len <= 32 * 1024:
            row["split_graph_us"] = round(graph_seconds(runs["split"]) * 1e6, 1)
        else:
            row["split_graph_us"] = "-"
        row["split_vs_non_split"] = round(row["split_TBps"] / row["non_split_TBps"], 2)
        rows.append(row)
        del q, k_cache, v_cache, tables, k, v
        torch.cuda.empty_cache()
    return rows


def quantized_batch(batch: int, seq_len: int, kv_cache_dtype: str) -> SimpleNamespace:
    """A random bf16 batch (``make_batch``), its cache quantised (``k8``, ``v8`` and their scales),
    and ``want``: cuDNN on the dequantised K/V, what a quantised call must give."""
    from kvlab.paging.kv_cache import per_page_and_head
    from kvlab.quantization import dequantize_kv, quantize_kv

    q, k_cache, v_cache, tables, seq_lens = make_batch(batch, seq_len)
    (k8, k_scale), (v8, v_scale) = quantize_kv(k_cache, kv_cache_dtype), quantize_kv(v_cache, kv_cache_dtype)
    k_scale, v_scale = per_page_and_head(k_scale), per_page_and_head(v_scale)      # as the engine keeps them
    k, v = contiguous_kv(dequantize_kv(k8, k_scale, torch.bfloat16), dequantize_kv(v8, v_scale, torch.bfloat16),
                         tables)
    return SimpleNamespace(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, seq_lens=seq_lens, k8=k8,
                           v8=v8, k_scale=k_scale, v_scale=v_scale, want=sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION))


def quantized(batch: int, seq_len: int, kv_cache_dtype: str, num_sms: int) -> dict:
    """The engine's call on a ``kv_cache_dtype`` cache against the bf16 one, same K/V, each with the
    split count the planner gives its kernel."""
    b = quantized_batch(batch, seq_len, kv_cache_dtype)
    splits = choose_num_splits(batch, KV_HEADS, seq_len, num_sms)
    quant_splits = choose_num_splits(batch, KV_HEADS, seq_len, num_sms, quantised=True)
    out = torch.empty_like(b.q)

    def bf16_call():
        return paged_decode(b.q, b.k_cache, b.v_cache, b.tables, b.seq_lens, splits, validate=False, out=out)

    def quant_call():
        return paged_decode(b.q, b.k8, b.v8, b.tables, b.seq_lens, quant_splits, validate=False, out=out,
                            k_scale=b.k_scale, v_scale=b.v_scale)

    bf16 = bench(bf16_call)
    quant = checked_seconds(quant_call, out, b.want)
    quant_bytes = 2 * batch * seq_len * KV_HEADS * (DIM + 4)        # one byte a value, a float32 scale a row
    row = {"kv_cache_dtype": kv_cache_dtype, "batch": batch, "seq_len": seq_len, "num_splits": splits,
           "quant_num_splits": quant_splits,
           "bf16_us": round(bf16 * 1e6, 1), "bf16_TBps": round(kv_tbps(batch, seq_len, bf16), 2)}
    if isinstance(quant, float):
        row.update(quant_us=round(quant * 1e6, 1), quant_TBps=round(quant_bytes / quant / 1e12, 2),
                   time_vs_bf16=round(quant / bf16, 3))
        # The same two calls replayed from CUDA graphs: no launch gaps, only the kernels (at the
        # small shapes the host's launch time is a large, noisy share of an eager call).
        bf16_graph, quant_graph = graph_seconds(bf16_call), graph_seconds(quant_call)
        row.update(bf16_graph_us=round(bf16_graph * 1e6, 1), quant_graph_us=round(quant_graph * 1e6, 1),
                   graph_time_vs_bf16=round(quant_graph / bf16_graph, 3))
        # And the kernels' own device time (decode and merge), L2 flushed before each call: what
        # the call costs inside a step's graph, without the graph launch that a replay adds.
        names = ("decode_split_kernel", "decode_streams_kernel", "merge_splits_kernel")
        bf16_kernels, quant_kernels = kernel_seconds(bf16_call, names), kernel_seconds(quant_call, names)
        row.update(bf16_kernel_us=round(bf16_kernels * 1e6, 1), quant_kernel_us=round(quant_kernels * 1e6, 1),
                   kernel_time_vs_bf16=round(quant_kernels / bf16_kernels, 3))
    else:
        row.update(quant_us=quant, quant_TBps="-", time_vs_bf16="-", bf16_graph_us="-", quant_graph_us="-",
                   graph_time_vs_bf16="-", bf16_kernel_us="-", quant_kernel_us="-", kernel_time_vs_bf16="-")
    print(row, flush=True)
    del b, out
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = arguments()
    parser.add_argument("--sweep", action="store_true", help="time every split count x tile x launch config")
    parser.add_argument("--no-chapter", action="store_true", help="skip chapter 6's table (rows)")
    parser.add_argument("--kv-cache-dtype", default="", help="also time quantised caches: fp8, int8 or fp8,int8")
    args = parser.parse_args()
    env = environment()
    ceiling = copy_bandwidth()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; copy ceiling {ceiling / 1e12:.2f} TB/s")
    rows = [] if args.no_chapter else chapter_rows()
    if rows:
        print_table(rows, list(rows[0]))
    medium_rows, sweep, best = [], [], []
    for batch, seq_len in MEDIUM_SHAPES:
        row, configs, winner = medium(batch, seq_len, env["sms"], args.sweep)
        medium_rows.append(row)
        sweep += configs
        if winner is not None:
            best.append(winner)
    print("\nmedium batches: the engine's call (validate=False, choose_num_splits) vs cuDNN SDPA, contiguous K/V")
    print_table(medium_rows, list(medium_rows[0]))
    if best:
        print("\nsweep: the best config per shape (us, TB/s), against choose_num_splits' pick with the default tile")
        print_table(best, ["batch", "seq_len", "num_splits", "block_n", "num_warps", "num_stages", "us", "TBps",
                           "cudnn_TBps", "vs_cudnn", "chosen_splits", "chosen_TBps", "chosen_vs_best"])
    payload = {"env": env, "copy_ceiling_Bps": ceiling, "rows": rows, "medium": medium_rows}
    if args.kv_cache_dtype:
        payload["quantized"] = [quantized(batch, seq_len, fmt, env["sms"]) for fmt in args.kv_cache_dtype.split(",")
                                for batch, seq_len in QUANT_SHAPES]
        print_table(payload["quantized"], list(payload["quantized"][0]))
    if args.sweep:
        payload.update(sweep=sweep, best=best, split_counts=SPLIT_COUNTS, tiles=TILES, launches=LAUNCHES)
    save("paged_decode", payload, args.out)


if __name__ == "__main__":
    main()
