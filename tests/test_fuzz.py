"""The seeded fuzz (opcontract.conformance.fuzz) of every op through every implementation
this machine runs: each call is the float64 reference's answer or a ContractViolation naming
an argument, and no input is modified."""

import pytest
import torch

from opcontract.backends.registry import CallInfo, implementations, rejection
from opcontract.conformance.fuzz import fuzz
from opcontract.conformance.inputs import make_inputs
from opcontract.contracts import get_contract, load_all
from opcontract.dispatch.device import device_of

CALLS = 400  # per op x implementation (tiny shapes: ~1 s each, also under the interpreter)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _impls():
    for op in sorted(load_all()):
        for impl in implementations(op):
            if not impl.relaxed_only:
                yield pytest.param(op, impl, id=f"{op}-{impl.name}")


@pytest.mark.parametrize("op, impl", list(_impls()))
def test_fuzz(op, impl):
    c = get_contract(op)
    first = make_inputs(c, c.conformance.cases[0], "float32", device=DEVICE)[0]
    why = rejection(
        impl, c, CallInfo(device_of(first[next(iter(first))]), "float32", {}, {}), "strict"
    )
    if why:
        pytest.skip(why)
    counts = fuzz(op, impl.name, CALLS, DEVICE)
    assert counts["results"] >= CALLS // 4, counts  # most mutations still leave a valid call
    assert counts["violations"] >= CALLS // 4, counts
