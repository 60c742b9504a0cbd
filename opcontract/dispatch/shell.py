"""The op shell: one ``torch.library`` custom op per contract, generated from it.

For op ``X`` the shell builds ``opcontract::X`` (the contract's inputs, its params, then the
route: backend, mode, config) returning the contract's outputs then its residuals, and
``opcontract::X_backward``, with registered autograd between them; fake implementations give
every shape and dtype from the contract. Inside, the op validates index ranges, selects the
implementation (memoised per signature), makes each input meet the implementation's
declared layout and calls the implementation's registered ``forward`` / ``backward``. No
shell names a backend.

torch.compile sees the op as opaque: the compiler can neither fuse nor reorder the arithmetic
inside (a fused multiply-add is not a multiply and an add). Plain eager calls that build no
autograd graph call the same functions without the library op, whose Python dispatch would
cost more than a decode-sized kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from opcontract import backends
from opcontract.backends.registry import CallInfo, Implementation
from opcontract.contracts import get_contract
from opcontract.contracts.results import result_type
from opcontract.contracts.schema import Contract, condition, dim_value, output_shape
from opcontract.dispatch import call_cache
from opcontract.dispatch.device import device_of, simulating
from opcontract.dispatch.provenance import Provenance, record
from opcontract.dispatch.select import Selection, call_info, route_options, select
from opcontract.dispatch.validate import BoundCall, Signature, bind, check_values, signature
from opcontract.errors import NoBackendError

_TORCH_DTYPES = {
    n: getattr(torch, n) for n in ("bfloat16", "float16", "float32", "float64", "int32", "int64")
}
_SCHEMA_TYPES = {"float": "float", "int": "int", "bool": "bool", "str": "str"}


def bypass_op(*tensors: torch.Tensor | None) -> bool:
    """True when no autograd graph is being built, nothing traces the call, no dispatch
    mode or tensor subclass is in play (nn.Parameter, which overrides nothing, is not
    one): then the library op may be skipped."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in call_cache.TENSOR_TYPES or (grad and t.requires_grad):
            return False
    return True


def conform(t: torch.Tensor | None, need: str) -> torch.Tensor | None:
    """``t``, or a copy of it that meets the layout ``need`` (see registry.LAYOUTS)."""
    if t is None or need == "any":
        return t
    if need == "contiguous":
        return t if t.is_contiguous() else t.contiguous()
    if t.dim() and (t.stride(-1) != 1 and t.shape[-1] > 1 or 0 in t.stride()[:-1]):
        return t.contiguous()
    return t


def layout_copies(impl: Implementation, inputs: dict[str, Any]) -> dict[str, str]:
    """The inputs the shell would copy for ``impl``, each with the layout it needs."""
    return {
        n: impl.layout_of(n)
        for n, t in inputs.items()
        if t is not None and conform(t, impl.layout_of(n)) is not t
    }


# ------------------------------------------------------------------------- routes
@dataclass(frozen=True)
class Route:
    """A validated, selected call: what runs it, and what provenance it records."""

    impl: Implementation | None
    config: dict[str, Any]
    provenance: Provenance | None
    rejected: dict[str, str]
    copies: tuple[tuple[str, str], ...]  # (input, layout) the impl needs and the shell checks


def _route(c: Contract, sel: Selection, dtypes: dict, mode: str) -> Route:
    impl = sel.selected
    if impl is None:
        return Route(None, {}, None, dict(sel.rejected), ())
    prov = Provenance(
        op=c.op,
        contract_version=c.version,
        contract_sha256=c.sha256,
        backend=impl.backend,
        implementation=impl.name,
        config=dict(sel.config),
        device=str(sel.call.device),
        dtypes=dict(dtypes),
        mode=mode,
        params=dict(sel.call.params),
        tuning_entry=sel.tuning_entry,
        backward_plan=sel.plan,
        backward_bytes=sel.plan_memory.get(sel.plan) if sel.plan else None,
    )
    checks = tuple((n, impl.layout_of(n)) for n in c.inputs if impl.layout_of(n) != "any")
    return Route(impl, dict(sel.config), prov, dict(sel.rejected), checks)


def resolve(c: Contract, bound: BoundCall, backend: str | None, mode: str, config: str) -> Route:
    """Select an implementation for a bound call (``config``: a route string, see
    ``select.route_string``)."""
    sel = select(c, call_info(bound), backend, mode, *route_options(config))
    return _route(c, sel, bound.dtypes, mode)


def _raise_no_backend(c: Contract, route: Route, backend: str | None) -> None:
    raise NoBackendError(c.op, route.rejected, requested=backend)


# ------------------------------------------------------------------------- the shell
class OpShell:
    """The custom ops, fake implementations, autograd and result type of one contract."""

    def __init__(self, c: Contract) -> None:
        self.contract = c
        self.sig: Signature = signature(c.op)
        self.inputs = tuple(c.inputs)
        self.params = tuple(c.params)
        self.outputs = tuple(c.outputs)
        self.residuals = tuple(c.residuals)
        self.returned = [n for n, o in c.outputs.items() if not o.when]
        self.lone = len(c.outputs) == 1  # the result is always the one output's tensor
        self.result = result_type(c.op)
        self.n_in, self.n_par = len(self.inputs), len(self.params)
        # where each shape symbol is read from the (flattened) inputs: a required input first
        src: dict[str, tuple[int, int]] = {}
        for opt in (False, True):
            for i, s in enumerate(c.inputs.values()):
                if (s.optional or s.absent_when is not None) == opt:
                    for j, d in enumerate(s.shape):
                        if isinstance(d, str):
                            src.setdefault(d, (i, j))
        self.symbols = tuple(sorted(src))
        self.size_source = tuple(src[s] for s in self.symbols)
        self.dtype_source = next(
            (
                i
                for i, r in enumerate(self.sig.inputs)
                if r.same_as or set(r.dtypes) & set(self.sig.served)
            ),
            0,
        )
        self.grads = tuple(c.grads)
        self.diff = tuple(n for n, o in c.outputs.items() if o.differentiable)
        self.saves = tuple(c.backward.saves) if c.backward else ()
        self._lead_out = {
            n: _leads(c, o.shape, [s for s in o.shape_when.values()]) for n, o in c.outputs.items()
        }
        self.fwd = self._build_forward()
        self.bwd = self._build_backward() if c.grads else None
        if self.bwd is not None:
            self.fwd.register_autograd(self._autograd_backward, setup_context=self._setup)

    # ---- schemas
    def _param_schema(self) -> list[str]:
        out = []
        for n, p in self.contract.params.items():
            t = _SCHEMA_TYPES[p.type]
            out.append(f"{t}{'?' if p.default is None else ''} {n}")
        return out

    def _build_forward(self):
        c = self.contract
        ins = [
            f"Tensor{'?' if (s.optional or s.absent_when) else ''} {n}" for n, s in c.inputs.items()
        ]
        args = ", ".join([*ins, *self._param_schema(), "str backend", "str mode", "str config"])
        rets = ", ".join(["Tensor"] * (len(self.outputs) + len(self.residuals)))
        op = torch.library.custom_op(
            f"opcontract::{c.op}",
            self._op_forward,
            mutates_args=(),
            schema=f"({args}) -> ({rets})",
        )
        op.register_fake(self._fake_forward)
        return op

    def _build_backward(self):
        c = self.contract
        saved = [f"Tensor? {n}" for n in self.saves]
        grads = [f"Tensor? grad_{n}" for n in self.diff]
        args = ", ".join(
            [*saved, *grads, "SymInt[] sizes", "bool[] needs", *self._param_schema()]
            + ["str dtype", "str backend", "str mode", "str config"]
        )
        rets = ", ".join(["Tensor"] * len(self.grads))
        op = torch.library.custom_op(
            f"opcontract::{c.op}_backward",
            self._op_backward,
            mutates_args=(),
            schema=f"({args}) -> ({rets})",
        )
        op.register_fake(self._fake_backward)
        return op

    # ---- forward
    def _split(self, args: tuple):
        n, p = self.n_in, self.n_par
        return (
            dict(zip(self.inputs, args[:n], strict=True)),
            dict(zip(self.params, args[n : n + p], strict=True)),
            args[n + p :],
        )

    def _route_flat(self, inputs: dict, params: dict, backend: str, mode: str, config: str):
        """The route of a flattened call (inside the op), memoised per signature."""
        c = self.contract
        k = None
        if not simulating():
            k = call_cache.key((c.op, backend, mode, config, "op"), tuple(inputs.values()), params)
        hit = call_cache.get(k)
        if hit is None:
            bound = bind(self.sig, tuple(inputs.values()), params)
            hit = resolve(c, bound, backend or None, mode, config)
            call_cache.put(k, hit)
        return hit

    def _op_forward(self, *args):
        inputs, params, (backend, mode, config) = self._split(args)
        route = self._route_flat(inputs, params, backend, mode, config)
        if route.impl is None:
            _raise_no_backend(self.contract, route, backend or None)
        return _one(self._empties(self.run_forward(route, inputs, params), inputs, params))

    def run_forward(self, route: Route, inputs: dict, params: dict, grad: bool = True) -> tuple:
        """Check index values, meet the layout, run the implementation, record provenance.
        ``grad=False`` (the eager fast path: no autograd graph records the call, none keeps
        the residuals): an implementation's ``forward_no_grad`` runs where it has one."""
        if self.sig.value_checked:
            check_values(self.sig, inputs, params, _sizes_of(self, inputs))
        for name, need in route.copies:
            inputs[name] = conform(inputs[name], need)
        impl = route.impl
        fwd = impl.forward if grad or impl.forward_no_grad is None else impl.forward_no_grad
        out = fwd(route.config, **inputs, **params)
        record(route.provenance)
        return out

    def _empties(self, out: tuple, inputs: dict, params: dict) -> tuple:
        like = next(t for t in inputs.values() if t is not None)
        return tuple(t if t is not None else like.new_empty((0,)) for t in out)

    def _fake_forward(self, *args):
        inputs, params, _ = self._split(args)
        bound = bind(self.sig, tuple(inputs.values()), params)
        c = self.contract
        like = next(t for t in inputs.values() if t is not None)
        out = []
        for n, o in c.outputs.items():
            asked = o.when is None or params[o.when]
            shape = output_shape(c, n, bound.sizes, params) if asked else [0]
            out.append(like.new_empty(shape, dtype=self._dtype(o.dtype, bound.dtype)))
        for r in c.residuals.values():
            have = r.when is None or condition(r.when)(params)
            shape = [dim_value(d, bound.sizes) for d in r.shape] if have else [0]
            out.append(like.new_empty(shape, dtype=self._dtype(r.dtype, bound.dtype)))
        return _one(tuple(out))

    def call_forward(self, inputs: dict, params: dict, backend: str, mode: str, config: str):
        """The forward op's outputs and residuals as a tuple."""
        out = self.fwd(*inputs.values(), *params.values(), backend, mode, config)
        return out if isinstance(out, tuple) else (out,)

    @staticmethod
    def _dtype(declared: str, served: str) -> torch.dtype:
        return _TORCH_DTYPES[served if declared == "input" else declared]

    # ---- backward
    def _setup(self, ctx, inputs, output):
        ins, params, route = self._split(inputs)
        output = output if isinstance(output, tuple) else (output,)
        named = {**ins, **dict(zip(self.outputs + self.residuals, output, strict=True))}
        ctx.save_for_backward(*[named[s] for s in self.saves])
        args = tuple(ins.values())
        ctx.sizes = [args[i].shape[j] for i, j in self.size_source]
        ctx.dtype = _dtype_of(args[self.dtype_source])
        ctx.params = tuple(params.values())
        ctx.route = tuple(route)

    def _autograd_backward(self, ctx, *grads):
        saved = ctx.saved_tensors
        g = [grads[self.outputs.index(n)] for n in self.diff]
        needs = [ctx.needs_input_grad[self.inputs.index(n)] for n in self.grads]
        if bypass_op(*saved, *g):
            res = self.run_backward(
                dict(zip(self.saves, saved, strict=True)),
                dict(zip(self.diff, g, strict=True)),
                ctx.sizes,
                needs,
                dict(zip(self.params, ctx.params, strict=True)),
                ctx.dtype,
                *ctx.route,
            )
            res = [res.get(n) if need else None for n, need in zip(self.grads, needs, strict=True)]
        else:
            out = self.bwd(*saved, *g, ctx.sizes, needs, *ctx.params, ctx.dtype, *ctx.route)
            out = out if isinstance(out, tuple) else (out,)
            res = [t if need else None for t, need in zip(out, needs, strict=True)]
        by_name = dict(zip(self.grads, res, strict=True))
        return (*[by_name.get(n) for n in self.inputs], *([None] * (self.n_par + 3)))

    def _backward_route(self, saved, sizes, params, dtype, backend, mode, config) -> Route:
        c = self.contract
        first = next(t for t in saved.values() if t is not None)
        sizes = dict(zip(self.symbols, (int(s) for s in sizes), strict=True))
        k = None
        if not simulating():
            k = (
                (c.op, backend, mode, config, "backward"),
                call_cache.state(),
                (first.device, dtype, tuple(sizes.items()), tuple(params.items())),
            )
        hit = call_cache.get(k)
        if hit is None:
            call = CallInfo(device_of(first), dtype, sizes, dict(params))
            sel = select(c, call, backend or None, mode, *route_options(config))
            hit = _route(c, sel, {}, mode)
            call_cache.put(k, hit)
        return hit

    def run_backward(self, saved, grads, sizes, needs, params, dtype, backend, mode, config):
        route = self._backward_route(saved, sizes, params, dtype, backend, mode, config)
        if route.impl is None:
            _raise_no_backend(self.contract, route, backend or None)
        impl = route.impl
        saved = {n: conform(t, impl.layout_of(n)) for n, t in saved.items()}
        grads = {n: conform(t, impl.layout_of(n)) for n, t in grads.items()}
        need = dict(zip(self.grads, needs, strict=True))
        return impl.backward(route.config, saved, grads, need, **params)

    def _op_backward(self, *args):
        k, d = len(self.saves), len(self.diff)
        saved = dict(zip(self.saves, args[:k], strict=True))
        grads = dict(zip(self.diff, args[k : k + d], strict=True))
        sizes, needs = args[k + d], args[k + d + 1]
        rest = args[k + d + 2 :]
        params = dict(zip(self.params, rest[: self.n_par], strict=True))
        dtype, backend, mode, config = rest[self.n_par :]
        res = self.run_backward(saved, grads, sizes, needs, params, dtype, backend, mode, config)
        like = next(t for t in saved.values() if t is not None)
        out, seen = [], set()
        for n, need in zip(self.grads, needs, strict=True):
            t = res.get(n) if need else None
            if t is None:
                t = like.new_empty((0,))
            elif id(t) in seen:  # a custom op's outputs may not alias each other
                t = t.clone()
            seen.add(id(t))
            out.append(t)
        return _one(tuple(out))

    def _fake_backward(self, *args):
        k, d = len(self.saves), len(self.diff)
        like = next(t for t in args[:k] if t is not None)
        sizes = dict(zip(self.symbols, args[k + d], strict=True))
        needs = args[k + d + 1]
        dtype = _TORCH_DTYPES[args[k + d + 2 + self.n_par]]
        out = []
        for n, need in zip(self.grads, needs, strict=True):
            shape = [dim_value(s, sizes) for s in self.contract.inputs[n].shape] if need else [0]
            out.append(like.new_empty(shape, dtype=dtype))
        return _one(tuple(out))

    # ---- results
    def build_result(self, out: tuple, params: dict, lead: tuple | None) -> Any:
        """The caller's result: a lone tensor, or the contract's named result; outputs with a
        leading batch symbol get the call's leading dims back."""
        if self.lone and lead is None:
            return out[0]
        c = self.contract
        vals = []
        for i, (n, o) in enumerate(c.outputs.items()):
            t = out[i]
            if o.when is not None and not params[o.when]:
                t = None
            elif lead is not None and self._leads_now(n, params):
                t = t.reshape(*lead, *t.shape[1:])
            vals.append(t)
        asked = [v for n, v in zip(self.outputs, vals, strict=True) if v is not None]
        if len(asked) == 1 and len(self.returned) == 1 and vals[0] is not None:
            return vals[0]
        return self.result(*vals)

    def _leads_now(self, name: str, params: dict) -> bool:
        rule = self._lead_out[name]
        if rule is not None:
            return rule
        o = self.contract.outputs[name]
        shape = o.shape
        for expr, alt in o.shape_when.items():
            if condition(expr)(params):
                shape = alt
                break
        return bool(shape) and shape[0] == self.contract.batch_dims


def _leads(c: Contract, shape: list, alternatives: list[list]) -> bool | None:
    """Whether an output's shape leads with the batch symbol: True / False for every form,
    None when it depends on the params."""
    forms = {bool(s) and s[0] == c.batch_dims for s in [shape, *alternatives]}
    return forms.pop() if len(forms) == 1 else None


def _one(out: tuple):
    """A custom op with one declared return returns that tensor, not a 1-tuple."""
    return out[0] if len(out) == 1 else out


def _dtype_of(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _sizes_of(shell: OpShell, inputs: dict) -> dict[str, int]:
    args = tuple(inputs.values())
    return {s: args[i].shape[j] for s, (i, j) in zip(shell.symbols, shell.size_source, strict=True)}


@functools.cache
def op_shell(op: str) -> OpShell:
    """The op shell of ``op`` (built once per process, after every backend registered)."""
    backends.load()
    return OpShell(get_contract(op))
