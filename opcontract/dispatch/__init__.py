"""Contract-checked dispatch.

>>> from opcontract import dispatch
>>> logp = dispatch.op("softcap_logprob")(hidden, weight, targets, softcap=20.0)
>>> print(dispatch.explain("softcap_logprob", hidden, weight, targets, softcap=20.0))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opcontract.contracts import get_contract
from opcontract.dispatch import call_cache
from opcontract.dispatch.call_cache import CachedCall
from opcontract.dispatch.device import simulate, simulating
from opcontract.dispatch.provenance import Provenance, last_provenance, record
from opcontract.dispatch.select import MODES, Selection, select
from opcontract.dispatch.validate import BoundCall, bind, check_values
from opcontract.errors import NoBackendError

__all__ = ["OpFunction", "Report", "explain", "last_provenance", "op", "simulate"]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


@dataclass(frozen=True)
class Report:
    """What dispatch would do for a call: the selected implementation and every rejection."""

    op: str
    mode: str
    device: str
    dtype: str
    sizes: dict[str, int]
    selected: str | None
    implementation: str | None
    config: dict[str, Any]
    accepted: list[str]
    rejected: dict[str, str]
    tuning_entry: str | None = None

    def __str__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        lines = [f"{self.op} [{self.mode}] on {self.device}, {self.dtype}, {sizes}"]
        if self.implementation:
            lines.append(
                f"  selected: {self.implementation} (backend {self.selected}) config {self.config}"
            )
        else:
            lines.append("  selected: none")
        if self.tuning_entry:
            lines.append(f"  tuned config from {self.tuning_entry}")
        for name in self.accepted:
            if name != self.implementation:
                lines.append(f"  also eligible: {name}")
        for name, why in self.rejected.items():
            lines.append(f"  rejected {name}: {why}")
        return "\n".join(lines)


def _report(name: str, mode: str, sel: Selection) -> Report:
    return Report(
        op=name,
        mode=mode,
        device=str(sel.call.device),
        dtype=sel.call.dtype,
        sizes=dict(sel.call.sizes),
        selected=sel.selected.backend if sel.selected else None,
        implementation=sel.selected.name if sel.selected else None,
        config=dict(sel.config),
        accepted=[i.name for i in sel.accepted],
        rejected=dict(sel.rejected),
        tuning_entry=sel.tuning_entry,
    )


def explain(
    name: str, *args: Any, backend: str | None = None, mode: str = "strict", **kwargs: Any
) -> Report:
    """Validate the call and report which implementation would serve it, and why not the rest."""
    _check_mode(mode)
    contract = get_contract(name)
    bound = bind(contract, args, kwargs)
    return _report(name, mode, select(contract, bound, backend, mode))


def _memo_entry(c, bound: BoundCall, sel: Selection, args, kwargs, mode) -> CachedCall:
    impl = sel.selected
    prov = None
    if impl is not None:
        prov = Provenance(
            op=c.op,
            contract_version=c.version,
            contract_sha256=c.sha256,
            backend=impl.backend,
            implementation=impl.name,
            config=dict(sel.config),
            device=str(sel.call.device),
            dtypes=dict(bound.dtypes),
            mode=mode,
            params=dict(bound.params),
            tuning_entry=sel.tuning_entry,
        )
    names = list(c.inputs)
    return CachedCall(
        positional=tuple(names[: len(args)]),
        keyword_inputs=frozenset(k for k in kwargs if k in c.inputs),
        absent=tuple(n for n in names[len(args) :] if n not in kwargs),
        params=dict(bound.params),
        sizes=dict(bound.sizes),
        value_checked=any(s.values is not None for s in c.inputs.values()),
        impl=impl,
        config=dict(sel.config),
        provenance=prov,
        rejected=dict(sel.rejected),
    )


def _host_side(fn: OpFunction, args: tuple, kwargs: dict) -> tuple[dict, CachedCall]:
    """Validation and selection, memoised per call signature."""
    c = fn.contract
    k = None if simulating() else call_cache.key(fn.name, fn.backend, fn.mode, args, kwargs)
    hit = call_cache.get(k)
    if hit is None:
        bound = bind(c, args, kwargs)
        sel = select(c, bound, fn.backend, fn.mode)
        hit = _memo_entry(c, bound, sel, args, kwargs, fn.mode)
        call_cache.put(k, hit)
        inputs = bound.inputs
    else:
        inputs = hit.inputs(args, kwargs)
        if hit.value_checked:
            check_values(c, inputs, hit.params, hit.sizes)
    if hit.impl is None:
        raise NoBackendError(fn.name, hit.rejected, requested=fn.backend)
    return inputs, hit


# Under torch.compile the host logic runs eagerly (a graph break), so the compiled graph
# holds only the op itself. Eager calls skip the disable wrapper's own cost.
_host_side_eager_in_compile = torch.compiler.disable(_host_side)


class OpFunction:
    """A contract-checked callable for one op. Built by :func:`op`."""

    def __init__(self, name: str, backend: str | None, mode: str) -> None:
        _check_mode(mode)
        self.contract = get_contract(name)
        self.name = name
        self.backend = backend
        self.mode = mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        host = _host_side_eager_in_compile if torch.compiler.is_compiling() else _host_side
        inputs, hit = host(self, args, kwargs)
        out = hit.impl.run(hit.config, **inputs, **hit.params)
        record(hit.provenance)
        return out

    def __repr__(self) -> str:
        return f"OpFunction({self.name!r}, backend={self.backend!r}, mode={self.mode!r})"


def op(name: str, *, backend: str | None = None, mode: str = "strict") -> OpFunction:
    """The contract-checked callable for ``name``.

    ``backend`` forces a backend (``"triton"``) or implementation (``"triton.fused"``);
    ``mode="relaxed"`` also admits implementations that don't satisfy the contract's
    numerics (stock library paths), still validating every input.
    """
    return OpFunction(name, backend, mode)
