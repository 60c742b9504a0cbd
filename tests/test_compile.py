"""Under torch.compile the ops keep their bits: the LM head is an opaque torch.library op."""

import pytest
import torch
from helpers import head_inputs

from opcontract import dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_forward_and_backward_keep_their_bits(backend):
    slp = dispatch.op("softcap_logprob", backend=backend)
    lce = dispatch.op("linear_cross_entropy", backend=backend)

    def step(h, w, t):  # the ops' own outputs: the compiler owns any arithmetic around them
        out = slp(h, w, t, softcap=20.0, multiplier=0.5, return_entropy=True)
        loss = lce(h, w, t, softcap=20.0, multiplier=0.5, label_smoothing=0.1)
        return out.logprob, out.entropy, loss

    h, w, t = (x.to(DEVICE) for x in head_inputs(T=5, H=64, V=300))
    results = []
    for fn in (step, torch.compile(step, dynamic=False)):
        hh = h.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        outs = fn(hh, ww, t)
        upstream = [torch.linspace(-1, 1, o.numel()).reshape(o.shape).to(o) for o in outs]
        torch.autograd.backward(outs, upstream)
        results.append((*(o.detach() for o in outs), hh.grad, ww.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
