"""paged_decode on the GPU: split vs non-split vs PyTorch peers, as effective KV bandwidth.

    python benchmarks/bench_paged_decode.py [--out DIR]

bf16, 32 query heads over 8 KV heads, head dim 128, block size 16, block tables shuffled.
Bytes counted: K and V of every cached token, read once. Peers in the same run: SDPA with the
cuDNN and the flash backends on *contiguous* K/V (no paging: the ceiling a paged kernel aims
at), gather-then-SDPA (copy each sequence's pages into a contiguous tensor, then flash SDPA),
and the device-to-device copy rate. Small shapes are also timed as CUDA-graph replays, which
leave out the launch gaps.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import kvlab  # noqa: E402,F401
from common import bench, copy_bandwidth, environment, print_table, save  # noqa: E402
from kvlab.kernels import paged_decode  # noqa: E402
from kvlab.reference import paged_attention_ref  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 32, 8, 128, 16
SHAPES = [(32, 32768), (1, 131072), (1, 32768), (4, 32768), (8, 8192), (1, 1024), (32, 1024)]


def make_batch(batch: int, seq_len: int):
    blocks = seq_len // BLOCK_SIZE
    num_blocks = batch * blocks
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks).to(torch.int32).contiguous()
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = environment()
    ceiling = copy_bandwidth()
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
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; copy ceiling {ceiling / 1e12:.2f} TB/s")
    print_table(rows, list(rows[0]))
    save("paged_decode", {"env": env, "copy_ceiling_Bps": ceiling, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
