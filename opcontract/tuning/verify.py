"""Bitwise verification of a candidate config against the canonical config.

A candidate passes only if every output (and, for ops with gradients, every gradient) is
``torch.equal`` to the canonical config's on fresh random inputs. A failing candidate names
the parameters whose change alone moved the bits: those are order-determining.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opcontract.backends.registry import CallInfo, Implementation
from opcontract.conformance.checks import _grads, named_outputs, with_optional_outputs
from opcontract.conformance.inputs import make_inputs
from opcontract.contracts.schema import ConformanceCase, Contract


@dataclass(frozen=True)
class Verdict:
    ok: bool
    moved: tuple[str, ...] = field(default_factory=tuple)  # params that alone moved bits
    detail: str = ""


def runner(impl: Implementation, config: dict):
    """``impl`` with ``config`` forced, through dispatch (differentiable)."""
    from opcontract import dispatch

    mode = "relaxed" if impl.relaxed_only else "strict"
    return dispatch.op(impl.op, backend=impl.name, mode=mode, config=config)


def _bits(
    impl: Implementation, contract: Contract, inputs: dict, params: dict, config: dict
) -> list[torch.Tensor]:
    run = runner(impl, config)
    outs = list(named_outputs(contract, run(**inputs, **params)).values())
    if contract.grads:
        outs += list(_grads(run, contract, inputs, params, 11).values())
    return outs


@dataclass
class Probe:
    """Fresh inputs for one call shape and the canonical config's bits on them."""

    impl: Implementation
    contract: Contract
    inputs: dict
    params: dict
    canonical: dict
    bits: list


def call_inputs(
    impl: Implementation,
    contract: Contract,
    dtype: str,
    sizes: dict[str, int],
    *,
    device: str = "cpu",
    params: dict | None = None,
    seed: int = 0,
) -> tuple[dict, dict, dict]:
    """Fresh inputs for one call shape (the contract's first case, resized), its params with
    every optional output asked for, and the implementation's canonical config."""
    case = contract.conformance.cases[0]
    case = ConformanceCase(
        sizes={**case.sizes, **sizes}, params={**case.params, **(params or {})}, std=case.std
    )
    # model-sized inputs are drawn on the GPU: float64 on the host would take seconds each
    inputs, p = make_inputs(
        contract, case, dtype, seed=seed, device=device, on_device=str(device) != "cpu"
    )
    p = with_optional_outputs(contract, p)
    canonical = impl.default_config(CallInfo(_device_info(device), dtype, case.sizes, p))
    return inputs, p, canonical


def prepare(
    impl: Implementation,
    contract: Contract,
    dtype: str,
    sizes: dict[str, int],
    *,
    device: str = "cpu",
    params: dict | None = None,
    seed: int = 0,
) -> Probe:
    inputs, p, canonical = call_inputs(
        impl, contract, dtype, sizes, device=device, params=params, seed=seed
    )
    return Probe(impl, contract, inputs, p, canonical, _bits(impl, contract, inputs, p, canonical))


def same_bits(a: list, b: list) -> bool:
    """Two lists of outputs (and gradients) with the same shapes, dtypes and bits."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def check(probe: Probe, config: dict) -> Verdict:
    """Bitwise comparison of ``config`` with the canonical config, forward and backward."""

    def same(cfg):
        return same_bits(
            probe.bits, _bits(probe.impl, probe.contract, probe.inputs, probe.params, cfg)
        )

    if same({**probe.canonical, **config}):
        return Verdict(True)
    moved = [
        k
        for k, v in config.items()
        if probe.canonical.get(k) != v and not same({**probe.canonical, k: v})
    ]
    return Verdict(
        False,
        tuple(moved),
        f"bits differ from the canonical config; moved by {moved or 'the combination'}",
    )


def verify_config(
    impl: Implementation,
    contract: Contract,
    dtype: str,
    sizes: dict[str, int],
    config: dict,
    *,
    device: str = "cpu",
    params: dict | None = None,
    seed: int = 0,
) -> Verdict:
    """Compare ``config`` with the canonical config bitwise, forward and backward."""
    return check(
        prepare(impl, contract, dtype, sizes, device=device, params=params, seed=seed), config
    )


def _device_info(device: str):
    import torch as _t

    from opcontract.dispatch.device import device_of

    return device_of(_t.empty(0, device=device))
