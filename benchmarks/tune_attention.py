"""Tile-size sweeps of the attention kernels on the GPU: how their launch configs were chosen.

    python benchmarks/tune_attention.py [--out DIR] [--only flash,paged,paged_new,extend,decode]

For each shape of the chapter 5 and 6 targets, every candidate config of the course's kernels
(``flash_attention``, ``paged_prefill`` with every key through the block table (``paged``) or
with the step's own K/V given (``paged_new``), ``paged_decode``) is checked against a peer's
output (a wrong config is reported, never timed) and timed; the peers of the same run (SDPA
flash and cuDNN) give the ratios. ``extend`` times both ``paged_prefill`` modes on the
benchmark's extends (new tokens onto a cached prefix) against ``flash_attention``'s default.
``tile_config`` and ``paged_decode``'s defaults are the winners.
(Kernel variants compared along the way, e.g. pointer vs TMA tile loads, are in RESULTS.md.)
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import kvlab  # noqa: E402,F401
from bench_flash_attention import EXTENDS, packed, paged_copy  # noqa: E402
from common import arguments, bench, environment, print_table, save  # noqa: E402
from kvlab.kernels import flash_attention, paged_decode, paged_prefill  # noqa: E402

FLASH_SHAPES = [(8, 1024, 128), (2, 4096, 128), (1, 16384, 128), (4, 4096, 64)]
DECODES = [(32, 32768), (1, 131072), (1, 32768), (1, 1024)]     # (batch, seq_len)
HEADS = 32
# (BLOCK_M, BLOCK_N, warps, stages)
FLASH_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4)]


def tflops(batch, seq_len, dim, seconds):
    return 4 * batch * HEADS * seq_len * seq_len * dim * 0.5 / seconds / 1e12


def sdpa(q, k, v, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def try_time(fn, ref):
    try:
        out = fn()
        err = float((out.float() - ref.float()).abs().max())
        if not err < 3e-2:
            return f"wrong ({err:.1e})"
        return bench(fn)
    except Exception as e:  # noqa: BLE001  (a config that does not compile is a result too)
        return f"error: {type(e).__name__}: {str(e)[:60]}"


def result_row(base, kernel, config, seconds, flops, peer_seconds, ratio_name):
    """One candidate's row: TFLOP/s and speed relative to a peer's time, or why it has neither."""
    bm, bn, w, s = config
    row = dict(base, kernel=kernel, cfg=f"{bm}x{bn} w{w} s{s}")
    if isinstance(seconds, float):
        row.update({"TFLOPs": round(flops / seconds / 1e12, 1), ratio_name: round(peer_seconds / seconds, 3)})
    else:
        row.update({"TFLOPs": seconds, ratio_name: "-"})
    print(row, flush=True)
    return row


def each_case(cases, tune_case, *args) -> list[dict]:
    """The rows of ``tune_case(*case, *args)`` for every case; a case's tensors are freed before the next."""
    rows = []
    for case in cases:
        rows += tune_case(*case, *args)
        torch.cuda.empty_cache()
    return rows


def tune_flash(batch, seq_len, dim, parts):
    rows = []
    q, k, v = (torch.randn(batch, HEADS, seq_len, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = sdpa(q, k, v, SDPBackend.FLASH_ATTENTION)
    peers = {"sdpa_flash": bench(lambda: sdpa(q, k, v, SDPBackend.FLASH_ATTENTION))}
    try:
        peers["sdpa_cudnn"] = bench(lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION))
    except RuntimeError as e:
        print("cudnn:", e)
    base = dict(batch=batch, seq_len=seq_len, dim=dim,
                **{n: round(tflops(batch, seq_len, dim, t), 1) for n, t in peers.items()})
    print(base, flush=True)
    cudnn = peers.get("sdpa_cudnn", peers["sdpa_flash"])
    flops = tflops(batch, seq_len, dim, 1.0) * 1e12
    kc, vc, tables = paged_copy(k, v)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    qp, kp, vp, ref_p = packed(q), packed(k), packed(v), packed(ref)
    qlens = seq_lens.clone()
    cu = torch.nn.functional.pad(torch.cumsum(qlens, 0, dtype=torch.int32), (1, 0))
    for bm, bn, w, s in FLASH_CONFIGS:
        cands = {}
        if "flash" in parts:
            cands["flash"] = (lambda: flash_attention(q, k, v, validate=False, block_m=bm, block_n=bn,
                                                      num_warps=w, num_stages=s), ref)
        if "paged" in parts:
            cands["paged"] = (lambda: paged_prefill(qp, kc, vc, tables, seq_lens, qlens, validate=False,
                                                    max_query_len=seq_len, cu_query_lens=cu, block_m=bm, block_n=bn,
                                                    num_warps=w, num_stages=s), ref_p)
        if "paged_new" in parts:
            cands["paged_new"] = (lambda: paged_prefill(qp, kc, vc, tables, seq_lens, qlens, validate=False,
                                                        k_new=kp, v_new=vp, max_query_len=seq_len,
                                                        cu_query_lens=cu, block_m=bm, block_n=bn,
                                                        num_warps=w, num_stages=s), ref_p)
        for name, (fn, r) in cands.items():
            rows.append(result_row(base, name, (bm, bn, w, s), try_time(fn, r), flops, cudnn, "vs_cudnn"))
    return rows


def tune_extend(batch, prefix, new, dim):
    rows = []
    total = prefix + new
    q = torch.randn(batch, HEADS, new, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, HEADS, total, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * batch * HEADS * dim * (new * prefix + new * (new + 1) / 2)
    kc, vc, tables = paged_copy(k, v)
    seq_lens = torch.full((batch,), total, dtype=torch.int32, device="cuda")
    qlens = torch.full((batch,), new, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * new
    ref = packed(flash_attention(q, k, v, validate=False))
    contiguous = bench(lambda: flash_attention(q, k, v, validate=False))
    base = dict(batch=batch, prefix=prefix, new=new, dim=dim, flash_default=round(flops / contiguous / 1e12, 1))
    print(base, flush=True)
    qp, k_new, v_new = packed(q), packed(k[:, :, prefix:]), packed(v[:, :, prefix:])
    for bm, bn, w, s in FLASH_CONFIGS:
        for name, extra in (("paged", {}), ("paged_new", dict(k_new=k_new, v_new=v_new))):
            fn = (lambda: paged_prefill(qp, kc, vc, tables, seq_lens, qlens, validate=False, max_query_len=new,
                                        cu_query_lens=cu, block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                                        **extra))
            rows.append(result_row(base, name, (bm, bn, w, s), try_time(fn, ref), flops, contiguous, "vs_flash"))
    return rows


def tune_decode(batch, seq_len):
    rows = []
    blocks = seq_len // 16
    kc = torch.randn(batch * blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * kc.numel() * 2
    ref = paged_decode(q, kc, vc, tables, seq_lens, num_splits=1, block_n=16)
    for splits, bn, w, s in itertools.product((None, 1), (32, 64, 128), (4, 8), (2, 3, 4)):
        if splits == 1 and (batch, seq_len) != (1, 32768):
            continue
        fn = (lambda: paged_decode(q, kc, vc, tables, seq_lens, num_splits=splits, max_seq_len=seq_len,
                                   validate=False, block_n=bn, num_warps=w, num_stages=s))
        t = try_time(fn, ref)
        row = dict(batch=batch, seq_len=seq_len, splits=splits or "auto", cfg=f"n{bn} w{w} s{s}")
        row.update(TBps=round(nbytes / t / 1e12, 2) if isinstance(t, float) else t,
                   us=round(t * 1e6, 1) if isinstance(t, float) else "-")
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    parser = arguments()
    parser.add_argument("--only", default="flash,paged,paged_new,extend,decode")
    args = parser.parse_args()
    parts = args.only.split(",")
    result = {"env": environment()}
    if {"flash", "paged", "paged_new"} & set(parts):
        result["flash"] = each_case(FLASH_SHAPES, tune_flash, parts)
    if "extend" in parts:
        result["extend"] = each_case(EXTENDS, tune_extend)
    if "decode" in parts:
        result["decode"] = each_case(DECODES, tune_decode)
    for key in ("flash", "extend", "decode"):
        if key in result:
            best = {}
            for r in result[key]:
                if isinstance(r.get("TFLOPs", r.get("TBps")), float):
                    k = tuple(r[c] for c in ("batch", "seq_len", "prefix", "new", "dim", "kernel", "splits") if c in r)
                    score = r.get("TFLOPs", r.get("TBps"))
                    if k not in best or score > best[k].get("TFLOPs", best[k].get("TBps")):
                        best[k] = r
            print(f"best per shape ({key}):")
            print_table(list(best.values()), list(next(iter(best.values()))))
    save("tune_attention", result, args.out)


if __name__ == "__main__":
    main()
