"""Validate a call against its contract: argument binding, ranks, shape symbols, dtypes,
devices, index ranges and param checks. Every failure names the argument and the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opcontract.contracts.schema import Contract, SameAs, check_value
from opcontract.errors import ContractViolation


@dataclass(frozen=True)
class BoundCall:
    inputs: dict[str, torch.Tensor]
    params: dict[str, Any]
    sizes: dict[str, int]
    dtypes: dict[str, str]
    dtype: str  # the dtype the op is served in (its first floating-point input's)
    device: torch.device


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_param(c: Contract, name: str, value: Any) -> Any:
    spec = c.params[name]
    field = f"params.{name}"
    if value is None:
        if spec.default is not None:
            raise ContractViolation(c.op, name, f"{field}.type", "may not be None")
        return None
    kind = spec.type
    if isinstance(value, torch.Tensor):
        raise ContractViolation(
            c.op, name, f"{field}.type", f"must be a Python {kind}, got a tensor"
        )
    ok = {
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        raise ContractViolation(
            c.op, name, f"{field}.type", f"must be {kind}, got {type(value).__name__} {value!r}"
        )
    if kind == "float":
        value = float(value)
    if spec.choices is not None and value not in spec.choices:
        raise ContractViolation(
            c.op, name, f"{field}.choices", f"{value!r} is not one of {spec.choices}"
        )
    if spec.check is not None and kind in ("float", "int"):
        why = check_value(spec.check, float(value))
        if why:
            raise ContractViolation(c.op, name, f"{field}.check", why)
    return value


def bind(c: Contract, args: tuple, kwargs: dict) -> BoundCall:
    """Bind and validate a call; raise ContractViolation on the first problem."""
    names = list(c.inputs)
    if len(args) > len(names):
        raise ContractViolation(
            c.op,
            f"positional #{len(args)}",
            "inputs",
            f"takes {len(names)} tensors positionally ({', '.join(names)}); "
            f"params are keyword-only",
        )
    inputs: dict[str, Any] = dict(zip(names, args, strict=False))
    params: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in c.inputs:
            if k in inputs:
                raise ContractViolation(c.op, k, "inputs", "given both positionally and by name")
            inputs[k] = v
        elif k in c.params:
            params[k] = v
        else:
            raise ContractViolation(
                c.op,
                k,
                "signature",
                f"unexpected argument; inputs are {names}, params are {list(c.params)}",
            )
    for name, spec in c.params.items():
        params[name] = _check_param(c, name, params.get(name, spec.default))
    for name in names:
        absent = [
            f"{p}={params[p]!r}"
            for p, vals in (c.inputs[name].absent_when or {}).items()
            if params[p] in vals
        ]
        if absent and inputs.get(name) is not None:
            raise ContractViolation(
                c.op, name, f"inputs.{name}.absent_when", f"must be None when {', '.join(absent)}"
            )
        if absent:
            inputs[name] = None
        elif inputs.get(name) is None:
            if not c.inputs[name].optional:
                raise ContractViolation(c.op, name, f"inputs.{name}", "missing")
            inputs[name] = None

    sizes: dict[str, int] = {}
    bound_by: dict[str, str] = {}
    device = None
    first = None
    for name, spec in c.inputs.items():
        t = inputs[name]
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ContractViolation(
                c.op, name, f"inputs.{name}", f"must be a torch.Tensor, got {type(t).__name__}"
            )
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ContractViolation(
                c.op, name, "device", f"is on {t.device}, but '{first}' is on {device}"
            )
        if t.dim() != len(spec.shape):
            raise ContractViolation(
                c.op,
                name,
                f"inputs.{name}.shape",
                f"must have rank {len(spec.shape)} {spec.shape}, got shape {list(t.shape)}",
            )
        for i, (dim, size) in enumerate(zip(spec.shape, t.shape, strict=True)):
            if isinstance(dim, int):
                if size != dim:
                    raise ContractViolation(
                        c.op, name, f"inputs.{name}.shape[{i}]", f"must be {dim}, got {size}"
                    )
            elif dim in sizes and sizes[dim] != size:
                raise ContractViolation(
                    c.op,
                    name,
                    f"inputs.{name}.shape[{i}]",
                    f"{dim} = {size} here but {dim} = {sizes[dim]} from '{bound_by[dim]}'",
                )
            else:
                sizes.setdefault(dim, size)
                bound_by.setdefault(dim, name)
        dt = _dtype_name(t)
        if isinstance(spec.dtype, SameAs):
            other = spec.dtype.same_as
            if inputs[other] is None:
                continue
            want = _dtype_name(inputs[other])
            if dt != want:
                raise ContractViolation(
                    c.op,
                    name,
                    f"inputs.{name}.dtype",
                    f"must have the dtype of '{other}' ({want}), got {dt}",
                )
        elif dt not in spec.dtype:
            raise ContractViolation(
                c.op, name, f"inputs.{name}.dtype", f"must be one of {list(spec.dtype)}, got {dt}"
            )

    for i, k in enumerate(c.constraints):
        if all(params.get(p) in vals for p, vals in k.when.items()) and not eval(  # noqa: S307
            k.require, {"__builtins__": {}}, dict(sizes)
        ):
            raise ContractViolation(c.op, k.argument, f"constraints[{i}]", k.message)

    check_values(c, inputs, params, sizes)

    dtypes = {n: _dtype_name(t) for n, t in inputs.items() if t is not None}
    served = c.float_dtypes()
    dtype = next((d for d in dtypes.values() if d in served), dtypes[names[0]])
    return BoundCall(inputs, params, sizes, dtypes, dtype, device)


def check_values(
    c: Contract, inputs: dict[str, Any], params: dict[str, Any], sizes: dict[str, int]
) -> None:
    """The contract's index ranges (e.g. token ids below V): these read the tensors.

    While a CUDA graph is being captured the values don't exist yet, so nothing is read:
    a captured graph's replays are not range-checked (check the ids before replaying).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    for name, spec in c.inputs.items():
        if spec.values is None or inputs[name] is None or inputs[name].numel() == 0:
            continue
        t = inputs[name]
        lo, hi = (sizes[b] if isinstance(b, str) else b for b in spec.values.range)
        allow = params[spec.values.allow] if spec.values.allow is not None else None
        # One reduction and one host sync when every value is in range
        seen = t if allow is None else torch.where(t == allow, lo, t)
        t_min, t_max = torch.stack(torch.aminmax(seen)).tolist()
        if lo <= t_min and t_max < hi:
            continue
        ok = (t >= lo) & (t < hi)
        extra = ""
        if allow is not None:
            ok |= t == allow
            extra = f" or {spec.values.allow}={allow}"
        bad = t[~ok]
        raise ContractViolation(
            c.op,
            name,
            f"inputs.{name}.values",
            f"must lie in [{lo}, {hi}){extra}; {bad.numel()} value(s) "
            f"do not, e.g. {bad.flatten()[0].item()}",
        )
