"""Every Triton launch in the host wrappers goes through ``launch``, which passes the pinned
compile options (LAUNCH: the kernels' bits depend on FMA contraction, which must not follow
Triton's default) and, after a specialization's first launch, uses its compiled handle."""

import ast
from pathlib import Path

import pytest
import torch

import opcontract.backends.triton as triton_backend
from opcontract.backends.triton import launch as launch_mod

_DIR = Path(triton_backend.__file__).parent
HOSTS = sorted(p for p in _DIR.glob("*.py") if not p.name.endswith("_kernels.py"))


def _kernel_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _scan():
    """(launch(...) calls, direct <...>_kernel[grid](...) calls) over the host wrappers."""
    through, direct = [], []
    for path in HOSTS:
        if path.name == "launch.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Subscript) and _kernel_name(node.func.value).endswith(
                "_kernel"
            ):
                direct.append(f"{path.name}:{node.lineno}")
            elif _kernel_name(node.func) == "launch" and node.args:
                through.append((path.name, _kernel_name(node.args[0])))
    return through, direct


def test_launch_options_pin_fp_fusion():
    assert triton_backend.LAUNCH == {"enable_fp_fusion": True}


def test_every_host_launch_goes_through_launch():
    through, direct = _scan()
    assert not direct, direct
    assert len(through) >= 14  # the scan sees the launches (dense_gemm, norms, softcap, swiglu)
    # a kernel by name, or ``kernel`` from a launch description (kernel, grid, args, meta)
    assert all(name.endswith("_kernel") or name == "kernel" for _, name in through), through


def test_launch_passes_the_pinned_options(monkeypatch):
    seen = {}

    class Fake:
        def __getitem__(self, grid):
            def run(*args, **meta):
                seen.update(grid=grid, args=args, meta=meta)

            return run

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch_mod.launch(Fake(), (3,), 1, 2, BLOCK=4, num_warps=2)
    assert seen == {
        "grid": (3,),
        "args": (1, 2),
        "meta": {"enable_fp_fusion": True, "BLOCK": 4, "num_warps": 2},
    }


def test_plan_reads_names_constexprs_and_defaults():
    from opcontract.backends.triton import dense_gemm_kernels as gk

    names, name_set, constexpr, defaults = launch_mod._plan(gk._add_partials_kernel)
    assert names[:3] == ("parts_ptr", "c_ptr", "bias_ptr")
    assert name_set == frozenset(names)
    assert dict(zip(names, constexpr, strict=True)) == {
        "parts_ptr": False,
        "c_ptr": False,
        "bias_ptr": False,
        "total": False,
        "N": False,
        "n_chunks": False,
        "stride_chunk": False,
        "BIAS": True,
        "BLOCK": True,
        "UNROLL": True,
    }
    assert defaults == {}


def test_key_is_at_least_as_fine_as_tritons_specialization():
    def key(*args, **meta):
        return launch_mod._key(
            test_key_is_at_least_as_fine_as_tritons_specialization, 0, args, meta
        )

    base = torch.zeros(64, dtype=torch.float32)
    assert key(base) != key(base[1:])  # 16-byte alignment
    assert key(base) != key(base.to(torch.float16))  # dtype
    assert key(base) == key(torch.ones(64))  # a tensor's values don't select a kernel
    ints = {key(v) for v in (1, 16, 17, 32, 2**31, 2**63, True)}
    assert len(ints) == 7  # ints by value, and True is not 1
    assert key(0.5) == key(2.0)  # a float runtime argument is float32
    assert key(1.0) != key(1)
    assert key(BLOCK=4) != key(BLOCK=8)  # constexprs and options by value
    assert key(base, num_warps=4) != key(base, num_warps=8)


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled_copy_kernel(x_ptr, y_ptr, n, scale, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, x * scale + OFFSET, mask=ok)

    return _scaled_copy_kernel


@pytest.mark.gpu
def test_compiled_handle_launch_matches_the_jit():
    """Second launches of a specialization take the compiled handle; every combination of
    alignment, size class and constexpr gives what the JIT's own launch gives."""
    kernel = _copy_kernel()
    launch_mod.clear()
    base = torch.randn(4096 + 1, device="cuda")
    for offset in (0, 1):
        for n in (1, 16, 17, 4096):
            for c in (0, 3):
                x = base[offset : offset + n]
                grid = (-(-n // 256),)
                want = torch.empty_like(x)
                kernel[grid](x, want, n, 0.5, OFFSET=c, BLOCK=256, enable_fp_fusion=True)
                for _ in range(2):  # the first through the JIT, the second by handle
                    got = torch.full_like(x, float("nan"))
                    launch_mod.launch(kernel, grid, x, got, n, 0.5, OFFSET=c, BLOCK=256)
                    torch.cuda.synchronize()
                    assert torch.equal(got, want), (offset, n, c)
    assert len(launch_mod._COMPILED) >= 2 * 3 * 2  # alignments x size classes x constexprs
    assert launch_mod._DIRECT_OK  # this Triton's launcher took the direct call


class _FakeCompiled:
    """A compiled kernel's handle: records launches through its launcher (direct) and its
    runner; ``accepts`` decides whether the launcher takes the direct call's arguments."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, log: list, accepts: bool = True) -> None:
        self.log, self.accepts = log, accepts

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, exit_, *values):
        if not self.accepts:
            raise TypeError("launcher takes other arguments")
        self.log.append(("direct", (gx, gy, gz), stream, values))

    def __getitem__(self, grid):
        return lambda *values, stream: self.log.append(("runner", grid, stream, values))


class _FakeKernel:
    """A @triton.jit function as launch() sees it: fn (for the signature) and [grid](...)."""

    def __init__(self, compiled: _FakeCompiled) -> None:
        self.compiled = compiled

        def fn(x_ptr, n, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = 7):  # noqa: F821
            pass

        self.fn = fn

    def __getitem__(self, grid):
        def jit(*args, **meta):
            self.compiled.log.append(("jit", grid, args, meta))
            return self.compiled

        return jit


@pytest.fixture
def fake_gpu(monkeypatch):
    """launch()'s cache path on a CPU: a current device and stream, compiled kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    monkeypatch.setattr(launch_mod, "_DIRECT_OK", True)
    launch_mod.clear()
    yield
    launch_mod.clear()


@pytest.mark.parametrize("accepts", [True, False])
def test_repeat_launches_use_the_compiled_handle(fake_gpu, accepts):
    """The first launch of a specialization goes through the JIT (with the pinned options);
    the next ones call the launcher directly with every parameter in signature order
    (defaults filled in), or through the runner where the launcher takes other arguments;
    a new specialization (alignment, constexpr) goes through the JIT again."""
    log: list = []
    kernel = _FakeKernel(_FakeCompiled(log, accepts))
    x = torch.zeros(64)
    launch_mod.launch(kernel, (3,), x, 10, 0.5, BLOCK=4, num_warps=2)
    assert log.pop() == (
        "jit",
        (3,),
        (x, 10, 0.5),
        {"enable_fp_fusion": True, "BLOCK": 4, "num_warps": 2},
    )
    launch_mod.launch(kernel, (5,), x, 10, 0.25, BLOCK=4, num_warps=2)
    how, grid, stream, values = log.pop()
    assert how == ("direct" if accepts else "runner")
    assert grid == (5, 1, 1) and stream == 1234
    assert values[:3] == (x, 10, 0.25) and values[3:] == (4, 7)  # BLOCK, FLAG's default
    assert launch_mod._DIRECT_OK is accepts
    launch_mod.launch(kernel, (5,), x[1:], 10, 0.25, BLOCK=4, num_warps=2)
    assert log.pop()[0] == "jit"  # another alignment
    launch_mod.launch(kernel, (5,), x, 10, 0.25, BLOCK=8, num_warps=2)
    assert log.pop()[0] == "jit"  # another constexpr


def test_launch_hooks_and_unhashable_arguments_take_the_safe_path(fake_gpu, monkeypatch):
    """With a launch hook installed (a profiler) the runner launches, so the hook sees the
    launch; an unhashable argument (a TensorDescriptor) always goes through the JIT; a
    tensor passed by name is refused (it would be keyed by identity)."""
    from triton import knobs

    log: list = []
    kernel = _FakeKernel(_FakeCompiled(log))
    x = torch.zeros(64)
    launch_mod.launch(kernel, (1,), x, 1, 1.0, BLOCK=4)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch_mod.launch(kernel, (1,), x, 1, 1.0, BLOCK=4)
    assert log[-1][0] == "runner"
    for _ in range(2):
        launch_mod.launch(kernel, (1,), [x], 1, 1.0, BLOCK=4)
        assert log[-1][0] == "jit"
    with pytest.raises(TypeError, match="positionally"):
        launch_mod.launch(kernel, (1,), x, 1, 1.0, BLOCK=4, FLAG=x)
