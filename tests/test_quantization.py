"""The quantised KV cache (kv_cache_dtype "fp8" / "int8"): the PyTorch reference, write_kv_quantized
against it, paged_decode over a quantised cache, the accounting, and bad input refused.

Runs in Triton's interpreter on a CPU (small sizes) and natively on a GPU
(``KVLAB_PROFILE=gpu pytest tests/test_quantization.py``, or ``-m kv_quant`` across the suite).
"""
import importlib
import random

import pytest
import torch

from kvlab import profile
from kvlab.accounting import kv_bytes_per_token, kv_cache_bytes_per_token, sequences_with_kv_cache_dtype
from kvlab.kernels import paged_decode
from kvlab.kernels.write_kv_quant import write_kv_quantized
from kvlab.paging import BlockPool, batch_slot_mapping
from kvlab.paging.kv_cache import per_page_and_head
from kvlab.quantization import (KV_CACHE_DTYPES, allocate_quantized_kv_cache, dequantize_kv, kv_cache_format,
                                outlier_kv, quantization_error, quantize_kv)
from kvlab.reference import paged_attention_ref
from helpers import scattered_tables

pytestmark = pytest.mark.kv_quant
DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"
FORMATS = ["fp8", "int8"]
paged_decode_module = importlib.import_module("kvlab.kernels.paged_decode")


# -- the reference ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_round_trip_error_is_within_half_a_step(kv_cache_dtype):
    """Against float64: int8 is off by at most half a step (scale / 2); fp8 by half a step of its
    exponent, 2**-4 of the value, or 2**-10 * scale among the subnormals."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None, None]     # rows from 1e-3 to 1e3
    x[5, 1] = 0.0                                             # an all-zero row: scale 1, values 0
    q, scale = quantize_kv(x, kv_cache_dtype)
    fmt = kv_cache_format(kv_cache_dtype)
    assert q.dtype == fmt.dtype and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert scale[5, 1] == 1.0 and bool((q[5, 1].float() == 0).all())
    back = dequantize_kv(q, scale, torch.float64)
    err, s = (back - x).abs(), scale.double()[..., None]
    if kv_cache_dtype == "int8":
        bound = s / 2
    else:
        bound = torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10)
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    # scales are powers of two in the format's range, and each row's largest value lands in the
    # grid's top half (max / 2 .. max) unless its scale is the smallest one (rows near 1e-3 here)
    exponent = torch.log2(scale)
    assert bool((exponent == exponent.round()).all())
    assert fmt.min_exponent <= float(exponent.min()) and float(exponent.max()) <= fmt.max_exponent
    top = q.float().abs().amax(-1)[(scale != 1) & (scale > 2.0 ** fmt.min_exponent)]
    assert len(top) > 200 and bool(((top >= fmt.max / 2) & (top <= fmt.max)).all())


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_every_code_times_its_scale_is_an_fp16_number(kv_cache_dtype):
    """The reason for powers of two: a kernel may dequantise into fp16 exactly, for rows from far
    below the smallest scale's reach to past the largest (those saturate)."""
    fmt = kv_cache_format(kv_cache_dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 2, 64, generator=gen) * torch.logspace(-9, 6, 96)[:, None, None]
    q, scale = quantize_kv(x, kv_cache_dtype)
    back = dequantize_kv(q, scale)
    assert bool((back.half().float() == back).all())
    assert float(back.abs().max()) == fmt.max * 2.0 ** fmt.max_exponent      # saturated, not infinite


def test_formats_and_names():
    assert kv_cache_format("auto") is None and KV_CACHE_DTYPES["fp8"].max == 448.0
    assert kv_cache_format("fp8_e4m3").dtype == torch.float8_e4m3fn and kv_cache_format(torch.int8).max == 127.0
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp16'"):
        kv_cache_format("fp16")
    with pytest.raises(ValueError, match="nothing to quantise"):
        quantize_kv(torch.ones(2, 4), "auto")


def test_fp8_saturates_instead_of_overflowing():
    """float8_e4m3fn has no infinity: past the largest scale (2**7), x / scale above 448 must clamp,
    not become NaN."""
    q, scale = quantize_kv(torch.tensor([[[1e5, -3.0, 0.5, 1e-3]]]), "fp8")
    assert float(scale) == 2.0 ** 7
    assert not bool(q.float().isnan().any()) and q.float()[0, 0, 0] == 448.0


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_a_scale_per_token_and_head_beats_one_per_tensor_with_outliers(kv_cache_dtype):
    """4 tokens of 256 are 100x larger. One scale per tensor is set by them; every other token uses a
    corner of the grid. int8 loses most of its values; fp8's exponent absorbs a 100x outlier, not
    a 10^5x one (the others fall into its subnormals)."""
    x = outlier_kv(256, 2, 64, num_outliers=4, gain=100.0)
    per_token_head = quantization_error(x, "token_head", kv_cache_dtype)
    per_tensor = quantization_error(x, "tensor", kv_cache_dtype)
    assert per_token_head < 0.03
    if kv_cache_dtype == "int8":
        assert per_tensor > 20 * per_token_head, (per_token_head, per_tensor)
    else:
        assert abs(per_tensor - per_token_head) < 0.1 * per_token_head, (per_token_head, per_tensor)
        x = outlier_kv(256, 2, 64, num_outliers=4, gain=1e5)
        assert quantization_error(x, "tensor", "fp8") > 10 * quantization_error(x, "token_head", "fp8")
    # without outliers the two are within a factor 2 (fp8) or 5 (int8) of each other
    plain = outlier_kv(256, 2, 64, num_outliers=0)
    assert quantization_error(plain, "tensor", kv_cache_dtype) < 5 * quantization_error(plain, "token_head",
                                                                                          kv_cache_dtype)


def test_kv_bytes_per_token_includes_the_scales():
    """llama-3-8b: 32 layers x 8 KV heads x 128 dims; fp8 stores 128 bytes + a 4-byte scale per head, K and V."""
    assert kv_cache_bytes_per_token("llama-3-8b") == kv_bytes_per_token("llama-3-8b", "bf16") == 131072
    assert kv_cache_bytes_per_token("llama-3-8b", "fp8") == 2 * 32 * 8 * (128 + 4) == 67584
    assert kv_cache_bytes_per_token("llama-3-8b", "int8") == 67584
    auto, fp8 = sequences_with_kv_cache_dtype("llama-3-8b", "H200-141GB", 8192, "fp8")
    assert 1.9 < fp8 / auto < 2.0                      # not quite 2x: the scales
    for name, fmt in KV_CACHE_DTYPES.items():          # the accounting's byte sizes are the stored dtypes'
        if fmt is not None:
            assert kv_cache_bytes_per_token("llama-3-8b", name) == 2 * 32 * 8 * (128 * fmt.dtype.itemsize + 4)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        kv_cache_bytes_per_token("llama-3-8b", "fp4")


# -- write_kv_quantized --------------------------------------------------------------------------
def poisoned(num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype):
    """Caches and scales full of NaN (int8 has none: -128, which the format never writes)."""
    caches = allocate_quantized_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype, DEVICE)
    for t in caches:
        t.fill_(-128 if t.dtype == torch.int8 else float("nan"))
    return caches


def unwritten(t):
    return t.isnan() if t.is_floating_point() else t == -128


def write_ref(key, value, caches, slots, kv_cache_dtype):
    """quantize_kv, scattered into copies of ``caches`` by slot (padding skipped)."""
    k_cache, v_cache, k_scale, v_scale = (t.clone() for t in caches)
    keep = slots >= 0
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        q, s = quantize_kv(x[keep], kv_cache_dtype)
        cache.view(-1, *cache.shape[2:])[slots[keep]] = q
        scale.view(-1, scale.shape[2])[slots[keep]] = s
    return k_cache, v_cache, k_scale, v_scale


def assert_same(got, want):
    got, want = got.float(), want.float()                  # float8 has no == of its own on every device
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} elements differ, first at {(~same).nonzero()[0].tolist()}"


def ragged_slots(rng, block_size, num_blocks, pad):
    """One step's slots for ragged sequences around page boundaries, pages scattered, -1 padding anywhere."""
    pool = BlockPool(num_blocks, block_size)
    lengths = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    for seq in range(len(lengths)):
        pool.allocate(seq, 0)
    for pos in range(max(lengths)):
        for seq, n in enumerate(lengths):
            if pos < n:
                pool.append(seq, 1)
    requests = [(seq, n - (num_new := rng.choice([1, n])), num_new) for seq, n in enumerate(lengths)]
    slots = batch_slot_mapping(pool, requests, device=DEVICE)
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64, device=DEVICE)])
    return slots[torch.randperm(len(slots), device=DEVICE)]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size",
                         [(1, 32, 16), (3, 24, 5)] + ([(8, 128, 16)] if BIG else []))
def test_write_kv_quantized_matches_reference(kv_cache_dtype, dtype, num_kv_heads, head_dim, block_size):
    """Bit for bit, values and scales; padding and unused slots untouched (still poisoned)."""
    rng = random.Random(f"{kv_cache_dtype}{dtype}{num_kv_heads}{head_dim}{block_size}")
    slots = ragged_slots(rng, block_size, num_blocks=16, pad=5)
    gen = torch.Generator().manual_seed(len(slots))
    key = (torch.randn(len(slots), num_kv_heads, head_dim, generator=gen) * 30).to(DEVICE, dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    key[0, 0] = 0.0                                          # an all-zero row
    caches = poisoned(16, block_size, num_kv_heads, head_dim, kv_cache_dtype)
    want = write_ref(key, value, caches, slots, kv_cache_dtype)
    write_kv_quantized(key, value, *caches, slots)
    for got, w in zip(caches, want):
        assert_same(got, w)
    written = int((~unwritten(caches[0])).all(-1).all(-1).sum())
    assert written == len(slots) - 5 == int((~unwritten(caches[3])).all(-1).sum())


def test_the_kernel_rounds_like_torch_on_every_kind_of_value():
    """The e4m3 and int8 rounding of the kernel against torch's own conversion: ties, subnormals,
    values just under 448, exponent carries (7.886 rounds to 8, not 4). Each row's amax is the
    format's max, so its scale is 1 and the kernel rounds exactly these values."""
    gen = torch.Generator().manual_seed(1)
    ties = torch.arange(-2048, 2048) / 16.0                  # every e4m3 midpoint below 128, and int8's .5s
    subnormal = torch.arange(-512, 512) * 2.0 ** -13         # around and below e4m3's 2**-9 step
    spread = torch.randn(4096, generator=gen) * 10 ** torch.empty(4096).uniform_(-4, 2.7, generator=gen)
    x = torch.cat([ties, subnormal, spread, torch.tensor([7.886, -7.886, 447.9, 440.0, 239.9, -448.0, 0.0])]).clamp(-448, 448)
    x = torch.cat([x, torch.zeros(-len(x) % 512)])
    rows = x.reshape(-1, 8, 64)
    rows[:, :, -1] = 448.0                                   # each row's amax is 448
    for kv_cache_dtype in FORMATS:
        qmax = kv_cache_format(kv_cache_dtype).max
        data = rows if kv_cache_dtype == "fp8" else rows * (127 / 448)      # int8: scale 1 as well
        data = data.to(DEVICE)
        q, scale = quantize_kv(data, kv_cache_dtype)
        assert bool((scale == 1).all())
        slots = torch.arange(len(data), device=DEVICE)
        caches = poisoned(len(data), 1, 8, 64, kv_cache_dtype)
        write_kv_quantized(data, data, *caches, slots)
        clamped = data.clamp(-qmax, qmax)
        if kv_cache_dtype == "fp8":
            torch_grid = clamped.to(torch.float8_e4m3fn)
        else:
            torch_grid = torch.round(clamped).to(torch.int8)
        assert_same(caches[0].reshape(data.shape), torch_grid)
        assert_same(q, torch_grid)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_strided_rows_and_empty_batch(kv_cache_dtype):
    """K and V may be views into a fused QKV projection; an empty batch writes nothing."""
    qkv = torch.randn(9, 3, 2, 16, device=DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(4 * 8, device=DEVICE)[:9]
    caches = poisoned(4, 8, 2, 16, kv_cache_dtype)
    want = write_ref(key, value, caches, slots, kv_cache_dtype)
    write_kv_quantized(key, value, *caches, slots)
    for got, w in zip(caches, want):
        assert_same(got, w)
    empty = poisoned(2, 4, 1, 16, kv_cache_dtype)
    nothing = torch.empty(0, 1, 16, device=DEVICE)
    write_kv_quantized(nothing, nothing, *empty, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert all(bool(unwritten(t).all()) for t in empty)


def _write_args(**overrides):
    caches = allocate_quantized_kv_cache(4, 4, 2, 16, "fp8", DEVICE)
    args = dict(key=torch.randn(3, 2, 16, device=DEVICE), value=torch.randn(3, 2, 16, device=DEVICE),
                k_cache=caches[0], v_cache=caches[1], k_scale=caches[2] + 7, v_scale=caches[3] + 7,
                slot_mapping=torch.tensor([0, 5, -1], device=DEVICE))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,error,match", [
    (dict(k_scale=None), ValueError, r"quantised: k_scale \(its scales\) must be given"),
    (dict(v_scale=torch.ones(4, 4, 2, dtype=torch.float16)), TypeError, "v_scale must be float32"),
    (dict(k_scale=torch.ones(4, 4, 1)), ValueError, r"k_scale must be a \[num_blocks, block_size"),
    (dict(k_scale=torch.ones(4, 2, 4).transpose(1, 2)), ValueError, "k_scale and v_scale must share one layout"),
    (dict(k_scale=[1.0]), TypeError, "k_scale must be a torch.Tensor"),
    (dict(key=torch.randn(3, 2, 16).double()), TypeError, "key has dtype torch.float64; supported"),
    (dict(v_cache=torch.zeros(4, 4, 2, 16, dtype=torch.int8)), ValueError, "must match"),
    (dict(k_cache=torch.zeros(4, 4, 2, 16), v_cache=torch.zeros(4, 4, 2, 16)), ValueError,
     "k_scale/v_scale are given but the cache is torch.float32, not quantised"),
    (dict(slot_mapping=torch.tensor([0, 16, 1])), ValueError, r"slot_mapping\[1\] = 16 is out of range"),
    (dict(slot_mapping=torch.tensor([3, 3, 1])), ValueError, "twice"),
    (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "int64"),
    (dict(key=torch.randn(3, 2, 8)), ValueError, "key must have shape"),
    (dict(k_scale=torch.ones(4, 4, 2, device="meta")), ValueError, "k_scale is on meta"),
])
def test_bad_write_is_refused_and_writes_nothing(overrides, error, match):
    args = _write_args(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
                          for k, v in overrides.items()})
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(error, match=match):
        write_kv_quantized(**args)
    for k, v in before.items():
        assert_same(args[k], v)


def test_one_tensor_for_both_scales_is_refused():
    args = _write_args()
    args["v_scale"] = args["k_scale"]
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match="k_scale and v_scale must be two tensors"):
        write_kv_quantized(**args)
    for k, v in before.items():
        assert_same(args[k], v)


@pytest.mark.parametrize("call, error, match", [
    (lambda q, s: dequantize_kv(q, s, dtype=torch.int8), TypeError, "dtype must be"),
    (lambda q, s: dequantize_kv(q, s, dtype="float16"), TypeError, "dtype must be"),
    (lambda q, s: dequantize_kv(q, s.long()), TypeError, "scale must be a floating-point tensor"),
    (lambda q, s: dequantize_kv(q.tolist(), s), TypeError, "q must be"),
    (lambda q, s: quantize_kv(torch.ones(3, 2, 0), "fp8"), ValueError, "head_dim"),
])
def test_bad_quantiser_arguments_are_named(call, error, match):
    q, s = quantize_kv(torch.randn(3, 2, 8), "int8")
    with pytest.raises(error, match=match):
        call(q, s)


def test_plain_write_kv_refuses_a_quantised_cache():
    from kvlab.kernels import write_kv

    args = _write_args()
    with pytest.raises(ValueError, match="k_scale.*write_kv_quantized"):
        write_kv(args["key"], args["value"], args["k_cache"], args["v_cache"], args["slot_mapping"])
    assert bool((args["k_cache"].float() == 0).all())


# -- paged_decode over a quantised cache ---------------------------------------------------------
def quantized_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype, seed=0,
                    engine_layout=True):
    """A quantised paged cache, its pages scattered; q one token per sequence. (quantize_kv fills it:
    write_kv_quantized matches it bit for bit, and the interpreter runs it one token at a time.)
    The scales are laid out as the engine keeps them, per page and KV head, unless
    ``engine_layout`` is False (a contiguous tensor, which the kernels take too)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = scattered_tables(lens, block_size, 2, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=gen) * torch.rand(*shape[:3], 1, generator=gen) * 4   # scales vary by token
    value = torch.randn(shape, generator=gen)
    caches = [t.to(DEVICE) for x in (key, value) for t in quantize_kv(x.to(dtype), kv_cache_dtype)]
    caches = caches[0], caches[2], caches[1], caches[3]     # k_cache, v_cache, k_scale, v_scale
    # Every slot that holds no token of its sequence (the rest of a last page, spare blocks) is
    # poisoned: NaN codes (fp8; int8 has none) and NaN scales, which no output may show. (A key
    # past the end gets zero weight, but a NaN value code read there would still leak as
    # 0 * NaN = NaN; Triton's interpreter turns e4m3's NaN code into 480, and 0 * 480 = 0: only a
    # GPU run can see that leak.)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, n in zip(tables, lens):
        pos = torch.arange(n)
        used[table[pos // block_size].long() * block_size + pos % block_size] = True
    unused = (~used).to(DEVICE)
    for t in caches:
        flat = t.view(torch.uint8).view(num_blocks * block_size, -1) if t.element_size() == 1 else t.flatten(0, 1)
        flat[unused] = 0x7F if t.dtype == torch.float8_e4m3fn else (float("nan") if t.is_floating_point() else 127)
    if engine_layout:
        caches = (*caches[:2], *(per_page_and_head(t) for t in caches[2:]))
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return q, caches, tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if BIG else []))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("lens", [[1], [37, 5], [16, 17, 1, 70]] + ([[4099, 1, 20_000]] if BIG else []))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_over_a_quantised_cache(kv_cache_dtype, dtype, num_heads, num_kv_heads, lens, num_splits):
    """Against float64 attention over the dequantised cache: the kernel's only error is its own arithmetic."""
    head_dim, block_size = (128, 16) if BIG else (32, 16)
    q, (k_cache, v_cache, k_scale, v_scale), tables, seq_lens = quantized_batch(
        lens, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype)
    ref = paged_attention_ref(q, dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale), tables, lens,
                              dtype=torch.float64)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=num_splits, out=out, k_scale=k_scale,
                 v_scale=v_scale)
    assert not bool(out.isnan().any())
    assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (16, 1)])
def test_paged_decode_over_a_quantised_cache_pads_the_group(kv_cache_dtype, num_heads, num_kv_heads):
    """GQA groups of 3 and 16 query heads: the quantised kernel pads a group to the 8 columns of
    an MMA tile (3 of 8 used) or takes 16 columns; no padded column may reach the output."""
    lens = [37, 5]
    q, (k_cache, v_cache, k_scale, v_scale), tables, seq_lens = quantized_batch(
        lens, num_heads, num_kv_heads, 32, 16, torch.float32, kv_cache_dtype, seed=5)
    ref = paged_attention_ref(q, dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale), tables, lens,
                              dtype=torch.float64)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=3, out=out, k_scale=k_scale, v_scale=v_scale)
    assert not bool(out.isnan().any())
    assert relative_error(out, ref) < 1e-5


def test_paged_decode_block_size_not_a_power_of_two():
    """Pages of 5 tokens: a tile crosses page boundaries, each token's scale read from its own page
    (here from a contiguous [block, slot, KV head] tensor: the kernel follows the strides)."""
    q, (k_cache, v_cache, k_scale, v_scale), tables, seq_lens = quantized_batch(
        [23, 4, 11], 8, 1, 32, 5, torch.float32, "int8", seed=3, engine_layout=False)
    assert k_scale.is_contiguous()
    ref = paged_attention_ref(q, dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale), tables,
                              [23, 4, 11], dtype=torch.float64)
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens, k_scale=k_scale, v_scale=v_scale)
    assert relative_error(out, ref) < 1e-5


def _decode_args():
    q, (k_cache, v_cache, k_scale, v_scale), tables, seq_lens = quantized_batch(
        [5, 20], 4, 2, 32, 16, torch.float32, "fp8", seed=4)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens, k_scale=k_scale,
                v_scale=v_scale)


@pytest.mark.parametrize("overrides,error,match", [
    (dict(v_scale=None), ValueError, r"quantised: v_scale \(its scales\) must be given"),
    (dict(k_scale=torch.ones(4, 16, 2)), ValueError, r"k_scale must be a \[num_blocks"),
    (dict(k_scale=torch.ones(5, 16, 2, dtype=torch.bfloat16)), TypeError, "k_scale must be float32"),
    (dict(q=torch.randn(2, 4, 32).double()), TypeError, "q has dtype torch.float64; supported"),
    (dict(k_cache=torch.zeros(5, 16, 2, 32), v_cache=torch.zeros(5, 16, 2, 32)), ValueError,
     "k_scale/v_scale are given but the cache is torch.float32"),
    (dict(seq_lens=torch.tensor([5, 60], dtype=torch.int32)), ValueError, r"seq_lens\[1\] = 60 must be in 1..48"),
    (dict(block_n=16), ValueError, r"block_n must be a multiple of 16 x 2 over a quantised cache"),
    (dict(num_warps=3), ValueError, r"num_warps must be a power of two \(a quantised cache: one stream"),
])
def test_bad_decode_is_refused_before_launch(overrides, error, match):
    args = _decode_args()
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in overrides.items()})
    out = torch.full((2, 4, 32), float("nan"), device=DEVICE)
    with pytest.raises(error, match=match):
        paged_decode(**args, out=out if args["q"].dtype == torch.float32 else None)
    assert bool(out.isnan().all())


def test_each_cache_goes_to_its_kernel(monkeypatch):
    """An unquantised cache launches decode_split_kernel, with no scales; a quantised one
    decode_streams_kernel, with its scales."""
    seen = []

    def spy(name):
        kernel = getattr(paged_decode_module, name)

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    seen.append((name, len(args)))
                    return kernel[grid](*args, **kwargs)
                return launch
        monkeypatch.setattr(paged_decode_module, name, Spy())

    spy("decode_split_kernel")
    spy("decode_streams_kernel")
    args = _decode_args()
    paged_decode(**{**args, "k_cache": args["k_cache"].float(), "v_cache": args["v_cache"].float(), "k_scale": None,
                    "v_scale": None}, num_splits=1)
    paged_decode(**args, num_splits=1)
    # decode_split_kernel takes no scales: neither their two pointers nor their three strides
    assert seen == [("decode_split_kernel", 13), ("decode_streams_kernel", 18)]


def test_codes_go_through_ptx_only_in_compiled_fp16_dots():
    """The inline-PTX conversion (kvlab.kernels.dequant) is chosen for fp8/int8 codes going into
    fp16 dots on a GPU, never in the interpreter (which runs no PTX) nor for float32 dots."""
    from kvlab.kernels.dequant import codes_ptx

    for dtype in (torch.float8_e4m3fn, torch.int8):
        assert codes_ptx(torch.zeros(4, dtype=dtype), torch.float16) == ""
    if torch.cuda.is_available():
        fp8 = torch.zeros(4, device="cuda", dtype=torch.float8_e4m3fn)
        assert codes_ptx(fp8, torch.float16) == ("e4m3" if torch.cuda.get_device_capability() >= (8, 9) else "")
        assert codes_ptx(torch.zeros(4, device="cuda", dtype=torch.int8), torch.float16) == "int8"
        assert codes_ptx(fp8, torch.float32) == ""
        assert codes_ptx(torch.zeros(4, device="cuda", dtype=torch.bfloat16), torch.float16) == ""
