"""Why an fp8 KV cache does not make paged_decode twice as fast on an H200.

Variants of the quantised split kernel that leave one part of its work out, and a sweep of its
launch:

    python benchmarks/probe_fp8_decode.py [--out DIR]           # the variants, 4 shapes
    python benchmarks/probe_fp8_decode.py --sweep [--out DIR]   # splits x tile x warps x stages
    python benchmarks/probe_fp8_decode.py --swapped [--out DIR] # the operand-swapped kernels, 5 shapes
    python benchmarks/probe_fp8_decode.py --pages [--out DIR]   # pages shuffled or in order, 16 or 128 a page
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

``swapped_kernel`` turns both products around, ``s.T = k @ q.T`` and ``o.T = v.T @ p.T``, so the
cache's tiles are the MMA's first operand (keys as rows: 64 or 128 of them fill Hopper's
``wgmma``, where the 4 query heads of a GQA group, padded to 16, could not) and the query's
the second. ``V_T`` reads V stored transposed within each page, as above. ``FP8_DOTS`` sends
the codes to the tensor cores as stored, in their fp8 mode, with q and the probabilities each
written as two e4m3 terms (``hi + lo / 16``, about bfloat16's precision; ``LO=False`` keeps one):
nothing of K or V is converted. ``K_HEAD_MAJOR`` reads K from a copy laid out
``[num_blocks, num_kv_heads, block_size, head_dim]`` (a page's keys of one head contiguous).
A slot past a sequence's end must then hold a finite code: the probe's caches do (the engine's
NaN-poisoned tests would not pass it). GPU only: the fp8 terms use Triton's own float32 -> e4m3
conversion, which the interpreter gets wrong (see ``kvlab.kernels.write_kv_quant``).
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
def program_keys(sl_ptr, num_splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's sequence, KV head and split, its range of keys ``[start, end)`` (as the
    engine's kernel cuts them) and the query heads of its GQA group (``head_mask``: the real ones)."""
    seq = tl.program_id(0); kv_head = tl.program_id(1); split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + seq)
    tps = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tps
    end = tl.minimum(start + tps, seq_len)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    return seq, kv_head, split, start, end, heads, tl.arange(0, GROUP_PAD) < GROUP


@triton.jit
def probe_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, out_ptr, lse_ptr, sm_scale,
               stride_qt, stride_qh, stride_table, num_kv_heads, num_splits,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr, MODE: tl.constexpr, SCALES: tl.constexpr, V_T: tl.constexpr = False):
    # MODE 0: fp16 dots (the engine's way); 1: fp8 dots (q and p in e4m3, row-scaled); 2: loads only
    # V_T: V stored transposed within its page, [num_blocks, num_kv_heads, HEAD_DIM, BLOCK_SIZE]
    seq, kv_head, split, start, end, heads, head_mask = program_keys(sl_ptr, num_splits, GROUP, GROUP_PAD, BLOCK_N)
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


@triton.jit
def to_e4m3_terms(x):
    """x (float32, |x| <= 448) as two e4m3 terms: x ~ hi + lo / 16."""
    hi = x.to(tl.float8e4nv)
    return hi, ((x - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)


@triton.jit
def swapped_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, out_ptr, lse_ptr, sm_scale,
                   stride_qt, stride_qh, stride_table, num_kv_heads, num_splits,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, V_T: tl.constexpr, FP8_DOTS: tl.constexpr, LO: tl.constexpr,
                   K_HEAD_MAJOR: tl.constexpr):
    seq, kv_head, split, start, end, heads, head_mask = program_keys(sl_ptr, num_splits, GROUP, GROUP_PAD, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q_t = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[None, :] * stride_qh + dims[:, None],
                  mask=head_mask[None, :], other=0.0).to(tl.float32)              # [HEAD_DIM, GROUP_PAD]
    if FP8_DOTS:
        q_amax = tl.max(tl.abs(q_t), axis=0)
        q_up = 448.0 / tl.where(q_amax > 0, q_amax, 1.0)
        q_hi, q_lo = to_e4m3_terms(q_t * q_up[None, :])
        score_scale = sm_scale / q_up
    else:
        q16 = q_t.to(tl.float16)
        score_scale = tl.full([GROUP_PAD], 1.0, tl.float32) * sm_scale
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)                               # the output, transposed
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(bt_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        if K_HEAD_MAJOR:
            k_offs = ((page.to(tl.int64) * num_kv_heads + kv_head) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * HEAD_DIM \
                + dims[None, :]
        else:
            k_offs = slot[:, None] * (num_kv_heads * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + k_offs)                          # a key past the end reads some page's slot
        k_scale = tl.load(ks_ptr + slot * num_kv_heads + kv_head, mask=valid, other=0.0)
        v_scale = tl.load(vs_ptr + slot * num_kv_heads + kv_head, mask=valid, other=0.0)
        if FP8_DOTS:
            s = tl.dot(k, q_hi)
            if LO:
                s += tl.dot(k, q_lo) * 0.0625
        else:
            s = tl.dot(k.to(tl.float16), q16).to(tl.float32)                      # [BLOCK_N, GROUP_PAD]
        s = s * score_scale[None, :] * k_scale[:, None]
        s = tl.where(valid[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[None, :])
        l = l * alpha + tl.sum(p, axis=0)
        w = p * v_scale[:, None]
        if V_T:
            page_c = tl.max_constancy(page, BLOCK_SIZE)
            v_offs = ((page_c.to(tl.int64) * num_kv_heads + kv_head) * HEAD_DIM * BLOCK_SIZE)[None, :] \
                + dims[:, None] * BLOCK_SIZE + (tl.arange(0, BLOCK_N) % BLOCK_SIZE)[None, :]
            v_offs = tl.max_contiguous(tl.multiple_of(v_offs, [BLOCK_SIZE, BLOCK_SIZE]), [1, BLOCK_SIZE])
            v_t = tl.load(v_ptr + v_offs)                                          # [HEAD_DIM, BLOCK_N]
            if FP8_DOTS:
                w_amax = tl.max(w, axis=0)
                w_up = 448.0 / tl.where(w_amax > 0, w_amax, 1.0)
                w_hi, w_lo = to_e4m3_terms(w * w_up[None, :])
                pv = tl.dot(v_t, w_hi)
                if LO:
                    pv += tl.dot(v_t, w_lo) * 0.0625
                pv = pv / w_up[None, :]
            else:
                # min() turns a NaN code past the end into a number (its weight is 0) and keeps the
                # conversion in the operand's layout: no trip through shared memory
                v_t = tl.minimum(v_t.to(tl.float16), tl.full([1, 1], 448.0, tl.float16))
                pv = tl.dot(v_t, w.to(tl.float16)).to(tl.float32)
        else:
            v = tl.where(valid[:, None], tl.load(v_ptr + k_offs).to(tl.float16), 0.0)
            pv = tl.trans(tl.dot(tl.trans(w.to(tl.float16)), v).to(tl.float32))
        acc = acc * alpha[None, :] + pv
        m = m_new
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[None, :]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
    row = seq * num_kv_heads * GROUP + heads
    tl.store(out_ptr + ((row * num_splits + split)[None, :]) * HEAD_DIM + dims[:, None], out, mask=head_mask[None, :])
    tl.store(lse_ptr + row * num_splits + split, lse, mask=head_mask)


def launch(kernel, q, k8, v8, ks, vs, tables, seq_lens, splits, out, block_n, warps, stages, **constants):
    """Stage 1 (``kernel``, with the split kernel's arguments and ``constants``), then the engine's merge."""
    batch = q.shape[0]
    partial = torch.empty(batch, HEADS, splits, DIM, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, HEADS, splits, dtype=torch.float32, device=q.device)
    kernel[(batch, KV_HEADS, splits)](q, k8, v8, ks, vs, tables, seq_lens, partial, lse, 1 / math.sqrt(DIM),
                                      q.stride(0), q.stride(1), tables.stride(0), KV_HEADS, splits,
                                      GROUP=HEADS // KV_HEADS, GROUP_PAD=16, HEAD_DIM=DIM, BLOCK_SIZE=BS,
                                      BLOCK_N=block_n, num_warps=warps, num_stages=stages, **constants)
    merge_splits_kernel[(batch * HEADS,)](partial, lse, out, splits, HEAD_DIM=DIM, SPLITS_PAD=triton.next_power_of_2(splits))
    return out


def run_swapped(q, k8, v8, ks, vs, tables, seq_lens, splits, out, v_t=True, fp8_dots=False, lo=True,
                k_head_major=False, block_n=128, warps=4, stages=3):
    return launch(swapped_kernel, q, k8, v8, ks, vs, tables, seq_lens, splits, out, block_n, warps, stages,
                  V_T=v_t, FP8_DOTS=fp8_dots, LO=lo, K_HEAD_MAJOR=k_head_major)


def run_probe(q, k8, v8, ks, vs, tables, seq_lens, splits, out, mode, scales=True, block_n=128, warps=4, stages=3,
              v_t=False):
    return launch(probe_kernel, q, k8, v8, ks, vs, tables, seq_lens, splits, out, block_n, warps, stages,
                  MODE=mode, SCALES=scales, V_T=v_t)


def ref_out(q, k, v, tables, seq_len):
    """float32 attention of one query token per sequence over its pages, in order."""
    kk, vv = (t.float().repeat_interleave(HEADS // KV_HEADS, 1) for t in contiguous_kv(k, v, tables))
    return torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None], kk, vv)[:, :, 0]


def time_variants(shape: str, splits: int, variants: dict, out, want=None, checked=lambda name: True) -> dict:
    """do_bench medians of ``variants`` (the first is the baseline, ``bf16``), the error against
    ``want`` (where given) of each ``checked`` variant's output, and times over the baseline's."""
    row = {"shape": shape, "splits": splits}
    for name, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        if want is not None and name != "bf16" and checked(name):
            row[name + "_err"] = float(f"{((out.float() - want).norm() / want.norm()).item():.2e}")
        row[name + "_us"] = round(do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3, 1)
    for name in variants:
        if name != "bf16":
            row[name + "/bf16"] = round(row[name + "_us"] / row["bf16_us"], 3)
    print(json.dumps(row), flush=True)
    return row


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
        rows.append(time_variants(f"{batch}x{seq_len}", splits, variants, out, want,
                                  checked=lambda name: "loads" not in name and "no_scales" not in name))
        del q, k, v, k8, v8, v8t, ks, vs
        torch.cuda.empty_cache()
    return rows


def swapped_table() -> list[dict]:
    """The operand-swapped kernels against bf16's and fp8's engine calls."""
    rows = []
    for batch, seq_len in [(32, 32768), (1, 131072), (8, 8192), (32, 4096), (4, 32768)]:
        q, k, v, tables, seq_lens = make(batch, seq_len)
        (k8, ks), (v8, vs) = quantize_kv(k, "fp8"), quantize_kv(v, "fp8")
        v8t = v8.permute(0, 2, 3, 1).contiguous()          # [num_blocks, KV, HEAD_DIM, BLOCK_SIZE]
        k8h = k8.permute(0, 2, 1, 3).contiguous()          # [num_blocks, KV, BLOCK_SIZE, HEAD_DIM]
        splits = choose_num_splits(batch, KV_HEADS, seq_len, 132)
        out = torch.empty_like(q)
        sw = lambda n, vv=v8t, **kw: (lambda: run_swapped(q, k8, vv, ks, vs, tables, seq_lens, n, out, **kw))  # noqa: E731
        variants = {
            "bf16": lambda: paged_decode(q, k, v, tables, seq_lens, splits, validate=False, out=out),
            "fp8": lambda: paged_decode(q, k8, v8, tables, seq_lens, splits, validate=False, out=out,
                                        k_scale=ks, v_scale=vs),
            "swapped_fp16_v_plain": sw(splits, v8, v_t=False),
            "swapped_fp16_v_t": sw(splits),
            "swapped_fp16_v_t_n64_s2_2x_splits": sw(2 * splits, block_n=64, stages=2),
            "fp8_dots": sw(splits, fp8_dots=True),
            "fp8_dots_n64_s2_2x_splits": sw(2 * splits, fp8_dots=True, block_n=64, stages=2),
            "fp8_dots_4x_splits": sw(4 * splits, fp8_dots=True, stages=2),
            "fp8_dots_one_term": sw(splits, fp8_dots=True, lo=False),
            "fp8_dots_k_head_major": lambda: run_swapped(q, k8h, v8t, ks, vs, tables, seq_lens, splits, out,
                                                         fp8_dots=True, k_head_major=True),
        }
        want = ref_out(q, dequantize_kv(k8, ks, torch.float32), dequantize_kv(v8, vs, torch.float32), tables, seq_len) \
            if batch * seq_len <= 32 * 8192 else None
        rows.append(time_variants(f"{batch}x{seq_len}", splits, variants, out, want))
        del q, k, v, k8, v8, v8t, k8h, ks, vs
        torch.cuda.empty_cache()
    return rows


def pages_table() -> list[dict]:
    """bf16's and fp8's engine calls with the pages shuffled (as everywhere else) or in order, 16 or
    128 tokens a page: does the gather's address pattern set fp8's pace?"""
    rows = []
    for batch, seq_len in [(32, 32768), (1, 131072), (8, 8192)]:
        for block_size, order in ((16, "shuffled"), (16, "in_order"), (128, "shuffled"), (128, "in_order")):
            q, k, v, tables, seq_lens = make(batch, seq_len, block_size, shuffled=order == "shuffled")
            (k8, ks), (v8, vs) = quantize_kv(k, "fp8"), quantize_kv(v, "fp8")
            splits = choose_num_splits(batch, KV_HEADS, seq_len, 132)
            out = torch.empty_like(q)
            variants = {"bf16": lambda: paged_decode(q, k, v, tables, seq_lens, splits, validate=False, out=out),
                        "fp8": lambda: paged_decode(q, k8, v8, tables, seq_lens, splits, validate=False, out=out,
                                                    k_scale=ks, v_scale=vs)}
            rows.append(time_variants(f"{batch}x{seq_len} pages of {block_size}, {order}", splits, variants, out))
            del q, k, v, k8, v8, ks, vs
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
            if (mult > 1 and splits == base) or bn % (16 * w):   # (the engine's kernel: 16 keys or more a warp)
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
    parser.add_argument("--swapped", action="store_true", help="the operand-swapped kernels instead")
    parser.add_argument("--pages", action="store_true", help="pages shuffled or in order, of 16 or 128 tokens")
    parser.add_argument("--ncu", action="store_true", help="one launch of four variants at 32 x 32K, for ncu")
    parser.add_argument("--out", default=None, help="folder for probe_fp8_decode*.json")
    args = parser.parse_args()
    table, suffix = ((launch_sweep, "_sweep") if args.sweep else (swapped_table, "_swapped") if args.swapped else
                     (pages_table, "_pages") if args.pages else (lambda: variants_table(args.ncu), ""))
    rows = table()
    if args.out and rows:
        path = Path(args.out) / f"probe_fp8_decode{suffix}.json"
        path.write_text(json.dumps(rows, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
