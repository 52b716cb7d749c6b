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
