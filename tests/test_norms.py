"""RMSNorm and fused add + RMSNorm: variants, no writes to inputs, bad input, compile."""

import pytest
import torch

from opcontract import ContractViolation, dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


def _rows(T=6, H=40, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).to(DEVICE) for s in ((T, H), (T, H), (H,))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_variants_match_their_formulas(backend):
    x, _, w = _rows(dtype=torch.float32)
    norm = dispatch.op("rms_norm", backend=backend)
    xhat = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    for variant, expect in (("plain", xhat * w), ("centred", xhat * (1 + w)), ("weightless", xhat)):
        y = norm(x, None if variant == "weightless" else w, variant=variant, eps=1e-5)
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_are_never_written(backend):
    # The Triton interpreter truncates float32 -> bfloat16 conversions (a GPU rounds to
    # nearest even), so the exact sum check runs in float32 there.
    interpreted = backend == "triton" and DEVICE == "cpu"
    x, r, w = _rows(dtype=torch.float32 if interpreted else torch.bfloat16)
    keep = [t.clone() for t in (x, r, w)]
    out = dispatch.op("fused_add_rms_norm", backend=backend)(x, r, w, variant="centred")
    dispatch.op("rms_norm", backend=backend)(x, w)
    for before, after in zip(keep, (x, r, w), strict=True):
        assert torch.equal(before, after)
    assert torch.equal(out.residual_out, (x.float() + r.float()).to(x.dtype))
    y = dispatch.op("rms_norm", backend=backend)(out.residual_out, w, variant="centred")
    assert torch.equal(out.y, y)


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            {"variant": "weightless"},
            r"'weight'.*absent_when.*must be None when variant='weightless'",
        ),
        ({"eps": 0.0}, r"'eps'.*params\.eps\.check"),
        ({"eps": -1e-6}, r"'eps'.*params\.eps\.check"),
        ({"variant": "scaled"}, r"'variant'.*choices"),
    ],
)
def test_bad_params(kw, match):
    x, _, w = _rows()
    with pytest.raises(ContractViolation, match=match):
        dispatch.op("rms_norm")(x, w, **kw)


def test_bad_tensors():
    x, r, w = _rows()
    norm = dispatch.op("rms_norm")
    with pytest.raises(ContractViolation, match=r"'weight'.*shape\[0\].*H = 39 here but H = 40"):
        norm(x, w[:39])
    with pytest.raises(ContractViolation, match=r"'weight'.*missing"):
        norm(x, None)
    with pytest.raises(ContractViolation, match=r"'weight'.*dtype of 'x'"):
        norm(x, w.float())
    with pytest.raises(ContractViolation, match=r"'residual'.*device"):
        dispatch.op("fused_add_rms_norm")(x, r.to("meta"), w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_norm_keeps_its_bits(backend):
    x, r, w = _rows(dtype=torch.float32)
    op = dispatch.op("fused_add_rms_norm", backend=backend)

    def step(x, r, w):
        out = op(x, r, w, variant="centred", eps=1e-5)
        return out.y, out.residual_out

    results = []
    for fn in (step, torch.compile(step, dynamic=False)):
        xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
        outs = fn(xs, rs, ws)
        torch.autograd.backward(outs, [torch.ones_like(outs[0]), torch.full_like(outs[1], 0.5)])
        results.append((*(o.detach() for o in outs), xs.grad, rs.grad, ws.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_packed_equals_separate(backend):
    g, u, _ = _rows(T=5, H=48)
    op = dispatch.op("swiglu", backend=backend)
    separate = op(g, u)
    packed = op(torch.cat([g, u], dim=-1), layout="packed")
    assert torch.equal(separate, packed)


def test_swiglu_bad_input():
    g, u, _ = _rows(T=5, H=48)
    op = dispatch.op("swiglu")
    with pytest.raises(ContractViolation, match=r"'gate'.*constraints\[0\].*must be even"):
        op(g[:, :47], layout="packed")
    with pytest.raises(ContractViolation, match=r"'up'.*must be None when layout='packed'"):
        op(g, u, layout="packed")
    with pytest.raises(ContractViolation, match=r"'up'.*missing"):
        op(g)
    with pytest.raises(ContractViolation, match=r"'up'.*G = 40 here but G = 48"):
        op(g, u[:, :40])


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_raw_rows_and_repeated_ids(backend):
    table = torch.randn(7, 40).to(DEVICE).requires_grad_()
    ids = torch.tensor([3, 3, 0, 6, 3], device=DEVICE)
    out = dispatch.op("normalized_embedding", backend=backend)(ids, table, return_raw=True)
    assert torch.equal(out.raw, table.detach()[ids])
    (out.y.sum() + out.raw.sum()).backward()
    assert torch.equal(table.grad[[1, 2, 4, 5]], torch.zeros(4, 40, device=DEVICE))
    assert table.grad[3].abs().sum() > 0


def test_embedding_ids_out_of_range():
    table = torch.randn(7, 40)
    with pytest.raises(ContractViolation, match=r"'ids'.*inputs\.ids\.values.*\[0, 7\)"):
        dispatch.op("normalized_embedding")(torch.tensor([1, 7]), table)
    with pytest.raises(ContractViolation, match=r"'ids'.*inputs\.ids\.values"):
        dispatch.op("normalized_embedding")(torch.tensor([-1]), table)
