"""paged_prefill_ws: the warp-specialised prefill/extend over a quantised cache (Gluon, sm_90).

The rule that picks it (``kvlab.kernel_plan.warp_specialized_extend``) and the refusals run
anywhere. The kernel itself runs only on an sm_90 GPU (Gluon has no CPU interpreter):
``KVLAB_PROFILE=gpu pytest tests/test_paged_prefill_ws.py``. There it is checked as
``paged_prefill`` is (tests/test_paged_prefill_quant.py): float64 attention over the dequantised
cache, ragged lengths around page boundaries, shuffled tables, GQA, NaN codes and scales in every
slot no sequence owns, NaN-filled outputs.
"""
import importlib

import pytest
import torch

from kvlab import profile
from kvlab.kernel_plan import WS_MIN_QUERY_LEN, WS_MIN_SEQ_LEN, warp_specialized_extend
from kvlab.kernels.flash_attention import paged_prefill
from test_paged_prefill_quant import TOLERANCE, assert_close, quantized_step, reference

pytestmark = pytest.mark.kv_quant
flash_module = importlib.import_module("kvlab.kernels.flash_attention")


def on_hopper() -> bool:
    return profile.DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0) and flash_module._has_gluon()


needs_hopper = pytest.mark.skipif(not on_hopper(), reason="paged_prefill_ws runs on an sm_90 GPU only (Gluon)")


@pytest.mark.parametrize("fmt,head_dim,max_seq_len,max_query_len,capability,want", [
    ("fp8", 128, WS_MIN_SEQ_LEN, WS_MIN_QUERY_LEN, (9, 0), True),
    ("int8", 128, 32768, 2048, (9, 0), True),
    ("fp8", 64, 32768, 2048, (9, 0), True),
    ("fp8", 128, WS_MIN_SEQ_LEN - 1, 2048, (9, 0), False),     # short steps: the Triton kernel is faster
    ("fp8", 128, 32768, WS_MIN_QUERY_LEN - 1, (9, 0), False),  # a few new tokens a sequence: Triton too
    ("fp8", 128, None, 2048, (9, 0), False),                   # unknown length: no guess
    ("fp8", 96, 32768, 2048, (9, 0), False),                   # not a head_dim the kernel is built for
    ("auto", 128, 32768, 2048, (9, 0), False),                 # a bf16 cache has nothing to dequantise
    ("fp8", 128, 32768, 2048, (10, 0), False),                 # Blackwell has no warpgroup MMAs
    ("fp8", 128, 32768, 2048, None, False),                    # no GPU
])
def test_the_rule_for_the_warp_specialised_kernel(fmt, head_dim, max_seq_len, max_query_len, capability, want):
    assert warp_specialized_extend(fmt, head_dim, max_seq_len, max_query_len, capability) is want


def test_asking_for_it_where_it_cannot_run_is_refused_before_anything_is_written():
    args, _, _ = quantized_step(0, [(20, 7), (0, 5)], 16, 4, 2, 64, torch.float32, "fp8")
    out = torch.full_like(args["q"], float("nan"))
    with pytest.raises(ValueError, match="warp_specialized=True"):
        paged_prefill(**args, out=out, warp_specialized=True)
    assert bool(out.isnan().all())
    unquantised = {k: v for k, v in args.items() if k not in ("k_scale", "v_scale")}
    unquantised.update(k_cache=torch.randn(args["k_cache"].shape, device=profile.DEVICE),
                       v_cache=torch.randn(args["v_cache"].shape, device=profile.DEVICE))
    with pytest.raises(ValueError, match="not quantised"):
        paged_prefill(**unquantised, out=out, warp_specialized=True)
    assert bool(out.isnan().all())


CASES = [  # (seed, [(prefix, new tokens)], num_heads, num_kv_heads, page size)
    (0, [(0, 37), (100, 200), (1000, 333), (31, 1), (16, 16)], 8, 2, 16),
    (1, [(5000, 700)], 4, 4, 16),
    (2, [(64, 64), (127, 129), (0, 300)], 32, 8, 16),
    (3, [(40, 90), (333, 17)], 8, 2, 5),
]


@needs_hopper
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_paged_prefill_ws_matches_float64_attention(kv_cache_dtype, dtype, head_dim, case):
    seed, seqs, num_heads, num_kv_heads, block_size = case
    args, _, _ = quantized_step(seed, seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, kv_cache_dtype)
    out = torch.full_like(args["q"], float("nan"))
    paged_prefill(**args, out=out, warp_specialized=True)
    assert_close(out, reference(args), dtype)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_prefill_ws_takes_contiguous_scales_too(head_dim):
    """The cases above keep the scales as the engine does, per page and KV head; a contiguous
    [block, slot, KV head] tensor is read through its strides."""
    seed, seqs, num_heads, num_kv_heads, block_size = CASES[0]
    args, _, _ = quantized_step(seed, seqs, block_size, num_heads, num_kv_heads, head_dim, torch.bfloat16, "fp8",
                                engine_layout=False)
    assert args["k_scale"].is_contiguous()
    out = torch.full_like(args["q"], float("nan"))
    paged_prefill(**args, out=out, warp_specialized=True)
    assert_close(out, reference(args), torch.bfloat16)


@needs_hopper
def test_long_chunks_over_a_quantised_cache_take_it(monkeypatch):
    args, _, _ = quantized_step(4, [(WS_MIN_SEQ_LEN, WS_MIN_QUERY_LEN), (50, 30)], 16, 8, 4, 128, torch.bfloat16,
                                "fp8")
    taken = []
    real = importlib.import_module("kvlab.kernels.paged_prefill_ws").paged_prefill_ws

    def spy(*a, **k):
        taken.append(True)
        return real(*a, **k)

    monkeypatch.setattr("kvlab.kernels.paged_prefill_ws.paged_prefill_ws", spy)
    longest = int(args["seq_lens"].max())
    got = paged_prefill(**args, max_seq_len=longest)
    assert taken, "a step over the long-prefix threshold did not take paged_prefill_ws"
    triton_kernel = paged_prefill(**args, max_seq_len=longest, warp_specialized=False)
    assert len(taken) == 1
    assert_close(got, reference(args), torch.bfloat16)
    err = float((got.float() - triton_kernel.float()).abs().max() / triton_kernel.float().abs().max())
    assert err <= TOLERANCE[torch.bfloat16]
    paged_prefill(**args, max_seq_len=WS_MIN_SEQ_LEN - 1)
    assert len(taken) == 1, "a short step took paged_prefill_ws"
    few, _, _ = quantized_step(5, [(WS_MIN_SEQ_LEN, WS_MIN_QUERY_LEN - 1)], 16, 8, 4, 128, torch.bfloat16, "fp8")
    paged_prefill(**few, max_seq_len=WS_MIN_SEQ_LEN + WS_MIN_QUERY_LEN - 1)
    assert len(taken) == 1, "a step of a few queries a sequence took paged_prefill_ws"
