"""The cache's second tier: KV blocks in (pinned) host memory, for preempted sequences.

When the scheduler must preempt a sequence it can either drop its K/V and **recompute** it
later (a prefill of everything computed so far), or **swap** it: copy its blocks to host
memory now and back when it resumes. Which is cheaper depends on the length:

* swapping costs two transfers of ``num_tokens * bytes_per_token`` bytes over PCIe, plus a
  fixed cost per transfer (launches, the gather into one staging buffer);
* recomputing costs a prefill: a term linear in the tokens (the weights' FLOPs per token) and
  a quadratic one (each token attends to all earlier ones).

:func:`preemption_mode` compares the two with :class:`PreemptionCosts` measured on the GPU
(``benchmarks/bench_offload.py``). :class:`HostBlockAllocator` books host blocks (the
scheduler's side); :class:`HostKVCache` moves bytes (the model runner's side): a sequence's
blocks of every layer go through one device staging buffer and one contiguous host run per
transfer, never one small copy per block and layer. On a GPU the copies run on a side
stream: the forward waits only for the blocks to be gathered (a device-speed copy), while the
slow device-to-host transfer overlaps with it.

**The prefix cache's host tier.** With prefix caching, a block evicted from the device cache
(:meth:`~kvlab.paging.BlockPool._take_free_block`) need not be lost: :class:`HostPrefixCache`
keeps its K/V in a host block under its hash, least recently used first, bounded by the host
blocks it owns (its own share of the host storage, never the swapped-out sequences'). The copy
is a swap-out of the very step that evicts the block: the runner copies a step's swap-outs
before anything of the step writes the cache. When a prompt's chain of cached hashes leaves
the device cache but goes on in the host tier, :meth:`~kvlab.paging.BlockPool.allocate` takes
device blocks for those hashes, registers them, and records swap-ins (host, device): the
prompt's cache hit goes on through them. A hash names the whole prefix (the chained tokens
and the salt), so the K/V brought back is exactly what a prefill would compute. A host block
read by a step's swap-in is reused only from the next step on, so no swap-out of that step
(they run first) overwrites it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvlab.validation import check_count

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(frozen=True)
class PreemptionCosts:
    """What swapping and recomputing cost, per byte and per token (seconds)."""

    bandwidth: float                  # bytes/s of a pinned host<->device copy
    latency: float                    # seconds of fixed cost per transfer (launch, sync)
    prefill_per_token: float          # seconds per recomputed token (the step-cost model's linear term)
    prefill_per_token_sq: float = 0.0  # seconds per token squared (causal attention over the prefix)


def swap_seconds(num_tokens: int, bytes_per_token: int, costs: PreemptionCosts) -> float:
    """Out now, back in later: two transfers of the sequence's K/V."""
    return 2 * (costs.latency + num_tokens * bytes_per_token / costs.bandwidth)


def recompute_seconds(num_tokens: int, costs: PreemptionCosts) -> float:
    """A prefill of the ``num_tokens`` tokens whose K/V was dropped."""
    return num_tokens * costs.prefill_per_token + num_tokens ** 2 * costs.prefill_per_token_sq


def preemption_mode(num_tokens: int, bytes_per_token: int, costs: PreemptionCosts, host_free_bytes: int) -> str:
    """"swap" if the host has room for the K/V and swapping is strictly cheaper, else "recompute"."""
    check_count("num_tokens", num_tokens)
    check_count("bytes_per_token", bytes_per_token)
    check_count("host_free_bytes", host_free_bytes)
    fits = num_tokens * bytes_per_token <= host_free_bytes
    cheaper = swap_seconds(num_tokens, bytes_per_token, costs) < recompute_seconds(num_tokens, costs)
    return "swap" if fits and cheaper else "recompute"


def crossover_tokens(bytes_per_token: int, costs: PreemptionCosts, max_tokens: int = 1 << 20) -> int | None:
    """The fewest tokens at which swapping is cheaper than recomputing (None: not up to
    ``max_tokens``). Swap minus recompute is concave in the length, so past the crossover
    swapping stays cheaper; a binary search finds it."""
    def cheaper(n):
        return swap_seconds(n, bytes_per_token, costs) < recompute_seconds(n, costs)

    if not cheaper(max_tokens):
        return None
    lo, hi = 0, max_tokens              # cheaper(lo) is False (0 tokens: recompute costs nothing)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cheaper(mid) else (mid, hi)
    return hi


def model_costs(config, bandwidth: float, latency: float, flops_per_s: float) -> PreemptionCosts:
    """Costs for a Llama-shaped ``config``: a recomputed token costs the forward's matmul FLOPs
    (2 per weight) at ``flops_per_s``, and its attention over ``n`` earlier tokens 4 * n *
    head_dim FLOPs per query head and layer (QK and PV), half of it on average with the mask."""
    c = config
    hidden, inter = c.hidden_size, c.intermediate_size
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    weights = c.num_layers * (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter) \
        + hidden * c.vocab_size
    attention = c.num_layers * c.num_heads * 4 * c.head_dim / 2
    return PreemptionCosts(bandwidth=bandwidth, latency=latency, prefill_per_token=2 * weights / flops_per_s,
                           prefill_per_token_sq=attention / flops_per_s)


# Measured on one H200 by benchmarks/bench_offload.py (results/offload.json): a staged transfer's
# rate (pinned copies reach 55 GB/s) and fixed cost, and the 8B-shaped model's prefill rate in
# weight FLOPs (its fitted linear term). There, swapping wins from about 20 tokens on.
H200 = dict(bandwidth=51.9e9, latency=168e-6, flops_per_s=685e12)
# A CPU "host tier" is a memcpy in the same memory, and a prefill runs at CPU FLOP rates.
CPU = dict(bandwidth=5e9, latency=20e-6, flops_per_s=100e9)


def default_costs(config, device: torch.device) -> PreemptionCosts:
    """The cost model of the engine on ``device`` for the model ``config``."""
    return model_costs(config, **(H200 if torch.device(device).type == "cuda" else CPU))


class HostBlockAllocator:
    """Books host blocks for swapped-out sequences: each gets one contiguous run, so its
    transfer is one copy (first fit; a request no run can hold is refused)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = check_count("num_blocks", num_blocks)
        self.runs: dict[int, int] = {0: num_blocks} if num_blocks else {}   # free runs: start -> length

    @property
    def num_free_blocks(self) -> int:
        return sum(self.runs.values())

    def largest_run(self) -> int:
        return max(self.runs.values(), default=0)

    def allocate(self, count: int) -> list[int]:
        """``count`` consecutive host block ids (ValueError if no free run is that long)."""
        check_count("count", count, minimum=1)
        for start, length in sorted(self.runs.items()):
            if length >= count:
                del self.runs[start]
                if length > count:
                    self.runs[start + count] = length - count
                return list(range(start, start + count))
        raise ValueError(f"no run of {count} free host blocks (largest: {self.largest_run()})")

    def free(self, blocks: list[int]) -> None:
        """Give back blocks (a run or part of one); neighbouring free runs merge. A block that
        is not allocated, or named twice, is refused, and then nothing is given back."""
        blocks = sorted(check_count("host block", b) for b in blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError("blocks: a host block is named twice")
        for block in blocks:
            if not 0 <= block < self.num_blocks or any(s <= block < s + n for s, n in self.runs.items()):
                raise ValueError(f"host block {block} is not allocated")
        runs = {**self.runs, **dict.fromkeys(blocks, 1)}
        self.runs, last = {}, None
        for start in sorted(runs):
            if last is not None and last + self.runs[last] == start:
                self.runs[last] += runs[start]
            else:
                self.runs[start], last = runs[start], start


class HostPrefixCache:
    """The prefix cache's host tier: evicted blocks' K/V by hash, in the host blocks it owns.

    The device pool calls :meth:`save` for each cached block it evicts, :meth:`take` and
    :meth:`restore` for the blocks it brings back; the scheduler turns the step's :meth:`take_transfers` into
    swap-outs and swap-ins. When every host block is taken, saving drops the least recently
    used entry and reuses its block.

    >>> tier = HostPrefixCache([6, 7])
    >>> tier.save(3, b"a"); tier.save(4, b"b"); tier.save(5, b"c")   # "a" is dropped for "c"
    >>> tier.lookup(b"a"), tier.lookup(b"c")
    (None, 6)
    >>> tier.restore(tier.take([b"b"]), [0]); tier.take_transfers()
    ([(3, 6), (4, 7), (5, 6)], [(7, 0)])
    """

    def __init__(self, host_blocks):
        self.host_blocks = [check_count("host block", b) for b in host_blocks]   # the host block ids it owns
        if len(set(self.host_blocks)) != len(self.host_blocks):
            raise ValueError("host_blocks: a host block is named twice")
        self.free: deque[int] = deque(self.host_blocks)
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, least recent first
        self.saves: list[tuple[int, int]] = []                 # this step's (device, host) copies out
        self.loads: list[tuple[int, int]] = []                 # this step's (host, device) copies in
        self.reading: list[int] = []                           # host blocks this step's loads read
        self.num_saved = 0
        self.num_restored = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, block_hash: bytes) -> int | None:
        """The host block holding ``block_hash``'s K/V, or None; changes nothing."""
        return self.entries.get(block_hash)

    def save(self, device_block: int, block_hash: bytes) -> None:
        """The device pool evicts ``device_block``, cached under ``block_hash``: keep a copy."""
        if block_hash in self.entries:          # already here: it is just used again
            self.entries.move_to_end(block_hash)
            return
        if self.free:
            host = self.free.popleft()
        elif self.entries:
            _, host = self.entries.popitem(last=False)
        else:
            return                              # a tier without host blocks keeps nothing
        self.entries[block_hash] = host
        self.saves.append((device_block, host))
        self.num_saved += 1

    def take(self, block_hashes) -> list[int]:
        """The host blocks of ``block_hashes``, to be copied back to the device: the entries
        leave the tier (the device cache holds them now); the blocks stay reserved until the
        next step, when the copies have read them."""
        block_hashes = list(block_hashes)
        if len(set(block_hashes)) != len(block_hashes):
            raise ValueError("block_hashes: a hash is named twice")
        if any(h not in self.entries for h in block_hashes):
            raise ValueError("block_hashes: a hash is not in the tier")
        host_blocks = [self.entries.pop(h) for h in block_hashes]
        self.reading += host_blocks
        return host_blocks

    def restore(self, host_blocks, device_blocks) -> None:
        """Record the copies of ``host_blocks`` (from :meth:`take`) into ``device_blocks``."""
        host_blocks, device_blocks = list(host_blocks), list(device_blocks)
        if len(host_blocks) != len(device_blocks):
            raise ValueError(f"host_blocks and device_blocks must pair up, got {len(host_blocks)} and "
                             f"{len(device_blocks)} blocks")
        self.loads += zip(host_blocks, device_blocks)
        self.num_restored += len(host_blocks)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's copies, ``(saves, loads)``, recorded since the last call."""
        transfers = (self.saves, self.loads)
        self.saves, self.loads = [], []
        return transfers

    def next_step(self) -> None:
        """The previous step's copies have run: the host blocks it read are free again."""
        self.free.extend(self.reading)
        self.reading = []

    def discard(self, host_blocks) -> None:
        """Forget the entries in ``host_blocks`` (their copies may not have happened)."""
        gone = set(host_blocks)
        for h, host in list(self.entries.items()):
            if host in gone:
                del self.entries[h]
                self.free.append(host)

    def clear(self) -> None:
        """Forget every entry."""
        self.discard(list(self.entries.values()))


class HostKVCache:
    """Host copies of KV blocks: ``storage[host_block]`` holds one block of every layer (K, V
    and, for a quantised cache, their scales) as one run of bytes."""

    def __init__(self, kv_cache, num_blocks: int):
        self.kv_cache = kv_cache
        # [num_layers, num_blocks, one block of one layer] views of the cache in the widest
        # integer type that divides every row (a gather moves 8-byte words, not single bytes)
        rows = [t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1) for t in kv_cache.block_tensors()]
        self.unit = next(u for u in (torch.int64, torch.int32, torch.uint8)
                         if all(r.shape[2] % u.itemsize == 0 for r in rows))
        self.parts = [r.view(self.unit) for r in rows]
        self.bytes_per_block = sum(r.shape[0] * r.shape[2] for r in rows)
        device = kv_cache.k.device
        self.storage = torch.empty(num_blocks, self.bytes_per_block, dtype=torch.uint8,
                                   pin_memory=device.type == "cuda")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def swap_out(self, gpu_blocks: list[int], host_blocks: list[int]) -> None:
        """Copy device blocks to the host run ``host_blocks``. On a GPU the caller's stream
        waits only until the blocks are gathered; the host copy finishes on the side stream."""
        start = self._check_transfer(gpu_blocks, host_blocks)
        if not gpu_blocks:
            return
        with _on_side_stream(self.stream) as current:         # what is allocated here belongs to the side stream
            ids = torch.tensor(gpu_blocks, dtype=torch.int64, device=self.kv_cache.k.device)
            staging = self._gather(ids)
            if current is not None:
                current.wait_stream(self.stream)          # the blocks may be reused from here on
            self.storage[start:start + len(host_blocks)].copy_(staging.view(torch.uint8), non_blocking=True)

    def swap_in(self, host_blocks: list[int], gpu_blocks: list[int]) -> None:
        """Copy the host run ``host_blocks`` into device blocks, before the caller's next kernel."""
        start = self._check_transfer(gpu_blocks, host_blocks, distinct=True)
        if not gpu_blocks:
            return
        device = self.kv_cache.k.device
        with _on_side_stream(self.stream) as current:
            ids = torch.tensor(gpu_blocks, dtype=torch.int64, device=device)
            staging = self.storage[start:start + len(host_blocks)].to(device, non_blocking=True)
            self._scatter(staging.view(self.unit), ids)
            if current is not None:
                current.wait_stream(self.stream)

    def _check_transfer(self, gpu_blocks, host_blocks, distinct: bool = False) -> int:
        """The first block of the host run, once both lists are checked, before anything is copied:
        they pair up, device blocks are in range (and ``distinct``, when written), host blocks one
        run in range."""
        if len(gpu_blocks) != len(host_blocks):
            raise ValueError(f"gpu_blocks and host_blocks must pair up, got {len(gpu_blocks)} and "
                             f"{len(host_blocks)} blocks")
        num_device = self.parts[0].shape[1]
        for block in gpu_blocks:
            if check_count("gpu block", block) >= num_device:
                raise ValueError(f"gpu block {block} is out of range: the cache has {num_device} blocks")
        if distinct and len(set(gpu_blocks)) != len(gpu_blocks):
            raise ValueError("gpu_blocks: a block is named twice")
        if not host_blocks:
            return 0
        start = check_count("host block", host_blocks[0])
        if list(host_blocks) != list(range(start, start + len(host_blocks))):
            raise ValueError(f"host blocks must be one consecutive run, got {list(host_blocks)[:8]}...")
        if start + len(host_blocks) > self.storage.shape[0]:
            raise ValueError(f"host blocks {start}..{start + len(host_blocks) - 1} are out of range: the host "
                             f"cache has {self.storage.shape[0]} blocks")
        return start

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks ``ids`` of every layer, block-major, in one staging buffer."""
        staging = torch.empty(len(ids), self.bytes_per_block // self.unit.itemsize, dtype=self.unit, device=ids.device)
        offset = 0
        for part in self.parts:
            layers, _, width = part.shape
            staging[:, offset:offset + layers * width].view(-1, layers, width).copy_(part[:, ids].transpose(0, 1))
            offset += layers * width
        return staging

    def _scatter(self, staging: torch.Tensor, ids: torch.Tensor) -> None:
        offset = 0
        for part in self.parts:
            layers, _, width = part.shape
            part[:, ids] = staging[:, offset:offset + layers * width].view(-1, layers, width).transpose(0, 1)
            offset += layers * width


@contextmanager
def _on_side_stream(stream):
    """Run the ``with`` block on ``stream`` after everything queued on the current stream (the
    K/V written by earlier steps); yields the current stream (None on a CPU)."""
    if stream is None:
        yield None
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield current
