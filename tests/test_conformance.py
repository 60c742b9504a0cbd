"""The conformance kit, generated for every contract x implementation x dtype x check."""

import dataclasses

import pytest
import torch

from opcontract.backends import registry
from opcontract.backends.registry import CallInfo, implementations, rejection
from opcontract.conformance import (
    CHECKS,
    check_accuracy,
    check_batch_invariance,
    checks_for,
    runner_for,
)
from opcontract.contracts import load_all
from opcontract.dispatch.device import DeviceInfo


def _cases():
    for op, c in load_all().items():
        for impl in implementations(op):
            if impl.relaxed_only:
                continue
            for dtype in impl.dtypes:
                for ci, case in enumerate(c.conformance.cases):
                    for check in checks_for(c, case):
                        yield pytest.param(
                            c,
                            impl,
                            dtype,
                            case,
                            check,
                            id=f"{op}-{impl.name}-{dtype}-case{ci}-{check}",
                        )


@pytest.mark.parametrize("contract,impl,dtype,case,check", list(_cases()))
def test_conformance(contract, impl, dtype, case, check):
    call = CallInfo(DeviceInfo("cpu"), dtype, case.sizes, case.params)
    why = rejection(impl, contract, call, "strict")
    if why:
        pytest.skip(why)
    result = CHECKS[check](runner_for(impl), contract, case, dtype)
    assert result.ok, result.detail


def test_negative_control_accuracy_catches_bf16_logits():
    """Stock eager rounds logits to bf16: the accuracy check must fail it."""
    c = load_all()["softcap_logprob"]
    eager = registry._REGISTRY["torch.eager"]
    result = check_accuracy(runner_for(eager), c, c.conformance.cases[0], "bfloat16")
    assert not result.ok and result.value > 10 * c.tolerance["bfloat16"]


def test_negative_control_batch_check_names_first_drift(monkeypatch):
    c = load_all()["softcap_logprob"]
    impl = registry._REGISTRY["torch.strict"]

    def batch_dependent(config, hidden, **kw):  # a perturbation whose bits move with T
        lp, *rest = impl.forward(config, hidden, **kw)
        return (lp + (hidden.shape[0] % 3) * 1e-6 * lp, *rest)

    fake = dataclasses.replace(impl, name="torch.fake", forward=batch_dependent)
    monkeypatch.setitem(registry._REGISTRY, "torch.fake", fake)
    result = check_batch_invariance(runner_for(fake), c, c.conformance.cases[0], "float32")
    assert not result.ok
    assert result.detail.startswith("batch with 5 padding rows (output 0): 29 of 37 elements")
    assert "first at [0]" in result.detail


def test_drift_report():
    from opcontract.conformance import drift

    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.5, 3.5])
    assert drift(a, b, "x") == "x: 2 of 3 elements differ; first at [1]: 2.0 vs 2.5"
    assert drift(a, a.clone(), "x") == "x: equal"


def _lce():
    c = load_all()["linear_cross_entropy"]
    return c, runner_for(registry._REGISTRY["torch.strict_ce"])


@pytest.mark.parametrize("ci", [0, 1])
def test_accuracy_fails_a_nan_where_the_reference_is_finite(ci):
    """max(worst, nan) is worst: a NaN must fail the check, not vanish from it."""
    c, strict = _lce()

    def nan_loss(**kw):
        out = strict(**kw)
        loss = out.loss.clone()
        loss.view(-1)[-1] = float("nan")
        return out._replace(loss=loss)

    result = check_accuracy(nan_loss, c, c.conformance.cases[ci], "float32")
    assert not result.ok
    assert "loss: 1 of" in result.detail and "not finite where the reference is" in result.detail


def test_accuracy_fails_a_nan_relative_error(monkeypatch):
    from opcontract.conformance import checks

    c, strict = _lce()
    ref = checks.reference_fn(c)

    def nan_reference(**kw):
        out = ref(**kw)
        return out._replace(loss=out.loss * float("nan"))

    monkeypatch.setattr(checks, "reference_fn", lambda contract: nan_reference)
    result = check_accuracy(strict, c, c.conformance.cases[0], "float32")
    assert not result.ok and "relative error nan" in result.detail


@pytest.mark.parametrize("ci", [0, 1, 2])
def test_accuracy_fails_a_wrong_token_accuracy(ci):
    """Also where the reference's accuracy is 0 (0/0 relative error): compared absolutely."""
    c, strict = _lce()

    def off_by_one_token(**kw):
        out = strict(**kw)
        acc = out.token_accuracy.clone()
        acc.view(-1)[0] += 1.0 / kw["targets"].shape[0]
        return out._replace(token_accuracy=acc)

    case = c.conformance.cases[ci]
    assert check_accuracy(strict, c, case, "float32").ok
    result = check_accuracy(off_by_one_token, c, case, "float32")
    assert not result.ok, result.detail
    assert "nan" not in result.detail


def test_accuracy_of_a_zero_reference_reads_equal():
    c, strict = _lce()
    result = check_accuracy(strict, c, c.conformance.cases[0], "float32")
    assert result.ok and "token_accuracy equal (reference 0)" in result.detail, result.detail


def test_grad_accuracy_fails_a_nan_gradient():
    from opcontract.conformance import check_grad_accuracy

    c, strict = _lce()

    def nan_grad(hidden, **kw):
        out = strict(hidden=hidden, **kw)
        # forward unchanged; d sqrt(|0 * h|) / dh = inf * 0 = nan
        return out._replace(loss=out.loss + 0.0 * (hidden.float() * 0).abs().sqrt().sum())

    case = c.conformance.cases[1]
    assert check_grad_accuracy(strict, c, case, "float32").ok
    result = check_grad_accuracy(nan_grad, c, case, "float32")
    assert not result.ok and "grad hidden" in result.detail and "not finite" in result.detail


def test_a_case_checks_a_token_accuracy_that_is_not_zero():
    """The real implementations pass on a case whose oracle's token accuracy is not 0 (with
    a large vocabulary, random targets never hit the argmax: 0 against 0 checks little)."""
    from opcontract.conformance.checks import _case, reference_fn

    c = load_all()["linear_cross_entropy"]
    hit = []
    for case in c.conformance.cases:
        inputs, params = _case(c, case, "float32", 0, "cpu")
        if reference_fn(c)(**inputs, **params).token_accuracy.sum() > 0:
            hit.append(case)
    assert hit
    for impl in ("torch.strict_ce", "triton.fused_ce"):
        for case in hit:
            for dtype in ("float32", "bfloat16"):
                run = runner_for(registry._REGISTRY[impl])
                result = check_accuracy(run, c, case, dtype)
                assert result.ok and "nan" not in result.detail, (impl, dtype, result.detail)
                assert "reference 0" not in result.detail
