"""Chapter 9, given: the swap-or-recompute cost record, the launcher of the quantised write
kernel, and ``use_my_quantization(llm)``, which serves an ``LLM`` with an fp8 or int8 cache
through your pieces."""
from __future__ import annotations

import kvlab  # noqa: F401  (before triton: picks the CPU interpreter when there is no GPU)
import torch

from kvlab.kernels.write_kv_quant import launch_write_kv_quantized
from kvlab.paging.kv_cache import block_and_offset
from kvlab.quantization import QUANTIZED_DTYPES
from kvlab.scaffold import check_pieces, is_written
# The engine's cost record (kvlab/engine/offload.py): what preempting a sequence costs, either way.
from kvlab.engine.offload import PreemptionCosts  # noqa: E402,F401


# -- write_kernel ------------------------------------------------------------------------------
def kv_cache_dtype_of(cache: torch.Tensor) -> str:
    """``"fp8"`` or ``"int8"``: the ``kv_cache_dtype`` of a quantised cache tensor."""
    if cache.dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"not a quantised cache: dtype {cache.dtype}")
    return QUANTIZED_DTYPES[cache.dtype].name


def write_kv_quantized_with(write_kv_quantized_kernel):
    """``write_kv_quantized(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)``,
    launching ``write_kv_quantized_kernel`` as ``kvlab.kernels.write_kv_quantized`` launches the
    course's: one program per token, the format's ``QMAX`` and ``FP8`` as constants."""

    def write_kv_quantized(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        """Launch the kernel: key/value ``[num_tokens, num_kv_heads, head_dim]`` (rows may be
        strided) into the fp8 or int8 caches and their float32 scales."""
        launch_write_kv_quantized(write_kv_quantized_kernel, key, value, k_cache, v_cache, k_scale, v_scale,
                                  slot_mapping)

    return write_kv_quantized


# -- your pieces in the engine -----------------------------------------------------------------
PIECES = ("quantize", "write_kernel")


def scatter_with(quantize_kv):
    """A write of a step's K/V into a quantised cache made of your ``quantize_kv``: each token's
    codes and scales go to its slot (-1: nothing), as the engine's PyTorch write does."""

    def write(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        for x, cache, scales, name in ((key[keep], k_cache, k_scale, "K"), (value[keep], v_cache, v_scale, "V")):
            codes, scale = quantize_kv(x, kv_cache_dtype_of(cache))
            if codes.dtype != cache.dtype or codes.shape != x.shape or tuple(scale.shape) != tuple(x.shape[:-1]):
                raise ValueError(f"quantize_kv of {name} {list(x.shape)} returned codes {codes.dtype} "
                                 f"{list(codes.shape)} and scales {list(scale.shape)}; the cache wants codes "
                                 f"{cache.dtype} {list(x.shape)} and scales {list(x.shape[:-1])}")
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, codes.view(torch.uint8))
            scales[block_and_offset(slots, scales.shape[1])] = scale.float()

    return write


def forget_slots(k_cache, v_cache, k_scale, v_scale, slots) -> None:
    """Wipe ``slots`` of one layer: scales NaN, fp8 values NaN (byte 0x7F), so that a row nobody
    writes again poisons every attention that reads it."""
    for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)):
        scales[block_and_offset(slots, scales.shape[1])] = float("nan")
        if cache.dtype == torch.float8_e4m3fn:
            cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots] = 0x7F


def runner_with(write=None, dequantize_kv=None):
    """The class ``RunnerWithMyQuantization``: the engine's ``ModelRunner`` whose steps write
    every layer's new K/V with ``write`` (your ``quantize_kv`` or your kernel) and, with your
    ``dequantize_kv``, read the cache through it (None: the engine's own)."""
    from kvlab.engine.model_runner import ModelRunner
    from kvlab.models.context import build_attention_context

    class RunnerWithMyQuantization(ModelRunner):
        """kvlab's ``ModelRunner`` with your quantised write and read in every step (given).

        Each layer computes the step's new K and V and the engine writes them quantised. The
        attention is then wrapped: it wipes those slots (scales NaN) and has your write store them
        again, so every code and scale the model reads is one yours wrote; with your
        ``dequantize_kv`` the layer's cache is dequantised by it and attended as plain floats.
        Steps run eagerly."""

        def forward(self, ids, positions, tables, starts, query_lens, slots):
            where = torch.tensor(slots, dtype=torch.int64, device=self.device)
            real = where[where >= 0]
            engine_attention = self.backend

            def write_then_attend(q, k_cache, v_cache, block_tables, seq_lens, query_lens, sm_scale, *,
                                  k_new, v_new, k_scale, v_scale):
                if write is not None:
                    forget_slots(k_cache, v_cache, k_scale, v_scale, real)
                    write(k_new, v_new, k_cache, v_cache, k_scale, v_scale, where)
                if dequantize_kv is None:
                    return engine_attention(q, k_cache, v_cache, sm_scale, ctx, k_new=k_new, v_new=v_new,
                                            k_scale=k_scale, v_scale=v_scale)
                k_plain, v_plain = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
                return engine_attention(q, k_plain.to(q.dtype), v_plain.to(q.dtype), sm_scale, ctx,
                                        k_new=k_new, v_new=v_new)

            ctx = build_attention_context(self.kv_cache, tables, starts, query_lens, slots,
                                          backend=write_then_attend)
            as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
            return self.model(as_tensor(ids), as_tensor(positions), ctx)

    RunnerWithMyQuantization.__qualname__ = "RunnerWithMyQuantization"
    return RunnerWithMyQuantization


def my_quantization_user(quantize_kv, dequantize_kv, write_kv_quantized):
    """The function ``use_my_quantization``, bound to one implementation's pieces."""

    def probe_quantize():
        x = torch.ones(1, 1, 2)
        dequantize_kv(*quantize_kv(x, "fp8"))

    def probe_kernel():
        from kvlab.profile import DEVICE

        row = torch.ones(1, 1, 2, device=DEVICE)
        cache = torch.zeros(1, 2, 1, 2, dtype=torch.float8_e4m3fn, device=DEVICE)
        scales = torch.zeros(1, 2, 1, device=DEVICE)
        write_kv_quantized(row, row, cache, cache.clone(), scales, scales.clone(),
                           torch.zeros(1, dtype=torch.int64, device=DEVICE))

    probes = {"quantize": probe_quantize, "write_kernel": probe_kernel}

    def use_my_quantization(llm, pieces=None) -> list[str]:
        """Serve ``llm`` (made with ``kv_cache_dtype="fp8"`` or ``"int8"``) with your ``pieces``;
        returns those it runs (the others stay kvlab's).

        ``pieces``: a subset of ``PIECES``; by default every one you have written (one that still
        raises ``NotImplementedError`` stays kvlab's). ``quantize``: your ``quantize_kv`` writes
        every layer's new K/V and your ``dequantize_kv`` reads the cache back; ``write_kernel``:
        your kernel writes them instead (in Triton's interpreter on a CPU: keep the generation
        small). ``llm`` must have no request queued."""
        if pieces is None:
            pieces = [name for name, probe in probes.items() if is_written(probe)]
        check_pieces(pieces, PIECES)
        if llm.has_unfinished_requests():
            raise RuntimeError("use_my_quantization: the runner can only be replaced while no request is queued")
        c = llm.engine_config
        if c.kv_cache_dtype not in ("fp8", "int8"):
            raise ValueError(f"use_my_quantization needs an LLM with kv_cache_dtype 'fp8' or 'int8', "
                             f"got {c.kv_cache_dtype!r}")
        if pieces:
            r = llm.model_runner
            settings = dict(block_size=r.block_size, num_gpu_blocks=r.num_blocks, max_model_len=r.max_model_len,
                            attention_backend=r.backend, enforce_eager=True, kv_cache_dtype=r.kv_cache_dtype)
            llm.model_runner = r = None           # the old cache goes before the new one is made
            write = (write_kv_quantized if "write_kernel" in pieces
                     else scatter_with(quantize_kv) if "quantize" in pieces else None)
            runner = runner_with(write, dequantize_kv if "quantize" in pieces else None)
            llm.model_runner = runner(llm.model, **settings)
        return [name for name in PIECES if name in pieces]

    return use_my_quantization
