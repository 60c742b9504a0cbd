"""Choose the implementation that serves a validated call, and say why the others can't."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from opcontract.backends.registry import (
    PLAN_KEY,
    CallInfo,
    Implementation,
    implementations,
    offered_plans,
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
    plan: str | None = None  # the backward plan that runs (the config's backward_plan)
    plan_memory: dict[str, int] = field(default_factory=dict)  # bytes per offered plan
    memory_budget: int | None = None


def route_string(config: dict | None, plan: str | None, memory_budget: int | None) -> str:
    """The route's ``config`` string, as the custom ops carry it: the forced config's JSON,
    with the caller's plan and memory budget where given ("" for none of them)."""
    if plan is None and memory_budget is None:
        return json.dumps(config, sort_keys=True) if config else ""
    return json.dumps(
        {"config": config, "plan": plan, "memory_budget": memory_budget}, sort_keys=True
    )


def route_options(text: str) -> tuple[dict | None, str | None, int | None]:
    """(config, plan, memory_budget) of a route string (see :func:`route_string`)."""
    if not text:
        return None, None, None
    data = json.loads(text)
    if set(data) == {"config", "plan", "memory_budget"}:
        return data["config"], data["plan"], data["memory_budget"]
    return data, None, None


def check_plan_request(contract: Contract, plan: str | None, memory_budget: int | None) -> None:
    """A plan the contract doesn't declare, or a budget that is no number of bytes, is a
    ContractViolation naming the argument."""
    from opcontract.errors import ContractViolation

    if plan is not None and plan not in contract.plans:
        known = ", ".join(contract.plans) if contract.plans else "none (it declares no plans)"
        raise ContractViolation(
            contract.op, "plan", "plans", f"no plan {plan!r}; the contract's plans: {known}"
        )
    if memory_budget is not None:
        if not contract.plans:
            raise ContractViolation(
                contract.op, "memory_budget", "plans", "the op declares no plans to budget"
            )
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int):
            raise ContractViolation(
                contract.op, "memory_budget", "plans",
                f"must be an int number of bytes, got {memory_budget!r}",
            )  # fmt: skip
        if memory_budget < 0:
            raise ContractViolation(
                contract.op, "memory_budget", "plans", f"{memory_budget} bytes is negative"
            )


def choose_plan(
    contract: Contract,
    impl: Implementation,
    call: CallInfo,
    config: dict,
    plan: str | None,
    memory_budget: int | None,
) -> tuple[str | None, dict[str, int]]:
    """(the backward plan that runs, each offered plan's bytes). The caller's plan, else the
    config's (tuned or canonical) if it fits the budget, else the first of the contract's
    plans that does; none that fits is a ContractViolation naming the budget."""
    from opcontract.errors import ContractViolation

    offered = offered_plans(impl)
    if not contract.plans or not offered:
        if plan is None and memory_budget is None:
            return None, {}
        arg = "plan" if plan is not None else "memory_budget"
        raise ContractViolation(
            contract.op, arg, "plans", f"{impl.name} offers no backward plans to choose from"
        )
    if plan is not None and plan not in offered:
        raise ContractViolation(
            contract.op, "plan", "plans", f"{impl.name} offers {list(offered)}, not {plan!r}"
        )
    need = {n: b for n, b in impl.plan_memory(call, config).items() if n in offered}
    first = config.get(PLAN_KEY) or next(n for n, p in contract.plans.items() if p.default)
    order = [plan] if plan is not None else [first, *(n for n in offered if n != first)]
    fits = [n for n in order if memory_budget is None or need[n] <= memory_budget]
    if not fits:
        which = f"plan {plan!r}" if plan is not None else "any backward plan"
        needs = ", ".join(f"{n} needs {need[n]} ({format_bytes(need[n])})" for n in order)
        raise ContractViolation(
            contract.op, "memory_budget", "plans",
            f"{memory_budget} bytes ({format_bytes(memory_budget)}) is too small for {which} of "
            f"{impl.name} at {dict(call.sizes)}: {needs}",
        )  # fmt: skip
    return fits[0], need


def format_bytes(n: int) -> str:
    """n bytes for people: 512 B, 1.50 KiB, 5.38 GiB."""
    if n < 1024:
        return f"{n} B"
    e = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**e:.2f} {'BKMGT'[e]}{'iB' if e else ''}"


def call_info(bound: BoundCall) -> CallInfo:
    first = next(t for t in bound.inputs.values() if t is not None)
    return CallInfo(device_of(first), bound.dtype, dict(bound.sizes), dict(bound.params))


def select(
    contract: Contract,
    call: CallInfo,
    backend: str | None,
    mode: str,
    config: dict | None = None,
    plan: str | None = None,
    memory_budget: int | None = None,
) -> Selection:
    """Keep the implementations that may serve the call. Where the tuning tables time some of
    them for this call's bucket, the fastest of those serves (entries of one objective
    compared: training times where there are any); else the highest priority.

    ``backend`` names a backend (``triton``) or one implementation (``triton.fused``).
    ``config`` (the tuner's candidates) replaces the tables' config; it must lie in the
    selected implementation's declared space, as a table entry must. ``plan`` names one of
    the contract's backward plans; ``memory_budget`` (bytes) bounds what the backward may
    allocate beyond its inputs and gradients (see :func:`choose_plan`): both move no bit.
    """
    check_plan_request(contract, plan, memory_budget)
    sel = _select(contract, call, backend, mode, config)
    sel.memory_budget = memory_budget
    if sel.selected is not None:
        sel.plan, sel.plan_memory = choose_plan(
            contract, sel.selected, call, sel.config, plan, memory_budget
        )
        if sel.plan is not None:
            sel.config = {**sel.config, PLAN_KEY: sel.plan}
    return sel


def _select(
    contract: Contract, call: CallInfo, backend: str | None, mode: str, config: dict | None
) -> Selection:
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
    timed = _comparable([i for i in sel.accepted if tuned[i.name] is not None], tuned)
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


def _comparable(timed: list[Implementation], tuned: dict) -> list[Implementation]:
    """The timed implementations whose entries time the same thing: those timed for
    training (forward and backward) where there are any, else those timed forward. A
    forward time beside a training time says nothing about which one is faster."""
    train = [i for i in timed if tuned[i.name].objective == "train"]
    return train or timed


def _entry(contract: Contract, call: CallInfo, impl: Implementation) -> Entry | None:
    """The tuning table's entry for this implementation and call bucket, or None."""
    if not impl.config_space:
        return None
    return default_db().lookup(
        call.device,
        contract.op,
        impl,
        call.dtype,
        shape_key(call.sizes, contract.conformance.batch_dim, contract.conformance.table_key,
                  call.params),  # fmt: skip
        bucket_of(call.sizes.get(contract.conformance.batch_dim, 0)),
        contract.numerics_sha256,
    )


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b
