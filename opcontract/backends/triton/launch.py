"""Kernel launches with the pinned compile options and less host time per call.

``launch(kernel, grid, *args, **meta)`` is ``kernel[grid](*args, **LAUNCH, **meta)``. The
first launch of a specialization goes through Triton's JIT, which compiles (or loads) the
kernel; later launches of the same specialization go straight to the compiled kernel's
launcher, skipping the JIT's argument binding, cache-key hashing and option parsing, and
(when no launch hook is installed) the runner's launch metadata and hook calls
(benchmarks/results/host_profile_h200.json). Where torch has its static CUDA launcher (the
one Inductor launches Triton's cubins with) and the kernel needs nothing it lacks (one CTA
per cluster, no scratch, no TMA descriptor, no cooperative or PDL launch), the compiled
kernel's own cubin is loaded once more through it and launched by it, which costs about
half Triton's launcher's host time (benchmarks/results/static_launch_probe_h200.json).
Either way the binary that runs is the one the JIT chose.

The key that finds a compiled kernel is at least as fine as the JIT's specialization (see
``_key``). Runtime arguments are positional and constexprs named, so a hit needs no
signature binding. Under ``TRITON_INTERPRET=1`` every launch goes through the JIT.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

from opcontract.backends.triton import LAUNCH, interpreting

_PLANS: dict[int, tuple] = {}
# key -> (kernel, compiled kernel, tail values, static handle | None)
_COMPILED: dict[tuple, tuple[Any, Any, tuple, tuple | None]] = {}
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
# launch through torch's static CUDA launcher where it serves the kernel (0: never)
STATIC = os.environ.get("OPCONTRACT_STATIC_LAUNCH", "1") != "0"

# Triton's scalar types as the static launcher's one-letter codes
_SCALAR_CODES = {
    "i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l",
    "u1": "I", "u8": "B", "u16": "H", "u32": "I", "u64": "K",
    "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d",
}  # fmt: skip


@functools.cache
def _static_launcher():
    """torch's static CUDA launcher, or None (an older torch, ROCm)."""
    if torch.version.hip is not None:
        return None
    return getattr(torch._C, "_StaticCudaLauncher", None)


@functools.cache
def _cubin_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="opcontract-cubin-")


def _static_handle(compiled, device: int) -> tuple | None:
    """(launch function, CUfunction, num_warps, shared bytes, argument codes, indices of the
    runtime parameters, scratch slots) to launch ``compiled`` through torch's static launcher;
    None where it can't serve the kernel, which then keeps Triton's launcher."""
    launcher = _static_launcher() if STATIC else None
    md = getattr(compiled, "metadata", None)
    cubin = getattr(compiled, "asm", {}).get("cubin")
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if launcher is None or md is None or cubin is None or not isinstance(signature, dict):
        return None
    if (
        getattr(md, "num_ctas", 1) != 1
        or getattr(md, "global_scratch_size", 0)
        or getattr(md, "profile_scratch_size", 0)
        or getattr(md, "launch_cooperative_grid", False)
        or getattr(md, "launch_pdl", False)
        or tuple(getattr(md, "cluster_dims", None) or (1, 1, 1)) not in ((1, 1, 1), (1,), ())
        or getattr(md, "tensordesc_meta", None)
    ):
        return None
    codes, keep = [], []
    for i, ty in enumerate(signature.values()):
        if ty == "constexpr":
            continue
        code = "O" if isinstance(ty, str) and ty.startswith("*") else _SCALAR_CODES.get(ty)
        if code is None:  # a TMA descriptor, a tuple: Triton's launcher handles it
            return None
        keep.append(i)
        codes.append(code)
    scratch = hasattr(md, "global_scratch_size") + hasattr(md, "profile_scratch_size")
    path = os.path.join(_cubin_dir(), f"{getattr(compiled, 'hash', id(compiled))}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        function = launcher._load_kernel(path, md.name, md.shared, device)[0]
    except Exception:  # noqa: BLE001 - Triton's launcher serves whatever this one can't
        return None
    prefix = keep == list(range(len(keep)))  # the runtime parameters lead: a slice takes them
    return (
        launcher._launch_kernel,
        function,
        md.num_warps,
        md.shared,
        "".join(codes) + "O" * scratch,
        len(keep) if prefix else tuple(keep),
        (None,) * scratch,
    )


def _launch_static(handle: tuple, grid: tuple, stream: int, args: tuple, tail: tuple) -> None:
    fn, function, warps, shared, codes, keep, scratch = handle
    if type(keep) is int and keep <= len(args):
        runtime = args[:keep] + scratch
    else:
        values = (*args, *tail)
        runtime = (*(values[i] for i in (range(keep) if type(keep) is int else keep)), *scratch)
    fn(function, grid[0], grid[1], grid[2], warps, shared, codes, runtime, stream)


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
            if hit[3] is not None and _no_hooks():
                _launch_static(hit[3], g, stream, args, hit[2])
                return
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
    device = torch._C._cuda_getDevice()
    if key is None:
        key = _key(kernel, device, args, meta)
    try:
        hash(key)
    except TypeError:  # an unhashable argument: every launch of it goes through the JIT
        return
    if len(_COMPILED) >= _MAX:
        _COMPILED.clear()
    tail = _tail(kernel, args, {**LAUNCH, **meta})
    _COMPILED[key] = (kernel, compiled, tail, _static_handle(compiled, device))


def clear() -> None:
    """Forget the compiled handles (the next launch of each goes through the JIT)."""
    _COMPILED.clear()
