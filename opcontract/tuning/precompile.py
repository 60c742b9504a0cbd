"""Compile a sweep's candidate kernels in parallel processes before its timed studies.

Triton compiles a kernel on its first launch and keeps the binary in its on-disk cache,
keyed by source, constants and specialisation. A study then loads each candidate instead of
compiling it, one after another, in the timing process. Workers launch each candidate once
(forward and backward) at the study's own shapes, so the specialisations match; nothing
they compute is kept, verified or timed.
"""

from __future__ import annotations

import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from opcontract.backends.registry import CallInfo, implementation
from opcontract.conformance.checks import with_optional_outputs
from opcontract.conformance.inputs import make_inputs
from opcontract.contracts import get_contract
from opcontract.contracts.schema import ConformanceCase
from opcontract.tuning.space import search_space


@dataclass(frozen=True)
class Job:
    op: str
    implementation: str
    dtype: str
    sizes: tuple[tuple[str, int], ...]
    params: tuple[tuple[str, object], ...]
    config: tuple[tuple[str, object], ...]
    device: str


def grid(impl, narrow: dict | None) -> list[dict]:
    """Every config of the (narrowed) search space."""
    space = {k: list((narrow or {}).get(k, v)) for k, v in search_space(impl).items()}
    keys = sorted(space)
    return [dict(zip(keys, vs, strict=True)) for vs in itertools.product(*(space[k] for k in keys))]


_last: tuple = (None, None)  # one worker's inputs for its previous job's shapes


def _launch(job: Job) -> str | None:
    """Run one candidate once, forward and backward; the error text if it failed."""
    global _last
    from opcontract.tuning.verify import _bits, _device_info

    c = get_contract(job.op)
    impl = implementation(job.implementation)
    key = (job.op, job.dtype, job.sizes, job.params, job.device)
    if _last[0] != key:
        _last = (None, None)  # free the previous shapes first
        case = c.conformance.cases[0]
        case = ConformanceCase(
            sizes={**case.sizes, **dict(job.sizes)},
            params={**case.params, **dict(job.params)},
            std=case.std,
        )
        inputs, p = make_inputs(c, case, job.dtype, device=job.device, on_device=True)
        p = with_optional_outputs(c, p)
        _last = (key, (inputs, p, case.sizes))
    inputs, p, sizes = _last[1]
    base = impl.default_config(CallInfo(_device_info(job.device), job.dtype, sizes, p))
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
