"""codes_to_dot: a quantised cache's tile (fp8 e4m3 or int8 codes) to the dots' 16-bit type, in registers.

Every e4m3 and int8 value is an fp16 number, so the conversion is exact; the scales are applied
elsewhere (to a tile's column of scores or of probabilities), never to the tile itself.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


# codes_to_dot's int8 conversion, four codes at a time (its docstring says how); the Gluon kernel
# of kernels/paged_prefill_ws.py takes it too.
INT8_TO_FP16_PTX = tl.constexpr(
    "{ .reg .b32 t, m; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64806480; "
    "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
    "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }")


@triton.jit
def codes_to_dot(codes, DOT: tl.constexpr, PTX: tl.constexpr, PIN: tl.constexpr = True):
    """``codes`` converted to ``DOT``. ``PTX`` ("e4m3" or "int8" codes to fp16, on a GPU; "" for
    a plain ``.to``) converts four codes at a time in a few lines of inline PTX:

    * e4m3: the hardware's ``cvt.rn.f16x2.e4m3x2`` takes two codes an instruction;
    * int8: each code ``x`` flipped to ``x + 128`` (an xor of its sign bit) is placed under the
      byte 0x64, which makes the fp16 number ``1024 + (x + 128)``; one fp16 subtraction of 1152
      per pair leaves ``x``. Five instructions for four codes, against one conversion each.

    ``PIN``: where the conversion happens. A tile on its way to ``tl.dot`` crosses shared memory,
    and Triton moves a plain conversion of a loaded tile (``.to``, or this PTX marked pure) past
    that crossing, to the dot's operand: the tile crosses as codes, a byte each, and is converted
    as the product reads it. That suits a tile already laid out as the product wants it (K, in
    ``q @ k.T`` or ``k @ q.T``): a third of the shared-memory traffic. A tile that must be
    transposed on the way (V, in ``p @ v`` or ``v.T @ p``) does not suit it: 8-bit codes have no
    transposing ``ldmatrix`` on Hopper, so they are read back a few bytes at a time and shuffled
    into place, several instructions for every useful one. Pinned (``PIN=True``, the PTX marked
    impure), the conversion stays where it is written, right after the load, and the tile
    crosses shared memory as fp16, read by ``ldmatrix.trans`` like a 16-bit tile. Compiled for an
    H200 (sm_90), ``paged_decode``'s loop went from 1,386 to 897 instructions per warp and tile
    with fp8 codes (V pinned, K not), from 1,782 to 1,020 with int8.
    """
    if PTX == "e4m3":
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [codes], dtype=tl.float16, is_pure=not PIN, pack=4)
    elif PTX == "int8":
        return tl.inline_asm_elementwise(INT8_TO_FP16_PTX, "=r,=r,r", [codes], dtype=tl.float16, is_pure=not PIN,
                                         pack=4)
    else:
        return codes.to(DOT)


@functools.lru_cache(maxsize=16)
def _has_e4m3_cvt(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def codes_ptx(cache: torch.Tensor, dot_dtype: torch.dtype) -> str:
    """``codes_to_dot``'s ``PTX`` for a kernel reading ``cache`` into ``dot_dtype`` dots: "e4m3" or
    "int8" when the codes go to fp16 dots in a compiled kernel (e4m3: on sm_89 and later, which
    have the instruction), else "" (the interpreter runs no PTX)."""
    if not cache.is_cuda or dot_dtype != torch.float16:
        return ""
    if cache.dtype == torch.int8:
        return "int8"
    if cache.dtype == torch.float8_e4m3fn and _has_e4m3_cvt(cache.device):
        return "e4m3"
    return ""
