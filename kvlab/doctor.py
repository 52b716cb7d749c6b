"""``kvlab check``: is this machine ready for the course?"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import platform
from pathlib import Path

import torch

from kvlab import profile

PACKAGES = ["torch", "triton", "numpy", "matplotlib", "ipywidgets", "jupyterlab", "jupyterlab_widgets"]


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def widget_extension_installed() -> bool:
    """JupyterLab's widget manager must be installed for step-through sliders to render."""
    try:
        from jupyter_core.paths import jupyter_path
    except ImportError:
        return False
    return any((Path(d) / "@jupyter-widgets" / "jupyterlab-manager").is_dir() for d in jupyter_path("labextensions"))


def triton_smoke_test() -> tuple[bool, str]:
    """Run a tiny kernel on random data and compare with torch: catches an interpreter that
    silently returns zeros, or a GPU toolchain that cannot compile."""
    try:
        from kvlab.kernels.vector_add import add

        x = torch.randn(1000, device=profile.DEVICE)
        y = torch.randn(1000, device=profile.DEVICE)
        out = add(x, y)
        err = (out - (x + y)).abs().max().item()
        return err == 0.0, f"max |error| = {err:g}"
    except Exception as e:  # report, don't crash: this is a diagnostic
        return False, f"{type(e).__name__}: {e}"


def doctor(verbose: bool = True) -> bool:
    lines, ok = [], True

    def row(label, value, good=True):
        nonlocal ok
        ok &= good
        lines.append(f"  {'ok ' if good else 'BAD'}  {label:<22} {value}")

    row("python", platform.python_version())
    for name in PACKAGES:
        version = _version(name)
        row(name, version, version != "missing")
    row("profile", profile.PROFILE + ("  (KVLAB_PROFILE)" if os.environ.get("KVLAB_PROFILE") else ""))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        row("gpu", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    else:
        row("gpu", "none: Triton kernels run in the CPU interpreter")
    row("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "unset"),
        profile.INTERPRETED == (profile.PROFILE == "cpu"))
    good, detail = triton_smoke_test()
    row("triton kernel vs torch", detail, good)
    row("widget extension", "installed" if widget_extension_installed() else "missing (sliders won't render)",
        widget_extension_installed())
    if verbose:
        print("kvlab environment check")
        print("\n".join(lines))
        print("all good" if ok else "some checks failed: see the BAD lines")
    return ok
