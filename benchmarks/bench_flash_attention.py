"""flash_attention and paged_prefill on the GPU, against PyTorch SDPA's flash and cuDNN backends.

    python benchmarks/bench_flash_attention.py [--out DIR] [--kv-cache-dtype fp8[,int8]]

Causal, bf16, 32 heads. Peers in the same run: SDPA with the flash backend (FlashAttention-2)
and the cuDNN backend (FlashAttention-3 class on Hopper), and naive attention (the score
matrix written out, softmax, product) where it fits. ``kvlab_paged`` is ``paged_prefill`` with
every key and value read through shuffled block tables (block size 16), on the same numbers;
``kvlab_paged_new`` hands the kernel the step's own K/V (``k_new``/``v_new``) and reads only
the cached prefix through the table: in a plain prefill, none. The engine's call is whichever
of the two ``kvlab.models.backends.reads_new_kv`` picks for the step (``engine_vs_contiguous``):
the new K/V for fresh prompts, every key through the table for extends. TFLOP/s count the causal half of the two matrix products: 2 * 2 * batch * heads * L^2 * D / 2.

Extends (``EXTENDS``: ``new`` tokens onto a cached prefix of ``prefix``) put most keys behind
the block table in both paged modes; they are compared with ``flash_attention`` on the same
keys held contiguously (SDPA's causal mask is aligned top-left, so it has no such case).
Also: peak memory of naive attention and of the kernel for one sequence of growing length.

``--kv-cache-dtype fp8[,int8]`` (``quantized_extends`` in the JSON): the engine's extend call
(``paged_prefill`` with every key through the table) on a quantised copy of the same paged cache
(codes and a float32 scale per token and KV head, dequantised in registers) against the bf16
call, in the same run; ``time_vs_bf16`` is the quantised time over the bf16 one (the goal: at
most 1 / 0.9). Each output is checked first against the contiguous kernel on the dequantised K/V.
Where the engine's call takes the warp-specialised kernel (``warp_specialized``: on an sm_90 GPU,
long steps, ``kvlab.kernel_plan.warp_specialized_extend``), ``triton_time_vs_bf16`` times the
Triton kernel it replaces, in the same run.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import kvlab  # noqa: E402,F401
from common import arguments, bench, bench_rounds, environment, print_table, save  # noqa: E402
from kvlab.kernels import flash_attention, paged_prefill  # noqa: E402

HEADS, BLOCK_SIZE = 32, 16
TARGETS = [(8, 1024, 128), (2, 4096, 128), (1, 16384, 128), (4, 4096, 64)]   # the chapter's goals
EXTENDS = [(8, 768, 256, 128), (4, 3072, 1024, 128), (1, 12288, 4096, 128), (4, 3072, 1024, 64),
           (1, 16384, 2048, 128), (1, 32768, 2048, 128)]   # the last two: chunks of a 16K and a 32K prompt
SWEEP = [(32, 512, 128), (16, 1024, 128), (8, 2048, 128), (4, 4096, 128), (2, 8192, 128), (1, 16384, 128)]


def naive_attention(q, k, v):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def sdpa(q, k, v, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def packed(t):
    """[batch, heads, len, dim] -> [batch * len, heads, dim], contiguous."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous()


def paged_copy(k, v):
    """The same K/V in a paged cache with shuffled blocks."""
    batch, kv_heads, length, dim = k.shape
    blocks = length // BLOCK_SIZE
    tables = torch.randperm(batch * blocks, device=k.device).view(batch, blocks).to(torch.int32).contiguous()
    k_cache = torch.empty(batch * blocks, BLOCK_SIZE, kv_heads, dim, device=k.device, dtype=k.dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[tables.long()] = k.transpose(1, 2).reshape(batch, blocks, BLOCK_SIZE, kv_heads, dim)
    v_cache[tables.long()] = v.transpose(1, 2).reshape(batch, blocks, BLOCK_SIZE, kv_heads, dim)
    return k_cache, v_cache, tables


def measure(batch, length, dim) -> dict:
    q, k, v = (torch.randn(batch, HEADS, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * batch * HEADS * length * length * dim / 2
    k_cache, v_cache, tables = paged_copy(k, v)
    q_packed, k_packed, v_packed = packed(q), packed(k), packed(v)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * length
    out = torch.empty_like(q)
    out_packed = torch.empty_like(q_packed)
    out_new = torch.empty_like(q_packed)
    runs = {
        "kvlab": lambda: flash_attention(q, k, v, validate=False, out=out),
        "kvlab_paged": lambda: paged_prefill(q_packed, k_cache, v_cache, tables, lens, lens, validate=False,
                                             max_query_len=length, cu_query_lens=cu, out=out_packed),
        "kvlab_paged_new": lambda: paged_prefill(q_packed, k_cache, v_cache, tables, lens, lens, validate=False,
                                                 k_new=k_packed, v_new=v_packed, max_query_len=length,
                                                 cu_query_lens=cu, out=out_new),
        "sdpa_flash": lambda: sdpa(q, k, v, SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION),
    }
    if batch * HEADS * length * length * 2 <= 8 << 30:
        runs["naive"] = lambda: naive_attention(q, k, v)
    ref = sdpa(q, k, v, SDPBackend.FLASH_ATTENTION).float()
    for buffer in (out, out_packed, out_new):
        buffer.fill_(float("nan"))
    for name in ("kvlab", "kvlab_paged", "kvlab_paged_new"):
        runs[name]()
    ref_packed = packed(ref)
    row = {"batch": batch, "seq_len": length, "heads": HEADS, "head_dim": dim,
           "err_kvlab": float((out.float() - ref).abs().max()),
           "err_paged": float((out_packed.float() - ref_packed).abs().max()),
           "err_paged_new": float((out_new.float() - ref_packed).abs().max())}
    for name in ("kvlab", "kvlab_paged", "kvlab_paged_new", "sdpa_flash", "sdpa_cudnn", "naive"):
        try:
            row[name] = round(flops / bench(runs[name]) / 1e12, 1) if name in runs else None
        except RuntimeError as e:                    # a backend that refuses the shape
            print(f"{name} at {batch}x{length} D{dim}: {str(e)[:80]}")
            row[name] = None
    row["vs_cudnn"] = round(row["kvlab"] / row["sdpa_cudnn"], 3) if row["sdpa_cudnn"] else None
    row["vs_flash"] = round(row["kvlab"] / row["sdpa_flash"], 3)
    row["paged_vs_contiguous"] = round(row["kvlab_paged"] / row["kvlab"], 3)
    row["paged_new_vs_contiguous"] = round(row["kvlab_paged_new"] / row["kvlab"], 3)
    row["engine_vs_contiguous"] = engine_ratio(row, length, length)
    return row


def engine_ratio(row: dict, max_seq_len: int, max_query_len: int) -> float:
    """The engine's call over the contiguous kernel: the paged mode the backend picks for the step."""
    from kvlab.models.backends import reads_new_kv

    return row["paged_new_vs_contiguous" if reads_new_kv(max_seq_len, max_query_len) else "paged_vs_contiguous"]


def extend_inputs(batch, prefix, new, dim) -> dict:
    """Random bf16 inputs of one extend, contiguous (``q``, ``k``, ``v``) and paged: ``args`` of
    ``paged_prefill``, the ``hints`` the engine passes, the new tokens' ``k_new``/``v_new``,
    and the causal ``flops``."""
    total = prefix + new
    q = torch.randn(batch, HEADS, new, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, HEADS, total, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_cache, v_cache, tables = paged_copy(k, v)
    seq_lens = torch.full((batch,), total, dtype=torch.int32, device="cuda")
    query_lens = torch.full((batch,), new, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * new
    return {"q": q, "k": k, "v": v, "flops": 4 * batch * HEADS * dim * (new * prefix + new * (new + 1) / 2),
            "args": (packed(q), k_cache, v_cache, tables, seq_lens, query_lens),
            "hints": dict(validate=False, max_query_len=new, max_seq_len=total, cu_query_lens=cu),  # the engine's
            "k_new": packed(k[:, :, prefix:]), "v_new": packed(v[:, :, prefix:])}


def measure_extend(batch, prefix, new, dim) -> dict:
    """``new`` tokens per sequence attending to a cached prefix of ``prefix`` tokens and to themselves."""
    total = prefix + new
    case = extend_inputs(batch, prefix, new, dim)
    q, k, v, flops, args, hints = (case[key] for key in ("q", "k", "v", "flops", "args", "hints"))
    k_new, v_new = case["k_new"], case["v_new"]
    runs = {"kvlab": lambda: flash_attention(q, k, v, validate=False),
            "kvlab_paged": lambda: paged_prefill(*args, **hints),
            "kvlab_paged_new": lambda: paged_prefill(*args, k_new=k_new, v_new=v_new, **hints)}
    ref = packed(runs["kvlab"]()).float()
    row = {"batch": batch, "prefix": prefix, "new": new, "head_dim": dim,
           "err_paged": float((runs["kvlab_paged"]().float() - ref).abs().max()),
           "err_paged_new": float((runs["kvlab_paged_new"]().float() - ref).abs().max())}
    for name, seconds in bench_rounds(runs).items():      # in turn, three times: drift hits all alike
        row[name] = round(flops / seconds / 1e12, 1)
    row["paged_vs_contiguous"] = round(row["kvlab_paged"] / row["kvlab"], 3)
    row["paged_new_vs_contiguous"] = round(row["kvlab_paged_new"] / row["kvlab"], 3)
    row["engine_vs_contiguous"] = engine_ratio(row, total, new)
    return row


def quantized_extend_inputs(batch, prefix, new, dim, kv_cache_dtype) -> dict:
    """``extend_inputs`` with the paged cache quantised: ``quant_args`` of ``paged_prefill`` (the
    codes, with ``quant_scales`` to pass beside them), and ``want``: the contiguous kernel on the
    dequantised K/V, what a quantised call must give."""
    from kvlab.paging.kv_cache import per_page_and_head
    from kvlab.quantization import dequantize_kv, quantize_kv

    case = extend_inputs(batch, prefix, new, dim)
    q, k_cache, v_cache, tables, seq_lens, query_lens = case["args"]
    (k8, k_scale), (v8, v_scale) = quantize_kv(k_cache, kv_cache_dtype), quantize_kv(v_cache, kv_cache_dtype)
    k_scale, v_scale = per_page_and_head(k_scale), per_page_and_head(v_scale)      # as the engine keeps them
    k, v = (torch.empty_like(case["k"]) for _ in range(2))
    for dense, codes, scale in ((k, k8, k_scale), (v, v8, v_scale)):
        pages = dequantize_kv(codes, scale, torch.bfloat16)[tables.long()]         # [B, blocks, 16, KV, D]
        dense.copy_(pages.flatten(1, 2).transpose(1, 2))
    case.update(quant_args=(q, k8, v8, tables, seq_lens, query_lens),
                quant_scales=dict(k_scale=k_scale, v_scale=v_scale),
                want=packed(flash_attention(case["q"], k, v, validate=False)).float())
    return case


def quantized_extend(batch, prefix, new, dim, kv_cache_dtype) -> dict:
    """The engine's extend call on a ``kv_cache_dtype`` cache against the bf16 one, same K/V."""
    from kvlab.kernel_plan import warp_specialized_extend
    from kvlab.models.backends import reads_new_kv

    assert not reads_new_kv(prefix + new, new)      # extends: every key through the table, as timed
    case = quantized_extend_inputs(batch, prefix, new, dim, kv_cache_dtype)
    want = case["want"]

    def quant_call(**kernel):
        return paged_prefill(*case["quant_args"], **case["quant_scales"], **case["hints"], **kernel)

    def triton_call():   # the Triton kernel, where the engine's call takes the warp-specialised one
        return quant_call(warp_specialized=False)

    err = float((quant_call().float() - want).abs().max())
    err_triton = float((triton_call().float() - want).abs().max())
    bf16 = bench(lambda: paged_prefill(*case["args"], **case["hints"]))
    quant = bench(quant_call)
    triton_only = bench(triton_call)
    row = {"kv_cache_dtype": kv_cache_dtype, "batch": batch, "prefix": prefix, "new": new, "head_dim": dim,
           "err": err, "err_triton": err_triton, "bf16_TFLOPs": round(case["flops"] / bf16 / 1e12, 1),
           "quant_TFLOPs": round(case["flops"] / quant / 1e12, 1), "bf16_us": round(bf16 * 1e6, 1),
           "quant_us": round(quant * 1e6, 1), "triton_kernel_us": round(triton_only * 1e6, 1),
           "warp_specialized": warp_specialized_extend(kv_cache_dtype, dim, prefix + new, new,
                                                       torch.cuda.get_device_capability()),
           "time_vs_bf16": round(quant / bf16, 3), "triton_time_vs_bf16": round(triton_only / bf16, 3),
           "meets_goal": quant / bf16 <= 1 / 0.9}
    print(row, flush=True)
    del case, want
    torch.cuda.empty_cache()
    return row


def peak_memory(length: int, dim: int = 128) -> dict:
    """Peak bytes allocated beyond the inputs, one sequence of 32 heads, naive vs the kernel."""
    q, k, v = (torch.randn(1, HEADS, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    result = {"seq_len": length}
    for name, fn in (("kvlab_bytes", lambda: flash_attention(q, k, v, validate=False)),
                     ("naive_bytes", lambda: naive_attention(q, k, v))):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            fn()
            torch.cuda.synchronize()
            result[name] = torch.cuda.max_memory_allocated() - base
        except torch.OutOfMemoryError:
            result[name] = None
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = arguments()
    parser.add_argument("--kv-cache-dtype", default="",
                        help="also time the extends on quantised caches: fp8, int8 or fp8,int8")
    args = parser.parse_args()
    formats = [f for f in args.kv_cache_dtype.split(",") if f]
    from kvlab.quantization import kv_cache_format

    for fmt in formats:
        try:
            quantised = kv_cache_format(fmt) is not None
        except ValueError:
            quantised = False
        if not quantised:
            parser.error(f"--kv-cache-dtype takes quantised formats (fp8, int8), got {fmt!r}")
    env = environment()
    rows = []
    for batch, length, dim in TARGETS + [s for s in SWEEP if s not in TARGETS]:
        rows.append(measure(batch, length, dim))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    extends = []
    for shape in EXTENDS:
        extends.append(measure_extend(*shape))
        print(extends[-1], flush=True)
        torch.cuda.empty_cache()
    memory = [peak_memory(n) for n in (1024, 2048, 4096, 8192, 16384)]
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']} (TFLOP/s, causal, bf16, {HEADS} heads)")
    print_table(rows, ["batch", "seq_len", "head_dim", "kvlab", "kvlab_paged", "kvlab_paged_new", "sdpa_flash",
                       "sdpa_cudnn", "naive", "vs_cudnn", "vs_flash", "paged_vs_contiguous", "paged_new_vs_contiguous",
                       "engine_vs_contiguous", "err_kvlab", "err_paged", "err_paged_new"])
    print_table(extends, list(extends[0]))
    print_table(memory, ["seq_len", "kvlab_bytes", "naive_bytes"])
    payload = {"env": env, "rows": rows, "extends": extends, "memory": memory}
    if formats:
        payload["quantized_extends"] = [quantized_extend(*shape, fmt) for fmt in formats for shape in EXTENDS]
        print_table(payload["quantized_extends"], list(payload["quantized_extends"][0]))
    save("flash_attention", payload, args.out)


if __name__ == "__main__":
    main()
