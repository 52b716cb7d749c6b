"""rms_norm, silu_and_mul and rotary_write_kv against their references in kvlab.reference.

The references are the model's PyTorch, line for line (the first tests check that, bit for
bit). The kernels run in Triton's interpreter on a CPU, in float32 and float16 at small sizes,
and natively on a GPU (``KVLAB_PROFILE=gpu pytest tests/test_layer_ops.py``), in bfloat16 too
and at model sizes. Every output is poisoned (NaN) before the call, so an element the kernel
forgets to write shows.
"""
import pytest
import torch

from kvlab import profile
from kvlab.kernels import rms_norm, rotary_write_kv, silu_and_mul
from kvlab.models import ModelConfig, RMSNorm, RotaryEmbedding
from kvlab.models.rope import apply_rope
from kvlab.reference import rms_norm_ref, rotary_write_kv_ref, silu_and_mul_ref

DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"
# The interpreter computes in NumPy, which has no bfloat16.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
NAN = float("nan")


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, device="cpu").to(device=DEVICE, dtype=dtype)


def assert_close(got, want):
    """float32: 1e-5. float16/bfloat16: a unit or so in the last place (the kernels and PyTorch
    may round a float32 intermediate differently, then the dtype's rounding shows it whole)."""
    tol = 1e-5 if want.dtype == torch.float32 else 1e-2
    assert not bool(got.isnan().any()), f"{int(got.isnan().sum())} elements were not written"
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{m}\nmax abs error {err:.3g}")


def assert_bits_equal(got, want):
    """Bit-identical, NaN poison included."""
    as_int = {4: torch.int32, 2: torch.int16}[got.element_size()]
    assert torch.equal(got.view(as_int), want.view(as_int))


def rope_tables(head_dim, max_positions=256):
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=head_dim,
                         intermediate_size=head_dim, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=head_dim, max_position_embeddings=max_positions)
    return RotaryEmbedding(config).tables(DEVICE)


# -- the references are the model --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_references_are_the_models_pytorch(dtype):
    """On the CPU, where the model runs its PyTorch: equal bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 48, generator=gen).to(dtype) for _ in range(2))
    norm = RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-5), norm(x))
        out, s = rms_norm_ref(x, norm.weight, 1e-5, r)
        assert torch.equal(s, x + r) and torch.equal(out, norm(x + r))

    gate_up = torch.randn(5, 64, generator=gen).to(dtype)
    assert torch.equal(silu_and_mul_ref(gate_up), torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:])

    cos, sin = rope_tables(16)
    cos, sin = cos.cpu(), sin.cpu()
    positions = torch.randint(0, 256, (5,), generator=gen)
    q, k, v = (torch.randn(5, h, 16, generator=gen).to(dtype) for h in (4, 2, 2))
    want_q, want_k = apply_rope(q, cos[positions], sin[positions]), apply_rope(k, cos[positions], sin[positions])
    k_cache, v_cache = torch.zeros(2, 4, 2, 16, dtype=dtype), torch.zeros(2, 4, 2, 16, dtype=dtype)
    rotary_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, torch.tensor([7, -1, 0, 3, 4]))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(k_cache.view(8, 2, 16)[7], want_k[0]) and torch.equal(v_cache.view(8, 2, 16)[4], v[4])


# -- rms_norm ------------------------------------------------------------------------------
ROWS = [(1, 4096), (37, 4096), (5, 5120)] if BIG else [(1, 64), (3, 384), (17, 200)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", ROWS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, num_tokens, hidden, with_residual):
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    # Strided rows: x is a slice of a wider buffer, as a column block of a fused projection is.
    x = randn(num_tokens, hidden + 24, dtype=dtype, gen=gen)[:, 8:8 + hidden]
    residual = randn(num_tokens, hidden, dtype=dtype, gen=gen) if with_residual else None
    weight = randn(hidden, dtype=dtype, gen=gen)
    out = torch.full((num_tokens, hidden), NAN, dtype=dtype, device=DEVICE)
    residual_out = torch.full_like(out, NAN) if with_residual else None
    got = rms_norm(x, weight, 1e-6, residual, out=out, residual_out=residual_out)
    want = rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert got[0] is out and got[1] is residual_out
        assert_close(out, want[0])
        assert_bits_equal(residual_out, want[1])     # one float32 add, rounded once: exact
    else:
        assert got is out
        assert_close(out, want)


def test_rms_norm_fresh_outputs_and_in_place():
    x, residual, weight = randn(3, 96), randn(3, 96), randn(96)
    want_out, want_sum = rms_norm_ref(x, weight, 1e-5, residual)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == (3, 96) and out.is_contiguous()
    assert_close(out, rms_norm_ref(x, weight, 1e-5))
    # vLLM's form: the norm overwrites x, the sum overwrites residual.
    out, total = rms_norm(x, weight, 1e-5, residual, out=x, residual_out=residual)
    assert out is x and total is residual
    assert_close(x, want_out)
    assert_close(residual, want_sum)


# -- silu_and_mul ----------------------------------------------------------------------------
COLUMNS = [(1, 14336), (37, 4864), (5, 100)] if BIG else [(1, 32), (3, 1100), (17, 100)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", COLUMNS)
def test_silu_and_mul_matches_reference(dtype, num_tokens, d):
    gen = torch.Generator().manual_seed(num_tokens * d)
    # gate | up strided: the merged projection's output padded to a wider row.
    x = randn(num_tokens, 2 * d + 16, dtype=dtype, gen=gen)[:, :2 * d] * 4   # silu's curved part and tails
    out = torch.full((num_tokens, d), NAN, dtype=dtype, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, silu_and_mul_ref(x))
    fresh = silu_and_mul(x)
    assert fresh.shape == (num_tokens, d) and fresh.is_contiguous()
    assert_bits_equal(fresh, out)


# -- rotary_write_kv ------------------------------------------------------------------------
def step_tokens(gen, block_size, num_blocks, pad):
    """Positions and slots of one engine step: sequences whose pages are scattered over a
    shuffled pool, each bringing its last token (decode) or all of them (prefill), lengths
    around page boundaries, ``pad`` padding tokens (slot -1), all in a shuffled order."""
    lengths = [1, block_size - 1, block_size + 1, 3 * block_size + 2]
    blocks = torch.randperm(num_blocks, generator=gen)
    positions, slots, used = [], [], 0
    for i, n in enumerate(lengths):
        pages = -(-n // block_size)
        table, used = blocks[used:used + pages], used + pages
        pos = torch.arange(n - 1 if i % 2 else 0, n)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    positions.append(torch.randint(0, 64, (pad,), generator=gen))
    slots.append(torch.full((pad,), -1))
    order = torch.randperm(sum(len(p) for p in positions), generator=gen)
    return torch.cat(positions)[order].to(DEVICE), torch.cat(slots)[order].to(DEVICE)


def fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen):
    """q, k, v as views into one [T, (H + 2 KV) * D] projection output, like the model's."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    return qkv, split_qkv(qkv, num_heads, num_kv_heads, head_dim)


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


HEADS = [(32, 8, 128), (28, 4, 128), (14, 2, 64)] if BIG else [(4, 2, 16), (3, 1, 32), (6, 3, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("block_size", [16, 4])
def test_rotary_write_kv_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_heads * head_dim + block_size)
    num_blocks = 64
    positions, slots = step_tokens(gen, block_size, num_blocks, pad=5)
    qkv, (q, k, v) = fused_qkv(len(slots), num_heads, num_kv_heads, head_dim, dtype, gen)
    cos, sin = rope_tables(head_dim)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, NAN)

    want_qkv, want_k_cache, want_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_write_kv_ref(*split_qkv(want_qkv, num_heads, num_kv_heads, head_dim), positions, cos, sin,
                        want_k_cache, want_v_cache, slots)
    rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots)

    assert_close(qkv, want_qkv)                      # q and k rotated in place, v untouched
    assert_bits_equal(qkv[:, -num_kv_heads * head_dim:], want_qkv[:, -num_kv_heads * head_dim:])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    for got, want in ((k_cache, want_k_cache), (v_cache, want_v_cache)):
        got, want = got.view(-1, num_kv_heads, head_dim), want.view(-1, num_kv_heads, head_dim)
        assert_close(got[written], want[written])
        assert_bits_equal(got[~written], want[~written])   # every other slot keeps its poison
    assert_bits_equal(v_cache.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]], v[slots >= 0])


def test_rotary_write_kv_padding_only_rotates():
    """A step of padding tokens: q and k are rotated, the caches are not touched."""
    gen = torch.Generator().manual_seed(1)
    qkv, (q, k, v) = fused_qkv(3, 2, 1, 16, torch.float32, gen)
    want_qkv = qkv.clone()
    cos, sin = rope_tables(16)
    positions = torch.tensor([5, 0, 200], device=DEVICE)
    k_cache = torch.full((2, 4, 1, 16), NAN, device=DEVICE)
    v_cache = torch.full_like(k_cache, NAN)
    slots = torch.full((3,), -1, device=DEVICE)
    rotary_write_kv_ref(*split_qkv(want_qkv, 2, 1, 16), positions, cos, sin, k_cache.clone(), v_cache.clone(), slots)
    rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    assert_close(qkv, want_qkv)
    assert bool(k_cache.isnan().all()) and bool(v_cache.isnan().all())


def test_empty_batches():
    empty = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(empty, randn(64), 1e-6).shape == (0, 64)
    assert [t.shape for t in rms_norm(empty, randn(64), 1e-6, empty)] == [(0, 64), (0, 64)]
    assert silu_and_mul(empty).shape == (0, 32)
    cos, sin = rope_tables(16)
    k_cache = torch.full((2, 4, 1, 16), NAN, device=DEVICE)
    no_tokens = torch.empty(0, 1, 16, device=DEVICE)
    nothing = torch.empty(0, dtype=torch.int64, device=DEVICE)
    rotary_write_kv(torch.empty(0, 2, 16, device=DEVICE), no_tokens, no_tokens, nothing, cos, sin,
                    k_cache, k_cache.clone(), nothing)
    assert bool(k_cache.isnan().all())


# -- bad input: refused with the argument's name, nothing written -----------------------------
def _norm_args(**overrides):
    args = dict(x=randn(3, 32), weight=randn(32), eps=1e-6, residual=randn(3, 32),
                out=torch.full((3, 32), NAN, device=DEVICE), residual_out=torch.full((3, 32), NAN, device=DEVICE))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,error,match", [
    (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    (dict(x=torch.ones(3, 32, dtype=torch.int32)), TypeError, "x must be float32, float16 or bfloat16"),
    (dict(x=torch.ones(3, 4, 8)), ValueError, r"x must be \[num_tokens, hidden\]"),
    (dict(x=torch.ones(32, 3).t()), ValueError, "x must have contiguous rows"),
    (dict(weight=torch.ones(32, dtype=torch.float16)), TypeError, "weight has dtype"),
    (dict(weight=torch.ones(31)), ValueError, r"weight must be a contiguous \[32\]"),
    (dict(eps="1e-6"), TypeError, "eps must be a float"),
    (dict(eps=-1.0), ValueError, "eps must be >= 0"),
    (dict(residual=torch.ones(3, 32, dtype=torch.float16)), TypeError, "residual has dtype"),
    (dict(residual=torch.ones(2, 32)), ValueError, "residual must have x's shape"),
    (dict(out=torch.ones(3, 16)), ValueError, "out must have x's shape"),
    (dict(residual=None), ValueError, "residual_out .* needs residual"),
    (dict(residual=torch.ones(3, 32, device="meta")), ValueError, "residual is on meta"),
])
def test_rms_norm_refuses_bad_input(overrides, error, match):
    args = _norm_args(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
                         for k, v in overrides.items()})
    poisoned = [t for t in (args["out"], args["residual_out"]) if bool(t.isnan().all())]
    with pytest.raises(error, match=match):
        rms_norm(args.pop("x"), args.pop("weight"), args.pop("eps"), args.pop("residual"), **args)
    assert all(bool(t.isnan().all()) for t in poisoned)


@pytest.mark.parametrize("x,out,error,match", [
    (torch.ones(3, 7), None, ValueError, r"x must be \[num_tokens, 2 \* d\]"),
    (torch.ones(3, 8, dtype=torch.int64), None, TypeError, "x must be float32"),
    (torch.ones(8, 3).t(), None, ValueError, "x must have contiguous rows"),
    (torch.ones(3, 8), torch.ones(3, 8), ValueError, r"out must have shape \[3, 4\]"),
    (torch.ones(3, 8), torch.ones(3, 4, dtype=torch.float16), TypeError, "out has dtype"),
])
def test_silu_and_mul_refuses_bad_input(x, out, error, match):
    with pytest.raises(error, match=match):
        silu_and_mul(x.to(DEVICE), out=None if out is None else out.to(DEVICE))


def _rotary_args(**overrides):
    """3 tokens, 2 query heads, 1 KV head of 16 dims; caches of 4 blocks x 4 slots."""
    gen = torch.Generator().manual_seed(2)
    qkv, (q, k, v) = fused_qkv(3, 2, 1, 16, torch.float32, gen)
    cos, sin = rope_tables(16, max_positions=64)
    args = dict(q=q, k=k, v=v, positions=torch.tensor([0, 9, 63], device=DEVICE), cos=cos, sin=sin,
                k_cache=torch.full((4, 4, 1, 16), NAN, device=DEVICE),
                v_cache=torch.full((4, 4, 1, 16), NAN, device=DEVICE),
                slot_mapping=torch.tensor([0, 5, -1], device=DEVICE))
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
                 for k, v in overrides.items()})
    return qkv, args


@pytest.mark.parametrize("overrides,error,match", [
    (dict(positions=torch.tensor([0, 64, 1])), ValueError, r"positions\[1\] = 64 is out of range 0..63"),
    (dict(positions=torch.tensor([0, 1, -3])), ValueError, r"positions\[2\] = -3"),
    (dict(positions=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "positions must be int64"),
    (dict(positions=torch.tensor([0, 1])), ValueError, r"positions must be a contiguous \[3\]"),
    (dict(slot_mapping=torch.tensor([0, 16, 1])), ValueError, r"slot_mapping\[1\] = 16 is out of range"),
    (dict(slot_mapping=torch.tensor([0, -2, 1])), ValueError, r"slot_mapping\[1\] = -2"),
    (dict(slot_mapping=torch.tensor([3, 3, -1])), ValueError, "twice"),
    (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "slot_mapping must be int64"),
    (dict(q=torch.randn(3, 2, 16, dtype=torch.float16)), TypeError, "q has dtype"),
    (dict(v=torch.randn(3, 1, 16, dtype=torch.float16)), TypeError, "v has dtype"),
    (dict(q=torch.randn(3, 2, 8)), ValueError, "q must be"),
    (dict(k=torch.randn(4, 1, 16)), ValueError, r"k must have shape \[3, 1, 16\]"),
    (dict(k=torch.randn(3, 16, 1).transpose(1, 2)), ValueError, "k must be contiguous within a token"),
    (dict(cos=torch.randn(64, 16, dtype=torch.float16)), TypeError, "cos must be float32"),
    (dict(sin=torch.randn(64, 8)), ValueError, r"sin must be a contiguous \[max_positions, 16\]"),
    (dict(sin=torch.randn(32, 16)), ValueError, "cos .* and sin .* must have the same shape"),
    (dict(k_cache=torch.zeros(4, 4, 1, 12), v_cache=torch.zeros(4, 4, 1, 12)), ValueError,
     "head_dim must be a power of two"),
    (dict(v_cache=torch.zeros(4, 4, 1, 8)), ValueError, "must match"),
    (dict(positions=torch.tensor([0, 1, 2], device="meta")), ValueError, "positions is on meta"),
    (dict(v=None), TypeError, "v must be a torch.Tensor"),
])
def test_rotary_write_kv_refuses_bad_input_and_writes_nothing(overrides, error, match):
    qkv, args = _rotary_args(**overrides)
    before = [t.clone() for t in (qkv, args["k_cache"], args["v_cache"])]
    with pytest.raises(error, match=match):
        rotary_write_kv(**args)
    for got, want in zip((qkv, args["k_cache"], args["v_cache"]), before):
        assert_bits_equal(got, want)


def test_rope_and_write_kv_keeps_every_row_beside_padding_slots():
    """The model's own write (PyTorch on the CPU): a -1 slot writes nothing, but the rotated
    q and k it returns keep every row, aligned with the step's tokens."""
    from kvlab.models.ops import rope_and_write_kv

    gen = torch.Generator().manual_seed(3)
    q, k, v = randn(4, 2, 16, gen=gen), randn(4, 1, 16, gen=gen), randn(4, 1, 16, gen=gen)
    rotary = RotaryEmbedding(ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=32,
                                         intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         head_dim=16, max_position_embeddings=64))
    positions = torch.tensor([3, 4, 5, 6], device=DEVICE)
    k_cache = torch.full((2, 4, 1, 16), NAN, device=DEVICE)
    v_cache = torch.full_like(k_cache, NAN)
    slots = torch.tensor([5, -1, 6, -1], device=DEVICE)
    q_out, k_out = rope_and_write_kv(q.clone(), k.clone(), v, positions, rotary, k_cache, v_cache, slots)
    cos, sin = rotary(positions)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert_close(k_out, apply_rope(k, cos, sin))
    flat_k, flat_v = k_cache.view(-1, 1, 16), v_cache.view(-1, 1, 16)
    assert_close(flat_k[[5, 6]], k_out[[0, 2]])
    assert_close(flat_v[[5, 6]], v[[0, 2]])
    assert int(flat_k.isnan().any(dim=(1, 2)).sum()) == 6
