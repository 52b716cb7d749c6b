"""Chapter 9, given: the swap-or-recompute cost record, the launcher of the quantised write
kernel, ``use_my_quantization(llm)``, which serves an ``LLM`` with an fp8 or int8 cache
through your pieces, ``serve_beside(mine, course, ...)``, which checks what they stored step by
step, and ``use_my_preemption_mode(llm, rule)``, which lets your rule pick swap or recompute."""
from __future__ import annotations

from dataclasses import dataclass

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

        slots_written = None       # the cache slots the last step stored (for serve_beside)

        def forward(self, ids, positions, tables, starts, query_lens, slots):
            where = torch.tensor(slots, dtype=torch.int64, device=self.device)
            real = where[where >= 0]
            self.slots_written = real              # for compare_caches: what this step stored
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


# -- checking your pieces against the course's, step by step -----------------------------------
@dataclass
class SideBySide:
    """What :func:`serve_beside` found: the greedy tokens of both engines, the errors your
    engine's requests ended with, and how the codes and scales your pieces stored compare with
    the course's (``layer0_equal``: bit for bit in layer 0, whose K/V come from the token ids
    alone; ``later_share``: the share of identical codes in the other layers, whose inputs went
    through attention over your dequantised cache)."""

    my_tokens: list[list[int]]
    course_tokens: list[list[int]]
    errors: list[str]
    slots_checked: int
    layer0_equal: bool
    later_share: float
    first_difference: str | None


def _stored(kv_cache, layer: int, slots: torch.Tensor, where) -> tuple:
    """Layer ``layer``'s K codes, V codes, K scales and V scales at ``slots`` (``where``: their
    ``block_and_offset``)."""
    return (kv_cache.k[layer].flatten(0, 1)[slots], kv_cache.v[layer].flatten(0, 1)[slots],
            kv_cache.k_scale[layer][where], kv_cache.v_scale[layer][where])


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns, so that NaN equals NaN and -0.0 differs from 0.0."""
    return x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int32)


def _difference(mine, course, slots: torch.Tensor, block_size: int) -> str | None:
    """The first element where layer 0's ``mine`` and ``course`` (from :func:`_stored`) differ, in words."""
    for name, a, b in zip(("K codes", "V codes", "K scales", "V scales"), mine, course):
        same = _bits(a) == _bits(b)
        if not bool(same.all()):
            bad = (~same).nonzero()[0].tolist()
            slot = int(slots[bad[0]])
            where = f"layer 0, slot {slot} (block {slot // block_size}, offset {slot % block_size}), KV head {bad[1]}"
            if len(bad) == 3:
                where += f", position {bad[2]}"
            mine_value, course_value = float(a[tuple(bad)].float()), float(b[tuple(bad)].float())
            return f"{name} differ at {where}: {mine_value!r} where the course's is {course_value!r}"
    return None


def serve_beside(mine, course, prompts, sampling_params) -> SideBySide:
    """Serve ``prompts`` on ``mine`` (an ``LLM`` that :func:`use_my_quantization` set up) and on
    ``course`` (an ``LLM`` with the same settings), one step each in turn, and after every step
    compare the codes and scales ``mine`` stored with those the course's engine stored in the same
    slots (both engines book the same blocks for the same requests)."""
    runner = mine.model_runner
    if not hasattr(runner, "slots_written"):
        raise ValueError("serve_beside: `mine` must be an LLM that use_my_quantization set up with a piece of yours")
    mine_cache, course_cache = runner.kv_cache, course.model_runner.kv_cache
    ids = [(mine.add_request(p, sampling_params), course.add_request(p, sampling_params)) for p in prompts]
    done_mine, done_course, checked, same, total, first = {}, {}, 0, 0, 0, None
    while mine.has_unfinished_requests() or course.has_unfinished_requests():
        runner.slots_written = None
        for llm, done in ((mine, done_mine), (course, done_course)):
            done.update((o.request_id, o) for o in llm.step() if o.finished)
        slots = runner.slots_written
        if slots is None or not slots.numel():
            continue
        checked += slots.numel()
        where = block_and_offset(slots, mine_cache.block_size)
        first = first or _difference(_stored(mine_cache, 0, slots, where), _stored(course_cache, 0, slots, where),
                                     slots, mine_cache.block_size)
        for layer in range(1, mine_cache.num_layers):          # the codes of the later layers, counted
            for a, b in zip(_stored(mine_cache, layer, slots, where)[:2], _stored(course_cache, layer, slots, where)[:2]):
                same += int((_bits(a) == _bits(b)).sum())
                total += a.numel()
    errors = [f"request {m}: {done_mine[m].error}" for m, _ in ids if done_mine[m].error]
    return SideBySide([list(done_mine[m].outputs[0].token_ids) for m, _ in ids],
                      [list(done_course[c].outputs[0].token_ids) for _, c in ids],
                      errors, checked, first is None and checked > 0, same / total if total else 0.0, first)


# -- your preemption_mode in the engine ---------------------------------------------------------
def use_my_preemption_mode(llm, rule) -> list[tuple[int, str]]:
    """Let ``rule`` (your ``preemption_mode(num_tokens, bytes_per_token, costs, host_free_bytes)``)
    pick swap or recompute for every sequence ``llm``'s scheduler preempts. ``llm`` needs
    ``swap_space`` and ``preemption_mode="auto"``. Returns a list that fills as the engine runs:
    ``(num_tokens, choice)`` per call. A rule that raises, or answers anything but ``"swap"`` or
    ``"recompute"``, is recorded as ``(num_tokens, "error: ...")`` and the sequence recomputes,
    so the engine serves on."""
    scheduler = llm.scheduler
    if scheduler.host_blocks is None or scheduler.preemption_mode != "auto":
        raise ValueError("use_my_preemption_mode needs an LLM with swap_space > 0 and preemption_mode='auto'")
    choices: list[tuple[int, str]] = []

    def choose(num_tokens, bytes_per_token, costs, host_free_bytes):
        try:
            choice = rule(num_tokens, bytes_per_token, costs, host_free_bytes)
        except Exception as err:  # noqa: BLE001  (a learner's rule: report it, keep serving)
            choices.append((num_tokens, f"error: {type(err).__name__}: {err}"))
            return "recompute"
        if choice not in ("swap", "recompute"):
            choices.append((num_tokens, f"error: returned {choice!r}, not 'swap' or 'recompute'"))
            return "recompute"
        choices.append((num_tokens, choice))
        return choice

    scheduler.choose_preemption_mode = choose
    return choices
