"""Contract-checked dispatch.

>>> from opcontract import dispatch
>>> logp = dispatch.op("softcap_logprob")(hidden, weight, targets, softcap=20.0)
>>> print(dispatch.explain("softcap_logprob", hidden, weight, targets, softcap=20.0))
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from opcontract.backends.registry import implementations
from opcontract.contracts import get_contract
from opcontract.dispatch import call_cache
from opcontract.dispatch.call_cache import UNTRIED, CachedCall
from opcontract.dispatch.device import _active as _simulate_blocks
from opcontract.dispatch.device import simulate, simulating
from opcontract.dispatch.provenance import Provenance, last_provenance, record
from opcontract.dispatch.provenance import _local as _provenance_local
from opcontract.dispatch.select import MODES, check_plan_request, route_string
from opcontract.dispatch.shell import bypass_op, layout_copies, op_shell, resolve
from opcontract.dispatch.validate import BoundCall, bind, check_values, signature
from opcontract.errors import NoBackendError

__all__ = ["OpFunction", "Provenance", "Report", "explain", "last_provenance", "op", "simulate"]

_LOWER = (torch.float16, torch.bfloat16, torch.float32)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _check_backend(name: str, backend: str | None) -> None:
    if backend is None:
        return
    impls = implementations(name)
    known = sorted({i.backend for i in impls} | {i.name for i in impls})
    if backend not in known:
        raise ValueError(f"{name}: unknown backend {backend!r}; known: {', '.join(known)}")


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
    copies: dict[str, str] = field(default_factory=dict)  # input -> layout it is copied to
    plan: str | None = None  # the backward plan that would run
    plan_memory: dict[str, int] = field(default_factory=dict)  # bytes of each offered plan
    memory_budget: int | None = None

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
        if self.plan:
            from opcontract.dispatch.select import format_bytes

            need = self.plan_memory
            others = "; ".join(f"{n}: {format_bytes(b)}" for n, b in need.items() if n != self.plan)
            budget = (
                f", budget {format_bytes(self.memory_budget)}"
                if self.memory_budget is not None
                else ""
            )
            lines.append(
                f"  backward plan: {self.plan}, {format_bytes(need[self.plan])} beyond inputs and "
                f"gradients ({others}{budget}); the plans give the same bits"
            )
        for name, layout in self.copies.items():
            lines.append(f"  copies '{name}' to a {layout} layout first (as given it is not)")
        for name in self.accepted:
            if name != self.implementation:
                lines.append(f"  also eligible: {name}")
        for name, why in self.rejected.items():
            lines.append(f"  rejected {name}: {why}")
        return "\n".join(lines)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_dispatch_modes = torch._C._len_torch_dispatch_stack  # 0: _get_current_dispatch_mode() is None
_grad_enabled, _compiling = torch.is_grad_enabled, torch.compiler.is_compiling


def _autocast_on() -> bool:
    return _any_autocast() and (
        torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    )


def _autocast(policy: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Cast floating inputs as the contract's autocast policy says (``lower``: to the
    autocast dtype, float64 left alone, as nn.Linear; ``promote``: to the widest among them)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or not torch.is_autocast_enabled(tensors[0].device.type):
        return args, kwargs
    if policy == "lower":
        to = torch.get_autocast_dtype(tensors[0].device.type)
        want = _LOWER
    else:
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        if not floats:
            return args, kwargs
        to = functools.reduce(torch.promote_types, floats)
        want = tuple(set(floats))

    def cast(v):
        return v.to(to) if isinstance(v, torch.Tensor) and v.dtype in want else v

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _sources(names: tuple, args: tuple, kwargs: dict, bound: BoundCall) -> tuple:
    out = []
    for i, n in enumerate(names):
        if i < len(args):  # positional, None included (a plan takes it where it came)
            out.append((n, i))
        elif bound.inputs[n] is None:
            out.append((n, None))
        else:
            out.append((n, n))
    return tuple(out)


class OpFunction:
    """A contract-checked callable for one op. Built by :func:`op`."""

    def __init__(
        self,
        name: str,
        backend: str | None,
        mode: str,
        config: dict | None = None,
        plan: str | None = None,
        memory_budget: int | None = None,
    ):
        _check_mode(mode)
        self.contract = get_contract(name)
        _check_backend(name, backend)
        check_plan_request(self.contract, plan, memory_budget)
        self.name = name
        self.backend = backend
        self.mode = mode
        self.config = route_string(config, plan, memory_budget)
        self.shell = op_shell(name)
        self.sig = signature(name)
        self._route = (name, backend, mode, self.config)
        self._autocast = self.contract.autocast != "none"
        self._batched = tuple(r.batched for r in self.sig.inputs)
        self._fast: call_cache.FastEntry | None = None  # the last planned signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _compiling():  # before any state of this object is read: dynamo would guard on it
            return self._traced(args, kwargs)
        f = self._fast
        if (  # the last planned signature again, under no_grad: its plan, no memo key built
            f is not None
            and not _grad_enabled()
            and not _dispatch_modes()
            and not (self._autocast and _autocast_on())
            and not _simulate_blocks[0]
            and f.match(args, kwargs)
        ):
            hit = f.call
            out = hit.plan(*args, *hit.absent)
            if out is not None:
                _provenance_local.last = f.provenance  # record(f.provenance), inlined
                return out[0] if self.shell.lone else self.shell.build_result(out, hit.params, None)
        autocast = self._autocast and _autocast_on()
        if autocast:
            args, kwargs = _autocast(self.contract.autocast, args, kwargs)
        sh = self.shell
        k = None if simulating() else call_cache.key(self._route, args, kwargs)
        hit = call_cache.get(k)
        if hit is None:
            hit = self._prepare(args, kwargs)
            call_cache.put(k, hit)
        route = hit.route
        if route.impl is None:
            raise NoBackendError(self.name, route.rejected, requested=self.backend)
        plan = hit.plan
        if (
            plan is not None
            and plan is not UNTRIED
            and not autocast
            and len(args) == hit.n_args
            and _get_current_dispatch_mode() is None
            and not (torch.is_grad_enabled() and any(a.requires_grad for a in args))
        ):  # a hit's positional args are plain tensors (the key admits no other)
            out = plan(*args, *hit.absent)
            if out is not None:
                record(route.provenance)
                if not torch.is_grad_enabled() and (f is None or f.call is not hit):
                    if hit.fast is UNTRIED:  # compiled once per signature, not per switch
                        hit.fast = call_cache.fast_entry(k, args, kwargs, hit)
                    self._fast = hit.fast
                return out[0] if sh.lone else sh.build_result(out, hit.params, None)
        inputs, params, lead = hit.inputs(args, kwargs), hit.params, hit.lead
        if lead is not None:
            inputs = self._flatten(inputs, len(lead))
        if bypass_op(*inputs.values()):
            if autocast:
                with _autocast_off():
                    out = sh.run_forward(route, inputs, params, grad=False)
            else:
                out = sh.run_forward(route, inputs, params, grad=False)
                if plan is UNTRIED:
                    hit.plan = self._plan(route, hit, inputs)
        else:
            out = sh.call_forward(inputs, params, self.backend or "", self.mode, self.config)
        return sh.build_result(out, params, lead)

    def _traced(self, args: tuple, kwargs: dict) -> Any:
        """Under torch.compile: validation on fake tensors, the library op, no memo."""
        if self._autocast and _autocast_on():
            args, kwargs = _autocast(self.contract.autocast, args, kwargs)
        bound = bind(self.sig, args, kwargs)
        inputs = bound.inputs
        if bound.lead is not None:
            inputs = self._flatten(inputs, len(bound.lead))
        sh = self.shell
        out = sh.call_forward(inputs, bound.params, self.backend or "", self.mode, self.config)
        return sh.build_result(out, bound.params, bound.lead)

    def _plan(self, route, hit: CachedCall, inputs: dict) -> Any:
        """The implementation's call plan for this signature (after one call of it ran), or
        None: where it has none, where index values would be read back from a GPU on every
        call, or where the call's inputs aren't passed as the plan takes them. Index values
        on the host are checked by the plan itself, on every call, before it runs."""
        make = route.impl.plan_no_grad
        if make is None or hit.absent is None:
            return None
        if not self.sig.value_checked:
            return make(route.config, dict(inputs), hit.params, hit.lead)
        if hit.lead is not None or any(
            inputs[r.name] is not None and inputs[r.name].device.type != "cpu"
            for r in self.sig.inputs
            if r.host or r.values is not None
        ):
            return None
        plan = make(route.config, dict(inputs), hit.params, hit.lead)
        if plan is None:
            return None
        sig, params, sizes, names = self.sig, hit.params, dict(hit.sizes), self.sig.input_names

        def checked(*args: Any) -> Any:
            check_values(sig, dict(zip(names, args, strict=True)), params, sizes)
            return plan(*args)

        return checked

    def _prepare(self, args: tuple, kwargs: dict) -> CachedCall:
        bound = bind(self.sig, args, kwargs)
        route = resolve(self.contract, bound, self.backend, self.mode, self.config)
        return CachedCall(
            _sources(self.sig.input_names, args, kwargs, bound),
            bound.params,
            bound.sizes,
            bound.lead,
            route,
        )

    def _flatten(self, inputs: dict, n_lead: int) -> dict:
        return {
            n: (t.reshape(-1, *t.shape[n_lead:]) if b and t is not None else t)
            for (n, t), b in zip(inputs.items(), self._batched, strict=True)
        }

    def __repr__(self) -> str:
        return f"OpFunction({self.name!r}, backend={self.backend!r}, mode={self.mode!r})"


@contextlib.contextmanager
def _autocast_off():
    """Implementations run as without autocast (their inputs were cast by the policy)."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        yield


def op(
    name: str,
    *,
    backend: str | None = None,
    mode: str = "strict",
    config: dict | None = None,
    plan: str | None = None,
    memory_budget: int | None = None,
) -> OpFunction:
    """The contract-checked callable for ``name``.

    ``backend`` forces a backend (``"triton"``) or implementation (``"triton.fused"``);
    ``mode="relaxed"`` also admits implementations that don't satisfy the contract's
    numerics (stock library paths), still validating every input. ``config`` forces a
    launch config, which must lie in the selected implementation's declared space (what the
    tuner does to time candidates). ``plan`` picks one of the contract's backward plans
    (``"token_chunks"``); ``memory_budget`` (bytes) keeps the backward to plans that
    allocate at most that much beyond inputs and gradients. Plans give the same bits.
    """
    return OpFunction(name, backend, mode, config, plan, memory_budget)


def explain(
    name: str,
    *args: Any,
    backend: str | None = None,
    mode: str = "strict",
    config: dict | None = None,
    plan: str | None = None,
    memory_budget: int | None = None,
    **kwargs: Any,
) -> Report:
    """Validate the call and report which implementation would serve it, and why not the rest;
    for ops with backward plans, the plan that would run and each plan's memory."""
    _check_mode(mode)
    _check_backend(name, backend)
    contract = get_contract(name)
    if contract.autocast != "none" and _autocast_on():
        args, kwargs = _autocast(contract.autocast, args, kwargs)
    bound = bind(signature(name), args, kwargs)
    from opcontract.dispatch.select import call_info, select

    sel = select(contract, call_info(bound), backend, mode, config, plan, memory_budget)
    inputs = bound.inputs
    if bound.lead is not None:  # the leading dims are flattened first: the rows decide
        inputs = OpFunction(name, backend, mode, config)._flatten(inputs, len(bound.lead))
    copies = layout_copies(sel.selected, inputs) if sel.selected else {}
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
        copies=copies,
        plan=sel.plan,
        plan_memory=dict(sel.plan_memory),
        memory_budget=sel.memory_budget,
    )
