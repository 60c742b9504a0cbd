"""qk_norm_rope: the layer kind is part of the call, and each backend keeps the contract."""

import pytest
import torch

from opcontract import ContractViolation, dispatch
from opcontract.backends.torch.qk_norm_rope import reference

qk = dispatch.op("qk_norm_rope")


def _inputs(T=5, Hq=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    pos = torch.arange(T) * 37 + 3
    return q, k, pos


def test_the_layer_kind_is_required_and_rope_only_on_local_layers():
    q, k, pos = _inputs()
    with pytest.raises(ContractViolation, match="'layer'.*missing") as e:
        qk(q, k, pos)
    assert e.value.argument == "layer"
    with pytest.raises(ContractViolation, match="'rope_theta'.*must be None when layer='global'"):
        qk(q, k, pos, layer="global", rope_theta=500000.0)
    with pytest.raises(ContractViolation, match="'rope_theta'.*required when layer='local'"):
        qk(q, k, pos, layer="local")
    with pytest.raises(ContractViolation, match="'layer'.*choices"):
        qk(q, k, pos, layer="sliding")


def test_local_rotates_and_global_does_not():
    q, k, pos = _inputs()
    g = qk(q, k, pos, layer="global")
    loc = qk(q, k, pos, layer="local", rope_theta=500000.0)
    ref = reference(q, k, pos, layer="global")
    assert ((g.q_out.double() - ref.q_out).norm() / ref.q_out.norm()) < 1e-6
    assert not torch.equal(g.q_out[1:], loc.q_out[1:])  # position 0 is not rotated
    # the rotation is a rotation: each pair's norm is kept (float32 rounding aside)
    half = q.shape[-1] // 2
    n2 = lambda x: x[..., :half] ** 2 + x[..., half:] ** 2  # noqa: E731
    assert torch.allclose(n2(loc.k_out), n2(g.k_out), rtol=1e-5, atol=1e-6)


def test_q_is_scaled_k_is_not():
    q, k, pos = _inputs()
    a = qk(q, k, pos, layer="global", qk_scale=1.0)
    b = qk(q, k, pos, layer="global", qk_scale=3.87)
    assert torch.equal(a.k_out, b.k_out)
    assert torch.allclose(b.q_out, a.q_out * 3.87, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_keeps_the_contract_beside_torch(monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, pos = (t.to(dtype) if t.is_floating_point() else t for t in _inputs(T=7, D=32))
    kw = dict(layer="local", rope_theta=500000.0)
    a = dispatch.op("qk_norm_rope", backend="torch")(q, k, pos, **kw)
    b = dispatch.op("qk_norm_rope", backend="triton")(q, k, pos, **kw)
    ref = reference(q, k, pos, **kw)
    for out, r in ((a.q_out, ref.q_out), (b.q_out, ref.q_out), (b.k_out, ref.k_out)):
        assert ((out.double() - r).norm() / r.norm()).item() < {torch.float32: 1e-6}.get(
            dtype, 8e-3
        )


def test_triton_plan_serves_repeated_calls_and_still_checks_positions():
    """No grad, host positions: the second call of a signature runs the forward plan (the
    same bits); a negative position on a later call still raises, naming positions."""
    from opcontract.dispatch import call_cache

    call_cache.clear()
    q, k, pos = _inputs(T=5, D=32)
    f = dispatch.op("qk_norm_rope", backend="triton")
    kw = dict(layer="local", rope_theta=500000.0)
    with torch.no_grad():
        a, b = f(q, k, pos, **kw), f(q, k, pos, **kw)
        hit = call_cache.get(call_cache.key(f._route, (q, k, pos), kw))
        assert hit is not None and callable(hit.plan)
        assert torch.equal(a.q_out, b.q_out) and torch.equal(a.k_out, b.k_out)
        with pytest.raises(ContractViolation, match="positions"):
            f(q, k, pos - 10**6, **kw)
    call_cache.clear()
