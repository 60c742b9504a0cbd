"""Triton backend. Kernels (``*_kernels.py``) hold no host logic; host wrappers own shapes,
grids and allocation and launch through ``launch.py`` (pinned compile options, compiled-handle
launches); ``register.py`` declares what each implementation does."""

from __future__ import annotations

import functools
import os

# Compile options every launch passes. FMA contraction is part of the kernels' arithmetic
# (their comments say where a product and an add fuse), so it is pinned rather than left to
# Triton's default, which Triton 3.10 turns off.
LAUNCH = {"enable_fp_fusion": True}


@functools.cache
def missing_library() -> str | None:
    """Why Triton can't be used at all here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    return None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def device_reason(device) -> str | None:
    """Triton runs on CUDA GPUs, and on the CPU only under TRITON_INTERPRET=1."""
    if device.type == "cpu" and not interpreting():
        return "Triton kernels need a CUDA GPU (TRITON_INTERPRET=1 runs them on the CPU)"
    return None
