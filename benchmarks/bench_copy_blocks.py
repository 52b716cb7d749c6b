"""copy_blocks on the GPU against torch's indexed copy, on an 8B-model-shaped cache.

    python benchmarks/bench_copy_blocks.py [--out DIR]

Cache: 32 layers, 8 KV heads x 128, bf16, block size 16 (32 KiB per block per layer), K and
V. Pairs: random (src, dst) with distinct dsts that are never srcs. Bytes counted: every
copied block read once and written once, K and V, all layers. Ceiling: the measured
device-to-device copy rate.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import kvlab  # noqa: E402,F401
from common import arguments, bench, copy_bandwidth, environment, print_table, save  # noqa: E402
from kvlab.kernels import copy_blocks  # noqa: E402
from kvlab.paging import allocate_kv_cache  # noqa: E402
from kvlab.reference import copy_blocks_ref  # noqa: E402

LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 32, 10240, 16, 8, 128


def main() -> None:
    args = arguments().parse_args()
    env = environment()
    ceiling = copy_bandwidth()
    cache = allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    cache.k.normal_()
    cache.v.normal_()
    rows = []
    for num_pairs in (16, 256, 4096):
        perm = torch.randperm(NUM_BLOCKS, device="cuda")
        pairs = torch.stack([perm[num_pairs:2 * num_pairs], perm[:num_pairs]], dim=1).contiguous()
        nbytes = 2 * 2 * num_pairs * LAYERS * cache.k[0, 0].numel() * cache.k.element_size()
        t_triton = bench(lambda: copy_blocks([cache.k, cache.v], pairs, validate=False))
        t_torch = bench(lambda: copy_blocks_ref([cache.k, cache.v], pairs))
        rows.append({
            "pairs": num_pairs,
            "MB_moved": round(nbytes / 1e6),
            "copy_blocks_us": round(t_triton * 1e6, 1),
            "copy_blocks_TBps": round(nbytes / t_triton / 1e12, 2),
            "of_copy_ceiling": round(nbytes / t_triton / ceiling, 2),
            "torch_index_us": round(t_torch * 1e6, 1),
            "torch_TBps": round(nbytes / t_torch / 1e12, 2),
            "speedup_vs_torch": round(t_torch / t_triton, 2),
        })
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; copy ceiling {ceiling / 1e12:.2f} TB/s")
    print_table(rows, list(rows[0]))
    save("copy_blocks", {"env": env, "copy_ceiling_Bps": ceiling, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
