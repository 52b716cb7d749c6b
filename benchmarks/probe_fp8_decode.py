"""Why an fp8 KV cache does not make paged_decode twice as fast on an H200.

Variants of the quantised split kernel that leave one part of its work out, and a sweep of its
launch:

    python benchmarks/probe_fp8_decode.py [--out DIR]           # the variants, 4 shapes
    python benchmarks/probe_fp8_decode.py --sweep [--out DIR]   # splits x tile x warps x stages
    ncu --clock-control none -k regex:"probe_kernel|decode_split" -c 4 \
        python benchmarks/probe_fp8_decode.py --ncu               # one launch of 4 variants, for counters

``probe_kernel`` is ``paged_decode``'s split kernel with switches: ``MODE`` 0 converts the e4m3
codes to fp16 for the dots, as the engine's kernel does, 1 quantises q and the probabilities
to e4m3 too and runs fp8 dots (no conversion of K/V; row scales keep the codes in range), 2 only
loads the tiles and folds them into a checksum (no dots, no softmax: the loads' own pace);
``SCALES=False`` leaves the scale loads out; ``V_T`` reads V from a copy stored transposed within
each page (``[num_blocks, num_kv_heads, head_dim, block_size]``, vLLM's first value-cache layout),
so the tile ``p @ v`` wants, keys side by side, is the one memory holds. (The probe masks V before
converting it, as the engine's kernel did before 2026-12-02's evening: MODE 0 keeps that kernel's
byte-wise shared-memory reads of V.) Times are ``do_bench`` medians over the same
shuffled pages, bf16's engine call first; errors against float32 attention on the dequantised
cache. bf16, 32 query / 8 KV heads, head_dim 128, pages of 16 tokens.
"""
import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

import kvlab  # noqa: F401  (the profile first)
import triton
import triton.language as tl
from triton.testing import do_bench
from kvlab.kernels import paged_decode
from kvlab.kernels.paged_decode import merge_splits_kernel   # the engine's merge: only stage 1 is probed
from kvlab.kernel_plan import choose_num_splits
from kvlab.quantization import quantize_kv, dequantize_kv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged_decode import BLOCK_SIZE as BS, DIM, HEADS, KV_HEADS, contiguous_kv  # noqa: E402
from bench_paged_decode import make_batch as make  # noqa: E402


@triton.jit
def probe_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, out_ptr, lse_ptr, sm_scale,
               stride_qt, stride_qh, stride_table, num_kv_heads, num_splits,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr, MODE: tl.constexpr, SCALES: tl.constexpr, V_T: tl.constexpr = False):
    # MODE 0: fp16 dots (the engine's way); 1: fp8 dots (q and p in e4m3, row-scaled); 2: loads only
    # V_T: V stored transposed within its page, [num_blocks, num_kv_heads, HEAD_DIM, BLOCK_SIZE]
    seq = tl.program_id(0); kv_head = tl.program_id(1); split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + seq)
    tps = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tps
    end = tl.minimum(start + tps, seq_len)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None], other=0.0).to(tl.float32)
    q_amax = tl.max(tl.abs(q), axis=1)
    q_amax = tl.where(q_amax > 0, q_amax, 1.0)
    if MODE == 1:
        qd = (q * (448.0 / q_amax)[:, None]).to(tl.float8e4nv)
        row_scale = q_amax / 448.0 * sm_scale
    else:
        qd = q.to(tl.float16)
        row_scale = tl.full([GROUP_PAD], 1.0, tl.float32) * sm_scale
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    probe = tl.zeros([HEAD_DIM], tl.int32)
    row_stride = num_kv_heads * HEAD_DIM
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(bt_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = slot[:, None] * row_stride + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
        if V_T:
            # A key's values sit BLOCK_SIZE bytes apart and a page's keys side by side, so the
            # tile p @ v wants (keys adjacent) is how memory holds it. Unmasked: the probe's
            # shapes have whole tiles only (a real kernel must zero rows past the end).
            page_c = tl.max_constancy(page, BLOCK_SIZE)      # tiles start on a page boundary
            v_offs = ((page_c.to(tl.int64) * num_kv_heads + kv_head) * HEAD_DIM * BLOCK_SIZE)[:, None] \
                + dims[None, :] * BLOCK_SIZE + (tl.arange(0, BLOCK_N) % BLOCK_SIZE)[:, None]
            v = tl.load(v_ptr + v_offs)
        else:
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        if SCALES:
            k_scale = tl.load(ks_ptr + slot * num_kv_heads + kv_head, mask=valid, other=0.0)
            v_scale = tl.load(vs_ptr + slot * num_kv_heads + kv_head, mask=valid, other=0.0)
        else:
            k_scale = tl.full([BLOCK_N], 0.01, tl.float32)
            v_scale = tl.full([BLOCK_N], 0.01, tl.float32)
        if MODE == 2:
            probe = tl.maximum(probe, tl.max(k.to(tl.int8, bitcast=True).to(tl.int32), axis=0))
            probe = tl.maximum(probe, tl.max(v.to(tl.int8, bitcast=True).to(tl.int32), axis=0))
            probe += tl.sum(k_scale + v_scale).to(tl.int32)
        else:
            if MODE == 1:
                s = tl.dot(qd, tl.trans(k))
            else:
                s = tl.dot(qd, tl.trans(k.to(tl.float16))).to(tl.float32)
            s = s * row_scale[:, None] * k_scale[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            w = p * v_scale[None, :]
            if MODE == 1:
                r = tl.max(w, axis=1)
                r = tl.where(r > 0, r, 1.0)
                pv = tl.dot((w * (448.0 / r)[:, None]).to(tl.float8e4nv), v) * (r / 448.0)[:, None]
            else:
                pv = tl.dot(w.to(tl.float16), v.to(tl.float16)).to(tl.float32)
            acc = acc * alpha[:, None] + pv
            m = m_new
    if MODE == 2:
        acc += probe[None, :].to(tl.float32)
        l += 1.0
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
    row = seq * num_kv_heads * GROUP + heads
    tl.store(out_ptr + ((row * num_splits + split)[:, None]) * HEAD_DIM + dims[None, :], out, mask=head_mask[:, None])
    tl.store(lse_ptr + row * num_splits + split, lse, mask=head_mask)


def run_probe(q, k8, v8, ks, vs, tables, seq_lens, splits, out, mode, scales=True, block_n=128, warps=4, stages=3,
              v_t=False):
    batch = q.shape[0]
    partial = torch.empty(batch, HEADS, splits, DIM, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, HEADS, splits, dtype=torch.float32, device=q.device)
    probe_kernel[(batch, KV_HEADS, splits)](q, k8, v8, ks, vs, tables, seq_lens, partial, lse, 1 / math.sqrt(DIM),
                                          q.stride(0), q.stride(1), tables.stride(0), KV_HEADS, splits,
                                          GROUP=HEADS // KV_HEADS, GROUP_PAD=16, HEAD_DIM=DIM, BLOCK_SIZE=BS,
                                          BLOCK_N=block_n, MODE=mode, SCALES=scales, V_T=v_t, num_warps=warps,
                                          num_stages=stages)
    merge_splits_kernel[(batch * HEADS,)](partial, lse, out, splits, HEAD_DIM=DIM, SPLITS_PAD=triton.next_power_of_2(splits))
    return out


def ref_out(q, k, v, tables, seq_len):
    """float32 attention of one query token per sequence over its pages, in order."""
    kk, vv = (t.float().repeat_interleave(HEADS // KV_HEADS, 1) for t in contiguous_kv(k, v, tables))
    return torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None], kk, vv)[:, :, 0]


def variants_table(ncu: bool) -> list[dict]:
    shapes = [(32, 32768)] if ncu else [(32, 32768), (1, 131072), (8, 8192), (32, 4096)]
    rows = []
    for batch, seq_len in shapes:
        q, k, v, tables, seq_lens = make(batch, seq_len)
        (k8, ks), (v8, vs) = quantize_kv(k, "fp8"), quantize_kv(v, "fp8")
        v8t = v8.permute(0, 2, 3, 1).contiguous()          # [num_blocks, KV, HEAD_DIM, BLOCK_SIZE]
        splits = choose_num_splits(batch, KV_HEADS, seq_len, 132)
        out = torch.empty_like(q)
        probe = lambda mode, **kw: (lambda: run_probe(q, k8, v8, ks, vs, tables, seq_lens, splits, out, mode, **kw))  # noqa: E731
        probe_t = lambda n, **kw: (lambda: run_probe(q, k8, v8t, ks, vs, tables, seq_lens, n, out, 0, v_t=True, **kw))  # noqa: E731
        variants = {
            "bf16": lambda: paged_decode(q, k, v, tables, seq_lens, splits, validate=False, out=out),
            "fp8": lambda: paged_decode(q, k8, v8, tables, seq_lens, splits, validate=False, out=out,
                                        k_scale=ks, v_scale=vs),
            "fp16_dots": probe(0), "fp16_dots_no_scales": probe(0, scales=False),
            "loads_only": probe(2), "loads_only_no_scales": probe(2, scales=False),
            "fp8_dots": probe(1), "fp8_dots_n256": probe(1, block_n=256), "fp8_dots_8_warps": probe(1, warps=8),
            "v_transposed": probe_t(splits), "v_transposed_2x_splits": probe_t(2 * splits),
            "v_transposed_n64_s2": probe_t(2 * splits, block_n=64, stages=2),
            "v_transposed_8_warps": probe_t(splits, warps=8),
        }
        if ncu:
            for name in ("bf16", "fp8", "v_transposed", "v_transposed_n64_s2"):
                variants[name]()
            torch.cuda.synchronize()
            return []
        want = ref_out(q, dequantize_kv(k8, ks, torch.float32), dequantize_kv(v8, vs, torch.float32), tables, seq_len) \
            if batch * seq_len <= 32 * 8192 else None
        row = {"shape": f"{batch}x{seq_len}", "splits": splits}
        for name, fn in variants.items():
            fn()
            torch.cuda.synchronize()
            if want is not None and "loads" not in name and "no_scales" not in name:
                row[name + "_err"] = float(f"{((out.float() - want).norm() / want.norm()).item():.2e}")
            row[name + "_us"] = round(do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3, 1)
        for name in variants:
            if name != "bf16":
                row[name + "/bf16"] = round(row[name + "_us"] / row["bf16_us"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, k8, v8, v8t, ks, vs
        torch.cuda.empty_cache()
    return rows


def launch_sweep() -> list[dict]:
    """fp8's engine call over split counts (1-8x bf16's) x block_n x warps x stages."""
    shapes = [(32, 32768), (1, 131072), (8, 8192), (1, 32768), (32, 1024), (4, 32768), (16, 8192)]
    rows = []
    for batch, seq_len in shapes:
        q, k, v, tables, seq_lens = make(batch, seq_len)
        (k8, ks), (v8, vs) = quantize_kv(k, "fp8"), quantize_kv(v, "fp8")
        out = torch.empty_like(q)
        base = choose_num_splits(batch, KV_HEADS, seq_len, 132)
        bf16 = do_bench(lambda: paged_decode(q, k, v, tables, seq_lens, base, validate=False, out=out),
                        warmup=30, rep=200, return_mode="median")
        found = []
        for mult, bn, w, st in itertools.product((1, 2, 4, 8), (64, 128), (4, 8), (2, 3, 4)):
            splits = min(128, base * mult)
            if mult > 1 and splits == base:
                continue
            t = do_bench(lambda: paged_decode(q, k8, v8, tables, seq_lens, splits, validate=False, out=out,
                                              k_scale=ks, v_scale=vs, block_n=bn, num_warps=w, num_stages=st),
                         warmup=20, rep=80, return_mode="median")
            found.append((t, splits, bn, w, st))
        found.sort()
        row = {"shape": f"{batch}x{seq_len}", "bf16_splits": base, "bf16_us": round(bf16 * 1e3, 1),
               "best": [dict(us=round(t * 1e3, 1), ratio=round(t / bf16, 3), splits=s, block_n=bn, warps=w, stages=st)
                        for t, s, bn, w, st in found[:5]]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, k8, v8, ks, vs
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="the launch sweep instead of the variants")
    parser.add_argument("--ncu", action="store_true", help="one launch of four variants at 32 x 32K, for ncu")
    parser.add_argument("--out", default=None, help="folder for probe_fp8_decode.json")
    args = parser.parse_args()
    rows = launch_sweep() if args.sweep else variants_table(args.ncu)
    if args.out and rows:
        path = Path(args.out) / ("probe_fp8_decode_sweep.json" if args.sweep else "probe_fp8_decode.json")
        path.write_text(json.dumps(rows, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
