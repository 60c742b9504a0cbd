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
from opcontract.tables.db import Entry, bucket_of, default_db, entry_problem, shape_key

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
    first = next(t for t in bound.inputs.values() if t is not None)
    return CallInfo(device_of(first), bound.dtype, dict(bound.sizes), dict(bound.params))


def select(
    contract: Contract,
    call: CallInfo,
    backend: str | None,
    mode: str,
    config: dict | None = None,
) -> Selection:
    """Keep the implementations that may serve the call. Where the tuning tables time some of
    them for this call's bucket, the fastest of those serves; else the highest priority.

    ``backend`` names a backend (``triton``) or one implementation (``triton.fused``).
    ``config`` (the tuner's candidates) replaces the tables' config; it must lie in the
    selected implementation's declared space, as a table entry must.
    """
    sel = Selection(call, None)
    for impl in implementations(contract.op):
        why = rejection(impl, contract, call, mode)
        if why is None and backend is not None and backend not in (impl.backend, impl.name):
            why = f"not requested (backend={backend!r})"
        if why is None:
            sel.accepted.append(impl)
        else:
            sel.rejected[impl.name] = why
    if not sel.accepted:
        return sel
    tuned = {i.name: _entry(contract, call, i) for i in sel.accepted}
    timed = [i for i in sel.accepted if tuned[i.name] is not None]
    if timed:  # the tables measured these here: the fastest one serves
        sel.selected = min(timed, key=lambda i: tuned[i.name].median_ms)
    else:
        sel.selected = max(sel.accepted, key=lambda i: i.priority.get(call.device.type, 0))
    impl = sel.selected
    sel.config = impl.default_config(call)
    if config is not None:  # what differs from the canonical config must be declared
        moved = {
            k: v for k, v in config.items() if k not in sel.config or not _same(sel.config[k], v)
        }
        forced = Entry({}, moved, contract.numerics_sha256, {}, 0.0, "the config asked for")
        why = entry_problem(forced, impl, contract.numerics_sha256)
        if why:
            raise ValueError(f"{contract.op}: config {config} for {impl.name}: {why}")
        sel.config = {**sel.config, **config}
        return sel
    entry = tuned[impl.name]
    if entry is not None:
        sel.config = {**sel.config, **entry.config}
        sel.tuning_entry = entry.describe()
    return sel


def _entry(contract: Contract, call: CallInfo, impl: Implementation) -> Entry | None:
    """The tuning table's entry for this implementation and call bucket, or None."""
    if not impl.config_space:
        return None
    return default_db().lookup(
        call.device,
        contract.op,
        impl,
        call.dtype,
        shape_key(call.sizes, contract.conformance.batch_dim),
        bucket_of(call.sizes.get(contract.conformance.batch_dim, 0)),
        contract.numerics_sha256,
    )


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b
