"""Shared benchmark plumbing: environment stamp, measured ceilings, timing, one JSON schema.

Every result file is ``{"benchmark", "command", "env", "ceilings", "rows", ...}`` where a
row is ``{"kernel", "provider", "mode", "metric", "x_name", "x", "median", "p20", "p80",
"unit", ...}`` (Liger-Kernel's benchmark row layout).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def env_stamp() -> dict:
    import triton

    from opcontract.tables.db import stamp as tables_stamp  # the versions entries are made for

    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""

    repo = Path(__file__).resolve().parent.parent
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability())
        if torch.cuda.is_available()
        else None,
        "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cutlass_dsl": tables_stamp()["cutlass_dsl"],
        "python": platform.python_version(),
        "opcontract_commit": _commit(run(["git", "-C", str(repo), "rev-parse", "HEAD"])),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@contextlib.contextmanager
def implementations_run(counts: collections.Counter):
    """Counts ``op:implementation`` of every dispatched call on this thread while open (the
    provenance dispatch records for each call; eager calls only, not a compiled graph's)."""
    import opcontract.dispatch as dispatch
    from opcontract.dispatch import provenance

    class Counting:
        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)
            if name == "last":
                counts[f"{value.op}:{value.implementation}"] += 1

    saved = provenance._local
    dispatch._provenance_local = provenance._local = Counting()
    try:
        yield counts
    finally:
        dispatch._provenance_local = provenance._local = saved


def _commit(rev: str) -> str | None:
    # the device machine gets a copy of the tree whose git state may be stale: the caller
    # passes the commit, which wins over what git says
    return os.environ.get("OPCONTRACT_COMMIT") or (rev if len(rev) == 40 else None)


def bench(fn, warmup_ms: float = 50, rep_ms: float = 400) -> tuple[float, float, float]:
    """(median, p20, p80) in milliseconds from CUDA events (triton.testing.do_bench)."""
    from triton.testing import do_bench

    med, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return med, p20, p80


def bench_graph(fn, rep_ms: float = 100) -> float:
    """Median replay time in milliseconds of ``fn`` captured in a CUDA graph: the GPU time
    alone, without the host's per-call work."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def wall_s(fn, runs: int = 3) -> float:
    """Median wall-clock seconds of ``fn()``, the GPU synchronised before and after each run."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 matmul rate on random data (TFLOP/s)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)[0]
    return 2 * n**3 / ms / 1e9


def copy_gbps(nbytes: int = 4 << 30) -> float:
    """Measured device-to-device copy rate, bytes read plus bytes written (GB/s)."""
    x = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))[0]
    return 2 * x.numel() / ms / 1e6


def kernel_us(fn, calls: int = 1, warm: bool = True) -> collections.Counter:
    """GPU microseconds per call of ``fn``, by kernel name (torch.profiler's CUDA events over
    ``calls`` calls, after one unprofiled call where ``warm``)."""
    from torch.profiler import ProfilerActivity, profile

    if warm:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name] += e.device_time_total / calls
    return out


def peak_extra_bytes(fn) -> int:
    """Peak device memory allocated during ``fn()`` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def write(path: str | os.PathLike, payload: dict) -> None:
    payload = {"command": " ".join([Path(sys.executable).name, *sys.argv]), **payload}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")
