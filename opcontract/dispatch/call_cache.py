"""Per-signature memo of validation and selection, so a repeated call costs a dict lookup.

Everything ``bind`` and ``select`` decide depends only on the call's signature (each
tensor's shape, dtype and device; each param's type and value), on the route asked for
(backend, mode, forced config) and on process state (the registry, the tuning tables,
``TRITON_INTERPRET``). The key holds all of them, so a hit returns exactly what the slow
path would. Index ranges read tensor values and are checked on every call. Calls inside
``simulate`` never use the memo.
"""

from __future__ import annotations

import functools
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
    fast: Any = field(default=UNTRIED)  # its FastEntry (None: it has none), made once
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


def _env_reader(name: str) -> Any:
    """A fast reader of one environment variable: os.environ's own mapping, looked up by the
    key encoded once (no encode/decode per call); os.environ.get where that isn't available."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return lambda: os.environ.get(name)
    return functools.partial(data.get, encode(name))


_env_tables, _env_interpret = _env_reader(db.ENV), _env_reader("TRITON_INTERPRET")
_Registry = registry._Registry


def state() -> tuple:
    """Process state that selection depends on besides the call itself (the backends are
    registered before any key is asked for: ``shell.op_shell`` loads them)."""
    return (
        _Registry.generation,
        db._generation,
        _cleared[0],
        _env_tables(),
        _env_interpret(),
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
    model's module calls its op with one signature step after step). ``match(args,
    kwargs)`` is True where the memo would return ``call``: the same process state, scalar
    keyword params of the same type and value, and each positional arg None where it was
    None, else a tensor of the same type class, shape, dtype and device."""

    match: Any  # (args: tuple, kwargs: dict) -> bool, compiled for this one signature
    call: CachedCall
    provenance: Any  # call.route.provenance


def fast_entry(k: tuple, args: tuple, kwargs: dict, call: CachedCall) -> FastEntry | None:
    """The fast entry of a planned call whose memo key is ``k``; None where the call's
    arguments can't be matched as one (a keyword tensor, a positional non-tensor other
    than None)."""
    if any(a is not None and type(a) not in TENSOR_TYPES for a in args):
        return None
    if any(type(v) not in _SCALAR_TYPES for v in kwargs.values()):
        return None
    return FastEntry(_matcher(k[1], args, k[2], kwargs), call, call.route.provenance)


def _matcher(process: tuple, args: tuple, sigs: tuple, kwargs: dict) -> Any:
    """``match`` for one signature, its checks unrolled into straight-line code (cheaper
    than a loop over the args on every call). ``sigs``: the memo key's entries of the
    positional args, (shape, dtype, device) for a tensor."""
    names = [f"a{i}" for i in range(len(args))]
    env: dict[str, Any] = {"state": state, "TT": TENSOR_TYPES, "S": process, "M": _MISSING}
    lines = [
        "def match(args, kwargs):",
        f"    if len(args) != {len(args)} or len(kwargs) != {len(kwargs)} or state() != S:",
        "        return False",
    ]
    if args:
        lines.append(f"    {', '.join(names)}{',' if len(args) == 1 else ''} = args")
    for i, (a, sig) in enumerate(zip(args, sigs[: len(args)], strict=True)):
        n = names[i]
        if a is None:
            lines.append(f"    if {n} is not None: return False")
            continue
        env[f"s{i}"], env[f"d{i}"], env[f"v{i}"] = sig
        lines.append(
            f"    if type({n}) not in TT or {n}.dtype is not d{i} or {n}.shape != s{i}"
            f" or {n}.device != v{i}: return False"
        )
    for j, (name, value) in enumerate(kwargs.items()):
        env[f"n{j}"], env[f"t{j}"], env[f"k{j}"] = name, type(value), value
        lines.append(f"    v = kwargs.get(n{j}, M)")
        lines.append(f"    if type(v) is not t{j} or v != k{j}: return False")
    lines.append("    return True")
    exec("\n".join(lines), env)  # noqa: S102 - source built above from names only
    return env["match"]


_MISSING = object()
