"""Per-signature memo of validation and selection, so a repeated call costs a dict lookup.

Everything ``bind`` and ``select`` decide depends only on the call's signature (each
tensor's shape, dtype and device; each param's type and value) and on process state (the
registry, the tuning tables, ``TRITON_INTERPRET``). The key holds both, so a hit returns
exactly what the slow path would. Index ranges read tensor values and are checked on
every call. Calls inside ``simulate`` never use the memo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from opcontract import backends
from opcontract.backends import registry
from opcontract.dispatch.provenance import Provenance
from opcontract.tuning import db

_MAX = 4096
_MEMO: dict[tuple, CachedCall] = {}
_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class CachedCall:
    """A validated, selected call shape: how to rebuild its inputs, and what runs it."""

    positional: tuple[str, ...]  # input names of the positional args, in order
    keyword_inputs: frozenset[str]
    absent: tuple[str, ...]  # inputs the contract sets to None for these params
    params: dict[str, Any]  # validated, defaults filled in
    sizes: dict[str, int]
    value_checked: bool  # the contract has index ranges to check on every call
    impl: Any  # Implementation | None
    config: dict[str, Any]
    provenance: Provenance | None
    rejected: dict[str, str]

    def inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        out = dict(zip(self.positional, args, strict=True))
        for k in self.keyword_inputs:
            out[k] = kwargs[k]
        for k in self.absent:
            out[k] = None
        return out


def _part(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (v.shape, v.dtype, v.device)
    if isinstance(v, _SCALARS):
        return (type(v), v)
    raise TypeError  # not memoised: the slow path validates it


def key(name: str, backend: str | None, mode: str, args: tuple, kwargs: dict) -> tuple | None:
    """The memo key of a call, or None if an argument can't be part of one."""
    backends.load()  # registering bumps the registry's generation: do it first
    try:
        sig = tuple(_part(a) for a in args) + tuple((k, _part(v)) for k, v in kwargs.items())
    except TypeError:
        return None
    state = (
        registry.generation(),
        db.generation(),
        os.environ.get(db.ENV),
        os.environ.get("TRITON_INTERPRET"),
    )
    return (name, backend, mode, state, sig)


def get(k: tuple | None) -> CachedCall | None:
    return None if k is None else _MEMO.get(k)


def put(k: tuple | None, entry: CachedCall) -> None:
    if k is None:
        return
    if len(_MEMO) >= _MAX:
        _MEMO.clear()
    _MEMO[k] = entry


def clear() -> None:
    _MEMO.clear()
