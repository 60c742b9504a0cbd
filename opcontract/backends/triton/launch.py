"""Kernel launches with the pinned compile options and less host time per call.

``launch(kernel, grid, *args, **meta)`` is ``kernel[grid](*args, **LAUNCH, **meta)``. The
first launch of a specialization goes through Triton's JIT, which compiles (or loads) the
kernel; later launches of the same specialization go straight to the compiled kernel's
launcher, skipping the JIT's argument binding, cache-key hashing and option parsing, and
(when no launch hook is installed) the runner's launch metadata and hook calls
(benchmarks/results/host_profile_h200.json). The binary that runs is the one the JIT
chose.

The key that finds a compiled kernel is at least as fine as the JIT's specialization (see
``_key``). Runtime arguments are positional and constexprs named, so a hit needs no
signature binding. Under ``TRITON_INTERPRET=1`` every launch goes through the JIT.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from opcontract.backends.triton import LAUNCH, interpreting

_PLANS: dict[int, tuple] = {}
_COMPILED: dict[tuple, tuple[Any, Any, tuple]] = {}
_MAX = 4096
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


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


def _key(kernel, device: int, args: tuple, meta: dict) -> tuple:
    """What selects a compiled kernel, at least as finely as Triton's specialization: the
    named arguments (constexprs, options) by value; a positional tensor by dtype and 16-byte
    alignment; a float as float32; any other positional argument by type and value (an
    unhashable one, such as a TensorDescriptor, makes the key unhashable: such launches
    always go through the JIT)."""
    return (
        id(kernel),
        device,
        tuple(meta.items()),
        *[
            (a.dtype, a.data_ptr() & 15 == 0)
            if type(a) in _TENSORS
            else float
            if type(a) is float
            else (type(a), a)
            for a in args
        ],
    )


def _tail(kernel, args: tuple, meta: dict) -> tuple:
    """The values of the parameters after the positional ones, in signature order: what the
    compiled kernel's launcher takes after ``args`` (constexprs included)."""
    names, _, _, defaults = _plan(kernel)
    return tuple(meta[n] if n in meta else defaults[n] for n in names[len(args) :])


@functools.cache
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def _no_hooks() -> bool:
    """No launch hooks are installed (a profiler such as Proton installs them)."""
    runtime = _runtime_knobs()
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # a HookChain lists its calls
            return False
    return True


def _direct(compiled, grid: tuple, stream: int, values: tuple) -> bool:
    """Call the compiled kernel's launcher as its own runner does, without launch metadata
    and hooks (there are none); False if this Triton's launcher takes other arguments."""
    global _DIRECT_OK
    try:
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *values)  # fmt: skip
    except TypeError:  # raised while parsing the arguments, before anything launches
        _DIRECT_OK = False
        return False
    return True


_DIRECT_OK = True


def launch(kernel, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch ``kernel`` (a ``@triton.jit`` function) on ``grid``: runtime arguments
    positional, in signature order; constexprs and launch options (num_warps, num_stages)
    by name."""
    key = None
    if _COMPILED:  # only compiled (not interpreted) kernels on a GPU ever land here
        device = torch._C._cuda_getDevice()  # the device Triton launches on: the current one
        key = _key(kernel, device, args, meta)
        try:
            hit = _COMPILED.get(key)
        except TypeError:  # an unhashable argument (a TensorDescriptor): the JIT decides
            hit = key = None
        if hit is not None and hit[0] is kernel:
            g = grid if len(grid) == 3 else (*grid, 1, 1)[:3]
            stream = torch._C._cuda_getCurrentRawStream(device)
            values = (*args, *hit[2])
            if not (_DIRECT_OK and _no_hooks() and _direct(hit[1], g, stream, values)):
                hit[1][g](*values, stream=stream)
            return
    compiled = kernel[grid](*args, **LAUNCH, **meta)
    if compiled is None or not hasattr(compiled, "function") or interpreting():
        return
    bad = [k for k, v in meta.items() if isinstance(v, torch.Tensor)]
    if bad:  # a key holds named values; a tensor there would be keyed (and kept) by identity
        raise TypeError(f"launch: pass runtime arguments positionally, not {bad}")
    if key is None:
        key = _key(kernel, torch._C._cuda_getDevice(), args, meta)
    try:
        hash(key)
    except TypeError:  # an unhashable argument: every launch of it goes through the JIT
        return
    if len(_COMPILED) >= _MAX:
        _COMPILED.clear()
    _COMPILED[key] = (kernel, compiled, _tail(kernel, args, {**LAUNCH, **meta}))


def clear() -> None:
    """Forget the compiled handles (the next launch of each goes through the JIT)."""
    _COMPILED.clear()


def prepared(
    kernel, grid: tuple[int, ...], args: tuple, meta: dict, checked: tuple[int, ...] | None = None
) -> Any:
    """A launcher of the kernel that ``launch(kernel, grid, *args, **meta)`` compiled, for a
    call plan (one signature, called again and again): ``go(*values)`` takes the same
    arguments in the same places, except that every pointer argument is passed as its
    address (an int: ``t.data_ptr()``, or an address inside the same storage), and launches
    the same binary on the same grid, returning True; it launches nothing and returns False
    where ``launch`` would not take that binary (an address's 16-byte alignment or the
    current device differs, or a launch hook is installed). Addresses go to the compiled
    launcher as they are: it neither calls ``data_ptr`` nor asks the driver about them
    (benchmarks/results/host_time_addresses_h200.json). ``checked``: the positions whose
    alignment ``go`` checks (default every pointer's; leave out buffers the caller has just
    allocated, which the allocator aligns to 512 bytes). None if no such launch has run (or
    the interpreter runs kernels)."""
    if not _COMPILED or interpreting() or not _DIRECT_OK:
        return None
    device = torch._C._cuda_getDevice()
    key = _key(kernel, device, args, meta)
    try:
        hit = _COMPILED.get(key)
    except TypeError:
        return None
    if hit is None or hit[0] is not kernel:
        return None
    compiled, tail = hit[1], hit[2]
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    g0, g1, g2 = (*grid, 1, 1)[:3]
    where = tuple(i for i, a in enumerate(args) if type(a) in _TENSORS)
    if not all(args[i].data_ptr() & 15 == 0 for i in where):
        return None  # plans serve the aligned case, which fresh buffers always are
    where = where if checked is None else tuple(checked)
    stream_of, current = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
    runtime = _runtime_knobs()

    def go(*a: Any) -> bool:
        ptrs = 0
        for i in where:
            ptrs |= a[i]
        if ptrs & 15 or current() != device:
            return False
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if (enter is not None and getattr(enter, "calls", True)) or (
            leave is not None and getattr(leave, "calls", True)
        ):
            return False  # as _no_hooks: a profiler's hooks see launches through the JIT
        run(g0, g1, g2, stream_of(device), function, packed, None, None, None, *a, *tail)
        return True

    return go
