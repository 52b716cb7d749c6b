"""Graded tests of chapter 9: ``pytest tests/graded -m ch09 --impl=exercises``."""
import random

import pytest
import torch

from kvlab import profile
from kvlab.quantization import outlier_kv
from kvlab.quantization import quantize_kv as reference_quantize_kv
from kvlab.scaffold.ch09 import PreemptionCosts

pytestmark = pytest.mark.ch09

FORMATS = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}
EXPONENTS = {"fp8": (-15, 7), "int8": (-24, 9)}      # the range of each format's scales: 2**e


def kv_like(shape, seed=0, dtype=torch.float32):
    """K/V-like values: channels of their own scales, one zero row and one constant row per head."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.exp(torch.randn(shape[-2:], generator=gen))
    x[0, 0] = 0.0                      # a (token, head) row of zeros
    x[-1, -1] = -2.5                   # a row of one value
    return x.to(dtype)


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return ""
    where = tuple(int(i) for i in bad[0])
    return f"at {list(where)}: got {got[where].item()}, expected {want[where].item()} ({bad.shape[0]} differ)"


def scale_hint(got: float, want: float) -> str:
    """What a wrong scale most likely means, for a learner (a line of its own under the mismatch)."""
    mantissa, _ = torch.frexp(torch.tensor(got, dtype=torch.float32))
    if not got > 0 or float(mantissa) != 0.5:
        return "not a power of two: the scale is the smallest 2**e at or above amax * (1.0 / max), not the ratio itself"
    if want == 1.0:
        return "a row of zeros gets scale 1, as does a row whose amax * (1.0 / max) is above 0.5 and at most 1"
    clamp = "the exponent is clamped to the format's range: fp8 -15..7, int8 -24..9"
    if (want in (2.0 ** 7, 2.0 ** 9) and got > want) or (want in (2.0 ** -15, 2.0 ** -24) and got < want):
        return clamp
    if got == 2 * want:
        return ("twice too large: where torch.frexp's mantissa is exactly 0.5 the ratio is a power of two already, "
                "2**(exponent - 1); and the ratio is amax * (1.0 / max), not amax / max")
    if got == want / 2:
        return "half too small: the scale is the power of two at or *above* amax * (1.0 / max)"
    return clamp


def check_scales(got, want, what):
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, \
        f"{what}: scales must be a float32 tensor, got {getattr(got, 'dtype', type(got).__name__)}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: scales of shape {list(got.shape)}, expected {list(want.shape)}"
    assert not bool(got.isnan().any()), f"{what}: a scale is NaN (a row of zeros must get scale 1)"
    if not torch.equal(got, want):
        where = tuple(int(i) for i in (got != want).nonzero()[0])
        raise AssertionError(f"{what}: scale {first_mismatch(got, want)}\n"
                             f"{scale_hint(got[where].item(), want[where].item())}")


def check_codes(got, want, what):
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, \
        f"{what}: codes must be {want.dtype}, got {getattr(got, 'dtype', type(got).__name__)}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: codes of shape {list(got.shape)}, expected {list(want.shape)}"
    if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
        raise AssertionError(f"{what}: code {first_mismatch(got.float(), want.float())}")


# -- quantize ------------------------------------------------------------------------------------
@pytest.mark.task("quantize")
def test_quantize_worked_example(ch09):
    # 4 tokens, 1 KV head: amax 3, 127/32, 4 and a row of zeros
    x = torch.tensor([[[1.0, -2.0, 0.5, 3.0]], [[1.0, -2.0, 0.5, 3.96875]], [[1.0, -2.0, 0.5, 4.0]], [[0.0] * 4]])
    codes, scales = ch09.quantize_kv(x, "int8")
    # 3/127 = 0.0236 -> 2**-5; 3.96875/127 is exactly 2**-5; 4/127 = 0.0315 -> 2**-4; zeros -> 1
    check_scales(scales, torch.tensor([[2.0 ** -5], [2.0 ** -5], [2.0 ** -4], [1.0]]),
                 "int8, rows of amax 3, 127/32, 4 and 0 (scales 2**-5, 2**-5, 2**-4, 1)")
    check_codes(codes, torch.tensor([[[32, -64, 16, 96]], [[32, -64, 16, 127]], [[16, -32, 8, 64]], [[0] * 4]],
                                    dtype=torch.int8),
                "int8: x / scale, so 1 -> 32 at 2**-5 (amax 3 -> 96, 127/32 -> 127), 16 at 2**-4 (amax 4 -> 64)")
    # fp8: amax 3, 7 (7/448 is exactly 2**-6) and a row of zeros
    x = torch.tensor([[[1.0, -2.0, 0.5, 3.0]], [[1.0, -2.0, 0.5, 7.0]], [[0.0] * 4]])
    codes, scales = ch09.quantize_kv(x, "fp8")
    # 3/448 = 0.0067 -> 2**-7; 7/448 is exactly 2**-6; zeros -> 1
    check_scales(scales, torch.tensor([[2.0 ** -7], [2.0 ** -6], [1.0]]),
                 "fp8, rows of amax 3, 7 and 0 (scales 2**-7, 2**-6, 1)")
    check_codes(codes, torch.tensor([[[128.0, -256.0, 64.0, 384.0]], [[64.0, -128.0, 32.0, 448.0]],
                                     [[0.0] * 4]]).to(torch.float8_e4m3fn),
                "fp8: 1 -> 128 at scale 2**-7 (amax 3 -> 384), 64 at 2**-6 (amax 7 -> 448)")


@pytest.mark.task("quantize")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_scales_are_powers_of_two_within_the_formats_range(ch09, kv_cache_dtype):
    """Every scale is the smallest power of two at or above amax * (1.0 / max), its exponent
    clamped: a tiny row gets the smallest scale, a huge row the largest (and saturates)."""
    qmax = FORMATS[kv_cache_dtype][1]
    low, high = EXPONENTS[kv_cache_dtype]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(48, 1, 16, generator=gen) * torch.logspace(-3, 3, 48)[:, None, None]
    x[0, 0], x[1, 0], x[2, 0] = 1e-8, -1e6, 0.0          # a tiny row, a huge row, a row of zeros
    codes, scales = ch09.quantize_kv(x, kv_cache_dtype)
    what = f"{kv_cache_dtype}, rows of amax 1e-8, 1e6, 0 and 1e-3 to 1e3"
    if not (isinstance(scales, torch.Tensor) and tuple(scales.shape) == (48, 1)):
        raise AssertionError(f"{what}: scales must be a tensor of shape [48, 1]")
    mantissa, _ = torch.frexp(scales.float())
    if not bool((mantissa == 0.5).all()):
        raise AssertionError(f"{what}: scale {float(scales[mantissa != 0.5][0]):.6g} is not a power of two\n"
                             "the scale is the smallest 2**e at or above amax * (1.0 / max)")
    for row, amax, e in ((0, 1e-8, low), (1, 1e6, high)):
        if float(scales[row, 0]) != 2.0 ** e:
            raise AssertionError(f"{what}: the row of amax {amax:g} got scale {float(scales[row, 0]):.6g}, "
                                 f"expected 2**{e}\nits ratio is {amax / qmax:.3g}, and the exponent is clamped "
                                 f"to {low}..{high}")
    if float(scales[2, 0]) != 1.0:
        raise AssertionError(f"{what}: the row of zeros got scale {float(scales[2, 0])}, expected 1")
    if float(codes[1, 0].float().abs().max()) != qmax:
        raise AssertionError(f"{what}: the row of amax 1e6 must saturate: at the largest scale its codes are ±{qmax:g}")
    check_scales(scales, reference_quantize_kv(x, kv_cache_dtype)[1], what)
    check_codes(codes, reference_quantize_kv(x, kv_cache_dtype)[0], what)
    if kv_cache_dtype == "int8":      # one float32 step above 127 * 2**-10: times the reciprocal it is 2**-10 exactly
        amax = torch.nextafter(torch.tensor(127 * 2.0 ** -10), torch.tensor(1.0))
        _, scales = ch09.quantize_kv(torch.stack([amax, -amax / 3])[None, None], "int8")
        if float(scales) != 2.0 ** -10:
            raise AssertionError(
                f"int8: the row of amax {float(amax)!r} got scale {float(scales)!r}, expected 2**-10\n"
                "amax * (1.0 / 127) is exactly 2**-10 in float32, and a power of two is its own scale "
                "(amax / 127 rounds past it: compute amax * (1.0 / max))")


@pytest.mark.task("quantize")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("shape,dtype", [((37, 2, 64), torch.float32), ((6, 4, 3, 24), torch.float16),
                                         ((50, 1, 128), torch.bfloat16)])
def test_quantize_matches_the_reference_bit_for_bit(ch09, kv_cache_dtype, shape, dtype):
    """Codes and scales equal kvlab.quantization's (for fp8: torch's float8 conversion of the
    clamped, scaled values) for every row, zero and constant rows included."""
    x = kv_like(shape, seed=len(shape) + shape[-1], dtype=dtype)
    want_codes, want_scales = reference_quantize_kv(x, kv_cache_dtype)
    codes, scales = ch09.quantize_kv(x, kv_cache_dtype)
    what = f"{kv_cache_dtype} of {dtype} {list(shape)}"
    check_scales(scales, want_scales, what)
    check_codes(codes, want_codes, what)
    if kv_cache_dtype == "fp8":       # the same thing, said as torch's conversion of the clamped values
        clamped = (x.float() / want_scales[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        check_codes(codes, clamped, what)


@pytest.mark.task("quantize")
def test_out_of_range_values_saturate(ch09):
    """Large and tiny values: past max * 2**max_exponent (57,344 for fp8, 65,024 for int8) the
    scaled values are clamped to ±max, nothing becomes NaN; tiny rows take the smallest scale."""
    x = torch.tensor([[[1e5, -7e4, 1.0, 1e-30]], [[1e-38, -1e-38, 0.0, 5e-39]], [[3e4, -3e4, 1.0, 0.0]]])
    for name, (dtype, qmax) in FORMATS.items():
        codes, scales = ch09.quantize_kv(x, name)
        assert not bool(codes.float().isnan().any()), f"{name}: a code is NaN"
        assert float(codes.float().abs().max()) <= qmax, f"{name}: a code past ±{qmax:g}: clamp x / scale"
        want_codes, want_scales = reference_quantize_kv(x, name)
        check_scales(scales, want_scales, name)
        check_codes(codes, want_codes, name)


@pytest.mark.task("quantize")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_dequantize_and_the_error_bound(ch09, kv_cache_dtype):
    x = kv_like((64, 2, 32), seed=5)
    codes, scales = ch09.quantize_kv(x, kv_cache_dtype)
    back = ch09.dequantize_kv(codes, scales)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.float32 and back.shape == x.shape, \
        "dequantize_kv must return float32 of the codes' shape"
    torch.testing.assert_close(back, codes.float() * scales[..., None], rtol=0, atol=0)
    assert not bool(back.isnan().any()) and float(back[0, 0].abs().max()) == 0.0, "a zero row must come back as zeros"
    err = (back - x).abs()
    if kv_cache_dtype == "int8":      # half a step of the row's grid
        bound = scales[..., None] * 0.5
    else:                             # 3 mantissa bits: half a step is 2^-4 of the value; subnormals: 2^-10 * scale
        bound = torch.maximum(x.abs() * 2.0 ** -4, scales[..., None] * 2.0 ** -10)
    worst = float((err / bound).max())
    assert worst <= 1.0 + 1e-5, f"{kv_cache_dtype}: an error of {worst:.3f}x the bound (half a step of the grid)"


@pytest.mark.task("quantize")
def test_bad_formats_and_shapes_are_refused(ch09):
    x = torch.randn(3, 2, 8)
    for bad in ("auto", "fp16", "e5m2"):
        with pytest.raises(ValueError):
            ch09.quantize_kv(x, bad)
    codes, scales = ch09.quantize_kv(x, "int8")
    with pytest.raises(ValueError):
        ch09.dequantize_kv(codes, scales[:, :1])


# -- write_kernel --------------------------------------------------------------------------------
POISON = 0x7F            # fp8 e4m3fn NaN; for int8, 127


def guarded_bytes(shape, dtype, fill_byte, pad=1024):
    """A cache of ``dtype`` viewing the middle of a byte buffer whose margins hold a canary."""
    numel = 1
    for n in shape:
        numel *= n
    size = numel * torch.empty(0, dtype=dtype).element_size()
    buffer = torch.full((pad + size + pad,), 0xA5, dtype=torch.uint8)
    buffer[pad:pad + size] = fill_byte
    return buffer, buffer[pad:pad + size].view(dtype).view(*shape), pad, size


def check_margins(name, buffer, pad, size):
    before, after = buffer[:pad], buffer[pad + size:]
    assert bool((after == 0xA5).all()), f"your kernel wrote past the end of `{name}`: check the store mask"
    assert bool((before == 0xA5).all()), \
        f"your kernel wrote before the start of `{name}`: check the store mask (a slot of -1 must store nothing)"


def run_write(ch09, guard, kv_cache_dtype, num_kv_heads, head_dim, in_dtype, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_tokens = 5, 4, 11
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 7]] = -1                                       # padding tokens write nothing
    rows = kv_like((num_tokens, num_kv_heads, head_dim), seed=seed)
    if strided:                                              # K and V as views into one qkv-like tensor
        packed = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen)
        packed[:, 1], packed[:, 2] = rows, rows.flip(0) * 3
        key, value = packed[:, 1].to(in_dtype), packed[:, 2].to(in_dtype)
        if in_dtype != torch.float32:                        # .to() made them contiguous: view again
            packed = packed.to(in_dtype)
            key, value = packed[:, 1], packed[:, 2]
    else:
        key, value = rows.to(in_dtype), (rows.flip(0) * 3).to(in_dtype)
    dtype = FORMATS[kv_cache_dtype][0]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_buf, k_cache, k_pad, k_size = guarded_bytes(shape, dtype, POISON)
    v_buf, v_cache, v_pad, v_size = guarded_bytes(shape, dtype, POISON)
    if strided:                                              # the engine's layout: [block, KV head, slot] in memory
        k_scale, v_scale = (guard.full((num_blocks, num_kv_heads, block_size), float("nan"), name=n).transpose(1, 2)
                            for n in ("k_scale", "v_scale"))
    else:
        k_scale = guard.full(shape[:-1], float("nan"), name="k_scale")
        v_scale = guard.full(shape[:-1], float("nan"), name="v_scale")
    want = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    device = profile.DEVICE
    if device != "cpu":          # plain pytest on a GPU machine compiles natively; kvlab.check uses the CPU
        key, value, slots = key.to(device), value.to(device), slots.to(device)
        k_cache, v_cache, k_scale, v_scale = (t.to(device) for t in (k_cache, v_cache, k_scale, v_scale))
    ch09.write_kv_quantized(key, value, k_cache, v_cache, k_scale, v_scale, slots)
    if device == "cpu":
        check_margins("k_cache", k_buf, k_pad, k_size)
        check_margins("v_cache", v_buf, v_pad, v_size)
        guard.check()
    got = [t.cpu() for t in (k_cache, v_cache, k_scale, v_scale)]
    keep = (slots >= 0).cpu()
    for x, cache, scales in ((key.cpu(), want[0], want[2]), (value.cpu(), want[1], want[3])):
        codes, scale = reference_quantize_kv(x[keep], kv_cache_dtype)
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[slots.cpu()[keep]] = codes.view(torch.uint8)
        written = slots.cpu()[keep]
        scales[written // block_size, written % block_size] = scale
    for name, g, w, g_scale, w_scale in (("k_cache", got[0], want[0], got[2], want[2]),
                                         ("v_cache", got[1], want[1], got[3], want[3])):
        same = g.view(torch.uint8) == w.view(torch.uint8)
        if not bool(same.all()):
            block, offset, head, d = (int(i) for i in (~same).nonzero()[0])
            slot = block * block_size + offset
            written = slot in slots.tolist()
            got_scale, want_scale = g_scale[block, offset, head].item(), w_scale[block, offset, head].item()
            scale_differs = written and got_scale != want_scale and got_scale == got_scale   # both written, not NaN
            raise AssertionError(
                f"{name}[{block}, {offset}, {head}, {d}] (slot {slot}, {'written' if written else 'not written'}): "
                f"got {g[block, offset, head, d].float().item()}, expected {w[block, offset, head, d].float().item()}"
                + ("" if written else " (a slot no token maps to must keep what it held)")
                + (f"\nits row's scale: got {got_scale}, expected {want_scale}\n{scale_hint(got_scale, want_scale)}"
                   if scale_differs else ""))
    for name, g, w in (("k_scale", got[2], want[2]), ("v_scale", got[3], want[3])):
        same = (g == w) | (g.isnan() & w.isnan())
        if not bool(same.all()):
            block, offset, head = (int(i) for i in (~same).nonzero()[0])
            got_scale, want_scale = g[block, offset, head].item(), w[block, offset, head].item()
            hint = "\n" + scale_hint(got_scale, want_scale) if got_scale == got_scale and want_scale == want_scale else ""
            if not g.is_contiguous():    # a kernel that ignores the strides stores scales in the wrong places
                hint = (f"\n{name} is kept as the engine keeps it, [block, KV head, slot] in memory: is every "
                        "scale addressed through scale_block_stride, scale_slot_stride and scale_head_stride?" + hint)
            raise AssertionError(f"{name}[{block}, {offset}, {head}]: got {got_scale}, expected {want_scale}{hint}")


@pytest.mark.task("write_kernel")
@pytest.mark.parametrize("num_kv_heads,head_dim,in_dtype,strided", [
    (2, 64, torch.float32, False), (3, 24, torch.float16, True), (1, 16, torch.bfloat16, False)])
def test_fp8_write_matches_the_reference(ch09, guard, num_kv_heads, head_dim, in_dtype, strided):
    """Codes and scales bit for bit against kvlab.quantization.quantize_kv at each written slot;
    padding tokens (slot -1) write nothing; every other slot keeps its poison (NaN)."""
    run_write(ch09, guard, "fp8", num_kv_heads, head_dim, in_dtype, strided, seed=num_kv_heads * 7 + head_dim)


@pytest.mark.task("write_kernel")
def test_fp8_write_rounds_where_the_interpreter_would_not(ch09, guard):
    """Values whose float32 -> e4m3 conversion Triton's interpreter gets wrong: 7.886 (must
    round up into the next binade, to 8) among them."""
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(4, 2, 16, generator=gen) * 448
    x[0, 0, :4] = torch.tensor([448.0, 7.886, 15.9, 239.9])      # amax 448: scale 1, the values as they are
    x[1, 1, :3] = torch.tensor([448.0, -3.97, 0.0155])
    k_cache = torch.full((2, 2, 2, 16), float("nan")).to(torch.float8_e4m3fn)
    v_cache = k_cache.clone()
    k_scale, v_scale = (guard.full((2, 2, 2), float("nan"), name=n) for n in ("k_scale", "v_scale"))
    slots = torch.tensor([3, 0, 2, 1])
    device = profile.DEVICE
    if device == "cpu":
        ch09.write_kv_quantized(x, x, k_cache, v_cache, k_scale, v_scale, slots)
        guard.check()
    else:                        # natively compiled: the GPU's own conversion must round the same way
        on = [t.to(device) for t in (x, k_cache, v_cache, k_scale, v_scale, slots)]
        ch09.write_kv_quantized(on[0], on[0], *on[1:])
        k_cache, k_scale = on[2].cpu(), on[4].cpu()
    codes, scales = reference_quantize_kv(x, "fp8")
    got = k_cache.view(-1, 2, 16)[slots]
    check_codes(got, codes, "fp8 codes")
    assert float(got[0, 0, 1].float()) == 8.0, f"7.886 must become 8.0 in e4m3, got {float(got[0, 0, 1].float())}"
    check_scales(k_scale.view(-1, 2)[slots], scales, "fp8 scales")


@pytest.mark.task("write_kernel")
def test_int8_write_matches_the_reference(ch09, guard):
    """The same kernel with FP8=False: int8, rounded half to even."""
    run_write(ch09, guard, "int8", 2, 32, torch.float32, True, seed=11)


# -- preemption_mode -----------------------------------------------------------------------------
# 1 KB per token at 10 GB/s: 0.1 us per token per transfer, 21 us fixed per transfer; recompute
# 1 us per token: swap 42 us + 0.2 us/token against 1 us/token -> swap is cheaper from 53 tokens on
COSTS = PreemptionCosts(bandwidth=10e9, latency=21e-6, prefill_per_token=1e-6)
BPT = 1000
HOST = 1 << 40


@pytest.mark.task("preemption_mode")
def test_swap_and_recompute_seconds(ch09):
    assert ch09.swap_seconds(100, BPT, COSTS) == pytest.approx(2 * (21e-6 + 100 * 1000 / 10e9), rel=1e-12), \
        "swap: two transfers, out now and in later, each latency + bytes / bandwidth"
    assert ch09.recompute_seconds(100, COSTS) == pytest.approx(100e-6, rel=1e-12)
    quad = PreemptionCosts(bandwidth=1e9, latency=0.0, prefill_per_token=1e-6, prefill_per_token_sq=1e-9)
    assert ch09.recompute_seconds(1000, quad) == pytest.approx(1000e-6 + 1e6 * 1e-9, rel=1e-12), \
        "recompute: n * prefill_per_token + n^2 * prefill_per_token_sq"
    assert ch09.swap_seconds(0, BPT, COSTS) == pytest.approx(42e-6) and ch09.recompute_seconds(0, COSTS) == 0


@pytest.mark.task("preemption_mode")
def test_both_sides_of_the_crossover(ch09):
    assert ch09.preemption_mode(10, BPT, COSTS, HOST) == "recompute", "10 tokens: 44 us to swap, 10 us to recompute"
    assert ch09.preemption_mode(52, BPT, COSTS, HOST) == "recompute", "52 tokens: 52.4 us to swap, 52 us to recompute"
    assert ch09.preemption_mode(53, BPT, COSTS, HOST) == "swap", "53 tokens: 52.6 us to swap, 53 us to recompute"
    assert ch09.preemption_mode(100_000, BPT, COSTS, HOST) == "swap"
    assert ch09.preemption_mode(0, BPT, COSTS, HOST) == "recompute", "nothing to recompute: never pay a transfer"


@pytest.mark.task("preemption_mode")
def test_a_tie_recomputes(ch09):
    # powers of two: every product and sum exact, so swap and recompute cost exactly the same
    tie = PreemptionCosts(bandwidth=2.0 ** 30, latency=2.0 ** -10, prefill_per_token=2.0 ** -14)
    n, bpt = 64, 2 ** 14                    # swap: 2 * (2^-10 + 2^20 / 2^30) = 2^-8; recompute 64 * 2^-14 = 2^-8
    assert ch09.swap_seconds(n, bpt, tie) == ch09.recompute_seconds(n, tie) == 2.0 ** -8
    assert ch09.preemption_mode(n, bpt, tie, HOST) == "recompute", "a tie: recompute (no host memory, no transfer)"
    assert ch09.preemption_mode(n + 1, bpt, tie, HOST) == "swap"


@pytest.mark.task("preemption_mode")
def test_host_memory_decides_too(ch09):
    n = 1000                                  # swap is far cheaper: 242 us against 1 ms
    assert ch09.preemption_mode(n, BPT, COSTS, n * BPT) == "swap", "exactly enough host memory: swap"
    assert ch09.preemption_mode(n, BPT, COSTS, n * BPT - 1) == "recompute", "one byte short: recompute"
    assert ch09.preemption_mode(n, BPT, COSTS, 0) == "recompute", "the host tier is full"


@pytest.mark.task("preemption_mode")
def test_the_quadratic_term_moves_the_crossover(ch09):
    quad = PreemptionCosts(bandwidth=10e9, latency=21e-6, prefill_per_token=1e-7, prefill_per_token_sq=1e-9)
    # swap 42 us + 0.2 us/n; recompute 0.1 us/n + 1 ns/n^2: recompute wins at 100, swap at 300
    assert ch09.preemption_mode(100, BPT, quad, HOST) == "recompute"
    assert ch09.preemption_mode(300, BPT, quad, HOST) == "swap"


@pytest.mark.task("preemption_mode")
@pytest.mark.parametrize("num_tokens", [-1, 2.0, "8", None, True])
def test_bad_token_counts_are_refused(ch09, num_tokens):
    """A negative count: ValueError; not an int: TypeError, as the engine's check_count
    (ValueError is accepted there too)."""
    with pytest.raises(ValueError if num_tokens == -1 else (TypeError, ValueError)):
        ch09.preemption_mode(num_tokens, BPT, COSTS, HOST)


@pytest.mark.task("preemption_mode")
def test_bad_sizes_are_refused(ch09):
    for bpt, host in ((-5, HOST), (BPT, -1)):
        with pytest.raises(ValueError):
            ch09.preemption_mode(10, bpt, COSTS, host)
    for bpt, host in ((1.5, HOST), (BPT, float(HOST))):
        with pytest.raises((TypeError, ValueError)):
            ch09.preemption_mode(10, bpt, COSTS, host)


# -- crossover -----------------------------------------------------------------------------------
def brute_force_crossover(bpt, costs, max_tokens):
    swap = lambda n: 2 * (costs.latency + n * bpt / costs.bandwidth)                          # noqa: E731
    recompute = lambda n: n * costs.prefill_per_token + n ** 2 * costs.prefill_per_token_sq   # noqa: E731
    return next((n for n in range(max_tokens + 1) if swap(n) < recompute(n)), None)


@pytest.mark.task("crossover")
def test_crossover_worked_example(ch09):
    assert ch09.crossover_tokens(BPT, COSTS) == 53, "swap 42 us + 0.2 us/token < 1 us/token from 52.5 tokens on"
    tie = PreemptionCosts(bandwidth=2.0 ** 30, latency=2.0 ** -10, prefill_per_token=2.0 ** -14)
    assert ch09.crossover_tokens(2 ** 14, tie) == 65, "at 64 tokens the two tie: swap is cheaper from 65"


@pytest.mark.task("crossover")
def test_no_crossover(ch09):
    slow_link = PreemptionCosts(bandwidth=1e9, latency=1e-5, prefill_per_token=1e-7)     # a token moves slower than it computes
    assert ch09.crossover_tokens(BPT, slow_link) is None
    assert ch09.crossover_tokens(BPT, COSTS, max_tokens=52) is None, "the crossover (53) is past max_tokens"
    assert ch09.crossover_tokens(BPT, COSTS, max_tokens=53) == 53


@pytest.mark.task("crossover")
def test_crossover_matches_a_scan(ch09):
    """Random costs, linear and quadratic, against a scan of every length; then
    preemption_mode agrees on both sides of the answer."""
    rng = random.Random(0)
    for _ in range(60):
        costs = PreemptionCosts(bandwidth=rng.choice([5e9, 2e10, 5e10]), latency=rng.choice([0.0, 5e-6, 3e-5, 1e-3]),
                                prefill_per_token=rng.uniform(1e-8, 2e-6),
                                prefill_per_token_sq=rng.choice([0.0, 0.0, rng.uniform(1e-12, 1e-9)]))
        bpt = rng.choice([4096, 32768, 131072, 524288])
        want = brute_force_crossover(bpt, costs, 3000)
        got = ch09.crossover_tokens(bpt, costs, max_tokens=3000)
        assert got == want, f"crossover_tokens({bpt}, {costs}, max_tokens=3000) = {got}, a scan finds {want}"
        if want is not None and want > 0:
            assert ch09.preemption_mode(want, bpt, costs, HOST) == "swap"
            assert ch09.preemption_mode(want - 1, bpt, costs, HOST) == "recompute"


@pytest.mark.task("crossover")
def test_crossover_far_out(ch09):
    """A crossover near a million tokens (the default max_tokens): found exactly, and quickly."""
    costs = PreemptionCosts(bandwidth=1e10, latency=0.5, prefill_per_token=2e-6)    # swap: 1 s + 0.2 us/token
    want = 555_556                                                                    # 1 / 1.8e-6 = 555,555.6
    assert brute_force_crossover(BPT, costs, want) == want
    assert ch09.crossover_tokens(BPT, costs) == want
