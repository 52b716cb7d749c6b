"""Which tiles suit a chunk over a cached prefix? (GPU; writes ``extend_tiles.json``)

    python benchmarks/sweep_extend_tiles.py [--out DIR]

Each extend shape ``(batch, prefix, new, head_dim)`` is timed with the contiguous kernel and
with ``paged_prefill`` as the engine calls it, at the default tiles and three fixed ones. The
columns ``p/cbest_*`` divide the paged kernel by the contiguous kernel's best config. This is
what set ``kernel_plan.tile_config``'s key-length rule.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_flash_attention import extend_inputs, packed  # noqa: E402
from common import arguments, bench, environment, save  # noqa: E402
from kvlab.kernel_plan import launch_config  # noqa: E402
from kvlab.kernels.flash_attention import flash_attention, paged_prefill  # noqa: E402
from kvlab.models.backends import reads_new_kv  # noqa: E402

SHAPES = [(8, 768, 256, 128), (4, 3072, 1024, 128), (1, 12288, 4096, 128), (4, 3072, 1024, 64),
          (1, 16384, 2048, 128), (1, 32768, 2048, 128), (1, 8192, 2048, 128), (2, 16384, 1024, 128),
          (1, 32768, 1024, 128), (1, 32768, 512, 128), (4, 8192, 1024, 128), (1, 4096, 2048, 128),
          (2, 8192, 2048, 64), (1, 65536, 2048, 128), (8, 4096, 512, 128), (1, 2048, 2048, 128)]
CONFIGS = {"default": {}, "128x128": dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
           "128x64": dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
           "64x128": dict(block_m=64, block_n=128, num_warps=4, num_stages=3)}


def measure(batch: int, prefix: int, new: int, dim: int) -> dict:
    total = prefix + new
    case = extend_inputs(batch, prefix, new, dim)
    q, k, v, flops, args, hints = (case[key] for key in ("q", "k", "v", "flops", "args", "hints"))
    new_kv = dict(k_new=case["k_new"], v_new=case["v_new"]) if reads_new_kv(total, new) else {}
    ref = packed(flash_attention(q, k, v, validate=False)).float()
    row = {"shape": [batch, prefix, new, dim], "default": launch_config(dim, new, None, None, None, None, 2)}
    for name, config in CONFIGS.items():
        if dim == 64 and config.get("num_warps") == 8:
            config = dict(config, num_warps=4)
        contiguous = lambda: flash_attention(q, k, v, validate=False, **config)  # noqa: E731
        paged = lambda: paged_prefill(*args, **hints, **new_kv, **config)  # noqa: E731
        row["err_" + name] = float((paged().float() - ref).abs().max())
        row["c_" + name] = round(flops / bench(contiguous) / 1e12, 1)
        row["p_" + name] = round(flops / bench(paged) / 1e12, 1)
    best = max(row["c_" + name] for name in CONFIGS)
    for name in CONFIGS:
        row["p/cbest_" + name] = round(row["p_" + name] / best, 3)
        row["p/cdef_" + name] = round(row["p_" + name] / row["c_default"], 3)
    return row


def main() -> None:
    args = arguments().parse_args()
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    save("extend_tiles", {"env": environment(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
