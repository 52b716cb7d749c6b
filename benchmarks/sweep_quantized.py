"""Which launch suits a quantised cache? (GPU; writes ``quantized_tiles.json``)

    python benchmarks/sweep_quantized.py [--out DIR] [--kv-cache-dtype fp8,int8] [--only decode|extend]
                                         [--tiles 128x64x8x3,...]

A quantised tile is half the bytes of a bf16 one and is converted in registers before the
tensor cores see it, so the launch that suits bf16 need not suit it. For each format:

* ``decode``: ``paged_decode`` at bench_paged_decode's QUANT_SHAPES, every (block_n, num_warps,
  num_stages) of DECODE_LAUNCHES with the split count ``choose_num_splits`` picks and with twice
  it, against the bf16 call at its defaults (each output poisoned first and checked against
  cuDNN on the dequantised K/V);
* ``extend``: ``paged_prefill`` at bench_flash_attention's EXTENDS, every tile of EXTEND_TILES,
  against the bf16 call at its defaults (each output checked against the contiguous kernel on the
  dequantised K/V); ``--tiles`` times others instead (``block_m x block_n x num_warps x num_stages``).

Columns ``time_vs_bf16``: the quantised call's time over the bf16 default's, in the same run.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_flash_attention import EXTENDS, quantized_extend_inputs  # noqa: E402
from bench_paged_decode import KV_HEADS, QUANT_SHAPES, checked_seconds, quantized_batch  # noqa: E402
from common import bench, environment, print_table, save  # noqa: E402
from kvlab.kernels import paged_decode, paged_prefill  # noqa: E402
from kvlab.kernels.paged_decode import choose_num_splits, quant_programs_per_sm  # noqa: E402

# (block_n, num_warps, num_stages): decode_streams_kernel runs one stream of keys a warp, so block_n is
# a multiple of 16 keys a warp
DECODE_LAUNCHES = [(n * w, w, s) for (n, w), s in itertools.product([(32, 1), (32, 2), (64, 2), (32, 4)], [2, 3, 4])]
EXTEND_TILES = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3),
                (64, 64, 4, 2), (64, 128, 4, 3), (64, 32, 4, 3)]          # (block_m, block_n, num_warps, num_stages)


def decode_rows(batch: int, seq_len: int, fmt: str, sms: int) -> list[dict]:
    b = quantized_batch(batch, seq_len, fmt)
    chosen = choose_num_splits(batch, KV_HEADS, seq_len, sms)
    out = torch.empty_like(b.q)
    bf16 = bench(lambda: paged_decode(b.q, b.k_cache, b.v_cache, b.tables, b.seq_lens, chosen, validate=False,
                                      out=out))
    rows = []
    for (block_n, warps, stages), factor in itertools.product(DECODE_LAUNCHES, (1, 2)):
        splits = choose_num_splits(batch, KV_HEADS, seq_len, sms, block_n=block_n,
                                   programs_per_sm=quant_programs_per_sm(warps)) * factor
        call = lambda: paged_decode(b.q, b.k8, b.v8, b.tables, b.seq_lens, splits, validate=False,  # noqa: E731
                                    out=out, k_scale=b.k_scale, v_scale=b.v_scale, block_n=block_n,
                                    num_warps=warps, num_stages=stages)
        seconds = checked_seconds(call, out, b.want, warmup_ms=20, rep_ms=100)
        row = {"kv_cache_dtype": fmt, "batch": batch, "seq_len": seq_len, "block_n": block_n, "num_warps": warps,
               "num_stages": stages, "num_splits": splits, "bf16_us": round(bf16 * 1e6, 1)}
        if isinstance(seconds, float):
            row.update(us=round(seconds * 1e6, 1), time_vs_bf16=round(seconds / bf16, 3))
        else:
            row.update(us=seconds, time_vs_bf16="-")
        rows.append(row)
    del b, out
    torch.cuda.empty_cache()
    return rows


def extend_rows(batch: int, prefix: int, new: int, dim: int, fmt: str, tiles=EXTEND_TILES) -> list[dict]:
    case = quantized_extend_inputs(batch, prefix, new, dim, fmt)
    want = case["want"]
    bf16 = bench(lambda: paged_prefill(*case["args"], **case["hints"]))
    rows = []
    for block_m, block_n, warps, stages in tiles:
        if dim == 64 and warps == 8:
            warps = 4
        tile = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        row = {"kv_cache_dtype": fmt, "batch": batch, "prefix": prefix, "new": new, "head_dim": dim, **tile,
               "bf16_us": round(bf16 * 1e6, 1)}
        call = lambda: paged_prefill(*case["quant_args"], **case["quant_scales"], **case["hints"],  # noqa: E731
                                     **tile)
        try:
            out = call()
            err = float((out.float() - want).abs().max())
            seconds = bench(call, warmup_ms=20, rep_ms=100)
            row.update(err=round(err, 4), us=round(seconds * 1e6, 1), time_vs_bf16=round(seconds / bf16, 3))
        except Exception as e:  # noqa: BLE001  (a tile that does not compile is a result too)
            row.update(err="-", us=f"error: {type(e).__name__}: {str(e)[:50]}", time_vs_bf16="-")
        rows.append(row)
    del case, want
    torch.cuda.empty_cache()
    return rows


def best_of(rows: list[dict], keys: list[str]) -> list[dict]:
    """The fastest row of each shape (rows that failed left out)."""
    best = {}
    for r in rows:
        if isinstance(r["us"], float):
            key = tuple(r[k] for k in keys)
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    return list(best.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for the JSON results")
    parser.add_argument("--kv-cache-dtype", default="fp8,int8")
    parser.add_argument("--only", choices=["decode", "extend"], default=None)
    parser.add_argument("--tiles", default=None, help="extend tiles to time, e.g. 128x64x8x3,64x64x4x2")
    args = parser.parse_args()
    tiles = [tuple(int(n) for n in t.split("x")) for t in args.tiles.split(",")] if args.tiles else EXTEND_TILES
    env = environment()
    payload = {"env": env, "decode_launches": DECODE_LAUNCHES, "extend_tiles": tiles}
    for fmt in args.kv_cache_dtype.split(","):
        if args.only in (None, "decode"):
            rows = [r for shape in QUANT_SHAPES for r in decode_rows(*shape, fmt, env["sms"])]
            payload.setdefault("decode", []).extend(rows)
            print(f"\n{fmt} decode: the best launch per shape")
            print_table(best_of(rows, ["batch", "seq_len"]), list(rows[0]))
        if args.only in (None, "extend"):
            rows = [r for shape in EXTENDS for r in extend_rows(*shape, fmt, tiles)]
            payload.setdefault("extend", []).extend(rows)
            print(f"\n{fmt} extend: every tile")
            print_table(rows, list(rows[0]))
    save("quantized_tiles", payload, args.out)


if __name__ == "__main__":
    main()
