"""Choose the implementation that serves a validated call, and say why the others can't."""

from __future__ import annotations

from dataclasses import dataclass, field

from opcontract.backends.registry import (
    CallInfo,
    Implementation,
    implementations,
    rejection,
)
from opcontract.contracts.schema import Contract
from opcontract.dispatch.device import device_of
from opcontract.dispatch.validate import BoundCall
from opcontract.tuning.db import bucket_of, default_db, shape_key

MODES = ("strict", "relaxed")


@dataclass
class Selection:
    call: CallInfo
    selected: Implementation | None
    config: dict = field(default_factory=dict)
    accepted: list[Implementation] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    tuning_entry: str | None = None


def call_info(bound: BoundCall) -> CallInfo:
    first = next(iter(bound.inputs.values()))
    return CallInfo(device_of(first), bound.dtype, dict(bound.sizes), dict(bound.params))


def select(contract: Contract, bound: BoundCall, backend: str | None, mode: str) -> Selection:
    """Keep the implementations that may serve the call. Where the tuning tables time some of
    them for this call's bucket, the fastest of those serves; else the highest priority.

    ``backend`` names a backend (``triton``) or one implementation (``triton.fused``).
    """
    call = call_info(bound)
    sel = Selection(call, None)
    for impl in implementations(contract.op):
        why = rejection(impl, contract, call, mode)
        if why is None and backend is not None and backend not in (impl.backend, impl.name):
            why = f"not requested (backend={backend!r})"
        if why is None:
            sel.accepted.append(impl)
        else:
            sel.rejected[impl.name] = why
    if sel.accepted:
        tuned = {i.name: _entry(contract, call, i) for i in sel.accepted}
        timed = [i for i in sel.accepted if tuned[i.name] and tuned[i.name].median_ms]
        if timed:  # the tables measured these here: the fastest one serves
            sel.selected = min(timed, key=lambda i: tuned[i.name].median_ms)
        else:
            sel.selected = max(sel.accepted, key=lambda i: i.priority.get(call.device.type, 0))
        sel.config = sel.selected.default_config(call)
        entry = tuned[sel.selected.name]
        if entry is not None:
            sel.config = {**sel.config, **entry.config}
            sel.tuning_entry = entry.describe()
    return sel


def _entry(contract: Contract, call: CallInfo, impl: Implementation):
    """The tuning table's entry for this implementation and call bucket, or None."""
    if not impl.config_space:
        return None
    return default_db().lookup(
        call.device,
        contract.op,
        impl.name,
        call.dtype,
        shape_key(call.sizes, contract.conformance.batch_dim),
        bucket_of(call.sizes.get(contract.conformance.batch_dim, 0)),
        contract.sha256,
    )
