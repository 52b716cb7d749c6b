"""write_kv against write_kv_ref: ragged batches, page boundaries, padding, strides, bad input.

Runs in Triton's interpreter on a CPU (small sizes) and natively on a GPU
(``KVLAB_PROFILE=gpu pytest tests/test_write_kv.py``, larger sizes).
"""
import random

import pytest
import torch

from kvlab import profile
from kvlab.kernels import write_kv
from kvlab.paging import BlockPool, batch_slot_mapping
from kvlab.reference import write_kv_ref

DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"


def poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))


def assert_same(got, want):
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} elements differ, first at {(~same).nonzero()[0].tolist()}"


def write_and_compare(key, value, k_cache, v_cache, slots):
    """write_kv into the (poisoned) caches, and check them against write_kv_ref on copies."""
    k_want, v_want = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slots)
    write_kv_ref(key, value, k_want, v_want, slots)
    assert_same(k_cache, k_want)
    assert_same(v_cache, v_want)


def ragged_batch(rng, block_size, num_blocks):
    """Sequences of ragged lengths around block boundaries, appended interleaved so their
    blocks scatter; returns the pool and the (seq, start, num_new) requests of one step."""
    pool = BlockPool(num_blocks, block_size)
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, rng.randint(2, 4 * block_size)]
    lengths = [n for n in lengths if n > 0]
    for seq in range(len(lengths)):
        pool.allocate(seq, 0)
    for pos in range(max(lengths)):  # interleave growth: tables end up scattered
        for seq, n in enumerate(lengths):
            if pos < n:
                pool.append(seq, 1)
    requests = []
    for seq, n in enumerate(lengths):
        num_new = rng.choice([1, n])   # a decode token or the whole prompt
        requests.append((seq, n - num_new, num_new))
    return pool, requests


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (8, 128) if BIG else (3, 16)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_write_kv_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    rng = random.Random(f"{dtype}{num_kv_heads}{head_dim}{block_size}")
    pool, requests = ragged_batch(rng, block_size, num_blocks=64)
    pad = 7
    slots = batch_slot_mapping(pool, requests, device=DEVICE)
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64, device=DEVICE)])
    slots = slots[torch.randperm(len(slots), device=DEVICE)]   # padding anywhere in the batch
    num_tokens = len(slots)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k_cache, v_cache = poisoned_cache(64, block_size, num_kv_heads, head_dim, dtype)
    write_and_compare(key, value, k_cache, v_cache, slots)
    written = int((~k_cache.isnan()).all(-1).all(-1).sum())
    assert written == num_tokens - pad


def test_write_kv_reads_strided_rows():
    """K and V may be views into a fused QKV projection: rows strided, each row contiguous."""
    num_tokens, heads, dim = 9, 2, 16
    qkv = torch.randn(num_tokens, 3, heads, dim, device=DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(4 * 8, device=DEVICE)[:num_tokens]
    k_cache, v_cache = poisoned_cache(4, 8, heads, dim, torch.float32)
    write_and_compare(key, value, k_cache, v_cache, slots)


def test_write_kv_large_batch():
    """An 8B-model-shaped layer on the GPU; a few pages' worth in the interpreter."""
    num_blocks, block_size, heads, dim = (4096, 16, 8, 128) if BIG else (16, 16, 8, 128)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:32768 if BIG else 200]
    key = torch.randn(len(slots), heads, dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    k_cache, v_cache = poisoned_cache(num_blocks, block_size, heads, dim, torch.bfloat16)
    write_and_compare(key, value, k_cache, v_cache, slots)


def test_empty_batch_writes_nothing():
    k_cache, v_cache = poisoned_cache(2, 4, 1, 8, torch.float32)
    empty = torch.empty(0, 1, 8, device=DEVICE)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert bool(k_cache.isnan().all())


def _args(**overrides):
    heads, dim = 2, 8
    args = dict(key=torch.randn(3, heads, dim, device=DEVICE), value=torch.randn(3, heads, dim, device=DEVICE),
                k_cache=torch.zeros(4, 4, heads, dim, device=DEVICE) + 7,
                v_cache=torch.zeros(4, 4, heads, dim, device=DEVICE) + 7,
                slot_mapping=torch.tensor([0, 5, -1], device=DEVICE))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,error,match", [
    (dict(slot_mapping=torch.tensor([0, 16, 1])), ValueError, r"slot_mapping\[1\] = 16 is out of range"),
    (dict(slot_mapping=torch.tensor([0, -2, 1])), ValueError, r"slot_mapping\[1\] = -2"),
    (dict(slot_mapping=torch.tensor([3, 3, 1])), ValueError, "twice"),
    (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "int64"),
    (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "one slot per token"),
    (dict(key=torch.randn(3, 2, 4)), ValueError, "key must have shape"),
    (dict(value=torch.randn(3, 2, 8, dtype=torch.float16)), TypeError, "value has dtype"),
    (dict(key=torch.randn(3, 8, 2).transpose(1, 2)), ValueError, "contiguous within a token"),
    (dict(v_cache=torch.zeros(4, 4, 2, 4)), ValueError, "must match"),
    (dict(k_cache=torch.zeros(16, 2, 8)), ValueError, "k_cache must be"),
    (dict(slot_mapping=torch.tensor([0, 1, 2], device="meta")), ValueError, "slot_mapping is on meta"),
    (dict(key=[1, 2]), TypeError, "key must be a torch.Tensor"),
])
def test_bad_input_is_refused_and_writes_nothing(overrides, error, match):
    args = _args(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
                    for k, v in overrides.items()})
    k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(error, match=match):
        write_kv(**args)
    assert torch.equal(args["k_cache"], k_before) and torch.equal(args["v_cache"], v_before)


def test_one_tensor_for_both_caches_is_refused():
    args = _args()
    args["v_cache"] = args["k_cache"]
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match="k_cache and v_cache must be two tensors"):
        write_kv(**args)
    assert torch.equal(args["k_cache"], before)


@pytest.mark.parametrize("first,second", [(0, 1), (3, 150), (70, 199), (130, 131)])
def test_a_slot_named_twice_is_found_anywhere(first, second):
    """The duplicate search compares tiles of 64 slots, in several programs: pairs in one tile, in two."""
    slots = torch.randperm(4 * 4 * 16, device=DEVICE)[:200]
    slots[second] = slots[first]
    k_cache, v_cache = poisoned_cache(16, 16, 1, 16, torch.float32)
    key = torch.randn(200, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="names a slot twice"):
        write_kv(key, key, k_cache, v_cache, slots)
    assert bool(k_cache.isnan().all()) and bool(v_cache.isnan().all())
    slots[second] = -1                       # padding may repeat
    slots[first] = -1
    write_and_compare(key, key, k_cache, v_cache, slots)


def test_default_call_reads_once(monkeypatch):
    from kvlab.kernels import checks

    reads = []
    real = checks.read_check
    monkeypatch.setattr(checks, "read_check", lambda *a, **k: reads.append(1) or real(*a, **k))
    write_kv(**_args())
    assert reads == [1]
    write_kv(**_args(), validate=False)
    assert reads == [1]


def test_a_strided_slot_mapping_is_refused():
    slots = torch.tensor([0, 9, 5, 9, -1, 9], device=DEVICE)[::2]
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        write_kv(**_args(slot_mapping=slots))
