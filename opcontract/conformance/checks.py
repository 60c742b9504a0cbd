"""The conformance kit: checks any implementation can be run through.

* accuracy: every float output within the contract's tolerance of the float64 oracle
  (||out - ref|| / ||ref||; equal to it where the oracle's output is all zeros), finite
  wherever the oracle's is; every integer output equal to the oracle's;
* batch invariance (``torch.equal``): rows computed alone, inside the batch, permuted,
  and with padding rows appended, all give the same bits;
* run-to-run: two identical calls give the same bits;
* for ops with gradients: gradient accuracy against float64 autograd of the oracle,
  run-to-run equality of every gradient, and batch invariance of gradients that promise
  it (a row's gradient depends only on that row and its upstream gradient).

Optional outputs are all asked for. A failure's detail names the first mismatching element.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opcontract import dispatch
from opcontract.backends.registry import Implementation
from opcontract.conformance.inputs import batch_inputs, make_inputs
from opcontract.contracts.schema import ConformanceCase, Contract
from opcontract.errors import ContractViolation


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


def named_outputs(contract: Contract, result: Any) -> dict[str, torch.Tensor]:
    """The call's outputs by contract name (a lone tensor is the first output)."""
    if isinstance(result, torch.Tensor):
        return {next(iter(contract.outputs)): result}
    return {n: getattr(result, n) for n in contract.outputs if getattr(result, n, None) is not None}


def reference_fn(contract: Contract) -> Callable[..., Any]:
    module, _, name = contract.reference.partition(":")
    return getattr(importlib.import_module(module), name)


def with_optional_outputs(contract: Contract, params: dict) -> dict:
    return {**params, **{o.when: True for o in contract.outputs.values() if o.when}}


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


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _error(out: torch.Tensor, ref: torch.Tensor, name: str) -> tuple[float, str, str | None]:
    """(error, how it reads, why it fails regardless of the tolerance, or None).

    The relative error ||out - ref|| / ||ref||; against a reference of norm zero (a token
    accuracy of 0, say) the absolute error, which must be 0 (an equal output): its error is
    then 0, or infinite. An output that is not finite where the reference is, or a NaN
    error (a non-finite reference), fails.
    """
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if o.shape != r.shape:
        return math.inf, "", f"{name}: shape {list(o.shape)}, the reference's {list(r.shape)}"
    lost = ~torch.isfinite(o) & torch.isfinite(r)
    if bool(lost.any()):
        idx = lost.nonzero()
        first = tuple(idx[0].tolist())
        return (
            math.nan,
            "",
            f"{name}: {idx.shape[0]} of {o.numel()} elements not finite where the reference "
            f"is; first at {list(first)}: {o[first].item()!r} vs {r[first].item()!r}",
        )
    if bool(torch.isfinite(r).all()) and r.norm().item() == 0:
        err = (o - r).abs().max().item() if o.numel() else 0.0
        if err == 0:
            return 0.0, f"{name} equal (reference 0)", None
        return math.inf, f"{name} abs. error {err:.3g} against a reference of 0", None
    err = _rel(o, r)
    if math.isnan(err):
        return err, "", f"{name}: relative error nan (the reference is not finite)"
    return err, f"{name} {err:.3g}", None


def _case(contract, case, dtype, seed, device, sizes=None):
    inputs, params = make_inputs(contract, case, dtype, sizes=sizes, seed=seed, device=device)
    return inputs, with_optional_outputs(contract, params)


def check_accuracy(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    inputs, params = _case(contract, case, dtype, seed, device)
    outs = named_outputs(contract, run(**inputs, **params))
    refs = named_outputs(contract, reference_fn(contract)(**inputs, **params))
    tol = contract.tolerance[dtype]
    worst, details = 0.0, []
    for name, ref in refs.items():
        out = outs.get(name)
        if out is None:
            return CheckResult("accuracy", False, f"output '{name}' missing")
        if not ref.is_floating_point():
            if not torch.equal(out.cpu(), ref.cpu()):
                return CheckResult("accuracy", False, drift(out.cpu(), ref.cpu(), name))
            details.append(f"{name} equal")
            continue
        err, detail, bad = _error(out, ref, name)
        if bad:
            return CheckResult("accuracy", False, bad, err)
        worst = max(worst, err)
        details.append(detail)
    return CheckResult(
        "accuracy", worst <= tol, f"rel. error {', '.join(details)} (tolerance {tol:g})", worst
    )


def check_run_to_run(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    inputs, params = _case(contract, case, dtype, seed, device)
    bad = _equal(outputs(run(**inputs, **params)), outputs(run(**inputs, **params)), "second call")
    return CheckResult("run_to_run", bad is None, bad or "two calls bitwise equal")


def _subsets(contract, case, dtype, seed, device, n, pad):
    """(name, row index, padding inputs or None) for each batch arrangement checked."""
    bdim = contract.conformance.batch_dim
    gen = torch.Generator().manual_seed(seed + 1)
    out = [
        (f"row {i} alone vs in a batch of {n}", torch.tensor([i]), None)
        for i in torch.randperm(n, generator=gen)[:3].tolist()
    ]
    out.append(("permuted batch", torch.randperm(n, generator=gen), None))
    padding, _ = make_inputs(contract, case, dtype, sizes={bdim: pad}, seed=seed + 2, device=device)
    out.append((f"batch with {pad} padding rows", torch.arange(n), padding))
    out.append((f"first {n // 2} rows as a batch", torch.arange(n // 2), None))
    return out


def _take(inputs, batched, idx, extra=None):
    rows = [k for k in batched if inputs[k] is not None]
    sub = {k: (v[idx.to(v.device)] if k in rows else v) for k, v in inputs.items()}
    if extra:
        sub = {k: (torch.cat([sub[k], extra[k]]) if k in rows else sub[k]) for k in sub}
    return sub


def check_batch_invariance(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
    pad: int = 5,
) -> CheckResult:
    """Rows alone, in the batch, permuted, with ``pad`` random rows appended, a prefix."""
    n = case.sizes[contract.conformance.batch_dim]
    inputs, params = _case(contract, case, dtype, seed, device)
    batched = batch_inputs(contract)
    bdim = contract.conformance.batch_dim
    rowwise = [o.shape[:1] == [bdim] for o in contract.outputs.values()]  # per-row outputs

    def per_row(result):  # a sum over the rows (a weight's gradient) is not a row's
        named = named_outputs(contract, result)
        return tuple(named[n] for n, r in zip(contract.outputs, rowwise, strict=True)
                     if r and n in named)  # fmt: skip

    full = per_row(run(**inputs, **params))
    for what, idx, extra in _subsets(contract, case, dtype, seed, device, n, pad):
        got = per_row(run(**_take(inputs, batched, idx, extra), **params))
        got = tuple(o[: len(idx)] for o in got)
        bad = _equal(got, tuple(o[idx.to(o.device)] for o in full), what)
        if bad:
            return CheckResult("batch", False, bad)
    return CheckResult("batch", True, f"alone x3, permuted, padded +{pad}, prefix: equal")


def _grads(fn, contract, inputs, params, upstream):
    """Gradients of sum(out * upstream[out]) over the differentiable outputs.

    ``upstream``: a dict of tensors, or a seed to draw them shaped like the outputs.
    """
    leaves = {
        k: (v.detach().clone().requires_grad_(True) if k in contract.grads and v is not None else v)
        for k, v in inputs.items()
    }
    outs = named_outputs(contract, fn(**leaves, **params))
    if isinstance(upstream, int):
        gen = torch.Generator().manual_seed(upstream)
        upstream = {
            n: torch.randn(outs[n].shape, generator=gen, dtype=torch.float64)
            for n, o in contract.outputs.items()
            if o.differentiable and n in outs
        }
    loss = sum((outs[n].double() * upstream[n].to(outs[n].device)).sum() for n in upstream)
    names = [k for k in contract.grads if leaves[k] is not None]
    grads = torch.autograd.grad(loss, [leaves[k] for k in names])
    return dict(zip(names, grads, strict=True))


def _upstream(contract, outs, seed, extra_rows=0):
    """Per-row upstream gradients for the differentiable outputs, ``extra_rows`` more rows."""
    gen = torch.Generator().manual_seed(seed + 7)
    return {
        name: torch.randn(
            (o.shape[0] + extra_rows, *o.shape[1:]), generator=gen, dtype=torch.float64
        ).to(o.device)
        for name, o in outs.items()
        if contract.outputs[name].differentiable
    }


def check_grad_accuracy(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    inputs, params = _case(contract, case, dtype, seed, device)
    got = _grads(run, contract, inputs, params, seed + 7)
    as64 = {
        k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in inputs.items()
    }
    ref = _grads(reference_fn(contract), contract, as64, params, seed + 7)
    tol = contract.grad_tolerance[dtype]
    bad = [k for k in got if got[k].dtype != inputs[k].dtype]
    if bad:
        return CheckResult("grad_accuracy", False, f"gradient of {bad} not in the input dtype")
    worst, details = 0.0, []
    for k in got:
        err, detail, why = _error(got[k], ref[k], f"grad {k}")
        if why:
            return CheckResult("grad_accuracy", False, why, err)
        worst = max(worst, err)
        details.append(detail)
    return CheckResult(
        "grad_accuracy", worst <= tol, ", ".join(details) + f" (tolerance {tol:g})", worst
    )


def check_grad_run_to_run(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    inputs, params = _case(contract, case, dtype, seed, device)
    a = _grads(run, contract, inputs, params, seed + 7)
    b = _grads(run, contract, inputs, params, seed + 7)
    bad = _equal(tuple(a.values()), tuple(b.values()), "gradients of a second call")
    return CheckResult("grad_run_to_run", bad is None, bad or "gradients bitwise equal")


def check_grad_batch_invariance(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
    pad: int = 5,
) -> CheckResult:
    """Rows of gradients promised batch-invariant, under the arrangements of ``batch``."""
    n = case.sizes[contract.conformance.batch_dim]
    inputs, params = _case(contract, case, dtype, seed, device)
    names = [k for k, inv in contract.grads.items() if "batch" in inv and inputs[k] is not None]
    batched = batch_inputs(contract)
    up = _upstream(contract, named_outputs(contract, run(**inputs, **params)), seed, pad)
    full = _grads(run, contract, inputs, params, {k: v[:n] for k, v in up.items()})
    for what, idx, extra in _subsets(contract, case, dtype, seed, device, n, pad):
        rows = idx.to(device)
        sub_up = {k: v[rows] for k, v in up.items()}
        if extra is not None:
            sub_up = {k: torch.cat([sub_up[k], v[n:]]) for k, v in up.items()}
        got = _grads(run, contract, _take(inputs, batched, idx, extra), params, sub_up)
        bad = _equal(
            tuple(got[k][: len(idx)] for k in names),
            tuple(full[k][rows] for k in names),
            f"gradient rows, {what}",
        )
        if bad:
            return CheckResult("grad_batch", False, bad)
    return CheckResult("grad_batch", True, f"{names}: alone, permuted, padded, prefix: equal")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values bit for bit (NaN payloads included), whatever the layouts."""
    return a.shape == b.shape and (a.numel() == 0 or torch.equal(_flat_bytes(a), _flat_bytes(b)))


def _snapshot(inputs: dict) -> dict:
    return {k: v.clone() for k, v in inputs.items() if v is not None}


def _unchanged(before: dict, inputs: dict) -> str | None:
    """None if every input holds the bytes it held before the call."""
    for k, v in before.items():
        if not same_bytes(v, inputs[k]):
            return f"input '{k}' was modified by the call"
    return None


def check_layout(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    """Every input as a transposed, sliced (every other element of a wider buffer), offset and
    expanded (stride-0) view, with NaN (an index input: its largest valid value) planted in
    the gaps, gives the bits of the same values laid out contiguously; no input is modified."""
    inputs, params = _case(contract, case, dtype, seed, device)
    done = []
    for name, t in inputs.items():
        if t is None or t.numel() == 0:
            continue
        for kind, view in strided_views(t, gap_value(contract, name, case, t)):
            dense = {**inputs, name: view.contiguous()}
            try:
                want = outputs(run(**dense, **params))
            except ContractViolation:
                continue  # these values make no valid call (an expanded index input, say)
            args = {**inputs, name: view}
            before = _snapshot(args)
            got = outputs(run(**args, **params))
            bad = _unchanged(before, args)
            if bad:
                return CheckResult("layout", False, f"{name} {kind}: {bad}")
            bad = _equal(got, want, f"'{name}' as a {kind} view")
            if bad:
                return CheckResult("layout", False, bad)
            done.append(f"{name} {kind}")
    return CheckResult("layout", True, "equal to contiguous: " + ", ".join(done))


def gap_value(contract: Contract, name: str, case: ConformanceCase, t: torch.Tensor):
    """What fills the gaps of a strided view: NaN, or an index input's largest valid value."""
    if t.is_floating_point():
        return float("nan")
    spec = contract.inputs[name].values
    if spec is None:
        return 0
    hi = spec.range[1]
    return (case.sizes[hi] if isinstance(hi, str) else hi) - 1


def strided_views(t: torch.Tensor, fill) -> list[tuple[str, torch.Tensor]]:
    """Views holding t's values (the expanded one: its first row's) in other layouts, their
    gaps filled with ``fill``."""
    out = []
    if t.dim() >= 2:
        out.append(("transposed", t.transpose(-1, -2).contiguous().transpose(-1, -2)))
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    out.append(("sliced", wide[..., ::2]))
    flat = torch.full((t.numel() + 3,), fill, dtype=t.dtype, device=t.device)
    flat[3:] = t.reshape(-1)
    out.append(("offset", flat[3:].view(t.shape)))
    if t.shape[0] > 1:
        out.append(("expanded", t[:1].expand(t.shape)))
    return out


def plant(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """NaN, +inf and -inf in one element each of ``rows`` (cycling through them)."""
    t = t.clone()
    for i, r in enumerate(rows):
        if r < t.shape[0]:
            at = torch.unravel_index(torch.tensor((7 * i + 1) % t[r].numel()), t[r].shape)
            t[r][at] = (float("nan"), float("inf"), -float("inf"))[i % 3]  # any strides
    return t


def nonfinite_rows(refs: dict, n: int) -> torch.Tensor | None:
    """The batch rows where a float output of the oracle is non-finite ([n] bool); with no
    batched float output, one flag for the whole call; None when nothing is non-finite."""
    floats = [r.cpu() for r in refs.values() if r.is_floating_point()]
    rows = [r for r in floats if r.dim() and r.shape[0] == n]
    if rows:
        bad = torch.zeros(n, dtype=torch.bool)
        for r in rows:
            bad |= ~torch.isfinite(r).reshape(n, -1).all(dim=1) if r.numel() else bad
        return bad
    if any(not torch.isfinite(r).all() for r in floats):
        return torch.ones(1, dtype=torch.bool)
    return None


def nonfinite_problem(
    contract: Contract, name: str, out, ref, tol: float, bad_rows, floor: float = 0.0
) -> str | None:
    """``out`` against the float64 oracle ``ref`` under the contract's nonfinite rule.
    ``bad_rows``: ``nonfinite_rows`` of the oracle's outputs. The finite elements' error is
    relative to ||ref||, or to ``floor`` where that is larger (an oracle that cancels to
    ~1e-17 where the exact value is 0 has no relative error to speak of)."""
    nf = contract.nonfinite
    out, ref = out.cpu(), ref.cpu()
    if bad_rows is not None and bad_rows.any() and name in nf.unspecified:
        if out.dim() == 0 or bad_rows.shape[0] != out.shape[0]:
            return None  # one value for the whole call, or no row to tell apart
        out, ref = out[~bad_rows], ref[~bad_rows]
    if not ref.is_floating_point():
        return None if torch.equal(out, ref) else drift(out, ref, name)
    o, r = out.double(), ref.double()
    if (torch.isnan(r) & ~torch.isnan(o)).any():
        return f"{name}: not NaN where the float64 math gives NaN"
    inf = torch.isinf(r)
    ok = (o == r) | (torch.isnan(o) if name in nf.inf_as_nan else torch.zeros_like(inf))
    if (inf & ~ok).any():
        return f"{name}: not the float64 math's infinity where it gives one"
    fin = torch.isfinite(r)
    if (fin & ~torch.isfinite(o)).any():
        return f"{name}: non-finite where the float64 math is finite"
    if fin.any():
        scale = max(r[fin].norm().item(), floor)
        err = (
            (o[fin] - r[fin]).norm().item() / scale
            if scale > 0
            else (o[fin] - r[fin]).norm().item()
        )
        if not err <= tol:
            return f"{name}: rel. error {err:.3g} over the finite elements (tolerance {tol:g})"
    return None


def check_nonfinite(
    run: Runner,
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    """NaN, +inf and -inf planted in rows of each batched float input, then in each shared
    float input: the outputs follow the contract's ``nonfinite`` rule against the float64
    oracle, and rows without a planted value keep the clean call's bits."""
    inputs, params = _case(contract, case, dtype, seed, device)
    bdim = contract.conformance.batch_dim
    n = case.sizes[bdim]
    rows = [1, n // 2, n - 1] if n > 2 else [0]
    batched = set(batch_inputs(contract))
    clean = named_outputs(contract, run(**inputs, **params))
    tol = contract.tolerance[dtype]
    done = []
    for name, t in inputs.items():
        if t is None or not t.is_floating_point() or t.numel() == 0:
            continue
        planted = {**inputs, name: plant(t, rows if name in batched else [0, 0, 0])}
        outs = named_outputs(contract, run(**planted, **params))
        as64 = {
            k: (v.double() if v is not None and v.is_floating_point() else v)
            for k, v in planted.items()
        }
        refs = named_outputs(contract, reference_fn(contract)(**as64, **params))
        bad_rows = nonfinite_rows(refs, n)
        for o_name, ref in refs.items():
            why = nonfinite_problem(contract, o_name, outs[o_name], ref, tol, bad_rows)
            if why:
                return CheckResult("nonfinite", False, f"non-finite values in '{name}': {why}")
        if name in batched:
            keep = torch.ones(n, dtype=torch.bool)
            keep[[r for r in rows if r < n]] = False
            for o_name, o in outs.items():
                if o.dim() and o.shape[0] == n and o_name in clean:
                    idx = keep.to(o.device)
                    if not torch.equal(o[idx], clean[o_name][idx]):
                        return CheckResult(
                            "nonfinite",
                            False,
                            drift(
                                o[idx],
                                clean[o_name][idx],
                                f"'{o_name}' rows without non-finite '{name}'",
                            ),
                        )
        done.append(name)
    return CheckResult("nonfinite", True, f"NaN/inf in {', '.join(done)}: as the float64 math")


CHECKS = {
    "accuracy": check_accuracy,
    "run_to_run": check_run_to_run,
    "batch": check_batch_invariance,
    "grad_accuracy": check_grad_accuracy,
    "grad_run_to_run": check_grad_run_to_run,
    "grad_batch": check_grad_batch_invariance,
    "layout": check_layout,
    "nonfinite": check_nonfinite,
}
# checks run on a contract's first conformance case only (they call the op many times)
FIRST_CASE_ONLY = ("layout",)


def checks_for(contract: Contract, case: ConformanceCase | None = None) -> list[str]:
    """Every check the contract owes (for one case: less the case's ``skip``; the layout
    check on the first case)."""
    names = ["accuracy", *contract.invariance]
    if contract.grads:
        names += ["grad_accuracy", "grad_run_to_run"]
        if any("batch" in inv for inv in contract.grads.values()):
            names.append("grad_batch")
    names.append("nonfinite")
    if case is None or case is contract.conformance.cases[0]:
        names += list(FIRST_CASE_ONLY)
    skip = set(case.skip) if case is not None else set()
    if "batch" in skip:
        skip.add("grad_batch")
    return [n for n in names if n not in skip]


def run_kit(
    impl: Implementation, contract: Contract, dtype: str, device: str = "cpu", seed: int = 0
) -> list[CheckResult]:
    """Every check the contract owes, for every conformance case."""
    run = runner_for(impl)
    results = []
    for ci, case in enumerate(contract.conformance.cases):
        for name in checks_for(contract, case):
            r = CHECKS[name](run, contract, case, dtype, seed=seed + ci, device=device)
            results.append(CheckResult(f"case{ci}.{r.check}", r.ok, r.detail, r.value))
    return results
