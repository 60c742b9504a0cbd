"""Validate a call against its contract: argument binding, ranks, leading batch dims, shape
symbols, dtypes, devices, param types and checks, and index ranges. Every failure is a
ContractViolation that names the argument and the contract field.

``bind`` needs only shapes, dtypes and params, so torch.compile runs it while it traces
(on fake tensors); it is written in plain Python over the precomputed :class:`Signature`
for that reason. ``check_values`` reads tensor values and runs inside the op.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from opcontract.contracts import get_contract
from opcontract.contracts.schema import SameAs, parse_check
from opcontract.errors import ContractViolation

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
DTYPE_NAMES = {
    getattr(torch, n): n
    for n in ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64")
    + ("uint8", "bool", "complex64", "complex128")
}


def dtype_name(t: torch.Tensor) -> str:
    name = DTYPE_NAMES.get(t.dtype)
    return name if name is not None else str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ParamRule:
    name: str
    kind: str  # float | int | bool | str
    default: Any
    choices: tuple | None
    terms: tuple[tuple[str, float], ...]  # the parsed check
    check: str | None
    required: bool = False
    present_when: tuple[tuple[str, tuple], ...] = ()


@dataclass(frozen=True)
class InputRule:
    name: str
    shape: tuple  # shape symbols and ints
    dtypes: tuple[str, ...]  # allowed dtype names; empty with same_as
    same_as: str | None
    optional: bool
    absent_when: tuple[tuple[str, tuple], ...]
    batched: bool  # its shape leads with the contract's batch_dims symbol
    values: tuple | None  # (low, high, allow param) of an index input
    host: bool = False  # may be a CPU tensor while the call runs on a GPU


@dataclass(frozen=True)
class Constraint:
    holds: Any  # fn(**sizes) -> bool
    argument: str
    message: str
    when: tuple[tuple[str, tuple], ...]
    index: int


@dataclass(frozen=True)
class Signature:
    """A contract's call signature in plain Python values (what ``bind`` reads)."""

    op: str
    inputs: tuple[InputRule, ...]
    params: tuple[ParamRule, ...]
    input_names: tuple[str, ...]
    param_names: tuple[str, ...]
    constraints: tuple[Constraint, ...]
    batch: str | None
    served: tuple[str, ...]
    value_checked: bool
    value_checks: tuple = ()  # the contract's value_checks, resolved to functions


@functools.cache
def signature(op: str) -> Signature:
    c = get_contract(op)
    inputs = tuple(
        InputRule(
            name=n,
            shape=tuple(s.shape),
            dtypes=() if isinstance(s.dtype, SameAs) else tuple(s.dtype),
            same_as=s.dtype.same_as if isinstance(s.dtype, SameAs) else None,
            optional=s.optional,
            absent_when=tuple((p, tuple(v)) for p, v in (s.absent_when or {}).items()),
            batched=c.batch_dims is not None and bool(s.shape) and s.shape[0] == c.batch_dims,
            values=None if s.values is None else (*s.values.range, s.values.allow),
            host=s.host,
        )
        for n, s in c.inputs.items()
    )
    params = tuple(
        ParamRule(
            name=n,
            kind=p.type,
            default=p.default,
            choices=tuple(p.choices) if p.choices is not None else None,
            terms=tuple(parse_check(p.check)) if p.check else (),
            check=p.check,
            required=p.required,
            present_when=tuple((k, tuple(v)) for k, v in (p.present_when or {}).items()),
        )
        for n, p in c.params.items()
    )
    symbols = sorted(c.symbols() | {n for n, p in c.params.items() if p.type == "int"})
    constraints = tuple(
        Constraint(
            holds=eval(f"lambda {', '.join(symbols)}, **_: ({k.require})", {"__builtins__": {}}),  # noqa: S307
            argument=k.argument,
            message=k.message,
            when=tuple((p, tuple(v)) for p, v in k.when.items()),
            index=i,
        )
        for i, k in enumerate(c.constraints)
    )
    return Signature(
        op=op,
        inputs=inputs,
        params=params,
        input_names=tuple(c.inputs),
        param_names=tuple(c.params),
        constraints=constraints,
        batch=c.batch_dims,
        served=tuple(c.float_dtypes()),
        value_checked=any(r.values is not None for r in inputs) or bool(c.value_checks),
        value_checks=tuple(_resolve(ref) for ref in c.value_checks),
    )


def _resolve(ref: str):
    import importlib

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class BoundCall:
    inputs: dict[str, torch.Tensor | None]
    params: dict[str, Any]
    sizes: dict[str, int]  # with leading batch dims, the batch symbol is their product
    dtypes: dict[str, str]
    dtype: str  # the dtype the op is served in (its first floating-point input's)
    device: torch.device | None
    lead: tuple | None  # the leading batch dims of the batched inputs, when they have any


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({type(value).__name__})"


def check_param(sig: Signature, rule: ParamRule, value: Any) -> Any:
    """The validated value of a param (an int given for a float becomes a float)."""
    op, name = sig.op, rule.name
    field = f"params.{name}"
    if value is None:
        if rule.required:
            raise ContractViolation(op, name, f"{field}.required", "missing (no default)")
        if rule.default is not None:
            raise ContractViolation(op, name, f"{field}.type", "may not be None")
        return None
    kind = rule.kind
    if isinstance(value, torch.Tensor):
        raise ContractViolation(op, name, f"{field}.type", f"must be a Python {kind}, got a tensor")
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, (int, float) if kind == "float" else int)
        ok = ok and not isinstance(value, bool)
    if not ok:
        raise ContractViolation(
            op, name, f"{field}.type", f"must be {kind}, got {type(value).__name__} {_show(value)}"
        )
    if kind == "float":
        try:
            value = float(value)
        except OverflowError:
            raise ContractViolation(
                op, name, f"{field}.type", f"{_show(value)} is outside the range of a float"
            ) from None
    elif kind == "int":
        if not INT64_MIN <= value <= INT64_MAX:
            raise ContractViolation(
                op, name, f"{field}.type", f"{_show(value)} is outside the range of int64"
            )
        value = int(value)
    if rule.choices is not None and value not in rule.choices:
        raise ContractViolation(
            op, name, f"{field}.choices", f"{_show(value)} is not one of {list(rule.choices)}"
        )
    for cmp, bound in rule.terms:
        if cmp == "finite":
            ok = math.isfinite(value)
        elif cmp == ">":
            ok = value > bound
        elif cmp == ">=":
            ok = value >= bound
        elif cmp == "<":
            ok = value < bound
        elif cmp == "<=":
            ok = value <= bound
        else:
            ok = value != bound
        if not ok:
            raise ContractViolation(
                op, name, f"{field}.check", f"{_show(value)} fails the check '{rule.check}'"
            )
    return value


def bind_params(sig: Signature, given: dict[str, Any]) -> dict[str, Any]:
    params = {r.name: check_param(sig, r, given.get(r.name, r.default)) for r in sig.params}
    for r in sig.params:
        for other, vals in r.present_when:
            wanted = params[other] in vals
            if wanted and params[r.name] is None:
                raise ContractViolation(
                    sig.op, r.name, f"params.{r.name}.present_when",
                    f"required when {other}={params[other]!r}",
                )  # fmt: skip
            if not wanted and params[r.name] is not None:
                raise ContractViolation(
                    sig.op, r.name, f"params.{r.name}.present_when",
                    f"must be None when {other}={params[other]!r} "
                    f"(it applies only when {other} is one of {list(vals)})",
                )  # fmt: skip
    return params


def bind(sig: Signature, args: tuple, kwargs: dict) -> BoundCall:
    """Bind and validate a call's shapes, dtypes, devices and params (no tensor values)."""
    op, names = sig.op, sig.input_names
    if len(args) > len(names):
        raise ContractViolation(
            op,
            f"positional #{len(args)}",
            "inputs",
            f"takes {len(names)} tensors positionally ({', '.join(names)}); "
            f"params are keyword-only",
        )
    inputs: dict[str, Any] = {}
    for i, a in enumerate(args):
        inputs[names[i]] = a
    given: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in names:
            if k in inputs:
                raise ContractViolation(op, k, "inputs", "given both positionally and by name")
            inputs[k] = v
        elif k in sig.param_names:
            given[k] = v
        else:
            raise ContractViolation(
                op,
                k,
                "signature",
                f"unexpected argument; inputs are {list(names)}, params are "
                f"{list(sig.param_names)}",
            )
    params = bind_params(sig, given)

    sizes: dict[str, Any] = {}
    bound_by: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    device = None
    first = None
    hosts: list[tuple[str, torch.device]] = []  # (name, device) of inputs declared host
    lead = None
    lead_from = None
    for rule in sig.inputs:
        name = rule.name
        absent = [f"{p}={params[p]!r}" for p, vals in rule.absent_when if params[p] in vals]
        t = inputs.get(name)
        if absent:
            if t is not None:
                raise ContractViolation(
                    op, name, f"inputs.{name}.absent_when", f"must be None when {', '.join(absent)}"
                )
            inputs[name] = None
            continue
        if t is None:
            if not rule.optional:
                raise ContractViolation(op, name, f"inputs.{name}", "missing")
            inputs[name] = None
            continue
        if not isinstance(t, torch.Tensor):
            raise ContractViolation(
                op, name, f"inputs.{name}", f"must be a torch.Tensor, got {type(t).__name__}"
            )
        if rule.host:
            hosts.append((name, t.device))
        elif device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ContractViolation(
                op, name, "device", f"is on {t.device}, but '{first}' is on {device}"
            )
        shape = tuple(t.shape)
        spec = rule.shape
        if rule.batched:
            n_lead = len(shape) - len(spec) + 1
            if n_lead < 1:
                raise ContractViolation(
                    op,
                    name,
                    f"inputs.{name}.shape",
                    f"must have rank >= {len(spec)} [..., {', '.join(map(str, spec[1:]))}] "
                    f"(leading dims are {spec[0]}), got shape {list(shape)}",
                )
            here = shape[:n_lead]
            if lead is None:
                lead, lead_from = here, name
            elif here != lead:
                sym = spec[0]
                why = (
                    f"{sym} = {here[0]} here but {sym} = {lead[0]} from '{lead_from}'"
                    if len(here) == len(lead) == 1
                    else f"leading dims {list(here)} here but {list(lead)} from '{lead_from}'"
                )
                raise ContractViolation(op, name, f"inputs.{name}.shape[0]", why)
            rows = 1
            for d in here:
                rows = rows * d
            shape = (rows, *shape[n_lead:])
        elif len(shape) != len(spec):
            raise ContractViolation(
                op,
                name,
                f"inputs.{name}.shape",
                f"must have rank {len(spec)} {list(spec)}, got shape {list(t.shape)}",
            )
        for i, dim in enumerate(spec):
            size = shape[i]
            if isinstance(dim, int):
                if size != dim:
                    raise ContractViolation(
                        op, name, f"inputs.{name}.shape[{i}]", f"must be {dim}, got {size}"
                    )
            elif dim in sizes:
                if sizes[dim] != size:
                    raise ContractViolation(
                        op,
                        name,
                        f"inputs.{name}.shape[{i}]",
                        f"{dim} = {size} here but {dim} = {sizes[dim]} from '{bound_by[dim]}'",
                    )
            else:
                sizes[dim] = size
                bound_by[dim] = name
        dt = dtype_name(t)
        dtypes[name] = dt
        if rule.same_as is not None:
            other = inputs.get(rule.same_as)
            if other is not None and isinstance(other, torch.Tensor):
                want = dtype_name(other)
                if dt != want:
                    raise ContractViolation(
                        op,
                        name,
                        f"inputs.{name}.dtype",
                        f"must have the dtype of '{rule.same_as}' ({want}), got {dt}",
                    )
        elif dt not in rule.dtypes:
            raise ContractViolation(
                op, name, f"inputs.{name}.dtype", f"must be one of {list(rule.dtypes)}, got {dt}"
            )

    for k in sig.constraints:
        if all(params.get(p) in vals for p, vals in k.when) and not k.holds(**sizes, **params):
            raise ContractViolation(op, k.argument, f"constraints[{k.index}]", k.message)

    dtype = dtypes[names[0]] if names[0] in dtypes else next(iter(dtypes.values()), "")
    for d in dtypes.values():
        if d in sig.served:
            dtype = d
            break
    if lead is not None and len(lead) == 1:
        lead = None  # already one row per item: nothing to flatten
    device = _host_inputs(op, hosts, device, first)
    return BoundCall(inputs, params, sizes, dtypes, dtype, device, lead)


def _host_inputs(op: str, hosts: list, device, first: str | None):
    """The call's device once its host-declared inputs are placed: each on the call's device,
    or all of them on the CPU while the call runs on a GPU (read without a wait)."""
    if not hosts:
        return device
    if device is None:
        return hosts[0][1]
    elsewhere = [(n, d) for n, d in hosts if d != device]
    if not elsewhere:
        return device
    for n, d in elsewhere:
        if d.type != "cpu" or device.type == "cpu":
            raise ContractViolation(
                op, n, "device", f"is on {d}, but '{first}' is on {device}"
            )  # fmt: skip
    if len(elsewhere) < len(hosts):
        n = next(n for n, d in hosts if d == device)
        raise ContractViolation(
            op, n, "device",
            f"is on {device}, but '{elsewhere[0][0]}' is on the CPU: index inputs are on the "
            f"CPU all together, or all on '{first}''s device",
        )  # fmt: skip
    return device


def check_values(sig: Signature, inputs: dict[str, Any], params: dict[str, Any], sizes) -> None:
    """The contract's index ranges (e.g. token ids below V): these read the tensors.

    Nothing is read from meta tensors (they hold no values), nor while a CUDA graph is being
    captured (the values don't exist yet: check the ids before replaying a captured graph).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    if any(t is not None and t.device.type == "meta" for t in inputs.values()):
        return  # no values to read
    pending = [p for p in (check(inputs, params) for check in sig.value_checks) if p is not None]
    read = _check_ranges(sig, inputs, params, sizes, [flags for flags, _ in pending])
    for (_, finish), values in zip(pending, read, strict=True):
        finish(values)


def _check_ranges(sig: Signature, inputs, params, sizes, flags: list = ()) -> list[list[int]]:
    """Every ranged input's min and max, and the value checks' ``flags`` (1-D int64 tensors),
    in one read-back (one host sync per call; none where they are all on the CPU); the
    offending values are looked for only when one is out. Returns each flags tensor's
    values, once every range holds."""
    ranged = []
    for rule in sig.inputs:
        if rule.values is None:
            continue
        t = inputs[rule.name]
        if t is None or t.numel() == 0 or t.device.type == "meta":
            continue
        low, high, allow_param = rule.values
        lo = sizes[low] if isinstance(low, str) else low
        hi = sizes[high] if isinstance(high, str) else high
        allow = params[allow_param] if allow_param is not None else None
        if allow is not None:
            info = torch.iinfo(t.dtype)
            if not info.min <= allow <= info.max:
                allow = None  # no element of this dtype can equal it
        ranged.append((rule, t, lo, hi, allow, allow_param))
    # (min, max) of each range: computed on the host where the tensor is (numpy: no torch
    # op), else read back with the flags in one copy
    host_stats = [_host_min_max(t, lo, allow) for _, t, lo, hi, allow, _ in ranged if lo < hi]
    parts = [
        torch.stack(torch.aminmax(t if allow is None else torch.where(t == allow, lo, t))).long()
        for (_, t, lo, hi, allow, _), known in zip(
            (r for r in ranged if r[2] < r[3]), host_stats, strict=True
        )
        if known is None
    ]
    n_stats = 2 * len(parts)  # a (min, max) pair per range read
    parts += list(flags)
    values = _read(parts) if parts else []
    read_stats = iter(values[i : i + 2] for i in range(0, n_stats, 2))
    stats = iter(known if known is not None else next(read_stats) for known in host_stats)
    for rule, t, lo, hi, allow, allow_param in ranged:
        if lo < hi:
            t_min, t_max = next(stats)
            if lo <= t_min and t_max < hi:
                continue
            ok = (t >= lo) & (t < hi)
        else:  # an empty range: only the sentinel may appear
            ok = torch.zeros_like(t, dtype=torch.bool)
        extra = ""
        if allow is not None:
            ok |= t == allow
            extra = f" or {allow_param}={allow}"
        bad = t[~ok]
        if bad.numel() == 0:
            continue
        raise ContractViolation(
            sig.op,
            rule.name,
            f"inputs.{rule.name}.values",
            f"must lie in [{lo}, {hi}){extra}; {bad.numel()} value(s) "
            f"do not, e.g. {bad.flatten()[0].item()}",
        )
    out, at = [], n_stats
    for f in flags:
        out.append(values[at : at + f.numel()])
        at += f.numel()
    return out


def _host_min_max(t: torch.Tensor, lo: int, allow: int | None) -> list[int] | None:
    """[min, max] of a CPU integer tensor (``allow`` counted as ``lo``), through numpy; None
    for a tensor elsewhere (read back with the rest)."""
    if t.device.type != "cpu" or t.dtype in (torch.bool, torch.uint16, torch.uint32) or (
        t.requires_grad
    ):
        return None
    if t.numel() <= 64:  # a few values: a Python list's min and max are quicker than numpy's
        v = t.reshape(-1).tolist()
        if allow is not None:
            v = [lo if x == allow else x for x in v]
        return [min(v), max(v)]
    a = t.numpy()
    if allow is not None:
        a = np.where(a == allow, lo, a)
    return [int(a.min()), int(a.max())]


def _read(parts: list[torch.Tensor]) -> list[int]:
    """The 1-D tensors' values, concatenated in order: one read-back per device they are on
    (a CPU tensor's read costs no wait for a GPU)."""
    where: dict[torch.device, list[int]] = {}
    for i, p in enumerate(parts):
        where.setdefault(p.device, []).append(i)
    out: list[list[int]] = [[] for _ in parts]
    for idx in where.values():
        flat = torch.cat([parts[i] for i in idx]).tolist()
        at = 0
        for i in idx:
            out[i] = flat[at : at + parts[i].numel()]
            at += parts[i].numel()
    return [v for vals in out for v in vals]
