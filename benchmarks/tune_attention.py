"""Tile-size sweeps of the attention kernels on the GPU: how their launch configs were chosen.

    python benchmarks/tune_attention.py [--out DIR] [--only flash,paged,decode]

For each shape of the chapter 5 and 6 targets, every candidate config is checked against a
peer's output (a wrong config is reported, never timed) and timed; the peers of the same run
(SDPA flash and cuDNN) give the ratios. ``flash`` also times a variant of the contiguous
kernel that loads its tiles with tensor descriptors (TMA) instead of pointers.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import kvlab  # noqa: E402,F401
from common import bench, environment, print_table, save  # noqa: E402
from kvlab.kernels import flash_attention, paged_decode, paged_prefill  # noqa: E402
from kvlab.kernels.flash_attention import LOG2_E, _attend_tile, _causal_bounds  # noqa: E402

FLASH_SHAPES = [(8, 1024, 128), (2, 4096, 128), (1, 16384, 128), (4, 4096, 64)]
HEADS = 32
FLASH_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4)]   # (BLOCK_M, BLOCK_N, warps, stages)


@triton.jit
def _attend_tile_fused(acc, m_i, l_i, q, k, v, offs_m, offs_n, len_k, causal_shift, qk_scale,
                       MASKED: tl.constexpr):
    """_attend_tile with the scale folded into the exponent and the rescaled acc fed to the MMA."""
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        visible = (offs_n[None, :] < len_k) & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def flash_tma_kernel(q_desc, k_desc, v_desc, out_ptr, len_q, len_k, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     FUSED: tl.constexpr):
    """The contiguous causal kernel with TMA tile loads; q/k/v/out are [batch * heads * len, dim]."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    q_row0 = bh * len_q
    k_row0 = bh * len_k
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([q_row0 + start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, end, shift = _causal_bounds(start_m, len_q, len_k, BLOCK_M, BLOCK_N, True)
    for start_n in range(0, full_end, BLOCK_N):
        k = k_desc.load([k_row0 + start_n, 0])
        v = v_desc.load([k_row0 + start_n, 0])
        if FUSED:
            acc, m_i, l_i = _attend_tile_fused(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                               qk_scale, MASKED=False)
        else:
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                         qk_scale, MASKED=False, CAUSAL=True, DOT_PRECISION="tf32")
    for start_n in range(full_end, end, BLOCK_N):
        k = k_desc.load([k_row0 + start_n, 0])
        v = v_desc.load([k_row0 + start_n, 0])
        if FUSED:
            acc, m_i, l_i = _attend_tile_fused(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                               qk_scale, MASKED=True)
        else:
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                         qk_scale, MASKED=True, CAUSAL=True, DOT_PRECISION="tf32")
    out = acc / l_i[:, None]
    d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + (q_row0 + offs_m[:, None]) * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=offs_m[:, None] < len_q)


def flash_tma(q, k, v, bm, bn, w, s, fused):
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, lq, d = q.shape
    lk = k.shape[2]
    out = torch.empty_like(q)
    descs = [TensorDescriptor.from_tensor(t.view(-1, d), [blk, d]) for t, blk in ((q, bm), (k, bn), (v, bn))]
    flash_tma_kernel[(triton.cdiv(lq, bm), b * h)](*descs, out, lq, lk, LOG2_E / d ** 0.5, HEAD_DIM=d,
                                                   BLOCK_M=bm, BLOCK_N=bn, FUSED=fused,
                                                   num_warps=w, num_stages=s)
    return out


@triton.jit
def flash_tma4d_kernel(q_desc, k_desc, v_desc, out_ptr, num_heads, len_q, len_k, group, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       FUSED: tl.constexpr):
    """4-D descriptors over [batch, heads, len, dim]: out-of-range rows come back as zeros."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    kvh = head // group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([b, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, end, shift = _causal_bounds(start_m, len_q, len_k, BLOCK_M, BLOCK_N, True)
    for start_n in range(0, full_end, BLOCK_N):
        k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        if FUSED:
            acc, m_i, l_i = _attend_tile_fused(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                               qk_scale, MASKED=False)
        else:
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                         qk_scale, MASKED=False, CAUSAL=True, DOT_PRECISION="tf32")
    for start_n in range(full_end, end, BLOCK_N):
        k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        if FUSED:
            acc, m_i, l_i = _attend_tile_fused(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                               qk_scale, MASKED=True)
        else:
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, start_n + offs_n, len_k, shift,
                                         qk_scale, MASKED=True, CAUSAL=True, DOT_PRECISION="tf32")
    out = acc / l_i[:, None]
    d = tl.arange(0, HEAD_DIM)
    rows = (b * num_heads + head) * len_q + offs_m
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=offs_m[:, None] < len_q)


def flash_tma4d(q, k, v, bm, bn, w, s, fused):
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, lq, d = q.shape
    out = torch.empty_like(q)
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, blk, d])
             for t, blk in ((q, bm), (k, bn), (v, bn))]
    flash_tma4d_kernel[(triton.cdiv(lq, bm), h, b)](*descs, out, h, lq, k.shape[2], h // k.shape[1],
                                                    LOG2_E / d ** 0.5, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                                                    FUSED=fused, num_warps=w, num_stages=s)
    return out


@triton.jit
def paged_pages_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, cu_ptr,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_table, group, qk_scale,
                       BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED: tl.constexpr):
    """paged_prefill with page-shaped loads: one table entry per page, [pages, BLOCK_SIZE, dim] tiles."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    kv_head = head // group
    q_start = tl.load(cu_ptr + seq).to(tl.int64)
    len_q = tl.load(cu_ptr + seq + 1) - q_start
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    table_ptr = block_tables_ptr + seq * stride_table
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
    in_page = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (q_start + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
                mask=offs_m[:, None] < len_q, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, end, shift = _causal_bounds(start_m, len_q, seq_len, BLOCK_M, BLOCK_N, True)
    num_pages = tl.cdiv(seq_len, BLOCK_SIZE)
    for start_n in range(0, end, BLOCK_N):
        page_idx = start_n // BLOCK_SIZE + tl.arange(0, PAGES)
        pages = tl.load(table_ptr + page_idx, mask=page_idx < num_pages, other=0).to(tl.int64)
        offs = ((pages[:, None, None] * BLOCK_SIZE + in_page[None, :, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM \
            + offs_d[None, None, :]
        offs = tl.reshape(offs, (BLOCK_N, HEAD_DIM))
        pos = start_n + offs_n
        if start_n < full_end:
            k = tl.load(k_cache_ptr + offs)
            v = tl.load(v_cache_ptr + offs)
        else:
            k = tl.load(k_cache_ptr + offs, mask=(pos < seq_len)[:, None], other=0.0)
            v = tl.load(v_cache_ptr + offs, mask=(pos < seq_len)[:, None], other=0.0)
        if FUSED:
            acc, m_i, l_i = _attend_tile_fused(acc, m_i, l_i, q, k, v, offs_m, pos, seq_len, shift, qk_scale,
                                               MASKED=True)
        else:
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_m, pos, seq_len, shift, qk_scale,
                                         MASKED=True, CAUSAL=True, DOT_PRECISION="tf32")
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < len_q)


def paged_pages(q, kc, vc, tables, seq_lens, cu, max_q, bm, bn, w, s, fused):
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_q, bm), q.shape[1], tables.shape[0])
    paged_pages_kernel[grid](q, kc, vc, out, tables, seq_lens, cu, q.stride(0), q.stride(1), out.stride(0),
                             out.stride(1), tables.stride(0), q.shape[1] // kc.shape[2], LOG2_E / q.shape[2] ** 0.5,
                             BLOCK_SIZE=kc.shape[1], NUM_KV_HEADS=kc.shape[2], HEAD_DIM=q.shape[2], BLOCK_M=bm,
                             BLOCK_N=bn, FUSED=fused, num_warps=w, num_stages=s)
    return out


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


def paged_copy(k, v, block_size=16):
    """The same K/V in a paged cache with shuffled blocks: (k_cache, v_cache, tables, seq_lens)."""
    b, hkv, lk, d = k.shape
    blocks = lk // block_size
    tables = torch.randperm(b * blocks, device=k.device).view(b, blocks).to(torch.int32)
    k_cache = torch.empty(b * blocks, block_size, hkv, d, device=k.device, dtype=k.dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[tables.long()] = k.transpose(1, 2).reshape(b, blocks, block_size, hkv, d)
    v_cache[tables.long()] = v.transpose(1, 2).reshape(b, blocks, block_size, hkv, d)
    return k_cache, v_cache, tables, torch.full((b,), lk, dtype=torch.int32, device=k.device)


def tune_flash(parts):
    rows = []
    for batch, seq_len, dim in FLASH_SHAPES:
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
        kc, vc, tables, seq_lens = paged_copy(k, v)
        qp = q.transpose(1, 2).reshape(batch * seq_len, HEADS, dim)
        ref_p = ref.transpose(1, 2).reshape(batch * seq_len, HEADS, dim)
        qlens = seq_lens.clone()
        cu = torch.nn.functional.pad(torch.cumsum(qlens, 0, dtype=torch.int32), (1, 0))
        for bm, bn, w, s in FLASH_CONFIGS:
            cands = {}
            if "flash" in parts:
                cands["ptr"] = (lambda: flash_attention(q, k, v, validate=False, block_m=bm, block_n=bn,
                                                        num_warps=w, num_stages=s), ref)
                cands["tma"] = (lambda: flash_tma(q, k, v, bm, bn, w, s, False), ref)
                cands["tma_fused"] = (lambda: flash_tma(q, k, v, bm, bn, w, s, True), ref)
                cands["tma4d"] = (lambda: flash_tma4d(q, k, v, bm, bn, w, s, False), ref)
                cands["tma4d_fused"] = (lambda: flash_tma4d(q, k, v, bm, bn, w, s, True), ref)
            if "paged" in parts:
                cands["paged_pages"] = (lambda: paged_pages(qp, kc, vc, tables, seq_lens, cu, seq_len, bm, bn, w, s,
                                                            False), ref_p)
                cands["paged_pages_fused"] = (lambda: paged_pages(qp, kc, vc, tables, seq_lens, cu, seq_len, bm, bn,
                                                                  w, s, True), ref_p)
                cands["paged"] = (lambda: paged_prefill(qp, kc, vc, tables, seq_lens, qlens, validate=False,
                                                        max_query_len=seq_len, cu_query_lens=cu, block_m=bm, block_n=bn,
                                                        num_warps=w, num_stages=s), ref_p)
            for name, (fn, r) in cands.items():
                t = try_time(fn, r)
                row = dict(base, kernel=name, cfg=f"{bm}x{bn} w{w} s{s}")
                if isinstance(t, float):
                    row.update(TFLOPs=round(tflops(batch, seq_len, dim, t), 1), vs_cudnn=round(cudnn / t, 3))
                else:
                    row.update(TFLOPs=t, vs_cudnn="-")
                rows.append(row)
                print(row, flush=True)
        del q, k, v, kc, vc
        torch.cuda.empty_cache()
    return rows


def tune_decode():
    rows = []
    for batch, seq_len in ((32, 32768), (1, 131072), (1, 32768), (1, 1024)):
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
        del kc, vc
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default="flash,paged,decode")
    args = parser.parse_args()
    parts = args.only.split(",")
    result = {"env": environment()}
    if "flash" in parts or "paged" in parts:
        result["flash"] = tune_flash(parts)
    if "decode" in parts:
        result["decode"] = tune_decode()
    for key in ("flash", "decode"):
        if key in result:
            best = {}
            for r in result[key]:
                if isinstance(r.get("TFLOPs", r.get("TBps")), float):
                    k = tuple(r[c] for c in ("batch", "seq_len", "dim", "kernel", "splits") if c in r)
                    score = r.get("TFLOPs", r.get("TBps"))
                    if k not in best or score > best[k].get("TFLOPs", best[k].get("TBps")):
                        best[k] = r
            print(f"best per shape ({key}):")
            print_table(list(best.values()), list(next(iter(best.values()))))
    save("tune_attention", result, args.out)


if __name__ == "__main__":
    main()
