"""Random inputs for a contract's conformance cases: fresh normal floats, never zeros;
index inputs uniform over their declared range, with a fraction set to the allowed sentinel."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from opcontract.contracts.schema import ConformanceCase, Contract, SameAs

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


def batch_inputs(contract: Contract) -> list[str]:
    """Inputs whose leading dimension is the contract's batch dimension."""
    b = contract.conformance.batch_dim
    return [n for n, s in contract.inputs.items() if s.shape and s.shape[0] == b]


def make_inputs(
    contract: Contract,
    case: ConformanceCase,
    dtype: str,
    *,
    sizes: dict[str, int] | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    on_device: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inputs and params for one case, served in ``dtype``; ``sizes`` overrides case sizes.

    Values are drawn on the CPU in float64 (the same on every machine for a seed) unless
    ``on_device``: then on ``device`` in float32, for model-sized shapes (a 202048 x 6656
    weight), still seeded and fresh, but not equal across device types.
    """
    if contract.conformance.make_inputs:
        module, _, name = contract.conformance.make_inputs.partition(":")
        build = getattr(importlib.import_module(module), name)
        return build(
            contract, case, dtype, sizes=sizes, seed=seed, device=device, on_device=on_device
        )
    dims = {**case.sizes, **(sizes or {})}
    params = {n: p.default for n, p in contract.params.items()}
    params.update(case.params)
    where = device if on_device else "cpu"
    gen = torch.Generator(where).manual_seed(seed)
    floats = torch.float32 if on_device else torch.float64
    out: dict[str, torch.Tensor] = {}
    for name, spec in contract.inputs.items():
        if any(params.get(p) in vals for p, vals in (spec.absent_when or {}).items()):
            out[name] = None
            continue
        shape = [dims[d] if isinstance(d, str) else d for d in spec.shape]
        allowed = contract.input_dtypes(name)
        dt = dtype if isinstance(spec.dtype, SameAs) or dtype in allowed else allowed[0]
        if spec.values is not None:
            lo, hi = (dims[b] if isinstance(b, str) else b for b in spec.values.range)
            t = torch.randint(lo, hi, shape, generator=gen, device=where)
            sentinel = params.get(spec.values.allow) if spec.values.allow else None
            if sentinel is not None and t.numel():
                drop = torch.rand(shape, generator=gen, device=where) < case.allow_fraction
                t = torch.where(drop, torch.full_like(t, sentinel), t)
            out[name] = t.to(DTYPES[dt]).to(device)
        else:
            std = case.std.get(name, 1.0)
            out[name] = (
                (torch.randn(shape, generator=gen, dtype=floats, device=where) * std)
                .to(DTYPES[dt])
                .to(device)
            )
    return out, params
