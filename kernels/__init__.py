"""The course's Triton kernels (installed as ``kvlab.kernels``).

Import :mod:`kvlab` before triton: on a machine without CUDA it switches Triton to its CPU
interpreter, so these kernels run everywhere on the same code path.
"""
import kvlab  # noqa: F401  (sets the profile before triton is imported)
from kvlab.kernels.activation import silu_and_mul
from kvlab.kernels.copy_blocks import copy_blocks
from kvlab.kernels.flash_attention import flash_attention, paged_prefill
from kvlab.kernels.matvec import matvec
from kvlab.kernels.paged_decode import paged_decode
from kvlab.kernels.rms_norm import rms_norm
from kvlab.kernels.rotary import rotary_write_kv
from kvlab.kernels.write_kv import write_kv
from kvlab.kernels.write_kv_quant import write_kv_quantized

__all__ = ["copy_blocks", "flash_attention", "matvec", "paged_decode", "paged_prefill", "rms_norm", "rotary_write_kv",
           "silu_and_mul", "write_kv", "write_kv_quantized"]
