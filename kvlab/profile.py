"""The two profiles of the course, and the switch between them.

* ``gpu``: a CUDA GPU is present; Triton kernels compile natively and notebooks use
  realistic sizes.
* ``cpu``: no GPU (a laptop, a workshop machine, CI). Triton kernels run in Triton's CPU
  interpreter (``TRITON_INTERPRET=1``) on the same code path, and notebooks shrink their
  sizes so every cell runs in seconds.

``KVLAB_PROFILE=cpu|gpu`` forces a profile. The interpreter switch must be set before
``triton`` is imported, which is why :mod:`kvlab` imports this module first.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

PROFILES = ("cpu", "gpu")


def _detect() -> str:
    forced = os.environ.get("KVLAB_PROFILE", "").strip().lower()
    if forced:
        if forced not in PROFILES:
            raise ValueError(f"KVLAB_PROFILE must be one of {PROFILES}, got {forced!r}")
        if forced == "gpu" and not torch.cuda.is_available():
            raise RuntimeError("KVLAB_PROFILE=gpu but torch sees no CUDA device")
        return forced
    return "gpu" if torch.cuda.is_available() else "cpu"


PROFILE: str = _detect()
DEVICE: str = "cuda" if PROFILE == "gpu" else "cpu"

if PROFILE == "cpu" and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        warnings.warn(
            "triton was imported before kvlab on a machine without a GPU: set "
            "TRITON_INTERPRET=1 before importing triton, or import kvlab first",
            stacklevel=2,
        )
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_scalars_as_indices() -> None:
    """Let computed loop bounds work in the interpreter of older Tritons with NumPy >= 2.4.

    The interpreter keeps a scalar in a one-element array. Triton 3.6 turns it into a Python
    index with ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be
    converted to Python scalars"), so ``range(0, end, BLOCK_N)`` with a computed ``end`` fails;
    later Tritons squeeze the array first. This does the same for the older ones.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:      # no Triton on this platform: nothing to interpret
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_scalars", False):
        return

    def patch_tensor_squeezing(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_squeezing.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_tensor_squeezing


if INTERPRETED:
    _interpreter_scalars_as_indices()


def resolve(profile: str | None = None) -> str:
    """The profile a notebook should size itself for: ``profile`` if given, else the machine's.

    A notebook may ask for ``"cpu"`` sizes on a GPU machine; it may not ask for ``"gpu"``
    sizes without a GPU.
    """
    if profile is None:
        return PROFILE
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES} or None, got {profile!r}")
    if profile == "gpu" and PROFILE != "gpu":
        raise ValueError("profile='gpu' needs a CUDA device; this machine runs the cpu profile")
    return profile


def pick(cpu, gpu, profile: str | None = None):
    """``gpu`` under the gpu profile, else ``cpu``: ``n = pick(cpu=256, gpu=32_768)``."""
    return gpu if resolve(profile) == "gpu" else cpu


def describe() -> str:
    """One line saying what produced a notebook's outputs: the profile, the device, how Triton runs."""
    device = DEVICE
    if DEVICE == "cuda":
        import torch

        device = f"cuda ({torch.cuda.get_device_name(0)})"
    triton = "Triton interpreter (CPU)" if INTERPRETED else "Triton compiled"
    return f"profile {PROFILE}, device {device}, {triton}"
