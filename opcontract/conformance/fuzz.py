"""Seeded fuzzing of every op through every implementation this machine runs: each call
returns the float64 reference's answer (within the contract's tolerance relative to
max(||ref||, 1), NaN and infinities as the contract's ``nonfinite`` rule says) or raises
ContractViolation naming one of the call's arguments; the inputs hold the same bytes
afterwards.

A call is built from a valid one by a few seeded mutations: sizes (0 included), leading
batch dims, dtypes (wrong and mixed ones too), strided / offset / expanded layouts with NaN
in the gaps, planted NaN and infinities, index values out of range or at the sentinel,
params from the valid ones and from every Python type, a missing, extra or positional
argument, meta tensors (those may also be NoBackendError: no backend runs on meta).
"""

from __future__ import annotations

import random

import torch

from opcontract import ContractViolation, NoBackendError, dispatch
from opcontract.conformance.checks import (
    named_outputs,
    nonfinite_problem,
    nonfinite_rows,
    plant,
    reference_fn,
    same_bytes,
    strided_views,
)
from opcontract.conformance.inputs import DTYPES, make_inputs
from opcontract.contracts import get_contract
from opcontract.dispatch.validate import bind_params, signature

ODD_VALUES = [None, True, -1, 0, 2**70, 10**400, float("nan"), float("inf"), -0.5, "x", [1]]
VALID_PARAMS = {
    "softcap": [None, 20.0, 0.5, 1e4],
    "multiplier": [1.0, 0.19611613513818404, -2.0, 0.0],
    "label_smoothing": [0.0, 0.1, 0.5],
    "ignore_index": [-100, -1, 0, 3],
    "eps": [1e-5, 1e-8, 1.0],
    "rope_theta": [500000.0, 10000.0, 10.0],
    "qk_scale": [3.87, 1.0, -0.5],
    "window": [2048, 64, 1],
    "scale": [None, 0.5],
}


def mutated_call(c, rng: random.Random, device: str):
    """(inputs, params, extra positional tensor or None, what): a valid call with a few
    random mutations."""
    case = c.conformance.cases[rng.randrange(len(c.conformance.cases))]
    sig = signature(c.op)
    params0 = {**{n: p.default for n, p in c.params.items()}, **case.params}
    for _ in range(32):  # sizes that meet the contract's constraints, mostly
        sizes = {
            s: rng.choice(
                [0, 1, 2, 3, 5, 7] if s == c.conformance.batch_dim else [1, 2, 3, 4, 6, 8, 9]
            )
            for s in case.sizes
        }
        ok = all(k.holds(**sizes, **params0) for k in sig.constraints if not k.when)
        if ok and rng.random() < 0.9:
            break
    if "G" in sizes and case.params.get("layout") == "packed":
        sizes["G"] *= 2
    dtype = rng.choice(["float32", "bfloat16", "float16"])
    inputs, params = make_inputs(
        c, case, dtype, sizes=sizes, seed=rng.randrange(1 << 30), device=device
    )
    what = [f"sizes {sizes}", dtype]
    extra = None
    for _ in range(rng.randrange(4)):
        kind = rng.choice(
            ["layout", "layout", "nonfinite", "param", "odd_param", "values", "dtype", "lead"]
            + ["signature", "meta"]
        )
        names = [n for n, t in inputs.items() if t is not None]
        if kind == "layout" and names:
            n = rng.choice(names)
            t = inputs[n]
            if t.numel():
                fill = float("nan") if t.is_floating_point() else 0
                view_kind, inputs[n] = rng.choice(strided_views(t, fill))
                what.append(f"{n} {view_kind}")
        elif kind == "nonfinite":
            floats = [n for n in names if inputs[n].is_floating_point() and inputs[n].numel()]
            if floats:
                n = rng.choice(floats)
                rows = [rng.randrange(inputs[n].shape[0]) for _ in range(rng.randrange(1, 4))]
                inputs[n] = plant(inputs[n], rows)
                what.append(f"non-finite in {n}")
        elif kind == "param":
            n = rng.choice(list(c.params) or [None])
            if n is not None:
                spec = c.params[n]
                pool = (
                    spec.choices
                    or VALID_PARAMS.get(n)
                    or ([True, False] if spec.type == "bool" else [spec.default])
                )
                params[n] = rng.choice(pool)
                what.append(f"{n}={params[n]!r}")
                for other, o_spec in c.params.items():  # keep dependent params consistent
                    needs = (o_spec.present_when or {}).get(n)
                    if needs is not None and rng.random() < 0.8:
                        params[other] = (
                            rng.choice(VALID_PARAMS[other]) if params[n] in needs else None
                        )
        elif kind == "odd_param" and c.params:
            n = rng.choice(list(c.params))
            params[n] = rng.choice(ODD_VALUES)
            what.append(f"{n}={params[n]!r}")
        elif kind == "values":
            idx = [n for n in names if c.inputs[n].values is not None and inputs[n].numel()]
            if idx:
                n = rng.choice(idx)
                t = inputs[n].clone()
                t.view(-1)[rng.randrange(t.numel())] = rng.choice([-7, 10**6, -100, -1, 0])
                inputs[n] = t
                what.append(f"{n} values")
        elif kind == "dtype" and names:
            n = rng.choice(names)
            to = rng.choice(list(DTYPES.values()))
            inputs[n] = inputs[n].to(to)
            what.append(f"{n} as {to}")
        elif kind == "lead" and c.batch_dims and "leading" not in " ".join(what):
            bdim = c.batch_dims
            batched = [
                n
                for n in names
                if c.inputs[n].shape[:1] == [bdim] and inputs[n].dim() == len(c.inputs[n].shape)
            ]
            T = sizes.get(bdim, 0)
            split = rng.choice([(1, T), (T, 1)] + ([(2, T // 2)] if T % 2 == 0 else []))
            for n in batched:
                if rng.random() < 0.9:  # now and then one input keeps its flat shape
                    inputs[n] = inputs[n].reshape(*split, *inputs[n].shape[1:])
            what.append(f"leading dims {split}")
        elif kind == "signature":
            choice = rng.randrange(3)
            if choice == 0 and names:
                n = rng.choice(names)
                inputs[n] = None
                what.append(f"{n} missing")
            elif choice == 1:
                params["temperature"] = 1.0
                what.append("extra kwarg")
            else:
                extra = torch.zeros(1)
                what.append("extra positional")
        elif kind == "meta" and names:
            n = rng.choice(names)
            inputs[n] = inputs[n].to("meta")
            what.append(f"{n} on meta")
    return inputs, params, extra, ", ".join(what)


def _call(f, inputs, params, extra):
    if extra is not None:  # one tensor more than the contract's inputs, positionally
        return f(*inputs.values(), extra, **params)
    return f(**inputs, **params)


def check_result(c, out, inputs, params, what):
    """The outputs against the float64 oracle on the same (flattened) inputs."""
    bdim = c.batch_dims
    batched = [n for n, spec in c.inputs.items() if spec.shape[:1] == [bdim]]
    lead = None
    flat = dict(inputs)
    for n in batched:
        t = inputs[n]
        if t is not None:
            k = t.dim() - len(c.inputs[n].shape) + 1
            lead = tuple(t.shape[:k])
            flat[n] = t.reshape(-1, *t.shape[k:])
    as64 = {
        k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in flat.items()
    }
    params = bind_params(signature(c.op), params)  # as the op saw them (2**70 as a float)
    refs = named_outputs(c, reference_fn(c)(**as64, **params))
    outs = named_outputs(c, out)
    dtype = next(
        str(v.dtype).removeprefix("torch.") for v in inputs.values()
        if v is not None and v.is_floating_point()
    )  # fmt: skip
    n = next((flat[b].shape[0] for b in batched if flat[b] is not None), 0)
    bad = nonfinite_rows(refs, n)
    argmax_outputs = {"predicted", "token_accuracy"} & set(refs)
    if argmax_outputs:
        from opcontract.backends.torch.softcap_logprob import argmax_is_ambiguous

        if argmax_is_ambiguous(**as64, **params):  # float32 ties the float64 math breaks
            refs = {k: v for k, v in refs.items() if k not in argmax_outputs}
    for name, ref in refs.items():
        assert name in outs, (what, name)
        o = outs[name]
        if lead is not None and o.dim() >= len(lead) and tuple(o.shape[: len(lead)]) == lead:
            o = o.reshape(-1, *o.shape[len(lead) :])
        assert tuple(o.shape) == tuple(ref.shape), (what, name, o.shape, ref.shape)
        problem = nonfinite_problem(c, name, o, ref, c.tolerance[dtype], bad, floor=1.0)
        assert problem is None, (what, problem)


def fuzz(op: str, implementation: str, calls: int, device: str = "cpu") -> dict[str, int]:
    """``calls`` seeded mutated calls of ``op`` forced onto ``implementation``; counts of the
    outcomes. Raises AssertionError (naming the call) on any other outcome."""
    c = get_contract(op)
    f = dispatch.op(op, backend=implementation)
    allowed = set(c.inputs) | set(c.params) | {"temperature"}
    rng = random.Random(f"{op}/{implementation}")
    counts = {"results": 0, "violations": 0, "no backend on meta": 0}
    for _ in range(calls):
        inputs, params, extra, what = mutated_call(c, rng, device)
        before = {
            k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor) and not v.is_meta
        }
        try:
            out = _call(f, dict(inputs), dict(params), extra)
        except ContractViolation as e:
            assert e.argument in allowed or e.argument.startswith("positional"), (what, str(e))
            counts["violations"] += 1
            continue
        except NoBackendError as e:
            assert any(t is not None and t.is_meta for t in inputs.values()), (what, str(e))
            counts["no backend on meta"] += 1
            continue
        for k, v in before.items():
            assert same_bytes(v, inputs[k]), (what, f"input '{k}' was modified")
        check_result(c, out, inputs, params, what)
        counts["results"] += 1
    return counts
