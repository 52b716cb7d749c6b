"""Graded tests of chapter 9: ``pytest tests/graded -m ch09 --impl=exercises``."""
import random

import pytest
import torch

from kvlab import profile
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


def expect(ok, message: str) -> None:
    """Fail with ``message`` alone (a plain ``assert`` would add pytest's dump of the expression)."""
    __tracebackhide__ = True
    if not ok:
        raise AssertionError(message)


def refuses(errors, call, what: str, rule: str) -> None:
    """``call()`` must raise one of ``errors``; otherwise fail, naming the call and the rule it breaks."""
    __tracebackhide__ = True
    names = " or ".join(e.__name__ for e in (errors if isinstance(errors, tuple) else (errors,)))
    try:
        got = call()
    except errors:
        return
    except NotImplementedError:
        raise
    except Exception as err:     # noqa: BLE001  (the wrong kind of error: say which was expected)
        raise AssertionError(f"{what} raised {type(err).__name__} ({err}), expected {names}: {rule}") from None
    raise AssertionError(f"{what} returned {got!r}, expected {names}: {rule}")


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return ""
    where = tuple(int(i) for i in bad[0])
    return f"at {list(where)}: got {got[where].item()}, expected {want[where].item()} ({bad.shape[0]} differ)"


def scale_hint(got: float, want: float, kv_cache_dtype: str, amax: float | None = None, kernel: bool = False) -> str:
    """What a wrong scale most likely means, for a learner (a line of its own under the mismatch).
    ``amax``: the row's largest |x|, where the test knows the row; ``kernel``: a hint for the kernel."""
    qmax = FORMATS[kv_cache_dtype][1]
    low, high = EXPONENTS[kv_cache_dtype]
    mantissa, _ = torch.frexp(torch.tensor(got, dtype=torch.float32))
    if not got > 0 or float(mantissa) != 0.5:
        return "not a power of two: the scale is the smallest 2**e at or above amax * (1.0 / max), not the ratio itself"
    if amax == 0.0:
        return "a row of zeros (amax 0) gets scale 1: nothing divides by 0, and the row comes back as zeros"
    if amax is not None and float(torch.tensor(amax, dtype=torch.float32) * (1.0 / qmax)) == 0.0:
        return (f"this row's amax, {amax:.3g}, is not 0, but amax * (1.0 / max) underflows to 0 in float32: such a "
                f"row gets the smallest scale, 2**{low}, not 1 (torch.frexp(0) gives exponent 0)")
    if got > 2.0 ** high or got < 2.0 ** low or (want == 2.0 ** high and got > want) \
            or (want == 2.0 ** low and got < want):
        return (f"the exponent is clamped to {kv_cache_dtype}'s range, {low}..{high}: no scale is below 2**{low} "
                f"or above 2**{high}")
    if got == 1.0 and amax is not None and want not in (0.5, 2.0):      # 1 is far from this row's scale
        return (f"scale 1 is for a row of zeros, but this row's amax is {amax:.4g}:" + ("\n" if kernel else " ")
                + ("is the row loaded from token t's K/V (key_ptr + t * key_token_stride + head * HEAD_DIM + dim: by "
                   "token, not by slot), and amax its largest |x| (tl.max(tl.abs(x), axis=1))?" if kernel else
                   "is amax the row's largest |x|, of the absolute values (a row of negative values has a largest x "
                   "below 0)?"))
    if got < want:
        factor = "half" if got == want / 2 else f"{want / got:g} times"
        return (f"{factor} too small: the scale is the power of two at or *above* amax * (1.0 / max); or amax is not "
                "the largest |x| of the row" + (" (tl.max(tl.abs(x), axis=1))" if kernel else ""))
    if got == 2 * want and not kernel:
        return ("twice too large: where torch.frexp's mantissa is exactly 0.5 the ratio is a power of two already, "
                "2**(exponent - 1);\nand the ratio is amax * (1.0 / max), not amax / max")
    if want == 1.0 and amax is None:
        return "a row of zeros gets scale 1, as does a row whose amax * (1.0 / max) is above 0.5 and at most 1"
    if kernel:
        return ("the scale follows from its row's amax alone: is the row token t's K/V of one head\n(at key_ptr + "
                "t * key_token_stride + head * HEAD_DIM + dim: by token, not by slot), and amax its largest |x| "
                "(tl.max(tl.abs(x), axis=1), padding masked to 0)?")
    return "the scale follows from its row's amax alone: the largest |x| of that (token, KV head)'s head_dim values"


def code_hint(got: float, want: float, y: float, kv_cache_dtype: str, kernel: bool = False) -> str:
    """What a wrong code most likely means when its row's scale is right: ``y`` is x / scale, unclamped."""
    qmax = FORMATS[kv_cache_dtype][1]
    high = EXPONENTS[kv_cache_dtype][1]
    if abs(y) > qmax and got != want:
        how = "y to [-QMAX, QMAX] (tl.minimum(tl.maximum(y, -QMAX), QMAX))" if kernel else "x / scale to [-max, max]"
        return (f"x / scale is {y:g}, past ±{qmax:g} (its row's scale is clamped at the largest, 2**{high}):\nclamp "
                f"{how} before rounding, so that it saturates at {want:g}"
                + (" (float8_e4m3fn has no infinity)" if qmax == 448 else ""))
    if kv_cache_dtype == "int8" and got == got:
        tie = abs(y - int(y)) == 0.5
        if abs(got) == abs(want) - 1 and got * want >= 0:         # one step toward zero
            return (("round with round_half_even(y) before the conversion to int8, which truncates toward zero"
                     if kernel else "round (torch.round, ties to even) before .to(torch.int8), which truncates toward "
                     "zero") + (f": {y:g} must become {want:g}" if not tie else ""))
        if abs(got) == abs(want) + 1 and got * want >= 0 and tie:
            return f"{y:g} is a tie: ties go to the even integer, {want:g} (torch.round does that, round-half-up does not)"
    if kernel and kv_cache_dtype == "fp8" and got * y > 0 and abs(y) / 2 <= abs(got) <= abs(y) * 1.125:
        return (f"x / scale is {y!r}: round with round_to_e4m3 before the conversion: Triton's interpreter converts "
                "float32 to e4m3 wrongly for some values (7.886 becomes 4.0)")
    if kernel:
        return ("its row's scale is right: is each code stored at element slot * NUM_KV_HEADS * HEAD_DIM + head * "
                "HEAD_DIM + dim, from the same element's x / scale?")
    return f"x / scale is {y!r}: its code is that value clamped to ±{qmax:g} and rounded to the nearest, ties to even"


def check_scales(got, want, what, kv_cache_dtype, x=None):
    """``got`` must equal the reference scales ``want``; ``x`` (the input), where given, sharpens the hint."""
    __tracebackhide__ = True
    expect(isinstance(got, torch.Tensor) and got.dtype == torch.float32,
           f"{what}: scales must be a float32 tensor, got {getattr(got, 'dtype', type(got).__name__)}")
    expect(tuple(got.shape) == tuple(want.shape), f"{what}: scales of shape {list(got.shape)}, expected {list(want.shape)}")
    expect(not bool(got.isnan().any()), f"{what}: a scale is NaN (a row of zeros must get scale 1)")
    if not torch.equal(got, want):
        where = tuple(int(i) for i in (got != want).nonzero()[0])
        amax = None if x is None else float(x[where].float().abs().max())
        raise AssertionError(f"{what}: scale {first_mismatch(got, want)}\n"
                             f"{scale_hint(got[where].item(), want[where].item(), kv_cache_dtype, amax)}")


def check_codes(got, want, what, kv_cache_dtype, x=None, scales=None):
    """``got`` must equal the reference codes ``want`` bit for bit; with ``x`` and the reference
    ``scales`` the message says what the code should have been made from."""
    __tracebackhide__ = True
    expect(isinstance(got, torch.Tensor) and got.dtype == want.dtype,
           f"{what}: codes must be {want.dtype}, got {getattr(got, 'dtype', type(got).__name__)}")
    expect(tuple(got.shape) == tuple(want.shape), f"{what}: codes of shape {list(got.shape)}, expected {list(want.shape)}")
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    if bool(differ.any()):
        where = tuple(int(i) for i in differ.nonzero()[0])
        got_code, want_code = float(got[where].float()), float(want[where].float())
        message = f"{what}: code at {list(where)}: got {got_code}, expected {want_code} ({int(differ.sum())} differ)"
        if x is not None:
            y = float(x[where].float()) / float(scales[where[:-1]])
            message += "\n" + code_hint(got_code, want_code, y, kv_cache_dtype)
        raise AssertionError(message)


# -- quantize ------------------------------------------------------------------------------------
@pytest.mark.task("quantize")
def test_quantize_worked_example(ch09):
    # 4 tokens, 1 KV head: amax 3, 127/32, 4 and a row of zeros
    x = torch.tensor([[[1.0, -2.0, 0.5, 3.0]], [[1.0, -2.0, 0.5, 3.96875]], [[1.0, -2.0, 0.5, 4.0]], [[0.0] * 4]])
    codes, scales = ch09.quantize_kv(x, "int8")
    # 3/127 = 0.0236 -> 2**-5; 3.96875/127 is exactly 2**-5; 4/127 = 0.0315 -> 2**-4; zeros -> 1
    want_scales = torch.tensor([[2.0 ** -5], [2.0 ** -5], [2.0 ** -4], [1.0]])
    check_scales(scales, want_scales, "int8, rows of amax 3, 127/32, 4 and 0 (scales 2**-5, 2**-5, 2**-4, 1)", "int8", x)
    check_codes(codes, torch.tensor([[[32, -64, 16, 96]], [[32, -64, 16, 127]], [[16, -32, 8, 64]], [[0] * 4]],
                                    dtype=torch.int8),
                "int8: x / scale, so 1 -> 32 at 2**-5 (amax 3 -> 96, 127/32 -> 127), 16 at 2**-4 (amax 4 -> 64)",
                "int8", x, want_scales)
    # fp8: amax 3, 7 (7/448 is exactly 2**-6) and a row of zeros
    x = torch.tensor([[[1.0, -2.0, 0.5, 3.0]], [[1.0, -2.0, 0.5, 7.0]], [[0.0] * 4]])
    codes, scales = ch09.quantize_kv(x, "fp8")
    # 3/448 = 0.0067 -> 2**-7; 7/448 is exactly 2**-6; zeros -> 1
    want_scales = torch.tensor([[2.0 ** -7], [2.0 ** -6], [1.0]])
    check_scales(scales, want_scales, "fp8, rows of amax 3, 7 and 0 (scales 2**-7, 2**-6, 1)", "fp8", x)
    check_codes(codes, torch.tensor([[[128.0, -256.0, 64.0, 384.0]], [[64.0, -128.0, 32.0, 448.0]],
                                     [[0.0] * 4]]).to(torch.float8_e4m3fn),
                "fp8: 1 -> 128 at scale 2**-7 (amax 3 -> 384), 64 at 2**-6 (amax 7 -> 448)", "fp8", x, want_scales)


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
    expect(isinstance(scales, torch.Tensor) and tuple(scales.shape) == (48, 1),
           f"{what}: scales must be a tensor of shape [48, 1], got {getattr(scales, 'shape', type(scales).__name__)}")
    mantissa, _ = torch.frexp(scales.float())
    if not bool((mantissa == 0.5).all()):
        raise AssertionError(f"{what}: scale {float(scales[mantissa != 0.5][0]):.6g} is not a power of two\n"
                             "the scale is the smallest 2**e at or above amax * (1.0 / max)")
    for row, amax, e in ((0, 1e-8, low), (1, 1e6, high)):
        got = float(scales[row, 0])
        if got != 2.0 ** e:
            raise AssertionError(f"{what}: the row of amax {amax:g} (its ratio {amax / qmax:.3g}) got scale {got:.6g}, "
                                 f"expected 2**{e}\n{scale_hint(got, 2.0 ** e, kv_cache_dtype, amax)}")
    expect(float(scales[2, 0]) == 1.0, f"{what}: the row of zeros got scale {float(scales[2, 0])}, expected 1")
    expect(float(codes[1, 0].float().abs().max()) == qmax,
           f"{what}: the row of amax 1e6 must saturate: at the largest scale its largest codes are ±{qmax:g}, "
           f"got {float(codes[1, 0].float().abs().max())}\nclamp x / scale to [-max, max] before rounding and "
           "converting")
    want_codes, want_scales = reference_quantize_kv(x, kv_cache_dtype)
    check_scales(scales, want_scales, what, kv_cache_dtype, x)
    check_codes(codes, want_codes, what, kv_cache_dtype, x, want_scales)
    if kv_cache_dtype == "int8":      # one float32 step above 127 * 2**-10: times the reciprocal it is 2**-10 exactly
        amax = torch.nextafter(torch.tensor(127 * 2.0 ** -10), torch.tensor(1.0))
        _, scales = ch09.quantize_kv(torch.stack([amax, -amax / 3])[None, None], "int8")
        expect(float(scales) == 2.0 ** -10,
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
    check_scales(scales, want_scales, what, kv_cache_dtype, x)
    check_codes(codes, want_codes, what, kv_cache_dtype, x, want_scales)
    if kv_cache_dtype == "fp8":       # the same thing, said as torch's conversion of the clamped values
        clamped = (x.float() / want_scales[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        check_codes(codes, clamped, what, kv_cache_dtype, x, want_scales)


@pytest.mark.task("quantize")
def test_out_of_range_values_saturate(ch09):
    """Large and tiny values: past max * 2**max_exponent (57,344 for fp8, 65,024 for int8) the
    scaled values are clamped to ±max, nothing becomes NaN; tiny rows take the smallest scale,
    and so does a row whose amax * (1.0 / max) underflows to 0 (amax 1e-44: not a row of zeros)."""
    x = torch.tensor([[[1e5, -7e4, 1.0, 1e-30]], [[1e-38, -1e-38, 0.0, 5e-39]], [[3e4, -3e4, 1.0, 0.0]],
                      [[1e-44, -1e-44, 0.0, 3e-45]]])
    for name, (dtype, qmax) in FORMATS.items():
        codes, scales = ch09.quantize_kv(x, name)
        want_codes, want_scales = reference_quantize_kv(x, name)
        expect(not bool(codes.float().isnan().any()),
               f"{name}: a code is NaN: clamp x / scale to [-max, max] before converting (float8_e4m3fn has no "
               "infinity: past 448 it converts to NaN)")
        expect(float(codes.float().abs().max()) <= qmax,
               f"{name}: a code of {float(codes.float().abs().max()):g}, past ±{qmax:g}: clamp x / scale to [-max, max]")
        what = f"{name}, rows of amax 1e5, 1e-38, 3e4 and 1e-44"
        check_scales(scales, want_scales, what, name, x)
        check_codes(codes, want_codes, what, name, x, want_scales)


@pytest.mark.task("quantize")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_dequantize_and_the_error_bound(ch09, kv_cache_dtype):
    x = kv_like((64, 2, 32), seed=5)
    codes, scales = ch09.quantize_kv(x, kv_cache_dtype)
    back = ch09.dequantize_kv(codes, scales)
    expect(isinstance(back, torch.Tensor) and back.dtype == torch.float32 and tuple(back.shape) == tuple(x.shape),
           f"dequantize_kv must return float32 of the codes' shape {list(x.shape)}, got "
           + (f"{back.dtype} of shape {list(back.shape)}" if isinstance(back, torch.Tensor) else type(back).__name__))
    want = codes.float() * scales[..., None]
    same = (back == want) | (back.isnan() & want.isnan())
    expect(bool(same.all()), f"dequantize_kv: {first_mismatch(back, want)}: each code times its row's scale, "
                             "codes.float() * scales[..., None]")
    expect(not bool(back.isnan().any()) and float(back[0, 0].abs().max()) == 0.0,
           "a row of zeros must come back as zeros (scale 1, codes 0), not NaN")
    err = (back - x).abs()
    if kv_cache_dtype == "int8":      # half a step of the row's grid
        bound = scales[..., None] * 0.5
    else:                             # 3 mantissa bits: half a step is 2^-4 of the value; subnormals: 2^-10 * scale
        bound = torch.maximum(x.abs() * 2.0 ** -4, scales[..., None] * 2.0 ** -10)
    worst = float((err / bound).max())
    expect(worst <= 1.0 + 1e-5, f"{kv_cache_dtype}: an error of {worst:.3f}x the bound (half a step of the grid)")


@pytest.mark.task("quantize")
def test_bad_formats_and_shapes_are_refused(ch09):
    x = torch.randn(3, 2, 8)
    for bad in ("auto", "fp16", "e5m2"):
        refuses(ValueError, lambda: ch09.quantize_kv(x, bad), f"quantize_kv(x, {bad!r})",
                "kv_cache_dtype must be 'fp8' or 'int8'" + (" ('auto' stores the model's dtype: nothing to quantise)"
                                                            if bad == "auto" else ""))
    codes, scales = ch09.quantize_kv(x, "int8")
    refuses(ValueError, lambda: ch09.dequantize_kv(codes, scales[:, :1]), "dequantize_kv(codes, scales[:, :1])",
            f"scales must have the codes' shape without head_dim, {list(codes.shape[:-1])}, not "
            f"{list(scales[:, :1].shape)}")


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
    """The canary bytes around a cache must be untouched."""
    after, before = buffer[pad + size:], buffer[:pad]
    if not bool((after == 0xA5).all()):
        first = int((after != 0xA5).nonzero()[0])
        raise AssertionError(f"your kernel wrote past the end of `{name}` (byte {size + first} of {size}): "
                             "check the store mask")
    if not bool((before == 0xA5).all()):
        first = int((before != 0xA5).nonzero()[0])
        raise AssertionError(f"your kernel wrote before the start of `{name}` (from byte {first - pad}): check the "
                             "store mask (a slot of -1 must store nothing)")


def run_write(ch09, guard, kv_cache_dtype, num_kv_heads, head_dim, in_dtype, strided, seed, big=None):
    """Launch the learner's write on 11 tokens (two of them padding) and compare the caches and
    scales with kvlab.quantization.quantize_kv's. ``big``: values for token 2's first KV head
    (and, times 3, for V's token 8), to reach past the largest scale."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_tokens = 5, 4, 11
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 7]] = -1                                       # padding tokens write nothing
    rows = kv_like((num_tokens, num_kv_heads, head_dim), seed=seed)
    if big is not None:
        rows[2, 0, :len(big)] = torch.tensor(big)
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
    key, value, slots = key.cpu().float(), value.cpu().float(), slots.cpu()
    keep = slots >= 0
    token_of = {int(slot): t for t, slot in enumerate(slots.tolist()) if slot >= 0}
    for x, cache, scales in ((key, want[0], want[2]), (value, want[1], want[3])):
        codes, scale = reference_quantize_kv(x[keep], kv_cache_dtype)
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[slots[keep]] = codes.view(torch.uint8)
        written = slots[keep]
        scales[written // block_size, written % block_size] = scale
    for name, x, g, w, g_scale, w_scale in (("k_cache", key, got[0], want[0], got[2], want[2]),
                                            ("v_cache", value, got[1], want[1], got[3], want[3])):
        same = g.view(torch.uint8) == w.view(torch.uint8)
        if not bool(same.all()):
            block, offset, head, d = (int(i) for i in (~same).nonzero()[0])
            slot = block * block_size + offset
            token = token_of.get(slot)
            got_code, want_code = g[block, offset, head, d].float().item(), w[block, offset, head, d].float().item()
            message = (f"{name}[{block}, {offset}, {head}, {d}] (slot {slot}, "
                       + (f"token {token}'s {name[0].upper()} of KV head {head}" if token is not None else "not written")
                       + f"): got {got_code}, expected {want_code}")
            if token is None:
                message += " (a slot no token maps to must keep what it held)"
            else:
                got_scale, want_scale = g_scale[block, offset, head].item(), w_scale[block, offset, head].item()
                if got_scale != want_scale and got_scale == got_scale:      # written, and wrong
                    message += (f"\nits row's scale: got {got_scale}, expected {want_scale}\n"
                                + scale_hint(got_scale, want_scale, kv_cache_dtype,
                                             float(x[token, head].abs().max()), kernel=True))
                elif got_scale == want_scale:
                    message += "\n" + code_hint(got_code, want_code, float(x[token, head, d]) / want_scale,
                                                kv_cache_dtype, kernel=True)
            raise AssertionError(message)
    for name, x, g, w in (("k_scale", key, got[2], want[2]), ("v_scale", value, got[3], want[3])):
        same = (g == w) | (g.isnan() & w.isnan())
        if not bool(same.all()):
            block, offset, head = (int(i) for i in (~same).nonzero()[0])
            slot = block * block_size + offset
            token = token_of.get(slot)
            got_scale, want_scale = g[block, offset, head].item(), w[block, offset, head].item()
            message = (f"{name}[{block}, {offset}, {head}] (slot {slot}, "
                       + (f"token {token}'s KV head {head}" if token is not None else "not written")
                       + f"): got {got_scale}, expected {want_scale}")
            layout = (f"\n{name} is kept as the engine keeps it, [block, KV head, slot] in memory: address every scale "
                      "through scale_block_stride, scale_slot_stride and scale_head_stride" if not g.is_contiguous() else "")
            if torch.equal(g[~g.isnan()].sort().values, w[~w.isnan()].sort().values):
                message += ("\nevery scale is right, but some are in the wrong place"
                            + (f": {name} is kept as the engine keeps it, [block, KV head, slot] in memory"
                               if not g.is_contiguous() else "")
                            + "\nstore a head's scale at (slot // BLOCK_SIZE) * scale_block_stride + (slot % "
                            "BLOCK_SIZE) * scale_slot_stride + head * scale_head_stride")
            elif token is None:
                message += "\na slot no token maps to must keep what it held: store scales only where row_ok" + layout
            elif got_scale != got_scale:
                message += "\nthis row's scale was not stored: store each written row's scale (mask row_ok)" + layout
            else:
                message += layout + "\n" + scale_hint(got_scale, want_scale, kv_cache_dtype,
                                                      float(x[token, head].abs().max()), kernel=True)
            raise AssertionError(message)


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
    got, got_scales = k_cache.view(-1, 2, 16)[slots], k_scale.view(-1, 2)[slots]
    check_scales(got_scales, scales, "fp8 scales of the tokens at slots 3, 0, 2, 1", "fp8", x)
    differ = got.view(torch.uint8) != codes.view(torch.uint8)
    if bool(differ.any()):
        t, head, d = (int(i) for i in differ.nonzero()[0])
        got_code, want_code = float(got[t, head, d].float()), float(codes[t, head, d].float())
        raise AssertionError(f"fp8 codes of token {t} (slot {int(slots[t])}), KV head {head}, element {d}: got "
                             f"{got_code}, expected {want_code} ({int(differ.sum())} differ)\n"
                             + code_hint(got_code, want_code, float(x[t, head, d]) / float(scales[t, head]), "fp8",
                                         kernel=True))


@pytest.mark.task("write_kernel")
def test_int8_write_matches_the_reference(ch09, guard):
    """The same kernel with FP8=False: int8, rounded half to even."""
    run_write(ch09, guard, "int8", 2, 32, torch.float32, True, seed=11)


@pytest.mark.task("write_kernel")
@pytest.mark.parametrize("kv_cache_dtype,in_dtype,strided", [
    ("fp8", torch.float32, False), ("fp8", torch.bfloat16, True), ("int8", torch.float32, True)])
def test_write_saturates_past_the_largest_scale(ch09, guard, kv_cache_dtype, in_dtype, strided):
    """A row of 1e5 and -7e4 beside ordinary values (and in V, three times those): its scale
    clamps at the largest, 2**7 for fp8 (past 448 * 2**7 = 57,344), 2**9 for int8 (past
    127 * 2**9 = 65,024), and its codes saturate at ±448 or ±127, as the reference's."""
    run_write(ch09, guard, kv_cache_dtype, 2, 16, in_dtype, strided, seed=5, big=[1e5, -7e4, 3e4, 1.0, -0.5])


# -- preemption_mode -----------------------------------------------------------------------------
# 1 KB per token at 10 GB/s: 0.1 us per token per transfer, 21 us fixed per transfer; recompute
# 1 us per token: swap 42 us + 0.2 us/token against 1 us/token -> swap is cheaper from 53 tokens on
COSTS = PreemptionCosts(bandwidth=10e9, latency=21e-6, prefill_per_token=1e-6)
BPT = 1000
HOST = 1 << 40


def expect_mode(ch09, args, want, why):
    __tracebackhide__ = True
    got = ch09.preemption_mode(*args)
    num_tokens, bpt, costs, host = args
    expect(got == want, f"preemption_mode({num_tokens}, {bpt}, {costs}, host_free_bytes={host}) = {got!r}, "
                        f"expected {want!r}: {why}")


def expect_seconds(got, want, what):
    __tracebackhide__ = True
    expect(isinstance(got, (int, float)) and got == pytest.approx(want, rel=1e-12, abs=1e-18),
           f"{what} = {got!r}, expected {want!r}")


@pytest.mark.task("preemption_mode")
def test_swap_and_recompute_seconds(ch09):
    expect_seconds(ch09.swap_seconds(100, BPT, COSTS), 2 * (21e-6 + 100 * 1000 / 10e9),
                   "swap_seconds(100, 1000, COSTS) (two transfers, out now and in later, each latency + bytes / "
                   "bandwidth)")
    expect_seconds(ch09.recompute_seconds(100, COSTS), 100e-6, "recompute_seconds(100, COSTS) (100 tokens at 1 us)")
    quad = PreemptionCosts(bandwidth=1e9, latency=0.0, prefill_per_token=1e-6, prefill_per_token_sq=1e-9)
    expect_seconds(ch09.recompute_seconds(1000, quad), 1000e-6 + 1e6 * 1e-9,
                   "recompute_seconds(1000, ...) with prefill_per_token_sq=1e-9 (n * prefill_per_token + n**2 * "
                   "prefill_per_token_sq)")
    expect_seconds(ch09.swap_seconds(0, BPT, COSTS), 42e-6, "swap_seconds(0, ...) (the two latencies remain)")
    expect_seconds(ch09.recompute_seconds(0, COSTS), 0.0, "recompute_seconds(0, ...)")


@pytest.mark.task("preemption_mode")
def test_both_sides_of_the_crossover(ch09):
    expect_mode(ch09, (10, BPT, COSTS, HOST), "recompute", "10 tokens: 44 us to swap, 10 us to recompute")
    expect_mode(ch09, (52, BPT, COSTS, HOST), "recompute", "52 tokens: 52.4 us to swap, 52 us to recompute")
    expect_mode(ch09, (53, BPT, COSTS, HOST), "swap", "53 tokens: 52.6 us to swap, 53 us to recompute")
    expect_mode(ch09, (100_000, BPT, COSTS, HOST), "swap", "100,000 tokens: 20 ms to swap, 100 ms to recompute")
    expect_mode(ch09, (0, BPT, COSTS, HOST), "recompute", "nothing to recompute: never pay a transfer")


@pytest.mark.task("preemption_mode")
def test_a_tie_recomputes(ch09):
    # powers of two: every product and sum exact, so swap and recompute cost exactly the same
    tie = PreemptionCosts(bandwidth=2.0 ** 30, latency=2.0 ** -10, prefill_per_token=2.0 ** -14)
    n, bpt = 64, 2 ** 14                    # swap: 2 * (2^-10 + 2^20 / 2^30) = 2^-8; recompute 64 * 2^-14 = 2^-8
    expect_seconds(ch09.swap_seconds(n, bpt, tie), 2.0 ** -8, f"swap_seconds({n}, {bpt}, {tie})")
    expect_seconds(ch09.recompute_seconds(n, tie), 2.0 ** -8, f"recompute_seconds({n}, {tie})")
    expect_mode(ch09, (n, bpt, tie, HOST), "recompute", "a tie (2**-8 s each): recompute (no host memory, no transfer)")
    expect_mode(ch09, (n + 1, bpt, tie, HOST), "swap", "one token past the tie, swapping is cheaper")


@pytest.mark.task("preemption_mode")
def test_host_memory_decides_too(ch09):
    n = 1000                                  # swap is far cheaper: 242 us against 1 ms
    expect_mode(ch09, (n, BPT, COSTS, n * BPT), "swap", "exactly enough host memory (and 242 us against 1 ms)")
    expect_mode(ch09, (n, BPT, COSTS, n * BPT - 1), "recompute", "one byte short of host memory")
    expect_mode(ch09, (n, BPT, COSTS, 0), "recompute", "the host tier is full")


@pytest.mark.task("preemption_mode")
def test_the_quadratic_term_moves_the_crossover(ch09):
    quad = PreemptionCosts(bandwidth=10e9, latency=21e-6, prefill_per_token=1e-7, prefill_per_token_sq=1e-9)
    # swap 42 us + 0.2 us/n; recompute 0.1 us/n + 1 ns/n^2: recompute wins at 100, swap at 300
    expect_mode(ch09, (100, BPT, quad, HOST), "recompute", "62 us to swap, 20 us to recompute")
    expect_mode(ch09, (300, BPT, quad, HOST), "swap", "102 us to swap, 120 us to recompute (90 us of it quadratic)")


def brute_force_crossover(bpt, costs, max_tokens):
    swap = lambda n: 2 * (costs.latency + n * bpt / costs.bandwidth)                          # noqa: E731
    recompute = lambda n: n * costs.prefill_per_token + n ** 2 * costs.prefill_per_token_sq   # noqa: E731
    return next((n for n in range(max_tokens + 1) if swap(n) < recompute(n)), None)


def random_costs(rng):
    costs = PreemptionCosts(bandwidth=rng.choice([5e9, 2e10, 5e10]), latency=rng.choice([0.0, 5e-6, 3e-5, 1e-3]),
                            prefill_per_token=rng.uniform(1e-8, 2e-6),
                            prefill_per_token_sq=rng.choice([0.0, 0.0, rng.uniform(1e-12, 1e-9)]))
    return costs, rng.choice([4096, 32768, 131072, 524288])


@pytest.mark.task("preemption_mode")
def test_random_costs_on_both_sides_of_a_scan(ch09):
    """Random costs, linear and quadratic: "swap" from the first length a scan finds swapping
    strictly cheaper, "recompute" one token before."""
    rng = random.Random(0)
    for _ in range(60):
        costs, bpt = random_costs(rng)
        first = brute_force_crossover(bpt, costs, 3000)
        if first is not None and first > 0:
            expect_mode(ch09, (first, bpt, costs, HOST), "swap", f"from {first} tokens on swapping is cheaper")
            expect_mode(ch09, (first - 1, bpt, costs, HOST), "recompute",
                        f"at {first - 1} tokens recomputing costs no more than swapping")


@pytest.mark.task("preemption_mode")
@pytest.mark.parametrize("num_tokens", [-1, 2.0, "8", None, True])
def test_bad_token_counts_are_refused(ch09, num_tokens):
    """A negative count: ValueError; not an int (a bool is not one either): TypeError, as
    kvlab.validation.check_count raises."""
    if num_tokens == -1:
        refuses(ValueError, lambda: ch09.preemption_mode(-1, BPT, COSTS, HOST), "preemption_mode(-1, ...)",
                "num_tokens must be >= 0 (check_count('num_tokens', num_tokens))")
    else:
        refuses(TypeError, lambda: ch09.preemption_mode(num_tokens, BPT, COSTS, HOST),
                f"preemption_mode({num_tokens!r}, ...)",
                f"num_tokens must be an int, and {type(num_tokens).__name__} is not "
                "(check_count('num_tokens', num_tokens))")


@pytest.mark.task("preemption_mode")
def test_bad_sizes_are_refused(ch09):
    refuses(ValueError, lambda: ch09.preemption_mode(10, -5, COSTS, HOST), "preemption_mode(10, -5, ...)",
            "bytes_per_token must be >= 0 (check_count('bytes_per_token', bytes_per_token))")
    refuses(ValueError, lambda: ch09.preemption_mode(10, BPT, COSTS, -1), "preemption_mode(10, 1000, costs, -1)",
            "host_free_bytes must be >= 0 (check_count('host_free_bytes', host_free_bytes))")
    refuses(TypeError, lambda: ch09.preemption_mode(10, 1.5, COSTS, HOST), "preemption_mode(10, 1.5, ...)",
            "bytes_per_token must be an int (check_count('bytes_per_token', bytes_per_token))")
    refuses(TypeError, lambda: ch09.preemption_mode(10, BPT, COSTS, float(HOST)),
            f"preemption_mode(10, 1000, costs, {float(HOST)!r})",
            "host_free_bytes must be an int, even a whole float is not (check_count('host_free_bytes', host_free_bytes))")


# -- crossover -----------------------------------------------------------------------------------
def expect_crossover(ch09, args, want, why, max_tokens=None):
    __tracebackhide__ = True
    bpt, costs = args
    if max_tokens is None:
        got, call = ch09.crossover_tokens(bpt, costs), f"crossover_tokens({bpt}, {costs})"
    else:
        got = ch09.crossover_tokens(bpt, costs, max_tokens=max_tokens)
        call = f"crossover_tokens({bpt}, {costs}, max_tokens={max_tokens})"
    expect(got == want, f"{call} = {got!r}, expected {want!r}: {why}")


@pytest.mark.task("crossover")
def test_crossover_worked_example(ch09):
    expect_crossover(ch09, (BPT, COSTS), 53, "swap 42 us + 0.2 us/token < 1 us/token from 52.5 tokens on")
    tie = PreemptionCosts(bandwidth=2.0 ** 30, latency=2.0 ** -10, prefill_per_token=2.0 ** -14)
    expect_crossover(ch09, (2 ** 14, tie), 65, "at 64 tokens the two tie (not strictly cheaper): swap wins from 65")


@pytest.mark.task("crossover")
def test_no_crossover(ch09):
    slow_link = PreemptionCosts(bandwidth=1e9, latency=1e-5, prefill_per_token=1e-7)     # a token moves slower than it computes
    expect_crossover(ch09, (BPT, slow_link), None, "a token takes 2 us to swap and 0.1 us to recompute: never")
    expect_crossover(ch09, (BPT, COSTS), None, "the crossover, 53, is past max_tokens", max_tokens=52)
    expect_crossover(ch09, (BPT, COSTS), 53, "max_tokens is included in the range", max_tokens=53)


@pytest.mark.task("crossover")
def test_crossover_matches_a_scan(ch09):
    """Random costs, linear and quadratic, against a scan of every length."""
    rng = random.Random(0)
    for _ in range(60):
        costs, bpt = random_costs(rng)
        want = brute_force_crossover(bpt, costs, 3000)
        expect_crossover(ch09, (bpt, costs), want, "the first n with swap_seconds(n) < recompute_seconds(n), by a scan",
                         max_tokens=3000)


@pytest.mark.task("crossover")
def test_crossover_far_out(ch09):
    """A crossover near a million tokens (the default max_tokens): found exactly, and quickly."""
    costs = PreemptionCosts(bandwidth=1e10, latency=0.5, prefill_per_token=2e-6)    # swap: 1 s + 0.2 us/token
    want = 555_556                                                                    # 1 / 1.8e-6 = 555,555.6
    expect(brute_force_crossover(BPT, costs, want) == want, "the test's own scan disagrees with its answer")
    expect_crossover(ch09, (BPT, costs), want, "swap 1 s + 0.2 us/token, recompute 2 us/token: 1 / 1.8e-6 = 555,555.6")
