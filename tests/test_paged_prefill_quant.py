"""paged_prefill over a quantised KV cache (kv_cache_dtype "fp8" / "int8"): the kernel reads the
codes and their scales and dequantises in registers.

Against float64 attention over the dequantised cache: fresh random inputs, ragged lengths around
page boundaries, shuffled block tables, GQA, with and without the step's own K/V (``k_new``/
``v_new``, which the new tokens then see exactly); every slot no sequence owns holds NaN codes
and NaN scales, and outputs go into NaN-filled buffers. Bad scales are refused before launch.
The engine's mixed steps (chunks over a cached prefix) through the Triton backend match the
reference backend on the same quantised cache.

Runs in Triton's interpreter on a CPU (head_dim 64, short sequences) and natively on a GPU
(``KVLAB_PROFILE=gpu pytest tests/test_paged_prefill_quant.py``: head_dim 64 and 128, bfloat16,
longer sequences).
"""
import importlib
import itertools
import random

import pytest
import torch

from helpers import tiny_tokenizer
from kvlab import LLM, SamplingParams, profile
from kvlab.kernels.flash_attention import paged_prefill
from kvlab.models import LlamaForCausalLM, ModelConfig, save_model
from kvlab.models import backends as backends_module
from kvlab.quantization import dequantize_kv, kv_cache_format, quantize_kv
from kvlab.paging.kv_cache import block_and_offset, per_page_and_head
from kvlab.reference import paged_attention_ref

pytestmark = pytest.mark.kv_quant
DEVICE = profile.DEVICE
BIG = profile.PROFILE == "gpu"
FORMATS = ["fp8", "int8"]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if BIG else [])
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
HEAD_DIMS = profile.pick(cpu=[64], gpu=[64, 128])
SCALE = profile.pick(cpu=1, gpu=8)              # lengths grow by this on a GPU
flash_module = importlib.import_module("kvlab.kernels.flash_attention")


def quantized_step(seed, seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, kv_cache_dtype,
                   engine_layout=True):
    """A step over a quantised paged cache: sequences ``seqs`` = [(prefix_len, query_len)], their
    pages shuffled over the pool. Slots no sequence owns hold NaN codes (int8: 127) and NaN scales.
    The scales are laid out as the engine keeps them, per page and KV head, unless
    ``engine_layout`` is False (a contiguous tensor, which the kernels take too).

    Returns ``(args, k_new, v_new)``: ``args`` the keyword arguments of paged_prefill (the scales
    included), ``k_new``/``v_new`` the new tokens' K/V before quantisation, packed like q."""
    gen = torch.Generator().manual_seed(seed)
    fmt = kv_cache_format(kv_cache_dtype)
    pages = [-(-(p + n) // block_size) for p, n in seqs]
    num_blocks = 1 + sum(pages) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    poison = 0x7F if fmt.dtype == torch.float8_e4m3fn else 127          # e4m3fn's NaN
    k_cache, v_cache = (torch.full(shape, poison, dtype=torch.uint8).view(fmt.dtype) for _ in range(2))
    k_scale, v_scale = (torch.full(shape[:3], float("nan")) for _ in range(2))
    tables = torch.zeros(len(seqs), max(pages) + 1, dtype=torch.int32)
    k_new, v_new = [], []
    for i, ((prefix, num_new), n_pages) in enumerate(zip(seqs, pages)):
        ids, free = free[:n_pages], free[n_pages:]
        tables[i, :n_pages] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(prefix + num_new)
        slots = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
        # token magnitudes spread over 1e-2 .. 1e2, so the scales differ from token to token
        size = torch.logspace(-2, 2, len(pos))[torch.randperm(len(pos), generator=gen)][:, None, None]
        for cache, scale, new in ((k_cache, k_scale, k_new), (v_cache, v_scale, v_new)):
            x = (torch.randn(len(pos), num_kv_heads, head_dim, generator=gen) * size).to(dtype)
            values, scales = quantize_kv(x, kv_cache_dtype)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values
            scale.view(-1, num_kv_heads)[slots] = scales
            new.append(x[prefix:])
    q = torch.randn(sum(n for _, n in seqs), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([p + n for p, n in seqs], dtype=torch.int32)
    query_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    if engine_layout:
        k_scale, v_scale = per_page_and_head(k_scale), per_page_and_head(v_scale)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens,
                query_lens=query_lens, k_scale=k_scale, v_scale=v_scale)
    return ({k: t.to(DEVICE) for k, t in args.items()}, torch.cat(k_new).to(DEVICE), torch.cat(v_new).to(DEVICE))


def reference(args, k_new=None, v_new=None, sm_scale=None):
    """float64 attention over the dequantised cache; with ``k_new``/``v_new`` the new tokens' own
    slots hold those exact values instead."""
    k = dequantize_kv(args["k_cache"].cpu(), args["k_scale"].cpu(), torch.float64)
    v = dequantize_kv(args["v_cache"].cpu(), args["v_scale"].cpu(), torch.float64)
    tables, seq_lens, query_lens = (args[name].cpu() for name in ("block_tables", "seq_lens", "query_lens"))
    if k_new is not None:
        row = 0
        for i, (n, m) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
            pos = torch.arange(n - m, n)
            slots = tables[i].long()[pos // k.shape[1]] * k.shape[1] + pos % k.shape[1]
            k.view(-1, *k.shape[2:])[slots] = k_new[row:row + m].cpu().double()
            v.view(-1, *v.shape[2:])[slots] = v_new[row:row + m].cpu().double()
            row += m
    return paged_attention_ref(args["q"].cpu().double(), k, v, tables, seq_lens, query_lens, causal=True,
                               sm_scale=sm_scale, dtype=torch.float64)


def spoil_new_slots(args):
    """NaN codes and scales in the new tokens' slots: a kernel reading them shows."""
    block_size = args["k_cache"].shape[1]
    for i, (n, m) in enumerate(zip(args["seq_lens"].tolist(), args["query_lens"].tolist())):
        pos = torch.arange(n - m, n)
        slots = (args["block_tables"][i].cpu().long()[pos // block_size] * block_size + pos % block_size).to(DEVICE)
        for name in ("k_cache", "v_cache"):
            args[name].view(torch.uint8).view(-1, *args[name].shape[2:])[slots] = 0x7F
        for name in ("k_scale", "v_scale"):
            args[name][block_and_offset(slots, block_size)] = float("nan")


def assert_close(got, want, dtype):
    assert not bool(got.isnan().any()), f"{int(got.isnan().sum())} NaN in the output: a row was not written"
    err = float((got.double().cpu() - want).abs().max() / want.abs().max())
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e}"


# (format, q's dtype, page size, new K/V given): on a GPU every page size and path in bf16, and
# fp16 and float32 once per format (each case compiles its own kernels: the whole product takes
# many minutes there); in the interpreter a subset in which each format meets each dtype, page
# size (whole pages per tile, or not) and path.
CASES = (list(itertools.product(FORMATS, [torch.bfloat16], [16, 5], [False, True]))
         + [(f, d, 16, True) for f in FORMATS for d in (torch.float16, torch.float32)] if BIG else
         [("fp8", torch.float32, 16, False), ("fp8", torch.float16, 5, True), ("fp8", torch.float32, 5, True),
          ("int8", torch.float32, 5, False), ("int8", torch.float16, 16, True), ("int8", torch.float32, 16, True)])


@pytest.mark.parametrize("kv_cache_dtype,dtype,block_size,new_kv", CASES, ids=[
    f"{f}-{str(d)[6:]}-page{b}-{'new-kv-given' if n else 'all-keys-paged'}" for f, d, b, n in CASES])
def test_paged_prefill_over_a_quantised_cache(kv_cache_dtype, dtype, block_size, new_kv):
    b = block_size
    seqs = [
        (0, 19 * SCALE),                          # a plain prefill, no prefix
        (b - 1, 1), (b + 1, 2),                   # short steps just around a page boundary
        (2 * b + 3, 11 * SCALE),                  # extend a prefix that ends mid-page
        (37 * SCALE, b + 1),                      # a chunk of a long prompt
    ]
    for head_dim in HEAD_DIMS:
        seed = random.Random(f"{kv_cache_dtype}{dtype}{b}{new_kv}{head_dim}").randrange(2**31)
        args, k_new, v_new = quantized_step(seed, seqs, b, 4, 2, head_dim, dtype, kv_cache_dtype)
        want = reference(args, k_new, v_new) if new_kv else reference(args)
        if new_kv:
            spoil_new_slots(args)                 # their K/V must come from k_new/v_new
        out = torch.full_like(args["q"], float("nan"))
        got = paged_prefill(**args, out=out, **(dict(k_new=k_new, v_new=v_new) if new_kv else {}))
        assert got is out
        assert_close(got, want, dtype)


@pytest.mark.parametrize("block_m,block_n", profile.pick(cpu=[(16, 32), (32, 16)], gpu=[(64, 64), (128, 128)]))
def test_tiles_larger_and_smaller_than_a_page(block_m, block_n):
    """Pages of 8 keys: a tile of keys holds several pages, or half of one; scales follow their keys
    (here from a contiguous [block, slot, KV head] tensor: the kernel follows the strides)."""
    args, _, _ = quantized_step(block_m + block_n, [(13 * SCALE, 21 * SCALE), (40 * SCALE, 3)], 8, 8, 2,
                                HEAD_DIMS[-1], torch.float32, "fp8", engine_layout=False)
    assert args["k_scale"].is_contiguous()
    out = torch.full_like(args["q"], float("nan"))
    paged_prefill(**args, out=out, sm_scale=0.3, block_m=block_m, block_n=block_n)
    assert_close(out, reference(args, sm_scale=0.3), torch.float32)


def test_the_same_as_the_kernel_on_the_dequantised_cache():
    """Codes and scales in registers give what the unquantised kernel gives on a float32 copy of
    the dequantised cache (the copy the quantised path never makes)."""
    args, _, _ = quantized_step(7, [(21, 9), (0, 17), (6, 1)], 4, 4, 1, HEAD_DIMS[0], torch.float32, "int8")
    copy = dict(args, k_cache=dequantize_kv(args["k_cache"], args["k_scale"]),
                v_cache=dequantize_kv(args["v_cache"], args["v_scale"]), k_scale=None, v_scale=None)
    got, want = paged_prefill(**args), paged_prefill(**copy)
    # the scales applied before or after the dots: float32 roundings apart, no more
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_the_plain_path_launches_without_scales(monkeypatch):
    """An unquantised cache launches the kernel with KV_QUANT off and no scale pointers (the
    quantised branch compiled away); a quantised one with both."""
    kernel, seen = flash_module.paged_prefill_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["KV_QUANT"], args[6] is None, args[7] is None))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(flash_module, "paged_prefill_kernel", Spy())
    args, _, _ = quantized_step(3, [(5, 2), (0, 3)], 4, 4, 2, HEAD_DIMS[0], torch.float32, "fp8")
    paged_prefill(**args)
    plain = dict(args, k_cache=dequantize_kv(args["k_cache"], args["k_scale"]),
                 v_cache=dequantize_kv(args["v_cache"], args["v_scale"]), k_scale=None, v_scale=None)
    paged_prefill(**plain)
    assert seen == [(True, False, False), (False, True, True)]


# -- refused arguments --------------------------------------------------------------------------------
def _bad(name):
    """Overrides of a valid fp8 step (7 blocks of 4 slots, 2 KV heads) that break one rule."""
    d = HEAD_DIMS[0]
    scale = torch.ones(7, 4, 2)
    return {
        "v_scale missing": (dict(v_scale=None), ValueError, r"quantised: v_scale \(its scales\) must be given"),
        "both missing": (dict(k_scale=None, v_scale=None), ValueError, r"quantised: k_scale \(its scales\)"),
        "scales, unquantised cache": (dict(k_cache=torch.zeros(7, 4, 2, d), v_cache=torch.zeros(7, 4, 2, d)),
                                      ValueError, "k_scale/v_scale are given but the cache is torch.float32"),
        "one scale, unquantised cache": (dict(k_cache=torch.zeros(7, 4, 2, d), v_cache=torch.zeros(7, 4, 2, d),
                                              v_scale=None), ValueError, "given but the cache is torch.float32"),
        "uint8 cache": (dict(k_cache=torch.zeros(7, 4, 2, d, dtype=torch.uint8),
                             v_cache=torch.zeros(7, 4, 2, d, dtype=torch.uint8)), ValueError,
                        "the cache is torch.uint8, not quantised"),
        "mixed formats": (dict(v_cache=torch.zeros(7, 4, 2, d, dtype=torch.int8)), ValueError, "must match"),
        "float16 scales": (dict(k_scale=scale.half()), TypeError, "k_scale must be float32"),
        "not a tensor": (dict(v_scale=[1.0] * 48), TypeError, "v_scale must be a torch.Tensor"),
        "wrong shape": (dict(k_scale=torch.ones(7, 4, 1)), ValueError,
                        r"k_scale must be a \[num_blocks, block_size, num_kv_heads\] = \[7, 4, 2\]"),
        # made on the device: moving a strided view to another device makes it contiguous
        "strided": (dict(v_scale=torch.ones(7, 4, 4, device=DEVICE)[..., ::2]), ValueError,
                    "k_scale and v_scale must share one layout"),
        "other device": (dict(k_scale=torch.ones(7, 4, 2, device="meta")), ValueError, "k_scale is on meta"),
        "float64 q": (dict(q=torch.randn(5, 4, d, dtype=torch.float64)), TypeError,
                      "q has dtype torch.float64; supported"),
    }[name]


BAD = ["v_scale missing", "both missing", "scales, unquantised cache", "one scale, unquantised cache", "uint8 cache",
       "mixed formats", "float16 scales", "not a tensor", "wrong shape", "strided", "other device", "float64 q"]


@pytest.mark.parametrize("name", BAD)
def test_bad_scales_are_refused_and_nothing_is_written(name):
    overrides, error, match = _bad(name)
    args, _, _ = quantized_step(1, [(5, 2), (0, 3)], 4, 4, 2, HEAD_DIMS[0], torch.float32, "fp8")
    assert args["k_cache"].shape == (7, 4, 2, HEAD_DIMS[0])
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
                 for k, v in overrides.items()})
    out = torch.full((5, 4, HEAD_DIMS[0]), 7.0, device=DEVICE)
    with pytest.raises(error, match=match):
        paged_prefill(**args, out=out)
    assert bool((out == 7.0).all()), "a refused call wrote to out"


# -- the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer random model (GQA 4/2 heads, head_dim 16) with the tiny BPE tokenizer."""
    tok = tiny_tokenizer()
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=tok.get_vocab_size(), hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    model.reset_parameters(std=0.2, seed=0)
    return save_model(model.eval(), tok, None, tmp_path_factory.mktemp("tiny"), dtype=torch.float32)


def test_mixed_steps_over_an_fp8_cache_match_the_reference_backend(checkpoint, monkeypatch):
    """Two prompts over a cached 24-token prefix, chunked by a 16-token step budget: mixed steps
    (3 and 13 new tokens, then 6 beside a decode). The Triton backend sends them to paged_prefill
    with the scales (no PyTorch fallback, no dequantised copy) and generates the reference
    backend's tokens on the same fp8 cache."""
    shared = [(5 * j) % 250 + 1 for j in range(24)]
    prompts = [shared + [7, 8, 9], shared + [(3 * j) % 200 + 11 for j in range(19)]]
    settings = dict(kv_cache_dtype="fp8", max_num_seqs=2, max_model_len=64, num_gpu_blocks=16, block_size=8,
                    enable_prefix_caching=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def run(backend):
        llm = LLM(checkpoint, attention_backend=backend, **settings)
        llm.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # caches the prefix
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.num_cached_tokens for o in outs] == [24, 24]
        return [o.outputs[0].token_ids for o in outs]

    want = run("reference")
    calls, real = [], flash_module.paged_prefill

    def spy(*args, **kwargs):
        calls.append((kwargs["k_scale"] is not None, kwargs["k_new"] is None, args[1].dtype))
        return real(*args, **kwargs)

    def no_fallback(*args, **kwargs):
        raise AssertionError("a quantised step fell back to the PyTorch gather")

    monkeypatch.setattr(importlib.import_module("kvlab.kernels"), "paged_prefill", spy)
    monkeypatch.setattr(backends_module, "torch_backend", no_fallback)
    assert run("triton") == want
    layers = 2
    assert len(calls) >= 2 * layers and set(calls) == {(True, True, torch.float8_e4m3fn)}
