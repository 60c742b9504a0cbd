"""Named results, built from each contract's ``outputs`` and ``named_result``: one field per
output in contract order, None for an output not asked for."""

from __future__ import annotations

import functools
from collections import namedtuple

from opcontract.contracts.loader import get_contract


@functools.cache
def result_type(op: str) -> type | None:
    """The named tuple an op returns when it returns more than one output (None if it has no
    ``named_result``)."""
    c = get_contract(op)
    if not c.named_result:
        return None
    fields = tuple(c.outputs)
    cls = namedtuple(c.named_result, fields, defaults=(None,) * len(fields))
    cls.__module__ = "opcontract.outputs"
    cls.__doc__ = f"{op}'s outputs: " + "; ".join(
        f"{n}: {o.doc}" if o.doc else n for n, o in c.outputs.items()
    )
    return cls
