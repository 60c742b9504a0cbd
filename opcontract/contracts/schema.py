"""Pydantic models for an op contract. Unknown fields are errors everywhere.

A contract is the single source of truth for an op: its signature (inputs, params,
outputs), the math, the order and precision of every reduction, where values change
dtype, the invariances guaranteed, the features forbidden, and the accuracy owed
against the float64 oracle. Backends declare their reduction plan in the same terms
(:class:`ReductionPlan`) and dispatch compares the two.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

DType = Literal["bfloat16", "float16", "float32", "float64", "int32", "int64", "bool"]
FLOAT_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32", "float64")

Invariance = Literal["run_to_run", "batch"]
"""run_to_run: identical inputs give identical bits on every call.
batch: a row's outputs depend only on that row (and the shared operands): not on how many
rows are in the call, on the row's position, on the other rows, or on padding rows."""

Feature = Literal[
    "split_k",  # a reduction split into partials whose partition depends on launch config
    "atomics",  # atomic accumulation (merge order decided by the scheduler)
    "tf32",  # float32 operands rounded to TF32 on the matrix units
    "fast_math",  # reassociation or flush-to-zero
    "approx_transcendentals",  # hardware exp2, log2 and division approximations (<= 2 ulp)
    "full_logits",  # materialises the full [rows, vocab] intermediate
    "library_gemm",  # a vendor GEMM whose reduction order is not declared
    "undeclared_cast",  # rounds an intermediate to a dtype at a point the epilogue doesn't list
]

Merge = Literal["add", "online_max_rescale", "max", "argmax_lowest"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SameAs(_Strict):
    same_as: str = Field(description="dtype is that of the named input")


class ValueRange(_Strict):
    range: tuple[int | str, int | str] = Field(description="[low, high): ints or shape symbols")
    allow: str | None = Field(None, description="param whose value is also allowed (a sentinel)")


class TensorSpec(_Strict):
    shape: list[str | int]
    dtype: list[DType] | SameAs
    values: ValueRange | None = None
    host: bool = Field(
        False,
        description="an index input that may be a CPU tensor while the call runs on a GPU: its "
        "values are then checked without waiting for the GPU, and the implementation copies it",
    )
    optional: bool = Field(False, description="may be None")
    absent_when: dict[str, list[str]] | None = Field(
        None, description="param -> values for which this input must be None (else required)"
    )
    doc: str = ""


class ParamSpec(_Strict):
    type: Literal["float", "int", "bool", "str"]
    default: float | int | bool | str | None = None
    required: bool = Field(False, description="no default: every call gives it")
    present_when: dict[str, list[str]] | None = Field(
        None, description="param -> values: given (not None) exactly when the param has one"
    )
    check: str | None = None
    choices: list[str] | None = None
    neutral: float | int | bool | str | None = Field(
        None,
        description="the default, declared inert: at this value every bit is the op's without "
        "the param (a param added after tables were stamped)",
    )
    math: str | None = Field(None, description="the param's part of the math, when neutral")
    doc: str = ""

    @model_validator(mode="after")
    def _neutral_is_the_default(self) -> ParamSpec:
        if self.neutral is not None and self.neutral != self.default:
            raise ValueError(f"neutral {self.neutral!r} must be the default ({self.default!r})")
        if self.math is not None and self.neutral is None:
            raise ValueError("math: only a neutral param carries its own part of the math")
        return self


class OutputSpec(_Strict):
    shape: list[str | int]
    dtype: DType | Literal["input"]
    when: str | None = Field(None, description="bool param that asks for this output")
    shape_when: dict[str, list[str | int]] = Field(
        default_factory=dict,
        description="condition over params -> the shape when it holds (first match wins)",
    )
    differentiable: bool = False
    doc: str = ""


class ResidualSpec(_Strict):
    """A tensor the forward hands to the backward, never returned to the caller."""

    shape: list[str | int]
    dtype: DType | Literal["input"]
    when: str | None = Field(None, description="condition over params; else empty ([0])")
    doc: str = ""


class BackwardSpec(_Strict):
    saves: list[str] = Field(description="inputs, outputs and residuals the backward reads")
    doc: str = ""


class NonFiniteSpec(_Strict):
    """What NaN and +-inf in the inputs produce, checked against the float64 oracle.

    Where the oracle's output is NaN the output is NaN; where it is +-inf, the same
    infinity (or NaN, for outputs in ``inf_as_nan``); where it is finite, finite and within
    the tolerance. Outputs in ``unspecified`` are not checked on rows whose oracle row holds
    a non-finite value. Rows of batched inputs without a non-finite value are unaffected.
    """

    inf_as_nan: list[str] = Field(default_factory=list)
    unspecified: list[str] = Field(default_factory=list)
    doc: str = ""


class Reduction(_Strict):
    """How one reduction runs.

    The reduced dimension is cut into blocks of ``block`` elements (``impl``: a size the
    implementation fixes once, never a function of the call's batch). Each block is
    reduced to one partial in ``accumulate`` precision, in an order the implementation
    fixes; partials are merged with ``merge`` in ascending block order. ``split``:
    ``none`` walks the blocks sequentially; ``fixed_blocks`` may compute the partials in
    parallel, since the contract pins the partition and the merge order.
    """

    over: str
    accumulate: Literal["float32", "float64", "int64"]
    block: int | Literal["impl"]
    order: Literal["ascending", "pairwise", "tree"] = "ascending"
    merge: Merge = "add"
    split: Literal["none", "fixed_blocks"] = "none"
    phase: Literal["forward", "backward"] = "forward"
    when: str | None = Field(None, description="bool param that asks for the output it serves")
    doc: str = ""


class ReductionPlan(_Strict):
    """An implementation's declaration of how it runs one of the contract's reductions.

    ``block="library"`` means a vendor library chooses (the order is not declared).
    """

    accumulate: Literal["float32", "float64", "int64"]
    block: int | Literal["library"]
    order: Literal["ascending", "pairwise", "tree", "library"] = "ascending"
    merge: Merge = "add"
    split: Literal["none", "fixed_blocks", "library"] = "none"


class EpilogueCast(_Strict):
    at: str
    to: DType | Literal["input"] = Field(description="a dtype, or 'input': the served dtype")
    doc: str = ""


class Constraint(_Strict):
    """A relation between shape symbols (and int params), checked on every call (``when``
    params match)."""

    require: str = Field(
        description="Python expression over shape symbols and int params, e.g. 'G % 2 == 0'"
    )
    argument: str
    message: str
    when: dict[str, list[str]] = Field(default_factory=dict)


class ConformanceCase(_Strict):
    sizes: dict[str, int]
    skip: list[str] = Field(default_factory=list, description="checks that don't apply here")
    params: dict[str, Any] = Field(default_factory=dict)
    std: dict[str, float] = Field(default_factory=dict)
    allow_fraction: float = 0.1


class ConformanceSpec(_Strict):
    batch_dim: str
    cases: list[ConformanceCase]
    table_key: list[str] | None = Field(
        None,
        description=(
            "the shape symbols (and str, int or bool params) a tuning entry is keyed by, "
            "beside the batch bucket; default every symbol but the batch one (attention: the "
            "head geometry and the layer kind, not the sizes of the key store, which every "
            "call has its own)"
        ),
    )
    make_inputs: str | None = Field(
        None,
        description=(
            "'module:function' building a case's inputs where random ones per input would not "
            "make a valid call (attention's key store and its tables); make_inputs' signature"
        ),
    )


class PlanSpec(_Strict):
    """A shape of work for the op's backward, one of several that give the same bits.

    The plans of a contract are equal-bits alternatives: every output and gradient is
    bitwise the same whichever runs (they add the same partials in the same order); only
    speed and memory differ. Implementations take the choice as their ``backward_plan``
    config parameter, a free parameter the tuner verifies bitwise like any other; callers
    choose one or set a memory budget (``dispatch.op(..., plan=, memory_budget=)``).
    """

    default: bool = Field(False, description="the plan that runs unless a caller or table says")
    doc: str = ""


Autocast = Literal["lower", "promote", "none"]
"""lower: floating inputs cast to the autocast dtype, as nn.Linear; promote: to the widest
floating dtype among them, as torch's elementwise ops; none: run as given."""


class Contract(_Strict):
    op: str
    version: int
    summary: str
    inputs: dict[str, TensorSpec]
    params: dict[str, ParamSpec] = Field(default_factory=dict)
    outputs: dict[str, OutputSpec]
    residuals: dict[str, ResidualSpec] = Field(default_factory=dict)
    backward: BackwardSpec | None = None
    batch_dims: str | None = Field(
        None,
        description=(
            "a shape symbol that may stand for any number (>= 1) of leading dims on every "
            "input and output whose shape starts with it; bitwise equal to the flattened call"
        ),
    )
    autocast: Autocast = "none"
    nonfinite: NonFiniteSpec = Field(default_factory=NonFiniteSpec)
    value_checks: list[str] = Field(
        default_factory=list,
        description="'module:function(inputs, params)' -> None or (flags, finish): checks of "
        "values a range can't state, as a 1-D int64 tensor of flags read back with the index "
        "ranges (one host sync), then finish(values) raising ContractViolation; before any "
        "kernel",
    )
    named_result: str | None = Field(
        None, description="type of the named tuple returned when an optional output is asked for"
    )
    constraints: list[Constraint] = Field(default_factory=list)
    grads: dict[str, list[Invariance]] = Field(
        default_factory=dict, description="inputs that get gradients, and what each guarantees"
    )
    math: str
    reductions: dict[str, Reduction]
    epilogue: list[EpilogueCast]
    invariance: list[Invariance]
    forbid: list[Feature]
    tolerance: dict[DType, float]
    grad_tolerance: dict[DType, float] = Field(default_factory=dict)
    plans: dict[str, PlanSpec] = Field(
        default_factory=dict,
        description="equal-bits backward plans (not part of the numerics: they move no bit)",
    )
    reference: str
    conformance: ConformanceSpec

    _path: str = PrivateAttr(default="<memory>")
    _sha256: str = PrivateAttr(default="")
    _numerics: str = PrivateAttr(default="")
    _lines: dict[tuple, int] = PrivateAttr(default_factory=dict)

    @property
    def path(self) -> str:
        return self._path

    @property
    def sha256(self) -> str:
        """Hash of the contract file's bytes: part of every provenance record."""
        return self._sha256

    @property
    def numerics_sha256(self) -> str:
        """Hash of what decides the op's bits: its inputs, params, outputs, math, reductions,
        epilogue, invariances, forbidden features and gradients (not docs, tolerances,
        conformance cases, call forms or autocast). A tuning entry is valid while it holds."""
        if not self._numerics:
            self._numerics = _numerics_hash(self)
        return self._numerics

    def line_of(self, *keys: str | int) -> int:
        """Line in the source file of a field (or of its nearest enclosing field)."""
        for n in range(len(keys), -1, -1):
            if keys[:n] in self._lines:
                return self._lines[keys[:n]]
        return 1

    def symbols(self) -> set[str]:
        return {d for spec in self.inputs.values() for d in spec.shape if isinstance(d, str)}

    def input_dtypes(self, name: str) -> list[str]:
        """Allowed dtypes of an input, following ``same_as`` links."""
        spec = self.inputs[name].dtype
        seen = {name}
        while isinstance(spec, SameAs):
            if spec.same_as in seen or spec.same_as not in self.inputs:
                return []
            seen.add(spec.same_as)
            spec = self.inputs[spec.same_as].dtype
        return list(spec)

    def float_dtypes(self) -> list[str]:
        """Dtypes the op is served in: those of its first floating-point input."""
        for name in self.inputs:
            dts = self.input_dtypes(name)
            if any(d in FLOAT_DTYPES for d in dts):
                return [d for d in dts if d in FLOAT_DTYPES]
        return []


# ---------------------------------------------------------------------------- checks
_CHECK_TERM = re.compile(r"^\s*(>=|<=|>|<|!=)\s*(-?[0-9.eE+-]+|inf)\s*$")


def parse_check(text: str) -> list[tuple[str, float]]:
    """Parse a param check such as ``"> 0"``, ``">= 0 and < 1"`` or ``"finite"``.

    Returns ``(operator, bound)`` pairs; ``("finite", nan)`` for ``finite``.
    Raises ``ValueError`` on text outside this grammar.
    """
    terms: list[tuple[str, float]] = []
    for part in text.split(" and "):
        part = part.strip()
        if part == "finite":
            terms.append(("finite", math.nan))
            continue
        m = _CHECK_TERM.match(part)
        if not m:
            raise ValueError(
                f"cannot parse check term {part!r} (use '> x', '>= x', "
                f"'< x', '<= x', '!= x' or 'finite', joined by 'and')"
            )
        terms.append((m.group(1), float(m.group(2))))
    return terms


_COMPARE = {
    "finite": lambda v, b: math.isfinite(v),
    ">": lambda v, b: v > b,
    ">=": lambda v, b: v >= b,
    "<": lambda v, b: v < b,
    "<=": lambda v, b: v <= b,
    "!=": lambda v, b: v != b,
}


def check_value(text: str, value: float) -> str | None:
    """Return why ``value`` fails the check ``text``, or None when it passes."""
    for op, bound in parse_check(text):
        if not _COMPARE[op](value, bound):
            return f"{value!r} fails the check '{text}'"
    return None


# Fields added to the schema after tables were stamped: left out of the hash at their
# default, so that a contract that doesn't use them keeps its hash (and its tuned entries).
_LATER_FIELDS = {"required": False, "present_when": None, "neutral": None, "math": None}


def _numerics_hash(c: Contract) -> str:
    def strip(model: BaseModel, drop: tuple[str, ...] = ("doc",), later=_LATER_FIELDS) -> dict:
        return {
            k: v
            for k, v in model.model_dump(mode="json").items()
            if k not in drop and not (k in later and v == later[k])
        }

    def inert(when: str | None) -> bool:  # asked for only by a neutral param
        return when is not None and when in c.params and c.params[when].neutral is not None

    data = {
        "op": c.op,
        "inputs": {n: strip(s, ("doc", "host")) for n, s in c.inputs.items()},  # placement
        # a neutral param (inert at its default) is left out with its math: the entries
        # verified before it existed ran every call that leaves it at the default bit for bit
        "params": {n: strip(p) for n, p in c.params.items() if p.neutral is None},
        "outputs": {
            n: strip(o, ("doc", "shape_when")) for n, o in c.outputs.items() if not inert(o.when)
        },
        "math": c.math,
        "reductions": {
            n: strip(r, later={**_LATER_FIELDS, "when": None})
            for n, r in c.reductions.items()
            if not inert(r.when)
        },
        "epilogue": [strip(e) for e in c.epilogue],
        "invariance": c.invariance,
        "forbid": c.forbid,
        "grads": c.grads,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


_CONDITIONS: dict[str, Any] = {}


def condition(expr: str):
    """A compiled condition over params (``"reduction == 'none'"``, ``"label_smoothing > 0"``,
    a bare bool param's name): ``fn(params) -> bool``. A plain Python function (torch.compile
    traces it)."""
    fn = _CONDITIONS.get(expr)
    if fn is None:
        names = sorted(compile(expr, "<condition>", "eval").co_names)
        args = ", ".join([*names, "**_"])
        body = eval(f"lambda {args}: bool({expr})", {"__builtins__": {"bool": bool}})  # noqa: S307
        fn = _CONDITIONS[expr] = lambda params: body(**params)
    return fn


def _dim_problem(d: str | int, symbols: set[str]) -> str | None:
    """A dim of an output or residual: an int, a shape symbol or an expression over them."""
    if isinstance(d, int):
        return None
    try:
        code = compile(d, "<dim>", "eval")
    except SyntaxError as e:
        return f"dim {d!r} is not an expression: {e.msg}"
    unknown = set(code.co_names) - symbols
    return f"symbol(s) {sorted(unknown)} bound by no input" if unknown else None


def dim_value(d: str | int, sizes: dict[str, int]) -> int:
    """The size of a declared dim for these shape symbols."""
    if isinstance(d, int):
        return d
    if d in sizes:
        return sizes[d]
    return _dim_fn(d)(sizes)


_DIMS: dict[str, Any] = {}


def _dim_fn(d: str):
    fn = _DIMS.get(d)
    if fn is None:
        names = sorted(compile(d, "<dim>", "eval").co_names)
        body = eval(f"lambda {', '.join([*names, '**_'])}: ({d})", {"__builtins__": {}})  # noqa: S307
        fn = _DIMS[d] = lambda sizes: body(**sizes)
    return fn


def output_shape(c: Contract, name: str, sizes: dict[str, int], params: dict) -> list[int]:
    """An output's shape for a call: the first ``shape_when`` whose condition holds, else
    ``shape``."""
    o = c.outputs[name]
    shape = o.shape
    for expr, alt in o.shape_when.items():
        if condition(expr)(params):
            shape = alt
            break
    return [dim_value(d, sizes) for d in shape]


def _condition_problem(expr: str, params: set[str]) -> str | None:
    try:
        code = compile(expr, "<condition>", "eval")
    except SyntaxError as e:
        return f"not an expression: {e.msg}"
    unknown = set(code.co_names) - params
    return f"unknown params {sorted(unknown)}" if unknown else None


def semantic_problems(c: Contract) -> list[tuple[tuple, str]]:
    """Cross-field problems a schema can't express, each with the path of the field at fault."""
    out: list[tuple[tuple, str]] = []
    symbols = c.symbols()
    params = set(c.params)
    for name, o in c.outputs.items():
        for expr, shape in o.shape_when.items():
            why = _condition_problem(expr, params)
            if why:
                out.append((("outputs", name, "shape_when"), why))
            for d in shape:
                if why := _dim_problem(d, symbols):
                    out.append((("outputs", name, "shape_when"), why))
    for name, r in c.residuals.items():
        if name in c.inputs or name in c.outputs:
            out.append((("residuals", name), f"'{name}' is also an input or output"))
        if r.when is not None and (why := _condition_problem(r.when, params)):
            out.append((("residuals", name, "when"), why))
        for d in r.shape:
            if why := _dim_problem(d, symbols):
                out.append((("residuals", name, "shape"), why))
    if c.grads and c.backward is None:
        out.append((("grads",), "an op with gradients needs a backward section (what it saves)"))
    if c.backward is not None:
        known = set(c.inputs) | set(c.outputs) | set(c.residuals)
        for s in c.backward.saves:
            if s not in known:
                out.append((("backward", "saves"), f"'{s}' is no input, output or residual"))
    if c.batch_dims is not None:
        if c.batch_dims not in symbols:
            out.append((("batch_dims",), f"'{c.batch_dims}' is not a shape symbol"))
        for name, spec in c.inputs.items():
            if c.batch_dims in spec.shape[1:]:
                out.append(
                    (("inputs", name, "shape"), f"batch symbol '{c.batch_dims}' only leads a shape")
                )
    for field in ("inf_as_nan", "unspecified"):
        for name in getattr(c.nonfinite, field):
            if name not in c.outputs:
                out.append((("nonfinite", field), f"'{name}' is not an output"))
    for name, spec in c.inputs.items():
        if isinstance(spec.dtype, SameAs) and spec.dtype.same_as not in c.inputs:
            out.append(
                (("inputs", name, "dtype"), f"same_as names unknown input '{spec.dtype.same_as}'")
            )
        elif not c.input_dtypes(name):
            out.append((("inputs", name, "dtype"), "same_as chain is circular"))
        for param, vals in (spec.absent_when or {}).items():
            choices = c.params[param].choices if param in c.params else None
            if choices is None or not set(vals) <= set(choices):
                out.append(
                    (
                        ("inputs", name, "absent_when"),
                        f"'{param}' is not a str param with choices {vals}",
                    )
                )
        if spec.values is not None:
            for bound in spec.values.range:
                if isinstance(bound, str) and bound not in symbols:
                    out.append(
                        (("inputs", name, "values"), f"range bound '{bound}' is not a shape symbol")
                    )
            if spec.values.allow is not None and spec.values.allow not in c.params:
                out.append(
                    (("inputs", name, "values"), f"allow names unknown param '{spec.values.allow}'")
                )
    for name, p in c.params.items():
        if p.check is not None:
            try:
                parse_check(p.check)
            except ValueError as e:
                out.append((("params", name, "check"), str(e)))
                continue
            if p.default is not None and not isinstance(p.default, (bool, str)):
                why = check_value(p.check, float(p.default))
                if why:
                    out.append((("params", name, "default"), f"default {why}"))
        if p.choices is not None and p.default is not None and p.default not in p.choices:
            out.append((("params", name, "default"), f"default {p.default!r} not among choices"))
        if p.required and p.default is not None:
            out.append((("params", name, "required"), "a required param has no default"))
        for other, vals in (p.present_when or {}).items():
            choices = c.params[other].choices if other in c.params else None
            if choices is None or not set(vals) <= set(choices):
                out.append(
                    (("params", name, "present_when"), f"'{other}' is not a str param with {vals}")
                )
            if p.default is not None:
                out.append(
                    (("params", name, "default"), "a param with present_when has no default")
                )
    for i, k in enumerate(c.constraints):
        try:
            code = compile(k.require, "<constraint>", "eval")
        except SyntaxError as e:
            out.append((("constraints", i, "require"), f"not an expression: {e.msg}"))
            continue
        ints = {n for n, p in c.params.items() if p.type == "int"}
        unknown = set(code.co_names) - symbols - ints
        if unknown:
            out.append((("constraints", i, "require"), f"unknown symbols {sorted(unknown)}"))
        if k.argument not in c.inputs and k.argument not in ints:
            out.append(
                (("constraints", i, "argument"), f"'{k.argument}' is not an input or int param")
            )
    for name, o in c.outputs.items():
        for d in o.shape:
            if why := _dim_problem(d, symbols):
                out.append((("outputs", name, "shape"), why))
    many = [n for n, o in c.outputs.items() if not o.when]
    if len(many) > 1 and not c.named_result:
        out.append((("outputs",), f"several outputs {many} need a named_result"))
    for name, o in c.outputs.items():
        if o.when is not None and (o.when not in c.params or c.params[o.when].type != "bool"):
            out.append((("outputs", name, "when"), f"'{o.when}' is not a bool param"))
    for name, r in c.reductions.items():
        if r.when is not None and (r.when not in c.params or c.params[r.when].type != "bool"):
            out.append((("reductions", name, "when"), f"'{r.when}' is not a bool param"))
    optional = [n for n, o in c.outputs.items() if o.when]
    if optional and not c.named_result:
        out.append((("outputs",), f"optional outputs {optional} need a named_result"))
    for name in c.grads:
        if name not in c.inputs:
            out.append((("grads", name), f"'{name}' is not an input"))
    if c.grads:
        for dt in c.float_dtypes():
            if dt not in c.grad_tolerance:
                out.append((("grad_tolerance",), f"no gradient tolerance for served dtype {dt}"))
    for name, r in c.reductions.items():
        if r.over not in symbols:
            out.append((("reductions", name, "over"), f"'{r.over}' is not a shape symbol"))
    points = {f"{r}.{e}" for r in c.reductions for e in ("in", "out")} | set(c.outputs)
    for i, e in enumerate(c.epilogue):
        if e.at not in points:
            out.append(
                (("epilogue", i, "at"), f"'{e.at}' is neither an output nor '<reduction>.in|out'")
            )
    for dt in c.float_dtypes():
        if dt not in c.tolerance:
            out.append((("tolerance",), f"no tolerance for served dtype {dt}"))
    for sym in c.conformance.table_key or ():
        keyed_param = sym in c.params and c.params[sym].type in ("str", "int", "bool")
        if (sym not in symbols or sym == c.conformance.batch_dim) and not keyed_param:
            out.append(
                (
                    ("conformance", "table_key"),
                    f"'{sym}' is not a shape symbol but the batch one, nor a str, int or bool "
                    "param",
                )
            )
    if c.conformance.batch_dim not in symbols:
        out.append(
            (("conformance", "batch_dim"), f"'{c.conformance.batch_dim}' is not a shape symbol")
        )
    for i, case in enumerate(c.conformance.cases):
        missing = symbols - set(case.sizes)
        if missing:
            out.append((("conformance", "cases", i, "sizes"), f"no size for {sorted(missing)}"))
        for k in case.params:
            if k not in c.params:
                out.append((("conformance", "cases", i, "params"), f"unknown param '{k}'"))
    if c.plans and sum(p.default for p in c.plans.values()) != 1:
        out.append((("plans",), "exactly one plan must be the default"))
    if c.plans and not c.grads:
        out.append((("plans",), "plans are shapes of the backward: the op has no gradients"))
    if ":" not in c.reference:
        out.append((("reference",), "reference must be 'module:function'"))
    return out
