"""The implementation registry: what each backend implementation declares, and the one
function that decides whether it may serve a call (used by dispatch, explain, lint, tuner)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opcontract.contracts.schema import Contract, ReductionPlan

BACKENDS = ("torch", "triton", "cute")
PLAN_KEY = "backward_plan"  # the config parameter that picks one of the contract's plans


@dataclass(frozen=True)
class DeviceInfo:
    """Where a call runs. ``capability`` is (major, minor) for CUDA devices, else None."""

    type: str
    capability: tuple[int, int] | None = None
    name: str = ""

    def __str__(self) -> str:
        if self.type == "cuda":
            return f"{self.name or 'cuda'} (SM{self.capability[0]}{self.capability[1]})"
        return self.type


@dataclass(frozen=True)
class CallInfo:
    """What selection needs to know about a validated call."""

    device: DeviceInfo
    dtype: str
    sizes: Mapping[str, int]
    params: Mapping[str, Any]


LAYOUTS = ("any", "rows", "contiguous")
"""What an implementation needs of a tensor's strides. any: every stride, offset and
expanded (stride-0) view; rows: unit stride along the last dim and no stride-0 dim;
contiguous: row-major. The op shell copies a tensor that falls short (explain says so)."""


@dataclass(frozen=True)
class Implementation:
    """One implementation of one op, with everything it promises about its numerics.

    ``forward(config, **inputs, **params)`` returns the contract's outputs then its
    residuals, in contract order (None for an output not asked for). ``backward(config,
    saved, grads, needs, **params)`` gets the tensors the contract's ``backward.saves``
    names, the upstream gradients of the differentiable outputs (None where there is none)
    and which inputs need a gradient; it returns {input: gradient or None}.
    ``forward_no_grad``, where given, returns the same outputs with the residuals None (what
    a call that builds no autograd graph runs: no buffers for the backward).
    ``plan_no_grad(config, inputs, params, lead)``, where given, is called after such a call
    of one signature ran (``inputs`` flattened, ``lead`` the caller's leading dims or None);
    it returns that signature's call plan, or None: a function of the caller's inputs in
    contract order (leading dims kept) that returns what ``forward_no_grad`` returns with
    each output shaped for the caller, or None where it can't serve a call (the shell then
    takes the full path); the bits are forward_no_grad's. ``config`` is a
    dict over ``config_space``; ``default_config(call)`` gives the canonical config.
    ``layout`` maps input (and, in the backward, output) names, or "*", to a LAYOUTS entry.
    ``plan_memory(call, config)`` gives, per backward plan of the contract's ``plans`` the
    implementation offers (its ``backward_plan`` config values), the bytes that plan
    allocates beyond its inputs and returned gradients. ``backward_only``: config keys the
    forward never reads (a forward-timed sweep leaves them at the canonical value).
    """

    op: str
    backend: str
    name: str
    forward: Callable[..., Any]
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    plan: Mapping[str, ReductionPlan]
    invariances: tuple[str, ...]
    backward: Callable[..., Any] | None = None
    forward_no_grad: Callable[..., Any] | None = None
    plan_no_grad: Callable[..., Any] | None = None
    layout: Mapping[str, str] = field(default_factory=dict)
    grad_invariances: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    features: tuple[str, ...] = ()
    capability: tuple[tuple[int, int], tuple[int, int]] | None = None
    config_space: Mapping[str, tuple] = field(default_factory=dict)
    default_config: Callable[[CallInfo], dict] = lambda call: {}
    available: Callable[[], str | None] = lambda: None
    device_check: Callable[[DeviceInfo], str | None] = lambda device: None
    priority: Mapping[str, int] = field(default_factory=dict)
    relaxed_only: bool = False
    plan_memory: Callable[[CallInfo, dict], dict[str, int]] | None = None
    backward_only: tuple[str, ...] = ()
    summary: str = ""
    source: tuple[str, int] = ("<unknown>", 0)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"{self.name}: backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        bad = {k: v for k, v in self.layout.items() if v not in LAYOUTS}
        if bad:
            raise ValueError(f"{self.name}: layout values must be among {LAYOUTS}, got {bad}")

    def layout_of(self, name: str) -> str:
        return self.layout.get(name, self.layout.get("*", "any"))


class _Registry(dict):
    """The registry's dict; every change bumps ``generation`` (dispatch's memo keys on it)."""

    generation = 0

    def __setitem__(self, key: str, value: Implementation) -> None:
        _Registry.generation += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        _Registry.generation += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        _Registry.generation += 1
        return super().pop(*args)


_REGISTRY: dict[str, Implementation] = _Registry()


def generation() -> int:
    """Changes whenever an implementation is added, replaced or removed."""
    return _Registry.generation


def register(**kwargs: Any) -> Implementation:
    """Register an implementation (see :class:`Implementation` for the fields)."""
    frame = inspect.stack()[1]
    impl = Implementation(**kwargs, source=(frame.filename, frame.lineno))
    if impl.name in _REGISTRY and _REGISTRY[impl.name].source != impl.source:
        raise ValueError(f"implementation name '{impl.name}' registered twice")
    _REGISTRY[impl.name] = impl
    return impl


def implementations(op: str | None = None) -> list[Implementation]:
    """Registered implementations (of one op, or all), in registration order."""
    from opcontract import backends

    backends.load()
    return [i for i in _REGISTRY.values() if op is None or i.op == op]


def implementation(name: str) -> Implementation:
    """The registered implementation called ``name``."""
    from opcontract import backends

    backends.load()
    if name not in _REGISTRY:
        raise KeyError(f"no implementation '{name}'; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def declaration_problems(impl: Implementation, contract: Contract) -> list[str]:
    """Ways the implementation's declaration falls short of the contract (empty: conforms)."""
    out: list[str] = []
    served = contract.float_dtypes()
    for dt in impl.dtypes:
        if dt not in served:
            out.append(f"declares dtype {dt}, which the contract does not serve")
    for name, red in contract.reductions.items():
        p = impl.plan.get(name)
        if p is None:
            out.append(f"declares no plan for reduction '{name}'")
            continue
        if "library" in (p.block, p.order, p.split):
            out.append(f"reduction '{name}' runs in a library-chosen order")
            continue
        if p.accumulate != red.accumulate:
            out.append(
                f"reduction '{name}' accumulates in {p.accumulate}, contract needs {red.accumulate}"
            )
        if p.order != red.order:
            out.append(f"reduction '{name}' runs in {p.order} order, contract needs {red.order}")
        if red.block != "impl" and p.block != red.block:
            out.append(f"reduction '{name}' uses block {p.block}, contract pins {red.block}")
        if p.merge != red.merge:
            out.append(f"reduction '{name}' merges with {p.merge}, contract needs {red.merge}")
        if red.split == "none" and p.split == "fixed_blocks":
            out.append(
                f"reduction '{name}' splits into parallel partials, contract forbids a split"
            )
    for name in impl.plan:
        if name not in contract.reductions:
            out.append(f"declares a plan for unknown reduction '{name}'")
    for inv in contract.invariance:
        if inv not in impl.invariances:
            out.append(f"does not guarantee '{inv}' invariance")
    if contract.grads and impl.backward is None:
        out.append("has no backward")
    for name, invs in contract.grads.items():
        if name not in impl.grad_invariances:
            out.append(f"has no gradient for '{name}'")
            continue
        for inv in invs:
            if inv not in impl.grad_invariances[name]:
                out.append(f"gradient of '{name}' does not guarantee '{inv}' invariance")
    for feat in impl.features:
        if feat in contract.forbid:
            out.append(f"uses forbidden feature '{feat}'")
    out += plan_problems(impl, contract)
    return out


def plan_problems(impl: Implementation, contract: Contract) -> list[str]:
    """How an implementation's backward plans (its ``backward_plan`` config values) fall short
    of the contract's ``plans``: each must be one of them, with its memory declared. An
    implementation may offer none (it runs one backward, of the same bits)."""
    offered = tuple(impl.config_space.get(PLAN_KEY, ()))
    unknown = [p for p in offered if p not in contract.plans]
    if unknown:
        known = ", ".join(contract.plans) or "none"
        return [f"offers backward plans {unknown} that the contract lacks (its plans: {known})"]
    if offered and impl.plan_memory is None:
        return ["offers backward plans without declaring their memory (plan_memory)"]
    return []


def offered_plans(impl: Implementation) -> tuple[str, ...]:
    """The contract plans an implementation lets its config choose between."""
    return tuple(impl.config_space.get(PLAN_KEY, ())) if impl.plan_memory is not None else ()


def rejection(impl: Implementation, contract: Contract, call: CallInfo, mode: str) -> str | None:
    """Why ``impl`` may not serve ``call`` under ``mode``; None when it may.

    The single statement of an implementation's constraint set.
    """
    why = impl.available()
    if why:
        return why
    dev = call.device
    if dev.type not in impl.devices:
        return f"runs on {', '.join(impl.devices)}, not {dev.type}"
    if dev.type == "cuda" and impl.capability is not None:
        lo, hi = impl.capability
        if not (lo <= dev.capability <= hi):
            return (
                f"needs compute capability SM{lo[0]}{lo[1]} to SM{hi[0]}{hi[1]}, "
                f"this GPU is SM{dev.capability[0]}{dev.capability[1]}"
            )
    why = impl.device_check(dev)
    if why:
        return why
    if call.dtype not in impl.dtypes:
        return f"serves {', '.join(impl.dtypes)}, not {call.dtype}"
    if mode == "strict":
        problems = declaration_problems(impl, contract)
        if impl.relaxed_only and not problems:
            problems = ["is registered for relaxed mode only"]
        if problems:
            return "does not satisfy the contract: " + "; ".join(problems)
    return None
