"""segmented_gemm: the K (and backward N) reduction in fixed segments whose sums meet in an
adjacent-pair tree, so the shards of any power-of-two degree finish the one-shard bits."""

import pytest
import torch

from opcontract import ContractViolation, dispatch
from opcontract.backends.fixed_order import adjacent_tree_sum, pairwise_sum

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEG = dispatch.op("segmented_gemm")
BACKENDS = ["torch", "triton"]


def _xw(M=6, K=96, N=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (0.2 * torch.randn(N, K, generator=g)).to(dtype)
    return x.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_segment_is_dense_gemms_accumulator(backend):
    # bf16 on the GPU; on the CPU the interpreter's bf16 store is not the GPU's: float32
    x, w = _xw(K=600, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    dense = dispatch.op("dense_gemm", backend=backend)
    seg = dispatch.op("segmented_gemm", backend=backend)(x, w)
    assert torch.equal(seg.to(x.dtype), dense(x, w))  # the same partials, one rounding later


def test_adjacent_tree_pairs_neighbours():
    v = torch.tensor([1e8, 1.0, -1e8, 1.0], device=DEVICE)  # float32: 1e8 + 1 rounds to 1e8
    assert adjacent_tree_sum(v).item() == 0.0  # (1e8 + 1) + (-1e8 + 1)
    assert pairwise_sum(v).item() == 2.0  # the halving tree: (1e8 - 1e8) + (1 + 1)
    with pytest.raises(ValueError, match="power-of-two"):
        adjacent_tree_sum(torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("degree", [1, 2, 4, 8])
def test_row_shards_finish_the_same_tree(degree, backend):
    SEG = dispatch.op("segmented_gemm", backend=backend)
    x, w = _xw()
    full = SEG(x, w, segments=8)
    step = x.shape[1] // degree
    parts = [
        SEG(x[:, r * step : (r + 1) * step], w[:, r * step : (r + 1) * step], segments=8 // degree)
        for r in range(degree)
    ]
    assert torch.equal(adjacent_tree_sum(torch.stack(parts)), full)
    ref = x.double() @ w.double().T
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_segments_change_the_order():
    """The negative control: 8 segments are not the sequential sum (else the test above
    would prove nothing)."""
    x, w = _xw(K=2048, M=32, N=32, dtype=torch.float32, seed=3)
    assert not torch.equal(SEG(x, w, segments=8), SEG(x, w, segments=1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_column_shards_finish_the_backward_tree(degree, backend):
    SEG = dispatch.op("segmented_gemm", backend=backend)
    x, w = _xw()
    g = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(5))
    g = g.to(DEVICE)
    xf = x.clone().float().requires_grad_()  # float32 leaves: the shards' dx stays unrounded
    SEG(xf, w.float(), grad_segments=4).backward(g)
    assert dispatch.last_provenance().backend == backend
    step = w.shape[0] // degree
    parts = []
    for r in range(degree):
        xr = x.clone().float().requires_grad_()
        SEG(xr, w[r * step : (r + 1) * step].float(), grad_segments=4 // degree).backward(
            g[:, r * step : (r + 1) * step]
        )
        parts.append(xr.grad)
    assert torch.equal(adjacent_tree_sum(torch.stack(parts)), xf.grad)


def test_weight_gradient_is_dense_gemms():
    x, w = _xw(dtype=torch.float32)
    g = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(6))
    g = g.to(DEVICE)
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    SEG(x, a, segments=4).backward(g)
    dispatch.op("dense_gemm")(x, b).backward(g)
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(
    "kw, field",
    [({"segments": 3}, "constraints[0]"), ({"segments": 64}, "constraints[0]"),
     ({"grad_segments": 32}, "constraints[1]"), ({"segments": 0}, "params.segments.check")],
)  # fmt: skip
def test_bad_segments_name_the_argument(kw, field):
    x, w = _xw()
    with pytest.raises(ContractViolation, match=field.replace("[", r"\[").replace("]", r"\]")) as e:
        SEG(x, w, **kw)
    assert e.value.argument == next(iter(kw))  # the param is named
