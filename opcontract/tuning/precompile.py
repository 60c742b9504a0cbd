"""Compile a sweep's candidate kernels in parallel processes before its timed studies.

Triton compiles a kernel on its first launch and keeps the binary in its on-disk cache,
keyed by source, constants and specialisation. A study then loads each candidate instead of
compiling it, one after another, in the timing process. Workers launch each candidate once
(forward and backward) at the study's own shapes, so the specialisations match; nothing
they compute is kept, verified or timed.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from opcontract.backends.registry import implementation
from opcontract.contracts import get_contract


@dataclass(frozen=True)
class Job:
    op: str
    implementation: str
    dtype: str
    sizes: tuple[tuple[str, int], ...]
    params: tuple[tuple[str, object], ...]
    config: tuple[tuple[str, object], ...]
    device: str


_last: tuple = (None, None)  # one worker's inputs (and canonical config) of its last call


def _launch(job: Job) -> str | None:
    """Run one candidate once, forward and backward; the error text if it failed."""
    global _last
    from opcontract.tuning.verify import _bits, call_inputs

    c = get_contract(job.op)
    impl = implementation(job.implementation)
    key = (job.op, job.implementation, job.dtype, job.sizes, job.params, job.device)
    if _last[0] != key:
        _last = (None, None)  # free the previous shapes first
        _last = (
            key,
            call_inputs(
                impl, c, job.dtype, dict(job.sizes), device=job.device, params=dict(job.params)
            ),
        )
    inputs, p, base = _last[1]
    try:
        _bits(impl, c, inputs, p, {**base, **dict(job.config)})
    except Exception as e:  # the study will meet (and report) the same failure
        return f"{job.implementation} {dict(job.config)}: {type(e).__name__}: {e}"
    return None


def precompile(jobs: list[Job], workers: int, progress: bool = True) -> list[str]:
    """Launch every job once across ``workers`` processes; the failures' texts."""
    from tqdm import tqdm

    if not jobs:
        return []
    ctx = multiprocessing.get_context("spawn")  # CUDA can't be forked
    failures = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_launch, j) for j in jobs]
        for f in tqdm(
            as_completed(futures), total=len(futures), desc="compiling", disable=not progress
        ):
            if (err := f.result()) is not None:
                failures.append(err)
    return failures
