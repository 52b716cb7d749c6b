"""matvec (a batch-1 linear layer) against cuBLAS (``F.linear`` of one row) on an 8B model's shapes.

    python benchmarks/bench_matvec.py [--out DIR]

bf16, Llama-3-8B's products: QKV 6144 x 4096, O 4096 x 4096, gate/up 28672 x 4096, down
4096 x 14336, LM head 128256 x 4096. Each is timed as the engine runs it, inside a CUDA graph,
over several copies of the weight (2 GiB in all, up to 16 copies) so that no copy is read from
L2; TB/s of weights read. Each output is first checked against float32 ``F.linear``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvlab  # noqa: E402,F401
from common import arguments, bench, environment, print_table, save  # noqa: E402
from kvlab.kernels import matvec  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def graph_seconds(fn) -> float:
    """Median seconds of one replay of a CUDA graph of ``fn``."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):       # warm-up off the default stream, as capture wants
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def measure(name: str, n: int, k: int) -> dict:
    copies = max(2, min(16, (2 << 30) // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float()[None], weights[0].float())[0]
    err = float((matvec(x, weights[0]).float() - ref).abs().max() / ref.abs().max())
    nbytes = copies * n * k * 2
    cublas = graph_seconds(lambda: [F.linear(x[None], w) for w in weights])
    kvlab_ = graph_seconds(lambda: [matvec(x, w, validate=False) for w in weights])
    return {"product": name, "n": n, "k": k, "cublas_TBs": round(nbytes / cublas / 1e12, 3),
            "matvec_TBs": round(nbytes / kvlab_ / 1e12, 3), "matvec_vs_cublas": round(cublas / kvlab_, 3),
            "rel_err": err}


def main() -> None:
    args = arguments().parse_args()
    rows = [measure(name, *shape) for name, shape in SHAPES.items()]
    print_table(rows, list(rows[0]))
    save("matvec", {"env": environment(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
