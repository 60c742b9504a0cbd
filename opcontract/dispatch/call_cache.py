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
from dataclasses import dataclass, field
from typing import Any

import torch

from opcontract.backends import registry
from opcontract.tables import db

_MAX = 4096
_MEMO: dict[tuple, Any] = {}
_cleared = [0]  # times the memo was emptied: a fast entry made before then is stale
_SCALARS = (bool, int, float, str, type(None))


UNTRIED = object()  # no call plan asked for yet


@dataclass(eq=False)
class CachedCall:
    """A validated, selected call shape: how to rebuild its inputs, what runs it, and (once
    asked for) the implementation's call plan for it (see Implementation.plan_no_grad)."""

    sources: tuple[tuple[str, Any], ...]  # per contract input: (name, arg index | keyword | None)
    params: dict[str, Any]  # validated, defaults filled in
    sizes: dict[str, int]
    lead: tuple | None  # leading batch dims to flatten (None: already one row per item)
    route: Any  # shell.Route
    plan: Any = field(default=UNTRIED)
    # derived from sources: the first n_args inputs come as the call's positional args, in
    # contract order; where the rest are absent, the plan takes (*args, *absent)
    n_args: int = field(init=False)
    absent: tuple | None = field(init=False)

    def __post_init__(self) -> None:
        n = 0
        while n < len(self.sources) and self.sources[n][1] == n:
            n += 1
        self.n_args = n
        rest = self.sources[n:]
        self.absent = (None,) * len(rest) if all(s is None for _, s in rest) else None

    def inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's inputs by name, in contract order (None where absent)."""
        return {
            n: (args[s] if type(s) is int else kwargs[s] if s is not None else None)
            for n, s in self.sources
        }


_SCALAR_TYPES = frozenset(_SCALARS)
# plain tensors and nn.Parameter (a subclass that only marks a module's weights: it
# overrides no torch function), which every model's weights are
TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def key(route: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """The memo key of a call (``route``: op, backend, mode, config), or None if an argument
    can't be part of one. Tensors enter by shape, dtype and device; scalars by type and value."""
    sig = []
    for a in args:
        if type(a) in TENSOR_TYPES:
            sig.append((a.shape, a.dtype, a.device))
        elif type(a) in _SCALAR_TYPES:
            sig.append((type(a), a))
        else:
            return None  # not memoised: the slow path validates it
    for k, v in kwargs.items():
        if type(v) in TENSOR_TYPES:
            sig.append((k, v.shape, v.dtype, v.device))
        elif type(v) in _SCALAR_TYPES:
            sig.append((k, type(v), v))
        else:
            return None
    return (route, state(), tuple(sig))


def _env_reader():
    """A fast reader of one environment variable: os.environ's own mapping, looked up by its
    encoded key (no encode/decode per call); os.environ.get where that isn't available."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return lambda name: os.environ.get(name)
    return lambda name, _k={}: data.get(_k.get(name) or _k.setdefault(name, encode(name)))


_env = _env_reader()


def state() -> tuple:
    """Process state that selection depends on besides the call itself (the backends are
    registered before any key is asked for: ``shell.op_shell`` loads them)."""
    return (
        registry._Registry.generation,
        db._generation,
        _cleared[0],
        _env(db.ENV),
        _env("TRITON_INTERPRET"),
    )


def get(k: tuple | None) -> Any:
    return None if k is None else _MEMO.get(k)


def put(k: tuple | None, entry: Any) -> None:
    if k is None:
        return
    if len(_MEMO) >= _MAX:
        clear()
    _MEMO[k] = entry


def clear() -> None:
    _MEMO.clear()
    _cleared[0] += 1


@dataclass(frozen=True, eq=False)
class FastEntry:
    """An OpFunction's last planned signature, matched without building a memo key (a
    model's module calls its op with one signature step after step): the process state and
    scalar keyword params it was made under, each positional tensor's shape, dtype and
    device, and the memo entry they lead to."""

    state: tuple
    kwargs: tuple[tuple[str, type, Any], ...]
    tensors: tuple[tuple[torch.Size, torch.dtype, torch.device] | None, ...]  # None: None
    call: CachedCall
    provenance: Any  # call.route.provenance


def fast_entry(k: tuple, args: tuple, kwargs: dict, call: CachedCall) -> FastEntry | None:
    """The fast entry of a planned call whose memo key is ``k``; None where the call's
    arguments can't be matched as one (a keyword tensor, a positional non-tensor other
    than None)."""
    sig = []
    for a, s in zip(args, k[2], strict=False):  # the key's (shape, dtype, device) of a tensor
        if a is None:
            sig.append(None)
        elif type(a) in TENSOR_TYPES:
            sig.append(s)
        else:
            return None
    if any(type(v) not in _SCALAR_TYPES for v in kwargs.values()):
        return None
    kw = tuple((n, type(v), v) for n, v in kwargs.items())
    return FastEntry(k[1], kw, tuple(sig), call, call.route.provenance)


def fast_match(f: FastEntry, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``len(f.tensors)`` positional args has ``f``'s signature under the
    same process state: then the memo would return ``f.call``."""
    if len(kwargs) != len(f.kwargs) or state() != f.state:
        return False
    get = kwargs.get
    for name, typ, value in f.kwargs:
        v = get(name, _MISSING)
        if type(v) is not typ or v != value:
            return False
    for a, sig in zip(args, f.tensors, strict=False):  # counts checked by the caller
        if sig is None:
            if a is not None:
                return False
            continue
        if type(a) not in TENSOR_TYPES or a.shape != sig[0] or a.dtype != sig[1]:
            return False
        if a.device != sig[2]:
            return False
    return True


_MISSING = object()
