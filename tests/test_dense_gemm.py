"""dense_gemm: bias, bad input, selection, StrictLinear, torch.compile."""

import pytest
import torch
from helpers import run_impl

from opcontract import ContractViolation, NoBackendError, dispatch
from opcontract.dispatch.device import simulate
from opcontract.nn import StrictLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _xwb(M=5, K=72, N=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(dtype).to(DEVICE) for s in ((M, K), (N, K), (N,))]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bias_optional_and_close_to_float64(backend):
    x, w, b = _xwb()
    gemm = dispatch.op("dense_gemm", backend=backend)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(gemm(x, w).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm(x, w, b).double(), ref + b.double(), rtol=1e-5, atol=1e-5)


def test_bad_input():
    x, w, b = _xwb()
    gemm = dispatch.op("dense_gemm")
    with pytest.raises(ContractViolation, match=r"'weight'.*K = 70 here but K = 72"):
        gemm(x, w[:, :70])
    with pytest.raises(ContractViolation, match=r"'bias'.*N = 23 here but N = 24"):
        gemm(x, w, b[:23])
    with pytest.raises(ContractViolation, match=r"'weight'.*dtype of 'x'"):
        gemm(x, w.bfloat16())
    with pytest.raises(ContractViolation, match=r"'bias'.*device"):
        gemm(x, w, b.to("meta"))


def test_cublas_only_in_relaxed_mode_and_selection():
    x, w, b = _xwb()
    with pytest.raises(NoBackendError, match="torch.cublas: does not satisfy the contract"):
        dispatch.op("dense_gemm", backend="torch.cublas")(x, w, b)
    out = dispatch.op("dense_gemm", backend="torch.cublas", mode="relaxed")(x, w, b)
    assert out.shape == (5, 24)
    with simulate((9, 0), name="H200"):  # float32: CuTe (16-bit floats only) never serves
        assert dispatch.explain("dense_gemm", x, w, b).implementation == "triton.gemm"
    with simulate((8, 0)):
        assert dispatch.explain("dense_gemm", x, w, b).implementation == "triton.gemm"
    with simulate((7, 0)):
        r = dispatch.explain("dense_gemm", x, w, b)
    assert "this GPU is SM70" in r.rejected["triton.gemm"]


def test_strict_linear_is_a_drop_in_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(72, 24).to(DEVICE)
    strict = StrictLinear.from_linear(lin)
    assert strict.state_dict().keys() == lin.state_dict().keys()
    x = torch.randn(2, 3, 72, device=DEVICE)
    torch.testing.assert_close(strict(x), lin(x), rtol=1e-5, atol=1e-5)
    fresh = StrictLinear(72, 24, bias=False).to(DEVICE)
    fresh.load_state_dict({"weight": lin.weight.detach()})
    rows = torch.randn(7, 72, device=DEVICE)
    assert torch.equal(fresh(rows)[2:3], fresh(rows[2:3]))  # a row alone = in a batch


def test_strict_linear_autograd_and_compile_keep_bits():
    torch.manual_seed(0)
    layer = StrictLinear(72, 24).to(DEVICE)
    x = torch.randn(6, 72, device=DEVICE)
    results = []
    for fn in (layer, torch.compile(layer, dynamic=False)):
        layer.zero_grad()
        xs = x.clone().requires_grad_()
        y = fn(xs)
        y.backward(torch.linspace(-1, 1, y.numel(), device=DEVICE).reshape(y.shape))
        results.append((y.detach(), xs.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("K", [600, 4352])  # 3 and 17 partials: inside and past one unroll
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_partials_keep_the_bits(dtype, K, fuse, monkeypatch):
    """The 256-element K partials computed by separate programs, then added in order (by
    each tile's last program, or by a second launch): the same bits as the sequential K
    loop, forward (with bias) and gradients; the arrival counters are back at zero after
    every fused launch."""
    from opcontract.backends.registry import implementation
    from opcontract.backends.triton import dense_gemm as tdg

    launches = []
    real_launch = tdg.launch

    def spy(kernel, grid, *args, **meta):
        launches.append(("gemm", grid[1]) if "CHUNK" in meta else ("sum",))
        real_launch(kernel, grid, *args, **meta)
        if meta.get("FUSE_SUM"):
            arrivals = args[16]
            assert arrivals.dtype == torch.int32 and not arrivals.any()

    monkeypatch.setattr(tdg, "launch", spy)
    monkeypatch.setattr(tdg, "fuse_sum", lambda device, weight_bytes: fuse)
    impl = implementation("triton.gemm")
    base = impl.default_config(None)
    g = torch.Generator().manual_seed(3)
    x0, w0 = (torch.randn(*s, generator=g).to(dtype).to(DEVICE) for s in ((5, K), (300, K)))
    b0 = torch.randn(300, generator=g).to(dtype).to(DEVICE)
    dy = torch.randn(5, 300, generator=g).to(dtype).to(DEVICE)
    outs = []
    for parallel in (False, True):
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        y = run_impl(impl, {**base, "parallel_partials": parallel}, x=x, weight=w, bias=b)
        y.backward(dy)
        outs.append((y.detach(), x.grad, w.grad, b.grad))
    for name, a, b in zip(("y", "dx", "dw", "db"), *outs, strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(outs[0][0], torch.zeros_like(outs[0][0]))
    # per run: forward, dx, dw; the parallel run's forward (K) and dx (N = 300) split their
    # reduction into 256-element partials (dw never does), summed in place or by a launch
    sums = [] if fuse else [("sum",)]
    assert launches == [("gemm", 1)] * 3 + [
        ("gemm", -(-K // 256)),
        *sums,
        ("gemm", 2),
        *sums,
        ("gemm", 1),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_skips_unneeded_gradients_and_keeps_the_bits(backend, monkeypatch):
    """A frozen weight (LoRA's base projections) or an input that needs no gradient: that
    gradient's GEMM is not run, and the gradients that are computed have the bits of a
    backward that computed all three."""
    from opcontract.backends.torch import dense_gemm as torch_dg
    from opcontract.backends.triton import dense_gemm as triton_dg

    module, name = (triton_dg, "_gemm") if backend == "triton" else (torch_dg, "_promoted_matmul")
    calls = []  # the backward's GEMMs
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    gemm = dispatch.op("dense_gemm", backend=backend)
    x0, w0, b0 = _xwb(M=7, K=300, N=40)
    dy = torch.randn(7, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def grads(need_x: bool, need_w: bool) -> tuple:
        x = x0.clone().requires_grad_(need_x)
        w = w0.clone().requires_grad_(need_w)
        b = b0.clone().requires_grad_(True)
        y = gemm(x, w, b)
        calls.clear()
        y.backward(dy)
        return x.grad, w.grad, b.grad

    full = grads(True, True)
    assert all(g is not None for g in full) and len(calls) == 2
    frozen_w = grads(True, False)
    assert frozen_w[1] is None and len(calls) == 1
    assert torch.equal(frozen_w[0], full[0]) and torch.equal(frozen_w[2], full[2])
    frozen_x = grads(False, True)
    assert frozen_x[0] is None and len(calls) == 1
    assert torch.equal(frozen_x[1], full[1]) and torch.equal(frozen_x[2], full[2])
