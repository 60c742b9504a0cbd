"""The device a call runs on, with an override for testing selection without that GPU."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch

from opcontract.backends.registry import DeviceInfo

_local = threading.local()
_active = [0]  # simulate blocks open on any thread: while none is, no thread simulates
_active_lock = threading.Lock()


def device_of(t: torch.Tensor) -> DeviceInfo:
    """The DeviceInfo of a tensor's device (or the simulated one, inside ``simulate``)."""
    sim = getattr(_local, "simulated", None)
    if sim is not None:
        return sim
    if t.device.type == "cuda":
        idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _cuda_device(idx)
    return DeviceInfo(t.device.type)


def simulating() -> bool:
    """Whether a ``simulate`` block is active on this thread."""
    return bool(_active[0]) and getattr(_local, "simulated", None) is not None


@functools.cache
def _cuda_device(index: int) -> DeviceInfo:
    return DeviceInfo(
        "cuda", torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index)
    )


@contextlib.contextmanager
def simulate(
    capability: tuple[int, int] | None, name: str = "simulated GPU", type: str = "cuda"
) -> Iterator[DeviceInfo]:
    """Make selection (``explain``, and ``op`` calls) see this device instead of the real one.

    For testing selection logic only: a call still runs where its tensors are.
    """
    prev = getattr(_local, "simulated", None)
    _local.simulated = DeviceInfo(type, capability, name)
    with _active_lock:
        _active[0] += 1
    try:
        yield _local.simulated
    finally:
        with _active_lock:
            _active[0] -= 1
        _local.simulated = prev
