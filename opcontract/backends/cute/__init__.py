"""CuTe DSL backend (``nvidia-cutlass-dsl``). Implementations register here and are rejected
with a reason where the library, CUDA, or a supported GPU is missing."""

from __future__ import annotations

import functools

# The versions the CuTe implementations were verified with on the H200 (conformance, bits
# against Triton): what ``pip install "opcontract[cute]"`` installs (pyproject pins the same).
TESTED = {
    "nvidia-cutlass-dsl": "4.8.1",
    "nvidia-cutlass-dsl-libs-base": "4.8.1",
    "nvidia-cutlass-dsl-libs-core": "4.8.1",
    "nvidia-cutlass-dsl-libs-cu12": "4.8.1",
    "apache-tvm-ffi": "0.1.15.post2",
}
INSTALL = 'pip install "opcontract[cute]"'


@functools.cache
def missing_library() -> str | None:
    """Why the CuTe implementations are skipped here (the install line to fix it), or None."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:
        return (
            "CUTLASS DSL is not installed: the CuTe implementations are skipped "
            f"({INSTALL} installs nvidia-cutlass-dsl {TESTED['nvidia-cutlass-dsl']} and "
            f"apache-tvm-ffi {TESTED['apache-tvm-ffi']}, the versions tested)"
        )
    return None
