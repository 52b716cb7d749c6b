"""write_kv on the GPU: one Triton launch vs torch's indexed copy vs the seed's per-token loop.

    python benchmarks/bench_write_kv.py [--out DIR]

Shape: one layer of an 8B-model cache (8 KV heads x 128, bf16, block size 16), 65,536 slots,
new tokens scattered to random slots. Bytes counted: K and V of every new token, read once
and written once. Ceiling: the measured device-to-device copy rate.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from common import arguments, bench, bench_host_loop, copy_bandwidth, environment, print_table, save  # noqa: E402
from kvlab.kernels import write_kv  # noqa: E402
from kvlab.paging.seed_cache import SeedPagedAttentionCache, append_tokens_one_by_one  # noqa: E402
from kvlab.reference import write_kv_ref  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 4096, 16, 8, 128
SEED_LOOP_MAX_TOKENS = 4096  # the per-token Python loop gets slow beyond this


def seed_loop_seconds(key, value) -> float:
    """The seed article's cache (one layer), written through its own per-token append_token."""
    cache = SeedPagedAttentionCache(NUM_BLOCKS, BLOCK_SIZE, num_layers=1, num_heads=HEADS, head_dim=DIM,
                                    dtype=key.dtype, device="cuda")
    keys, values = key[:, None], value[:, None]   # [tokens, layers=1, heads, dim]

    def one_request():
        cache.allocate_request(0)
        append_tokens_one_by_one(cache, 0, keys, values)
        cache.release_request(0)

    return bench_host_loop(one_request)


def main() -> None:
    args = arguments().parse_args()
    env = environment()
    ceiling = copy_bandwidth()
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    rows = []
    for num_tokens in (1, 32, 256, 2048, 16384, 65536):
        slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:num_tokens]
        key = torch.randn(num_tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        value = torch.randn_like(key)
        nbytes = 2 * 2 * key.numel() * key.element_size()  # K and V, read + write
        t_triton = bench(lambda: write_kv(key, value, k_cache, v_cache, slots, validate=False))
        t_checked = bench(lambda: write_kv(key, value, k_cache, v_cache, slots))
        t_torch = bench(lambda: write_kv_ref(key, value, k_cache, v_cache, slots))
        t_seed = seed_loop_seconds(key, value) if num_tokens <= SEED_LOOP_MAX_TOKENS else None
        rows.append({
            "tokens": num_tokens,
            "write_kv_us": round(t_triton * 1e6, 1),
            "write_kv_GBps": round(nbytes / t_triton / 1e9),
            "of_copy_ceiling": round(nbytes / t_triton / ceiling, 2),
            "validated_us": round(t_checked * 1e6, 1),
            "torch_index_us": round(t_torch * 1e6, 1),
            "speedup_vs_torch": round(t_torch / t_triton, 2),
            "seed_loop_us": round(t_seed * 1e6) if t_seed else "-",
            "speedup_vs_seed": round(t_seed / t_triton) if t_seed else "-",
        })
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; copy ceiling {ceiling / 1e12:.2f} TB/s")
    print_table(rows, list(rows[0]))
    save("write_kv", {"env": env, "copy_ceiling_Bps": ceiling, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
