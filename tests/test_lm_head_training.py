"""Optional outputs, ties, and linear_cross_entropy's reductions and bad input."""

import pytest
import torch
from helpers import head_inputs

from opcontract import ContractViolation, dispatch
from opcontract.outputs import CrossEntropyOutput, LogprobOutput

BACKENDS = ["torch", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: interpreter on the CPU


def inputs(**kw):
    return [x.to(DEVICE) for x in head_inputs(**kw)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_optional_outputs_are_a_named_tuple(backend):
    h, w, t = inputs()
    slp = dispatch.op("softcap_logprob", backend=backend)
    plain = slp(h, w, t, softcap=20.0)
    out = slp(h, w, t, softcap=20.0, return_entropy=True)
    assert isinstance(out, LogprobOutput) and out.predicted is None
    assert torch.equal(out.logprob, plain)
    assert (out.entropy > 0).all() and (
        out.entropy <= torch.log(torch.tensor(600.0, device=DEVICE))
    ).all()
    out = slp(h, w, t, softcap=20.0, return_predicted=True)
    assert out.entropy is None and out.predicted.dtype == torch.int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_ties_go_to_the_lowest_index(backend):
    h, w, t = inputs(T=4, V=300)
    w[250] = w[40]  # an exact tie between columns 40 and 250 (different vocab blocks)
    w[41] = w[40]  # and within one block
    h[:] = w[40]  # make column 40 the maximum for every row
    out = dispatch.op("softcap_logprob", backend=backend)(h, w, t, return_predicted=True)
    assert out.predicted.tolist() == [40, 40, 40, 40]


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_gives_zero_loss_and_zero_grads(backend):
    h, w, t = inputs(ignore=range(6))
    h.requires_grad_()
    w.requires_grad_()
    lce = dispatch.op("linear_cross_entropy", backend=backend)
    loss = lce(h, w, t, softcap=20.0, reduction="mean", label_smoothing=0.1)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_is_minus_logprob_and_reduces(backend):
    h, w, t = inputs(ignore=(1, 4))
    lp = dispatch.op("softcap_logprob", backend=backend)(h, w, t, softcap=20.0)
    lce = dispatch.op("linear_cross_entropy", backend=backend)
    none = lce(h, w, t, softcap=20.0, reduction="none")
    assert torch.equal(none, -lp)
    total = lce(h, w, t, softcap=20.0, reduction="sum")
    mean = lce(h, w, t, softcap=20.0)
    assert torch.allclose(total, none.sum(), rtol=1e-6) and mean.shape == ()
    assert torch.allclose(mean, total / 4, rtol=1e-6)
    out = lce(h, w, t, softcap=20.0, reduction="sum", return_token_accuracy=True)
    assert isinstance(out, CrossEntropyOutput) and torch.equal(out.loss, total)
    pred = dispatch.op("softcap_logprob", backend=backend)(
        h, w, t, softcap=20.0, return_predicted=True
    ).predicted
    keep = t != -100
    assert out.token_accuracy.item() == float(((pred == t) & keep).sum())


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"reduction": "avg"}, r"'reduction'.*choices"),
        ({"label_smoothing": 1.0}, r"'label_smoothing'.*check"),
        ({"label_smoothing": -0.1}, r"'label_smoothing'.*check"),
        ({"return_token_accuracy": 1}, r"'return_token_accuracy'.*must be bool"),
    ],
)
def test_linear_cross_entropy_bad_params(bad, match):
    h, w, t = inputs()
    with pytest.raises(ContractViolation, match=match):
        dispatch.op("linear_cross_entropy")(h, w, t, **bad)
