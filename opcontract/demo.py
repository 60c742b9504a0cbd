"""The main job (``make demo``): lint the contracts, run every op through dispatch on the
available device, print what was selected, what was rejected and why, and check accuracy
against the float64 oracle and bitwise invariance.

On a machine without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from opcontract import ContractViolation, NoBackendError, dispatch  # noqa: E402
from opcontract.backends.registry import implementations  # noqa: E402
from opcontract.cli import lint  # noqa: E402
from opcontract.conformance import (  # noqa: E402
    check_accuracy,
    check_batch_invariance,
    check_run_to_run,
    make_inputs,
    runner_for,
)
from opcontract.contracts import load_all  # noqa: E402


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16"
    _section("contract-lint")
    if lint.main([]) != 0:
        return 1
    failures = 0
    for op, contract in load_all().items():
        case = contract.conformance.cases[0]
        inputs, params = make_inputs(contract, case, dtype, device=device, seed=1)
        _section(f"{op} on {device}, {dtype}, {case.sizes}, {case.params}")
        print(dispatch.explain(op, **inputs, **params))
        out = dispatch.op(op)(**inputs, **params)
        print("provenance:", dispatch.last_provenance().as_dict())
        first = out if isinstance(out, torch.Tensor) else out[0]
        print(
            f"output: {type(out).__name__} {list(first.shape)} {first.dtype}, "
            f"first values {first.flatten()[:4].tolist()}"
        )
        for impl in implementations(op):
            if impl.relaxed_only:
                continue
            run = runner_for(impl)
            try:
                checks = [
                    check_accuracy(run, contract, case, dtype, device=device),
                    check_run_to_run(run, contract, case, dtype, device=device),
                    check_batch_invariance(run, contract, case, dtype, device=device),
                ]
            except NoBackendError as e:
                print(f"  {impl.name}: not run here: {e.rejected[impl.name]}")
                continue
            for r in checks:
                failures += not r.ok
                print(f"  {impl.name:14s} {r.check:10s} {'ok  ' if r.ok else 'FAIL'} {r.detail}")

    _section("fail closed")
    contract = load_all()["softcap_logprob"]
    inputs, params = make_inputs(contract, contract.conformance.cases[0], dtype, device=device)
    try:
        dispatch.op("softcap_logprob")(**inputs, softcap=-1.0)
    except ContractViolation as e:
        print("ContractViolation:", e)
    try:
        dispatch.op("softcap_logprob", backend="torch.eager")(**inputs, **params)
    except NoBackendError as e:
        print("NoBackendError:", e)
    print(f"\n{'all checks passed' if not failures else f'{failures} check(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
