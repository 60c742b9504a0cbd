"""Kernel launches with the pinned compile options and less host time per call.

``launch(kernel, grid, *args, **meta)`` is ``kernel[grid](*args, **LAUNCH, **meta)``. The
first launch of a specialization goes through Triton's JIT, which compiles (or loads) the
kernel; later launches of the same specialization go straight to the compiled kernel's
launcher, skipping the JIT's argument binding, cache-key hashing and option parsing (about
half the host time of a launch at decode sizes on the H200:
benchmarks/results/host_profile_h200.json). The binary that runs is the one the JIT chose.

The specialization key is at least as fine as the JIT's: the current device, the launch
options, each constexpr's value, and for each runtime argument what Triton specialises on
(a tensor's dtype and 16-byte alignment; an int's type range, equality to 1 and
divisibility by 16; a float is float32; anything else by value). Under
``TRITON_INTERPRET=1`` every launch goes through the JIT.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from opcontract.backends.triton import LAUNCH, interpreting

_PLANS: dict[int, tuple] = {}
_COMPILED: dict[tuple, tuple[Any, tuple]] = {}
_MAX = 4096
_I32 = 1 << 31
_I64 = 1 << 63


def _plan(kernel) -> tuple[tuple[str, ...], frozenset[str], tuple[bool, ...], dict[str, Any]]:
    """The kernel's parameter names in order (and as a set), which are constexprs, and
    their defaults."""
    entry = _PLANS.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        params = inspect.signature(kernel.fn).parameters
        names = tuple(params)
        constexpr = tuple("constexpr" in str(p.annotation) for p in params.values())
        defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
        entry = _PLANS[id(kernel)] = (kernel, names, frozenset(names), constexpr, defaults)
    return entry[1:]


def _spec(value: Any, constexpr: bool) -> Any:
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() & 15 == 0)
    if type(value) is int:
        return (-_I32 <= value < _I32, value < _I64, value == 1, value & 15 == 0)
    if type(value) is float:
        return float
    return (type(value), value)


def launch(kernel, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch ``kernel`` (a ``@triton.jit`` function) on ``grid``: positional runtime
    arguments in signature order, constexprs and launch options (num_warps, num_stages)
    by name."""
    meta = {**LAUNCH, **meta}
    if interpreting():
        kernel[grid](*args, **meta)
        return
    names, name_set, constexpr, defaults = _plan(kernel)
    values = list(args)
    for name in names[len(args) :]:
        values.append(meta[name] if name in meta else defaults[name])
    options = tuple((k, v) for k, v in meta.items() if k not in name_set)
    device = torch._C._cuda_getDevice()  # the device Triton launches on: the current one
    key = (
        id(kernel),
        device,
        options,
        tuple(_spec(v, c) for v, c in zip(values, constexpr, strict=True)),
    )
    hit = _COMPILED.get(key)
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    if hit is not None and hit[0] is kernel:
        hit[1][grid3](*values, stream=torch._C._cuda_getCurrentRawStream(device))
        return
    compiled = kernel[grid](*args, **meta)
    if compiled is not None and hasattr(compiled, "function"):
        if len(_COMPILED) >= _MAX:
            _COMPILED.clear()
        _COMPILED[key] = (kernel, compiled)


def clear() -> None:
    """Forget the compiled handles (the next launch of each goes through the JIT)."""
    _COMPILED.clear()
