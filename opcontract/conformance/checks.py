"""The conformance kit: checks any implementation can be run through.

* accuracy: ||out - ref|| / ||ref|| against the contract's float64 oracle, within the
  contract's tolerance for the dtype;
* batch invariance (``torch.equal``): rows computed alone, inside the batch, permuted,
  and with padding rows appended, all give the same bits;
* run-to-run: two identical calls give the same bits.

A failure's detail names the first mismatching element (a drift report).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opcontract import dispatch
from opcontract.backends.registry import Implementation
from opcontract.conformance.inputs import batch_inputs, make_inputs
from opcontract.contracts.schema import ConformanceCase, Contract


@dataclass(frozen=True)
class CheckResult:
    check: str
    ok: bool
    detail: str
    value: float | None = None

    def __bool__(self) -> bool:
        return self.ok


Runner = Callable[..., Any]


def runner_for(impl: Implementation) -> Runner:
    """Call ``impl`` through dispatch (so inputs are validated), forcing that implementation."""
    return dispatch.op(
        impl.op, backend=impl.name, mode="relaxed" if impl.relaxed_only else "strict"
    )


def outputs(result: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(r for r in result if isinstance(r, torch.Tensor))


def reference_fn(contract: Contract) -> Callable[..., Any]:
    module, _, name = contract.reference.partition(":")
    return getattr(importlib.import_module(module), name)


def drift(a: torch.Tensor, b: torch.Tensor, what: str) -> str:
    """Name the first element where two tensors differ in their bits."""
    if a.shape != b.shape:
        return f"{what}: shapes differ {list(a.shape)} vs {list(b.shape)}"
    diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    idx = diff.nonzero()
    if idx.numel() == 0:
        return f"{what}: equal"
    first = tuple(idx[0].tolist())
    return (
        f"{what}: {idx.shape[0]} of {a.numel()} elements differ; first at {list(first)}: "
        f"{a[first].item()!r} vs {b[first].item()!r}"
    )


def _equal(a: tuple, b: tuple, what: str) -> str | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(x, y):
            return drift(x, y, f"{what} (output {i})")
    return None


def check_accuracy(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    inputs, params = make_inputs(contract, case, dtype, seed=seed, device=device)
    out = outputs(run(**inputs, **params))[0]
    ref = reference_fn(contract)(**inputs, **params)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    tol = contract.tolerance[dtype]
    finite = bool(torch.isfinite(out).all())
    ok = finite and err <= tol
    return CheckResult(
        "accuracy",
        ok,
        f"rel. error {err:.3g} (tolerance {tol:g})" + ("" if finite else "; non-finite output"),
        err,
    )


def check_run_to_run(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    inputs, params = make_inputs(contract, case, dtype, seed=seed, device=device)
    a = outputs(run(**inputs, **params))
    b = outputs(run(**inputs, **params))
    bad = _equal(a, b, "second call")
    return CheckResult("run_to_run", bad is None, bad or "two calls bitwise equal")


def check_batch_invariance(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
    alone: int = 3,
    pad: int = 5,
) -> CheckResult:
    """Rows alone, in the batch, permuted, and with ``pad`` random rows appended."""
    bdim = contract.conformance.batch_dim
    n = case.sizes[bdim]
    inputs, params = make_inputs(contract, case, dtype, seed=seed, device=device)
    batched = batch_inputs(contract)
    full = outputs(run(**inputs, **params))

    def rows(idx: torch.Tensor, extra: dict | None = None) -> tuple:
        sub = {k: (v[idx.to(v.device)] if k in batched else v) for k, v in inputs.items()}
        if extra:
            sub = {k: (torch.cat([sub[k], extra[k]]) if k in batched else sub[k]) for k in sub}
        return outputs(run(**sub, **params))

    gen = torch.Generator().manual_seed(seed + 1)
    for i in torch.randperm(n, generator=gen)[:alone].tolist():
        bad = _equal(
            rows(torch.tensor([i])),
            tuple(o[i : i + 1] for o in full),
            f"row {i} alone vs in a batch of {n}",
        )
        if bad:
            return CheckResult("batch", False, bad)
    perm = torch.randperm(n, generator=gen)
    bad = _equal(rows(perm), tuple(o[perm.to(o.device)] for o in full), "permuted batch")
    if bad:
        return CheckResult("batch", False, bad)
    padding, _ = make_inputs(contract, case, dtype, sizes={bdim: pad}, seed=seed + 2, device=device)
    padded = rows(torch.arange(n), padding)
    bad = _equal(tuple(o[:n] for o in padded), full, f"batch with {pad} padding rows")
    if bad:
        return CheckResult("batch", False, bad)
    half = rows(torch.arange(n // 2))
    bad = _equal(half, tuple(o[: n // 2] for o in full), f"first {n // 2} rows as a batch")
    if bad:
        return CheckResult("batch", False, bad)
    return CheckResult("batch", True, f"alone x{alone}, permuted, padded +{pad}, prefix: equal")


CHECKS = {
    "accuracy": check_accuracy,
    "run_to_run": check_run_to_run,
    "batch": check_batch_invariance,
}


def run_kit(
    impl: Implementation, contract: Contract, dtype: str, device: str = "cpu", seed: int = 0
) -> list[CheckResult]:
    """Every check the contract owes, for every conformance case."""
    run = runner_for(impl)
    results = []
    for ci, case in enumerate(contract.conformance.cases):
        for name in ["accuracy", *contract.invariance]:
            r = CHECKS[name](run, contract, case, dtype, seed=seed + ci, device=device)
            results.append(CheckResult(f"case{ci}.{r.check}", r.ok, r.detail, r.value))
    return results
