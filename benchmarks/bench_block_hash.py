"""Prefix-cache hashing on the CPU: how long the block-hash chain of a million tokens takes.

    python benchmarks/bench_block_hash.py [--out DIR] [--tokens N] [--repeat R]

``hash_blocks`` (chained SHA-256, one hash per full block of 16 tokens: 62,500 blocks for 1M
tokens) is timed on token ids given as a numpy uint32 array, a numpy int64 array and a
Python list (converting the list is part of the cost), with and without a tenant salt.
Beside it, what bounds it from below:

* the hashlib floor: one ``sha256(96 bytes).digest()`` call per block, nothing else;
* the bulk rate: one SHA-256 over all the token bytes (what the compression itself costs).

Then the cost of a cache lookup per block: the dict walk alone, and a whole ``allocate`` +
``free`` of a 2K-token system-prompt request on a warm cache. Timings are medians after a
warm-up; variants are timed in rotation, so a machine busy with other work slows all alike.
Runs on the CPU only (no GPU is used).
"""
from __future__ import annotations

import argparse
import os
import platform
import ssl
import statistics
import sys
import time
from hashlib import sha256
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import print_table, save  # noqa: E402
from kvlab.paging import BlockPool  # noqa: E402
from kvlab.paging.prefix_hash import hash_blocks, root_hash, token_bytes  # noqa: E402

BLOCK_SIZE = 16


def time_in_rotation(cases: dict, repeat: int, warmup: int = 2) -> dict:
    """Seconds of each ``cases[name]()`` over ``repeat`` rounds, one call of each per round."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def environment() -> dict:
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return {"cpu": model, "cores": os.cpu_count(), "sha_extensions": " sha_ni" in flags,
            "python": platform.python_version(), "numpy": np.__version__, "openssl": ssl.OPENSSL_VERSION,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "date": time.strftime("%Y-%m-%d")}


def hashing_cases(num_tokens: int) -> dict:
    rng = np.random.default_rng(0)
    ids64 = rng.integers(0, 128_000, num_tokens, dtype=np.int64)
    ids32, ids_list = ids64.astype(np.uint32), ids64.tolist()
    data = token_bytes(ids64)
    num_blocks = num_tokens // BLOCK_SIZE
    one_message = root_hash() + data[:4 * BLOCK_SIZE]
    assert hash_blocks(ids64, BLOCK_SIZE) == hash_blocks(ids_list, BLOCK_SIZE)
    return {
        "hash_blocks, uint32 array": lambda: hash_blocks(ids32, BLOCK_SIZE),
        "hash_blocks, int64 array": lambda: hash_blocks(ids64, BLOCK_SIZE),
        "hash_blocks, int64 array, salt": lambda: hash_blocks(ids64, BLOCK_SIZE, salt="tenant-a"),
        "hash_blocks, Python list": lambda: hash_blocks(ids_list, BLOCK_SIZE),
        "hash_blocks, Python list, salt": lambda: hash_blocks(ids_list, BLOCK_SIZE, salt="tenant-a"),
        "token_bytes, int64 array": lambda: token_bytes(ids64),
        "token_bytes, Python list": lambda: token_bytes(ids_list),
        "floor: sha256(96 B).digest() per block": lambda: [sha256(one_message).digest() for _ in range(num_blocks)],
        "bulk: one sha256 over all bytes": lambda: sha256(data).digest(),
    }


def lookup_cases() -> tuple[dict, dict]:
    """Lookups on a warm cache: (cases, blocks each case looks up)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 128_000, 1_000_000).tolist()
    hashes = hash_blocks(tokens, BLOCK_SIZE)
    warm = BlockPool(len(hashes) + 1, BLOCK_SIZE, enable_prefix_caching=True)
    warm.allocate("warm-up", len(tokens), tokens)
    warm.free("warm-up")                       # every block cached, all evictable
    system = rng.integers(0, 128_000, 2048).tolist()
    prompts = iter([system + rng.integers(0, 128_000, 100).tolist() for _ in range(1000)])  # new questions
    pool = BlockPool(2048, BLOCK_SIZE, enable_prefix_caching=True)
    first = next(prompts)
    pool.allocate("first", len(first), first)
    pool.free("first")

    def request():
        prompt = next(prompts)
        pool.allocate("next", len(prompt), prompt)
        assert pool.num_cached_tokens["next"] == 2048
        pool.free("next")

    cases = {"dict walk (_cached_prefix), 1M tokens": lambda: warm._cached_prefix(hashes),
             "allocate + free, 2,148-token prompt, 2,048 cached": request}
    return cases, {"dict walk (_cached_prefix), 1M tokens": len(hashes),
                   "allocate + free, 2,148-token prompt, 2,048 cached": len(first) // BLOCK_SIZE}


def rows_of(times: dict, blocks: dict) -> list[dict]:
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row = {"case": name, "median_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
               "max_ms": round(max(ts) * 1e3, 2)}
        row["ns_per_block"] = round(med / blocks[name] * 1e9) if name in blocks else "-"
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for the JSON results")
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds after the warm-up")
    args = parser.parse_args()
    env = environment()
    num_blocks = args.tokens // BLOCK_SIZE
    cases = hashing_cases(args.tokens)
    per_block = {name: num_blocks for name in cases if "token_bytes" not in name and not name.startswith("bulk")}
    hashing = rows_of(time_in_rotation(cases, args.repeat), per_block)
    lookups, looked_up = lookup_cases()
    lookup = rows_of(time_in_rotation(lookups, args.repeat), looked_up)
    print(f"{env['cpu']} ({env['cores']} cores, SHA extensions: {env['sha_extensions']}), Python {env['python']}, "
          f"{env['openssl']}, load average before: {env['load_average']}")
    print(f"\n{args.tokens:,} tokens, block size {BLOCK_SIZE}: {num_blocks:,} blocks")
    columns = ["case", "median_ms", "min_ms", "max_ms", "ns_per_block"]
    print_table(hashing, columns)
    print("\ncache lookups on a warm cache")
    print_table(lookup, columns)
    save("block_hash", {"env": env, "tokens": args.tokens, "block_size": BLOCK_SIZE, "repeat": args.repeat,
                        "hashing": hashing, "lookups": lookup}, args.out)


if __name__ == "__main__":
    main()
