"""The CuTe DSL backend: its dense_gemm declaration and rejections everywhere (CPU), its
numerics on an SM90 GPU with nvidia-cutlass-dsl installed (marked gpu)."""

import dataclasses
import importlib.util
import sys

import pytest
import torch

from opcontract import NoBackendError, dispatch
from opcontract.backends import registry
from opcontract.backends.cute import missing_library
from opcontract.contracts import get_contract
from opcontract.dispatch.device import simulate
from opcontract.dispatch.select import call_info
from opcontract.dispatch.validate import bind, signature

HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
MUSE_NK = [(8704, 6656), (6656, 4096), (39936, 6656), (6656, 19968)]


def _xwb(M=5, K=72, N=24, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(dtype).to(device) for s in ((M, K), (N, K), (N,))]


def _impl():
    return registry.implementation("cute.gemm")


def _call(dtype=torch.bfloat16):
    return call_info(bind(signature("dense_gemm"), tuple(_xwb(dtype=dtype)), {}))


def test_registered_without_importing_cutlass():
    impl = _impl()
    assert impl.backend == "cute" and impl.op == "dense_gemm"
    assert impl.devices == ("cuda",) and impl.dtypes == ("bfloat16", "float16")
    assert impl.capability == ((9, 0), (9, 0))
    # preferred to Triton wherever it can serve (SM90, 16-bit floats, library installed)
    assert impl.priority["cuda"] > registry.implementation("triton.gemm").priority["cuda"]
    assert registry.declaration_problems(impl, get_contract("dense_gemm")) == []
    if not HAVE_CUTLASS:
        assert "cutlass" not in sys.modules


def test_rejected_with_a_reason_on_cpu_and_simulated_gpus():
    x, w, b = _xwb()
    with simulate((9, 0), name="H200"):
        r = dispatch.explain("dense_gemm", x, w, b)
    assert r.implementation == ("cute.gemm" if HAVE_CUTLASS else "triton.gemm")
    if HAVE_CUTLASS:
        assert "cute.gemm" in r.accepted
    else:
        assert "CUTLASS DSL is not installed" in r.rejected["cute.gemm"]
    with simulate((8, 0), name="A100"):
        r = dispatch.explain("dense_gemm", x, w, b)
    assert r.implementation == "triton.gemm"
    assert ("this GPU is SM80" if HAVE_CUTLASS else "CUTLASS DSL") in r.rejected["cute.gemm"]
    with simulate((9, 0)):
        r = dispatch.explain("dense_gemm", *_xwb(dtype=torch.float32))
    assert "cute.gemm" in r.rejected and r.implementation == "triton.gemm"


def test_selected_on_sm90_where_the_library_is_present(monkeypatch):
    present = dataclasses.replace(_impl(), available=lambda: None)
    monkeypatch.setitem(registry._REGISTRY, "cute.gemm", present)
    x, w, b = _xwb()
    with simulate((9, 0), name="H200"):
        r = dispatch.explain("dense_gemm", x, w, b)
        assert r.implementation == "cute.gemm" and "triton.gemm" in r.accepted
        r = dispatch.explain("dense_gemm", *_xwb(dtype=torch.float32))
        assert r.implementation == "triton.gemm"  # float32: CuTe declares 16-bit floats only
    with simulate((10, 0), name="B200"):
        assert dispatch.explain("dense_gemm", x, w, b).implementation == "triton.gemm"


def test_each_constraint_has_its_own_reason():
    """With the library taken as present: CPU, SM80, SM100 and float32 each say why."""
    c = get_contract("dense_gemm")
    impl = dataclasses.replace(_impl(), available=lambda: None)
    call = _call()
    assert "runs on cuda, not cpu" in registry.rejection(impl, c, call, "strict")
    for cap in ((8, 0), (10, 0)):
        dev = registry.DeviceInfo("cuda", cap, "sim")
        why = registry.rejection(impl, c, dataclasses.replace(call, device=dev), "strict")
        assert f"this GPU is SM{cap[0]}{cap[1]}" in why
    h200 = registry.DeviceInfo("cuda", (9, 0), "H200")
    assert registry.rejection(impl, c, dataclasses.replace(call, device=h200), "strict") is None
    f32 = dataclasses.replace(_call(torch.float32), device=h200)
    assert "not float32" in registry.rejection(impl, c, f32, "strict")


def test_missing_library_reason():
    if HAVE_CUTLASS:
        assert missing_library() is None
    else:
        assert 'skipped (pip install "opcontract[cute]" installs' in missing_library()
        x, w, b = _xwb()
        with simulate((9, 0), name="H200"):
            text = str(dispatch.explain("dense_gemm", x, w, b))
        assert (
            "rejected cute.gemm: CUTLASS DSL is not installed: the CuTe implementations are "
            'skipped (pip install "opcontract[cute]"' in text
        )


def test_cute_extra_pins_the_tested_versions():
    """pyproject's [cute] extra installs exactly the versions the backend names as tested."""
    from pathlib import Path

    from opcontract.backends.cute import TESTED

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = {}
    for req in project["project"]["optional-dependencies"]["cute"]:
        name, version = req.split(";")[0].strip().split("==")
        pins[name] = version
    assert pins == TESTED
    assert TESTED["nvidia-cutlass-dsl"] == "4.8.1"  # docs/h200.md's CuTe measurements


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rejection")
def test_forcing_cute_on_cpu_raises_no_backend():
    x, w, b = _xwb()
    with pytest.raises(NoBackendError) as e:
        dispatch.op("dense_gemm", backend="cute")(x, w, b)
    msg = str(e.value)
    assert "requested backend 'cute'" in msg
    why = "runs on cuda, not cpu" if HAVE_CUTLASS else "CUTLASS DSL is not installed"
    assert "cute.gemm: " + why in msg
    assert "triton.gemm: not requested" in msg


def test_config_space_moves_no_reduction():
    from opcontract.backends.cute import dense_gemm as dg

    assert dg.K_BLOCK == get_contract("dense_gemm").reductions["gemm_k"].block
    assert dg.default_config() == dg.CONFIG
    assert set(dg.CONFIG) == set(dg.CONFIG_SPACE)
    for k, v in dg.CONFIG.items():
        assert v in dg.CONFIG_SPACE[k]


def test_overlapped_loop_only_where_k_is_a_multiple_of_512(monkeypatch):
    """The host compiles the overlapped loop only when asked and when the (8-padded) K is a
    multiple of 512 (whole steps of 8 k-tiles); otherwise the plain loop, same bits."""
    import contextlib

    from opcontract.backends.cute import dense_gemm as dg

    keys = []
    monkeypatch.setattr(dg, "_launch", lambda key, *a: keys.append(key))
    monkeypatch.setattr(dg, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    for K, overlap in ((1024, 1), (1000, 1), (6656, 1), (1024, 0), (512, None)):
        x, w, _ = _xwb(M=3, K=K, N=16)
        dg.gemm(x, w, None, None if overlap is None else {"overlap": overlap})
    assert [k[5] for k in keys] == [True, False, True, False, dg.CONFIG["overlap"] == 1]


def test_backward_reads_transposed_operands_in_place(monkeypatch):
    """The backward's transposed operands (weight.T for dx; dy.T and x.T for dweight) go to
    the kernel as views, MN-major, where TMA can read them (extents and strides multiples of
    8); elsewhere they are copied K-major as before."""
    import contextlib

    from opcontract.backends.cute import dense_gemm as dg

    seen = []

    def launch(key, a, b, c, bias, addend, num_ctas):
        seen.append((key[6], key[7], a.is_contiguous(), b.is_contiguous()))

    monkeypatch.setattr(dg, "_launch", launch)
    monkeypatch.setattr(dg, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    x, w, _ = _xwb(M=64, K=96, N=40)
    dy = torch.randn(64, 40).bfloat16()
    dg.backward(dy, x, w, has_bias=False)
    # dx: a = dy (K-major), b = weight.T (MN-major); dw: a = dy.T, b = x.T (both MN-major)
    assert seen == [(False, True, True, False), (True, True, False, False)]
    seen.clear()
    x, w, _ = _xwb(M=37, K=300, N=70)  # extents not multiples of 8: K-major copies
    dg.backward(torch.randn(37, 70).bfloat16(), x, w, has_bias=False)
    assert seen == [(False, False, True, True), (False, False, True, True)]


# ---------------------------------------------------------------- GPU (SM90 + CUTLASS DSL)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_cute = pytest.mark.skipif(
    not (HAVE_CUTLASS and _sm90()), reason="needs nvidia-cutlass-dsl and an SM90 GPU"
)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cute_conformance_kit_on_gpu(dtype):
    from opcontract.conformance import run_kit

    failed = [r for r in run_kit(_impl(), get_contract("dense_gemm"), dtype, "cuda") if not r.ok]
    assert not failed, failed


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 8704, 6656), (1000, 6656, 4096), (77, 130, 300)])
def test_cute_close_to_float64(M, N, K, bias):
    x, w, b = _xwb(M, K, N, device="cuda")
    w = w * 0.05
    cute = dispatch.op("dense_gemm", backend="cute")
    y = cute(x, w, b if bias else None)
    assert dispatch.last_provenance().implementation == "cute.gemm"
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert y.dtype == x.dtype and y.shape == (M, N)
    assert rel <= get_contract("dense_gemm").tolerance["bfloat16"], rel


@pytest.mark.gpu
@needs_cute
def test_cute_rows_bitwise_equal_across_batch_sizes():
    N, K = MUSE_NK[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(N, device="cuda", generator=g).bfloat16()
    cute = dispatch.op("dense_gemm", backend="cute")
    full = cute(x, w, b)
    for m in (1, 3, 64, 1000):
        idx = torch.randperm(4096, device="cuda", generator=g)[:m]
        assert torch.equal(cute(x[idx], w, b), full[idx]), m


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tiles", [(128, 128), (64, 128), (64, 64)])
def test_cute_overlapped_promotion_keeps_the_bits(tiles, dtype):
    """The overlapped main loop (two partials, each chunk added while the next one's MMAs
    run) gives the plain loop's bits: K at 1, 2 and 13 multiples of 512, with and without
    bias; K chunks scaled 1e-3..1e3 so that a change in the order of the adds would show."""
    from opcontract.backends.cute import dense_gemm as dg

    g = torch.Generator(device="cuda").manual_seed(2)
    for K in (512, 1024, 6656):
        scale = torch.logspace(-3, 3, K // 256, device="cuda").repeat_interleave(256)
        x = (torch.randn(77, K, device="cuda", generator=g) * scale).to(dtype)
        w = (torch.randn(200, K, device="cuda", generator=g) * K**-0.5).to(dtype)
        b = torch.randn(200, device="cuda", generator=g).to(dtype)
        for bias in (None, b):
            cfg = {"tile_m": tiles[0], "tile_n": tiles[1]}
            plain = dg.gemm(x, w, bias, {**cfg, "overlap": 0})
            overlapped = dg.gemm(x, w, bias, {**cfg, "overlap": 1})
            assert torch.equal(plain, overlapped), (K, bias is not None)
    assert {key[5] for key in dg._compiled} == {False, True}  # both loops ran


@pytest.mark.gpu
@needs_cute
def test_cute_backward_close_to_float64():
    x, w, b = _xwb(37, 300, 70, device="cuda")
    x.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    y = dispatch.op("dense_gemm", backend="cute")(x, w, b)
    dy = torch.randn_like(y)
    y.backward(dy)
    dy64 = dy.double()
    tol = get_contract("dense_gemm").grad_tolerance["bfloat16"]
    for got, ref in (
        (x.grad, dy64 @ w.double()),
        (w.grad, dy64.T @ x.double()),
        (b.grad, dy64.sum(0)),
    ):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel <= tol, rel


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("M", [304, 4096])
@pytest.mark.parametrize("N,K", MUSE_NK)
def test_cute_backward_mn_major_gives_the_copied_operands_bits(M, N, K):
    """dx and dweight with the transposed operands read in place (MN-major) equal the same
    GEMMs on K-major copies, and Triton's, bitwise."""
    from opcontract.backends.cute import dense_gemm as dg

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
    dy = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    dx, dw, _ = dg.backward(dy, x, w, has_bias=False)
    assert torch.equal(dx, dg.gemm(dy, w.T.contiguous()))
    assert torch.equal(dw, dg.gemm(dy.T.contiguous(), x.T.contiguous()))
    xt, wt = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = dispatch.op("dense_gemm", backend="triton")(xt, wt)
    tdx, tdw = torch.autograd.grad(y, (xt, wt), dy)
    assert torch.equal(dx, tdx) and torch.equal(dw, tdw)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("N,K", MUSE_NK)
def test_cute_and_triton_give_the_same_bits(N, K):
    """Dispatch may serve one bucket with CuTe and the next with Triton (whichever the
    tuning table times faster): that is batch-invariant only if their bits are equal."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(300, K, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16().requires_grad_(True)
    dy = torch.randn(300, N, device="cuda", generator=g).bfloat16()
    outs = {}
    for backend in ("cute", "triton"):
        y = dispatch.op("dense_gemm", backend=backend)(x, w)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        outs[backend] = (y, dx, dw)
    for name, a, b in zip(("y", "dx", "dw"), outs["cute"], outs["triton"], strict=True):
        assert torch.equal(a, b), name
