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
