"""Sweep files (YAML) and the Optuna studies that run them.

Each (op, implementation, dtype, batch bucket) is one study. A candidate config is first
checked bitwise against the canonical config on fresh inputs (forward and backward); a
mismatch is recorded with the parameters that moved the bits and never timed. Survivors are
timed (median of CUDA events after warm-up; wall clock on the CPU). The fastest verified
config is written to the table once its study ends.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from opcontract.backends.registry import implementation
from opcontract.conformance.checks import named_outputs
from opcontract.contracts import get_contract
from opcontract.tables.db import bucket_of, declared_value, make_entry, shape_key, write_entry
from opcontract.tuning.space import candidates, search_space
from opcontract.tuning.verify import Probe, _device_info, check, prepare, runner, same_bits


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SweepOp(_Strict):
    op: str
    implementation: str
    sizes: dict[str, int] = Field(description="every shape symbol but the batch one")
    params: dict[str, Any] = Field(default_factory=dict)
    batch: list[int] = Field(description="values of the contract's batch symbol to tune")
    space: dict[str, list[Any]] | None = Field(
        default=None,
        description="a narrower search: per parameter, a subset of the declared values",
    )
    objective: Literal["forward", "train"] = Field(
        default="forward",
        description="what is timed: the forward call, or forward and backward (training)",
    )
    memory_budget: int | None = Field(
        default=None,
        ge=0,
        description=(
            "bytes the backward may allocate beyond its inputs and gradients: candidates "
            "whose backward plan needs more at the item's shapes are never timed"
        ),
    )
    timing: Literal["eager", "graph"] = Field(
        default="eager",
        description=(
            "eager: calls as launched from Python (host time included where it dominates); "
            "graph: replays of a CUDA graph of the call, the GPU time that a graph-captured "
            "decode loop sees (on CUDA; elsewhere eager)"
        ),
    )


class Sweep(_Strict):
    name: str
    dtypes: list[str]
    ops: list[SweepOp]


class SweepError(ValueError):
    """A sweep file that can't be run, with the reason."""


def load_sweep(path: str | Path) -> Sweep:
    try:
        sweep = Sweep.model_validate(yaml.safe_load(Path(path).read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as e:
        raise SweepError(f"{path}: {e}") from None
    for i, item in enumerate(sweep.ops):
        try:
            c = get_contract(item.op)
            impl = implementation(item.implementation)
        except KeyError as e:
            raise SweepError(f"{path}: ops[{i}]: {e.args[0]}") from None
        if impl.op != item.op:
            raise SweepError(f"{path}: ops[{i}]: {impl.name} implements {impl.op}, not {item.op}")
        missing = c.symbols() - set(item.sizes) - {c.conformance.batch_dim}
        if missing:
            raise SweepError(f"{path}: ops[{i}]: no size for {sorted(missing)}")
        unknown = set(item.params) - set(c.params)
        if unknown:
            raise SweepError(f"{path}: ops[{i}]: unknown params {sorted(unknown)}")
        for k, values in (item.space or {}).items():
            declared = impl.config_space.get(k)
            if declared is None:
                raise SweepError(
                    f"{path}: ops[{i}].space: {impl.name} has no parameter {k!r}; "
                    f"its space is {sorted(impl.config_space)}"
                )
            outside = [v for v in values if v not in declared]
            if outside or not values:
                raise SweepError(
                    f"{path}: ops[{i}].space.{k}: {outside or 'no values'} not among the "
                    f"declared {list(declared)}"
                )
        for dt in sweep.dtypes:
            if dt not in impl.dtypes:
                raise SweepError(f"{path}: {impl.name} does not serve {dt}")
    return sweep


def check_storage(storage: str | None) -> None:
    """Fail before any work if an Optuna storage path can't be written."""
    if not storage:
        return
    path = (
        Path(storage.removeprefix("sqlite:///"))
        if storage.startswith("sqlite:///")
        else Path(storage)
    )
    parent = path.parent if str(path.parent) else Path(".")
    probe = parent / f".opcontract-write-test-{time.time_ns()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SweepError(f"storage {storage!r} can't be written: {e.strerror}") from None


def _storage(storage: str | None):
    if storage is None or storage.startswith(("sqlite:", "postgresql:", "mysql:")):
        return storage
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(storage))  # several GPUs can share one journal


def workload(probe: Probe, objective: str = "forward") -> Callable[[dict], Callable[[], Any]]:
    """config -> the call to time: the forward, or (``train``) the forward and the backward
    of its differentiable outputs into the contract's gradient inputs, with fixed upstream
    gradients and leaves made once (no copies inside the timed call)."""
    c = probe.contract
    if objective == "forward" or not c.grads:
        return lambda cfg: functools.partial(
            runner(probe.impl, cfg), **probe.inputs, **probe.params
        )
    leaves = {
        k: (v.detach().clone().requires_grad_(True) if k in c.grads and v is not None else v)
        for k, v in probe.inputs.items()
    }
    wrt = [leaves[k] for k in c.grads if leaves[k] is not None]
    with torch.no_grad():
        outs = named_outputs(c, runner(probe.impl, probe.canonical)(**probe.inputs, **probe.params))
    diff = [n for n, o in c.outputs.items() if o.differentiable and n in outs]
    gen = torch.Generator(outs[diff[0]].device).manual_seed(7)
    ups = [
        torch.randn(outs[n].shape, generator=gen, device=outs[n].device).to(outs[n].dtype)
        for n in diff
    ]

    def train(cfg):
        run = runner(probe.impl, cfg)

        def step():
            o = named_outputs(c, run(**leaves, **probe.params))
            return torch.autograd.grad([o[n] for n in diff], wrt, ups)

        return step

    return train


def time_ms(fn, device: str, timing: str = "eager") -> float:
    """Median time of ``fn`` in milliseconds: of its calls, or (``timing="graph"``, CUDA)
    of replays of a CUDA graph that captured it."""
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if timing == "graph":
            fn()  # compiled and warm before capture
            return do_bench_cudagraph(fn, rep=100, return_mode="median")
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


@dataclass
class StudyResult:
    op: str
    implementation: str
    dtype: str
    bucket: int
    best: dict | None
    best_ms: float | None
    default_ms: float | None
    rejected: list[tuple[dict, tuple[str, ...]]]
    trials: int
    unequal_to: str | None = None  # the implementation whose bits it failed to match
    error: str | None = None  # why the study failed (no entry), if it did


def _call_key(item: SweepOp, dtype: str, batch: int) -> tuple:
    return (
        item.op,
        dtype,
        tuple(sorted(item.sizes.items())),
        batch,
        repr(sorted(item.params.items())),
    )


def _by_call(tasks: list) -> list:
    """Tasks grouped by call (op, dtype, sizes, batch, params), each group in sweep order:
    the implementations of one call run back to back, the first one's bits the reference."""
    groups: dict[tuple, list] = {}
    for t in tasks:
        groups.setdefault(_call_key(*t), []).append(t)
    return [t for g in groups.values() for t in g]


def tune(
    probe: Probe,
    *,
    name: str,
    storage: str | None,
    trials: int,
    timeout: float | None,
    device: str,
    narrow: dict[str, list] | None = None,
    work: Callable[[dict], Callable[[], Any]] | None = None,
    timing: str = "eager",
    over_budget: Callable[[dict], str | None] | None = None,
) -> tuple[dict | None, float | None, list]:
    """One Optuna study over the implementation's space (``narrow``ed per parameter where
    given), timing ``work`` (default: the forward; see :func:`workload`) as ``timing`` says
    (see :func:`time_ms`); (best config, ms, rejected). ``over_budget(config)``: why a
    candidate's backward plan exceeds the memory budget (it is then never timed), or None."""
    import optuna
    from optuna.trial import TrialState

    space = search_space(probe.impl, narrow)
    size = math.prod(len(v) for v in space.values())
    sampler = (
        optuna.samplers.GridSampler({k: list(v) for k, v in space.items()}, seed=0)
        if size <= trials
        else optuna.samplers.TPESampler(seed=0)
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name,
        storage=_storage(storage),
        sampler=sampler,
        direction="minimize",
        load_if_exists=True,
    )
    rejected: list = []
    work = work or workload(probe)
    canonical = {k: probe.canonical[k] for k in space if probe.canonical.get(k) in space[k]}
    if len(canonical) == len(space) and not study.trials:
        study.enqueue_trial(canonical)  # the default is always a candidate

    def objective(trial):
        cfg = {k: trial.suggest_categorical(k, list(v)) for k, v in space.items()}
        if over_budget is not None and (why := over_budget({**probe.canonical, **cfg})):
            trial.set_user_attr("over_budget", why)
            rejected.append((cfg, ("memory_budget",)))
            raise optuna.TrialPruned()
        verdict = check(probe, cfg)
        if not verdict.ok:  # moved bits: recorded, never timed
            trial.set_user_attr("moved", list(verdict.moved))
            rejected.append((cfg, verdict.moved))
            raise optuna.TrialPruned()
        full = {**probe.canonical, **cfg}
        return time_ms(work(full), device, timing)

    # ``trials`` is the study's total: a resumed sweep runs only what an interrupted one left
    # (a finished grid runs nothing). A candidate that raises (a launch the GPU refuses) is a
    # failed trial, not the end of the sweep.
    ended = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    left = min(trials, size) - sum(t.state in ended for t in study.trials)
    if left > 0:
        study.optimize(objective, n_trials=left, timeout=timeout, catch=(Exception,))
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if not done:
        return None, None, rejected
    best = min(done, key=lambda t: t.value)
    return dict(best.params), best.value, rejected


def study_space(item: SweepOp, impl, canonical: dict) -> dict[str, list] | None:
    """The item's narrowed space; a forward-timed study also pins the implementation's
    backward-only keys (the backward plan) at the canonical value: the forward can't time
    them, and a table entry must not pick a plan by the forward's noise."""
    narrow = dict(item.space or {})
    if item.objective == "forward":
        for k in impl.backward_only:
            if k in impl.config_space and k in canonical:
                narrow[k] = [canonical[k]]
    return narrow or None


def _budget_check(item: SweepOp, impl, info, dtype: str, sizes: dict):
    """over_budget for :func:`tune`: why a config's backward plan needs more than the
    item's memory budget, or None; None where there is no budget or no plans."""
    if item.memory_budget is None or impl.plan_memory is None:
        return None
    from opcontract.backends.registry import PLAN_KEY, CallInfo

    call = CallInfo(info, dtype, sizes, dict(item.params))

    def over(cfg: dict) -> str | None:
        plan = cfg.get(PLAN_KEY)
        need = impl.plan_memory(call, cfg).get(plan, 0)
        if need > item.memory_budget:
            return f"{plan} needs {need} bytes, over the budget of {item.memory_budget}"
        return None

    return over


def _precompile(tasks: list, device: str, workers: int, progress: bool) -> None:
    from opcontract.tuning.precompile import Job, precompile

    jobs = [
        Job(
            item.op,
            item.implementation,
            dt,
            tuple(sorted({**item.sizes, get_contract(item.op).conformance.batch_dim: b}.items())),
            tuple(sorted(item.params.items())),
            tuple(sorted(cfg.items())),
            device,
        )
        for item, dt, b in tasks
        if implementation(item.implementation).backend == "triton"  # the one with a disk cache
        for cfg in candidates(implementation(item.implementation), {}, item.space)
    ]
    for err in precompile(jobs, workers, progress):
        print(f"precompile: {err}", flush=True)


def _not_here(impl, info) -> str | None:
    """Why ``impl`` can't run on this device at all (a Triton kernel on a CPU, without the
    interpreter), or None."""
    if info.type not in impl.devices:
        return f"{impl.name} runs on {', '.join(impl.devices)}, not {info.type}"
    return impl.device_check(info)


def run_sweep(
    sweep: Sweep,
    table: str | Path,
    *,
    storage: str | None = None,
    trials: int = 20,
    timeout: float | None = None,
    device: str | None = None,
    progress: bool = True,
    only: set[str] | None = None,
    on_result: Callable[[StudyResult], None] | None = None,
    compile_workers: int = 0,
    max_batch: int | None = None,
    min_batch: int | None = None,
) -> list[StudyResult]:
    """Run every study of the sweep (of the ops in ``only``, if given; of the batch sizes
    from ``min_batch`` up to ``max_batch``, where given). As each study ends,
    the fastest of its verified configs and the default goes into ``table`` with its time
    (the times also let dispatch choose between implementations), and to ``on_result``.

    The implementations of one call (op, dtype, shape, batch, params) run back to back on the
    same inputs; one whose canonical outputs and gradients are not bitwise equal to the
    first one's gets no entry, so dispatch never switches between unequal implementations
    from one batch bucket to the next.

    ``compile_workers`` > 0 first compiles every candidate in that many processes, so the
    studies (one process, timing) load kernels instead of compiling them one by one.

    A study that fails (its implementation can't run on this device, or its default config
    raises) writes no entry; its result has ``error`` set to the reason, and the sweep goes
    on with the next study."""
    from tqdm import tqdm

    check_storage(storage)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        info = _device_info(device)
    except (RuntimeError, AssertionError) as e:  # torch without CUDA, or no GPU
        raise SweepError(f"device {device!r} can't be used here: {e}") from None
    items = [i for i in sweep.ops if only is None or i.op in only or i.implementation in only]
    if only is not None and not items:
        raise SweepError(f"--only {sorted(only)} matches no op or implementation of the sweep")
    missing = {
        i.implementation: why
        for i in items
        if (why := implementation(i.implementation).available()) is not None
    }
    for name, why in missing.items():
        print(f"skipping {name}: {why}", flush=True)
    items = [i for i in items if i.implementation not in missing]
    tasks = _by_call(
        [
            (item, dt, b)
            for item in items
            for dt in sweep.dtypes
            for b in item.batch
            if (max_batch is None or b <= max_batch) and (min_batch is None or b >= min_batch)
        ]
    )
    if compile_workers > 0:  # not the studies that fail without running (see below)
        runnable = [
            t for t in tasks if _not_here(implementation(t[0].implementation), info) is None
        ]
        _precompile(runnable, device, compile_workers, progress)
    results = []

    def failed(item: SweepOp, dt: str, b: int, name: str, why: str) -> None:
        print(f"{name}: failed, no entry: {why}", flush=True)
        results.append(
            StudyResult(item.op, item.implementation, dt, b, None, None, None, [], 0, error=why)
        )
        if on_result is not None:
            on_result(results[-1])

    first: tuple | None = None  # (call, implementation, its canonical bits) of the call's first
    for item, dt, b in tqdm(tasks, desc=f"tuning {sweep.name}", disable=not progress):
        c = get_contract(item.op)
        impl = implementation(item.implementation)
        sizes = {**item.sizes, c.conformance.batch_dim: b}
        # one study per table key: the fixed sizes are part of it (shapes must not share trials)
        shape = shape_key(sizes, c.conformance.batch_dim, c.conformance.table_key, item.params)
        name = f"{sweep.name}/{item.op}/{impl.name}/{dt}/{shape}/{b}"
        call = _call_key(item, dt, b)
        if first is not None and first[0] != call:
            first = None  # a new call: the previous one's bits can go
        why = _not_here(impl, info)
        if why is not None:
            failed(item, dt, b, name, why)
            continue
        try:
            probe = prepare(impl, c, dt, sizes, device=device, params=item.params)
            if first is None:
                first = (call, impl.name, probe.bits)
            elif not same_bits(first[2], probe.bits):
                # dispatch serves each bucket with the fastest tabled implementation: only
                # implementations whose bits agree may share a call's table
                print(
                    f"{name}: bits differ from {first[1]}'s on the same inputs: no entry",
                    flush=True,
                )
                results.append(
                    StudyResult(item.op, impl.name, dt, b, None, None, None, [], 0, first[1])
                )
                if on_result is not None:
                    on_result(results[-1])
                continue
            work = workload(probe, item.objective)
            best, best_ms, rejected = tune(
                probe,
                name=name,
                storage=storage,
                trials=trials,
                timeout=timeout,
                device=device,
                narrow=study_space(item, impl, probe.canonical),
                work=work,
                timing=item.timing,
                over_budget=_budget_check(item, impl, info, dt, sizes),
            )
            default_ms = time_ms(work(probe.canonical), device, item.timing)
        except Exception as e:  # the default config itself fails: nothing to write
            failed(item, dt, b, name, f"{type(e).__name__}: {e}")
            continue
        if best is None or best_ms >= default_ms:  # the default is (still) the fastest
            # its declared values (a value outside the space, such as the interpreter's
            # smaller tiles, is the default anyway and no table may carry it)
            best = {
                k: probe.canonical[k]
                for k, values in search_space(impl).items()
                if k in probe.canonical and declared_value(probe.canonical[k], values)
            }
            best_ms = default_ms
        write_entry(
            table,
            make_entry(
                info,
                item.op,
                impl.name,
                dt,
                shape,
                bucket_of(b),
                best,
                c.numerics_sha256,
                best_ms,
                item.objective,
            ),
        )
        results.append(
            StudyResult(item.op, impl.name, dt, b, best, best_ms, default_ms, rejected, trials)
        )
        if on_result is not None:
            on_result(results[-1])
    return results
