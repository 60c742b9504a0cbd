"""Per-signature memo of validation and selection, so a repeated call costs a dict lookup.

Everything ``bind`` and ``select`` decide depends only on the call's signature (each
tensor's shape, dtype and device; each param's type and value), on the route asked for
(backend, mode, forced config) and on process state (the registry, the tuning tables,
``TRITON_INTERPRET``). The key holds all of them, so a hit returns exactly what the slow
path would. Index ranges read tensor values and are checked on every call. Calls inside
``simulate`` never use the memo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from opcontract import backends
from opcontract.backends import registry
from opcontract.tables import db

_MAX = 4096
_MEMO: dict[tuple, Any] = {}
_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class CachedCall:
    """A validated, selected call shape: how to rebuild its inputs, and what runs it."""

    sources: tuple[tuple[str, Any], ...]  # per contract input: (name, arg index | keyword | None)
    params: dict[str, Any]  # validated, defaults filled in
    sizes: dict[str, int]
    lead: tuple | None  # leading batch dims to flatten (None: already one row per item)
    route: Any  # shell.Route

    def inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's inputs by name, in contract order (None where absent)."""
        return {
            n: (args[s] if type(s) is int else kwargs[s] if s is not None else None)
            for n, s in self.sources
        }


def _part(v: Any) -> Any:
    if type(v) is torch.Tensor:
        return (v.shape, v.dtype, v.device)
    if isinstance(v, _SCALARS):
        return (type(v), v)
    raise TypeError  # not memoised: the slow path validates it


def key(route: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """The memo key of a call (``route``: op, backend, mode, config), or None if an argument
    can't be part of one."""
    backends.load()  # registering bumps the registry's generation: do it first
    try:
        sig = tuple(_part(a) for a in args) + tuple((k, _part(v)) for k, v in kwargs.items())
    except TypeError:
        return None
    return (route, state(), sig)


def state() -> tuple:
    """Process state that selection depends on besides the call itself."""
    return (
        registry.generation(),
        db.generation(),
        os.environ.get(db.ENV),
        os.environ.get("TRITON_INTERPRET"),
    )


def get(k: tuple | None) -> Any:
    return None if k is None else _MEMO.get(k)


def put(k: tuple | None, entry: Any) -> None:
    if k is None:
        return
    if len(_MEMO) >= _MAX:
        _MEMO.clear()
    _MEMO[k] = entry


def clear() -> None:
    _MEMO.clear()
