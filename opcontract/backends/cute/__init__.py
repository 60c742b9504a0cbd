"""CuTe DSL backend (``nvidia-cutlass-dsl``). Implementations register here and are rejected
with a reason where the library, CUDA, or a supported GPU is missing."""

from __future__ import annotations

import functools


@functools.cache
def missing_library() -> str | None:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:
        return "CUTLASS DSL is not installed (pip install nvidia-cutlass-dsl)"
    return None
