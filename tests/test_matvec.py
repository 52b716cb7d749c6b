"""matvec (a batch-1 linear layer) against F.linear in float64, and its argument checks.

In Triton's interpreter on a CPU at small, ragged sizes (N and K not multiples of the tiles),
natively on a GPU (``KVLAB_PROFILE=gpu pytest tests/test_matvec.py``) in bfloat16 too and at an
8B model's sizes. Outputs are poisoned (NaN) first, so a row the kernel forgets shows.
"""
import pytest
import torch
import torch.nn.functional as F

from kvlab import profile
from kvlab.kernels import matvec
from kvlab.kernels.matvec import matvec_config
from kvlab.models import ops

DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SHAPES = [(1, 1), (5, 3), (37, 70), (64, 96), (130, 33)] + ([(6144, 4096), (4096, 14336), (28672, 4096)] if BIG else [])


def inputs(n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matvec_matches_float64(n, k, dtype):
    x, w = inputs(n, k, dtype, seed=n * 1000 + k)
    out = torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)
    got = matvec(x, w, out=out)
    assert got is out and not bool(out.isnan().any()), "a row was not written"
    want = F.linear(x.double()[None], w.double())[0]
    # float32 sums; the result rounded once to the dtype
    tol = 1e-5 if dtype == torch.float32 else {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol * max(1.0, float(want.abs().max())), rtol=tol)


def test_matvec_fresh_output_and_empty():
    x, w = inputs(9, 20, torch.float32)
    assert matvec(x, w).shape == (9,)
    assert matvec(x, w[:0]).shape == (0,)


def test_the_engine_uses_it_for_one_half_precision_row_on_a_gpu(monkeypatch):
    import kvlab.kernels

    calls = []
    monkeypatch.setattr(kvlab.kernels, "matvec", lambda *a, **kw: calls.append(1) or matvec(*a, **kw))
    x, w = inputs(24, 40, torch.float16)
    with torch.inference_mode():
        got = ops.linear(x[None], w)
        ops.linear(torch.stack([x, x]), w)                      # two rows: cuBLAS (or the CPU's path)
    assert got.shape == (1, 24) and len(calls) == (1 if DEVICE == "cuda" else 0)
    torch.testing.assert_close(got[0].double(), F.linear(x.double()[None], w.double())[0], atol=2e-3, rtol=2e-3)


def test_config_tiles_are_powers_of_two():
    for n, k in [(4096, 4096), (28672, 4096), (128256, 4096), (3, 5)]:
        cfg = matvec_config(n, k)
        assert all(cfg[b] & (cfg[b] - 1) == 0 for b in ("BLOCK_N", "BLOCK_K"))


@pytest.mark.parametrize("call,error,match", [
    (lambda x, w: matvec(x.tolist(), w), TypeError, "x must be a torch.Tensor"),
    (lambda x, w: matvec(x.long(), w), TypeError, "x must be float32"),
    (lambda x, w: matvec(x[None], w), ValueError, r"x must be \[K\]"),
    (lambda x, w: matvec(x, w[0]), ValueError, r"weight must be \[N, K\]"),
    (lambda x, w: matvec(x, w.t().contiguous().t()), ValueError, "weight must be contiguous"),
    (lambda x, w: matvec(x, w.half()), TypeError, "weight has dtype"),
    (lambda x, w: matvec(x[:-1], w), ValueError, "needs x of K = 6"),
    (lambda x, w: matvec(x, w, out=torch.empty(4, dtype=x.dtype, device=x.device)), ValueError, "out must have shape"),
    (lambda x, w: matvec(x, w, out=torch.empty(5, dtype=torch.float16, device=x.device)), TypeError, "out has dtype"),
])
def test_bad_arguments_are_refused(call, error, match):
    x, w = inputs(5, 6, torch.float32)
    with pytest.raises(error, match=match):
        call(x, w)
