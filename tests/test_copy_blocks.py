"""copy_blocks against copy_blocks_ref: random disjoint pairs, all layers, K and V, bad input."""
import pytest
import torch

from kvlab import profile
from kvlab.kernels import copy_blocks
from kvlab.paging import allocate_kv_cache
from kvlab.reference import copy_blocks_ref

DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"


def random_pairs(num_blocks, num_pairs, gen):
    """(src, dst) pairs with distinct dsts that are never also srcs, as copy-on-write makes them."""
    perm = torch.randperm(num_blocks, generator=gen)
    dst = perm[:num_pairs]
    src = perm[num_pairs:][torch.randint(num_blocks - num_pairs, (num_pairs,), generator=gen)]  # srcs may repeat
    return torch.stack([src, dst], dim=1).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_layers,block_size,num_kv_heads,head_dim", [
    (2, 16, 2, 64), (3, 5, 1, 128), (32, 16, 8, 128) if BIG else (1, 16, 8, 128)])
def test_copy_blocks_matches_reference(dtype, num_layers, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_layers * 100 + block_size)
    num_blocks = 512 if BIG else 24
    cache = allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    pairs = random_pairs(num_blocks, num_blocks // 3, gen)
    k_want, v_want = cache.k.clone(), cache.v.clone()
    copy_blocks_ref([k_want, v_want], pairs)
    copy_blocks([cache.k, cache.v], pairs)
    assert torch.equal(cache.k, k_want) and torch.equal(cache.v, v_want)
    # and the copy really happened: every dst now equals its src, in every layer
    assert torch.equal(cache.k[:, pairs[:, 1]], cache.k[:, pairs[:, 0]])


def test_copy_blocks_single_layer_tensor():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(10, 4, 2, 8, generator=gen).to(DEVICE)
    pairs = torch.tensor([[1, 7], [1, 8], [3, 0]], device=DEVICE)
    want = k.clone()
    copy_blocks_ref([want], pairs)
    copy_blocks([k], pairs)
    assert torch.equal(k, want) and torch.equal(k[7], k[1])


def test_no_pairs_copies_nothing():
    k = torch.randn(3, 2, 1, 4, device=DEVICE)
    before = k.clone()
    copy_blocks([k], torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k, before)


@pytest.mark.parametrize("pairs,error,match", [
    ([[0, 5]], ValueError, r"block_mapping\[0, 1\] = 5 is out of range"),
    ([[-1, 2]], ValueError, r"block_mapping\[0, 0\] = -1"),
    ([[0, 2], [1, 2]], ValueError, "into one dst block twice"),
    ([[0, 1], [1, 2]], ValueError, "both a src and a dst"),
    ([0, 1], ValueError, r"\[num_pairs, 2\]"),
])
def test_bad_pairs_are_refused_and_copy_nothing(pairs, error, match):
    k = torch.randn(5, 2, 1, 4, device=DEVICE)
    v = torch.randn(5, 2, 1, 4, device=DEVICE)
    before = (k.clone(), v.clone())
    with pytest.raises(error, match=match):
        copy_blocks([k, v], torch.tensor(pairs, device=DEVICE))
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_bad_arguments():
    k = torch.randn(5, 2, 1, 4, device=DEVICE)
    with pytest.raises(TypeError, match="int64"):
        copy_blocks([k], torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="list of cache tensors"):
        copy_blocks(k, torch.tensor([[0, 1]], device=DEVICE))
    with pytest.raises(ValueError, match="has 4 blocks"):
        copy_blocks([k, torch.randn(4, 2, 1, 4, device=DEVICE)], torch.tensor([[0, 1]], device=DEVICE))
    with pytest.raises(ValueError, match="block_mapping is on meta"):
        copy_blocks([k], torch.tensor([[0, 1]], device="meta"))


def test_races_are_found_across_tiles():
    """The pair searches compare tiles of 64 pairs, in several programs: a clash far apart is found too."""
    k = torch.randn(400, 2, 1, 4, device=DEVICE)
    before = k.clone()
    pairs = torch.stack([torch.arange(150), torch.arange(200, 350)], dim=1).to(DEVICE)
    bad = pairs.clone()
    bad[140, 1] = bad[3, 1]
    with pytest.raises(ValueError, match="into one dst block twice"):
        copy_blocks([k], bad)
    bad = pairs.clone()
    bad[2, 0] = bad[149, 1]
    with pytest.raises(ValueError, match="both a src and a dst"):
        copy_blocks([k], bad)
    assert torch.equal(k, before)
    copy_blocks([k], pairs)
    assert torch.equal(k[200:350], before[:150])


def test_default_call_reads_once(monkeypatch):
    from kvlab.kernels import checks

    reads = []
    real = checks.read_check
    monkeypatch.setattr(checks, "read_check", lambda *a, **k: reads.append(1) or real(*a, **k))
    k = torch.randn(5, 2, 1, 4, device=DEVICE)
    copy_blocks([k], torch.tensor([[0, 3], [1, 4]], device=DEVICE))
    copy_blocks([k], torch.tensor([[0, 3], [1, 4]], device=DEVICE), validate=False)
    assert reads == [1]
