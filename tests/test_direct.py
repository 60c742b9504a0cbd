"""Plain eager calls that build no autograd graph skip the torch.library op (same function,
same bits); autograd, torch.compile and dispatch modes still go through it."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opcontract import dispatch
from opcontract.backends import gemm_op, norm_op, swiglu_op
from opcontract.backends.direct import bypass_op


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(module, name, spy)
    return calls


CASES = [
    (norm_op, "add_rms_norm", "rms_norm", lambda: (torch.randn(5, 40), torch.randn(40)), {}),
    (swiglu_op, "swiglu_op", "swiglu", lambda: (torch.randn(5, 24), torch.randn(5, 24)), {}),
    (gemm_op, "dense_gemm_op", "dense_gemm", lambda: (torch.randn(5, 32), torch.randn(8, 32)), {}),
]


@pytest.mark.parametrize("module,op_name,op,make,kw", CASES)
def test_no_grad_skips_the_op_with_the_same_bits(monkeypatch, module, op_name, op, make, kw):
    args = make()
    f = dispatch.op(op)
    with_op = f(*[a.requires_grad_() for a in args], **kw).detach()
    calls = _counting(monkeypatch, module, op_name)
    with torch.no_grad():
        direct = f(*args, **kw)
    assert calls == [] and torch.equal(direct, with_op)
    plain = f(*[a.detach() for a in args], **kw)  # grad mode, nothing requires grad
    assert calls == [] and torch.equal(plain, with_op)
    out = f(*[a.detach().requires_grad_() for a in args], **kw)
    assert calls == [1] and out.requires_grad


def test_bypass_conditions():
    x = torch.randn(3)
    assert bypass_op(x, None)
    assert not bypass_op(x.requires_grad_())
    with torch.no_grad():
        assert bypass_op(x)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not bypass_op(torch.randn(3))


def test_eager_backward_skips_the_backward_op_with_the_same_bits(monkeypatch):
    x, w, dy = torch.randn(5, 40), torch.randn(40), torch.randn(5, 40)
    f = dispatch.op("rms_norm")

    def grads():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        f(xs, ws).backward(dy)
        return xs.grad, ws.grad

    calls = _counting(monkeypatch, norm_op, "add_rms_norm_backward")
    direct = grads()
    assert calls == []
    monkeypatch.setattr(norm_op, "bypass_op", lambda *t: False)  # through the ops
    via_op = grads()
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op, strict=True))
