"""Index inputs that a contract declares ``host`` may come as CPU tensors while the call runs
on a GPU (dispatch then checked their values without waiting for the GPU). Implementations
bring them to the call's device with ``on_device`` where a kernel reads them, and may use the
host copy first for what the host decides (a tile table, a chunk count) without a sync."""

from __future__ import annotations

import numpy as np
import torch

# True: stage each host-to-device copy through pinned memory. Off: on the H200 the pageable
# copies were as fast at B = 1 and 6-11% faster at B = 16 and 64, eager and CUDA-graph decode
# alike (benchmarks/results/hf_decode_static_capturable_h200.json)
PINNED_STAGING = False


def on_device(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """``t`` on ``device``: a host tensor copied without waiting for the GPU's queue (the
    copy is ordered before any kernel launched after it on the current stream).

    With ``PINNED_STAGING`` a host tensor bound for a GPU goes through pinned memory first
    (PyTorch's pinned-memory cache keeps the staging block until the copy has run); off by
    default, where it was measured slower."""
    if t is None or t.device == device:
        return t
    device = torch.device(device)
    if PINNED_STAGING and device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def may_keep(device: torch.device) -> bool:
    """Whether a device buffer allocated now may be kept for later calls (a cache of
    counters, a call plan's workspace). Not while a CUDA graph is captured, nor on a stream
    other than the device's default: torch.compile's CUDA graph trees ("reduce-overhead")
    warm a graph up on their own stream with every allocation of the thread taken from the
    graph's private pool, and a buffer kept from there is a live allocation the graph does
    not own, which they refuse when they record ("tensor(s) in the cudagraph pool not
    tracked as outputs"). Off the default stream a buffer is made per call instead."""
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    return torch.cuda.current_stream(device) == torch.cuda.default_stream(device)


def on_device_int32(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple:
    """Host integer tensors on ``device`` as int32, in one copy: packed on the host, copied
    once, each returned as a view of its shape. For index inputs that kernels read as int32
    anyway (a per-tensor copy costs the host several microseconds each)."""
    flat = np.concatenate([t.numpy().reshape(-1).astype(np.int32, copy=False) for t in tensors])
    packed = on_device(torch.from_numpy(flat), device)
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        out.append(packed[at : at + n].view(t.shape))
        at += n
    return tuple(out)
