"""Conformance kit: accuracy against the float64 oracle, batch invariance, run-to-run."""

from opcontract.conformance.checks import (
    CHECKS,
    CheckResult,
    check_accuracy,
    check_batch_invariance,
    check_grad_accuracy,
    check_grad_batch_invariance,
    check_grad_run_to_run,
    check_layout,
    check_nonfinite,
    check_run_to_run,
    checks_for,
    drift,
    run_kit,
    runner_for,
)
from opcontract.conformance.inputs import make_inputs

__all__ = [
    "CHECKS",
    "CheckResult",
    "check_accuracy",
    "check_batch_invariance",
    "check_grad_accuracy",
    "check_grad_batch_invariance",
    "check_grad_run_to_run",
    "check_layout",
    "check_nonfinite",
    "check_run_to_run",
    "checks_for",
    "drift",
    "make_inputs",
    "run_kit",
    "runner_for",
]
