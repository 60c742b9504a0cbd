"""Every Triton launch in the host wrappers passes the pinned compile options (LAUNCH): the
kernels' bits depend on FMA contraction, which must not follow Triton's default."""

import ast
from pathlib import Path

import opcontract.backends.triton as triton_backend

_DIR = Path(triton_backend.__file__).parent
HOSTS = sorted(p for p in _DIR.glob("*.py") if not p.name.endswith("_kernels.py"))


def _launches(tree: ast.AST):
    """Calls of the form ``<...>_kernel[grid](...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            target = node.func.value
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if name.endswith("_kernel"):
                yield node


def test_launch_options_pin_fp_fusion():
    assert triton_backend.LAUNCH == {"enable_fp_fusion": True}


def test_every_host_launch_passes_the_pinned_options():
    found, missing = 0, []
    for path in HOSTS:
        for call in _launches(ast.parse(path.read_text())):
            found += 1
            pinned = any(
                k.arg is None and isinstance(k.value, ast.Name) and k.value.id == "LAUNCH"
                for k in call.keywords
            )
            if not pinned:
                missing.append(f"{path.name}:{call.lineno}")
    assert found >= 15  # the scan sees the launches (dense_gemm, norms, softcap, swiglu)
    assert not missing, missing
