"""The runtime tuning tables dispatch reads: JSON shipped in the package plus user tables,
keyed by GPU name and compute capability, op, implementation, dtype and batch bucket, each
entry stamped with the versions and the contract's numerics hash it was verified under.

An entry is used only if its stamp matches this machine, its contract's numerics are the
ones it was verified under, every config key is a declared free parameter of its
implementation with one of the declared values, and its timing is a finite number; anything
else (a corrupt file too) is ignored with one warning naming the table, the entry and the
reason, and the default config runs. ``entry_problem`` is that one check, also used by
``opcontract-tune verify``. Writes are atomic (a temporary file renamed over the table)
under an exclusive lock, so concurrent tuners never corrupt a table.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import opcontract
from opcontract.backends.registry import DeviceInfo, Implementation

FORMAT = 2  # 2: entries carry the contract's numerics hash (numerics_sha256)
PACKAGE_TABLES = Path(__file__).parent
USER_TABLES = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "opcontract" / "tuning"
)
ENV = "OPCONTRACT_TUNING_PATH"
KEY_FIELDS = ("gpu", "capability", "op", "implementation", "dtype", "shape", "bucket")
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


def shape_key(
    sizes: dict[str, int],
    batch_dim: str,
    keys: list[str] | None = None,
    params: dict | None = None,
) -> str:
    """The call's fixed sizes (``keys``, default every symbol but the batch one), then the
    params ``keys`` names, e.g. 'H=6656,V=202048' or 'D=128,Hkv=2,Hq=32,layer=local'."""
    fixed = [
        f"{k}={v}"
        for k, v in sorted(sizes.items())
        if k != batch_dim and (keys is None or k in keys)
    ]
    params = params or {}
    named = [f"{k}={params[k]}" for k in sorted(keys or ()) if k not in sizes and k in params]
    return ",".join(fixed + named)


def bucket_of(n: int) -> int:
    """The batch bucket: the next power of two (0 for an empty batch)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@functools.cache
def _stamp() -> tuple[tuple[str, str | None], ...]:
    return tuple(_read_stamp().items())


def stamp() -> dict[str, str | None]:
    """Versions an entry is valid for (read once per process)."""
    return dict(_stamp())


def _read_stamp() -> dict[str, str | None]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        from importlib.metadata import version

        cutlass = version("nvidia-cutlass-dsl")
    except Exception:
        cutlass = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cutlass_dsl": cutlass,
        "opcontract": opcontract.__version__,
    }


@functools.cache
def _driver() -> str | None:
    """The NVIDIA driver version (recorded in written entries, never matched)."""
    if not torch.cuda.is_available():
        return None
    import subprocess

    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.split("\n")[0].strip() or None
    return None


# The versions that can change what an implementation's config does: its own compiler's and
# torch's. A Triton entry stays valid when the CUTLASS DSL is installed or upgraded. The
# driver is recorded, not matched.
_BACKEND_STAMP = {"triton": ("triton",), "cute": ("cutlass_dsl",)}


def stamp_fields(implementation: str) -> tuple[str, ...]:
    """The stamp fields an entry of ``implementation`` must match."""
    return ("torch", "opcontract", *_BACKEND_STAMP.get(implementation.split(".")[0], ()))


def device_key(device: DeviceInfo) -> tuple[str, list[int] | None]:
    return (
        device.name or device.type,
        list(device.capability) if device.capability is not None else None,
    )


def table_key(
    device: DeviceInfo, op: str, implementation: str, dtype: str, shape: str, bucket: int
) -> dict[str, Any]:
    """An entry's key: the fields of KEY_FIELDS."""
    gpu, cap = device_key(device)
    return dict(
        gpu=gpu,
        capability=cap,
        op=op,
        implementation=implementation,
        dtype=dtype,
        shape=shape,
        bucket=bucket,
    )


@dataclass(frozen=True)
class Entry:
    key: dict[str, Any]
    config: dict[str, Any]
    numerics_sha256: str | None
    stamp: dict[str, Any]
    median_ms: Any
    source: str
    objective: str = "forward"  # what median_ms timed: the forward, or forward+backward

    def describe(self) -> str:
        return f"{self.source}: {self.key}"


def declared_value(value: Any, declared: tuple) -> bool:
    """``value`` is one of ``declared`` with the same type (True is not 1, 4.0 is not 4)."""
    return any(type(value) is type(d) and value == d for d in declared)


def entry_problem(entry: Entry, impl: Implementation, numerics_sha256: str) -> str | None:
    """Why ``entry`` may not configure ``impl`` (None: it may). Dispatch and
    ``opcontract-tune verify`` both ask this."""
    if entry.numerics_sha256 != numerics_sha256:
        return f"was verified under other numerics of the {impl.op} contract"
    ms = entry.median_ms
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms):
        return f"its median_ms {ms!r} is not a finite number"
    if not isinstance(entry.config, dict):
        return f"its config {entry.config!r} is not a mapping"
    for k, v in entry.config.items():
        declared = impl.config_space.get(k)
        if declared is None:
            return (
                f"config key {k!r} is not a free parameter of {impl.name} "
                f"(declared: {sorted(impl.config_space)})"
            )
        if not declared_value(v, declared):
            return f"config {k}={v!r} is not among {impl.name}'s declared values {list(declared)}"
    return None


class TuningDB:
    """Tables from ``paths`` (files, or folders of *.json), later paths taking precedence."""

    def __init__(self, paths: list[Path]) -> None:
        self.entries: list[Entry] = []
        for p in paths:
            files = sorted(p.glob("*.json")) if p.is_dir() else [p] if p.exists() else []
            for f in files:
                self.entries.extend(self._load(f))

    @staticmethod
    def _load(path: Path) -> list[Entry]:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            return [
                Entry(
                    {k: e[k] for k in KEY_FIELDS},
                    e["config"],
                    e.get("numerics_sha256"),
                    dict(e["stamp"]),
                    e.get("median_ms"),
                    str(path),
                    e.get("objective", "forward"),
                )
                for e in data["entries"]
            ]
        except Exception as exc:
            _warn_once(f"opcontract: ignoring tuning table {path}: {exc}")
            return []

    def lookup(
        self,
        device: DeviceInfo,
        op: str,
        impl: Implementation,
        dtype: str,
        shape: str,
        bucket: int,
        numerics_sha256: str,
    ) -> Entry | None:
        """The newest entry for this key that may configure ``impl``; else None (a rejected
        entry is ignored with one warning)."""
        key = table_key(device, op, impl.name, dtype, shape, bucket)
        now = stamp()
        for e in reversed(self.entries):
            if e.key != key:
                continue
            why = entry_problem(e, impl, numerics_sha256)
            if why is None:
                stale = {
                    k: (e.stamp.get(k), now.get(k))
                    for k in stamp_fields(impl.name)
                    if e.stamp.get(k) != now.get(k)
                }
                if stale:
                    why = f"was made with other versions {stale}"
            if why:
                _warn_once(
                    f"opcontract: ignoring tuning entry {e.describe()}: {why}; "
                    f"using the default config"
                )
                return None
            return e
        return None


def make_entry(
    device: DeviceInfo,
    op: str,
    implementation: str,
    dtype: str,
    shape: str,
    bucket: int,
    config: dict,
    numerics_sha256: str,
    median_ms: float | None,
    objective: str = "forward",
) -> dict[str, Any]:
    """A table entry; ``objective`` says what ``median_ms`` timed (``forward``, or ``train``:
    forward and backward), so dispatch compares entries of one objective only."""
    return dict(
        **table_key(device, op, implementation, dtype, shape, bucket),
        config=config,
        numerics_sha256=numerics_sha256,
        stamp={**stamp(), "driver": _driver()},
        median_ms=median_ms,
        objective=objective,
    )


def write_entry(path: str | Path, entry: dict[str, Any]) -> None:
    """Add or replace ``entry`` in the table at ``path``: atomic, under an exclusive lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(path.suffix + ".lock")
    with open(lock, "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        data = {"format": FORMAT, "entries": []}
        if path.exists():
            data = json.loads(path.read_text())
        key = {k: entry[k] for k in KEY_FIELDS}
        data["entries"] = [e for e in data["entries"] if {k: e[k] for k in KEY_FIELDS} != key] + [
            entry
        ]
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)


def table_paths() -> list[Path]:
    """Shipped tables, then the user's (~/.cache/opcontract/tuning), then OPCONTRACT_TUNING_PATH."""
    paths = [PACKAGE_TABLES, USER_TABLES]
    paths += [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    return paths


@functools.cache
def _db(paths: tuple[Path, ...]) -> TuningDB:
    return TuningDB(list(paths))


def default_db() -> TuningDB:
    """The shipped tables and those on OPCONTRACT_TUNING_PATH (re-read when it changes)."""
    return _db(tuple(table_paths()))


_generation = 0


def generation() -> int:
    """Bumped by :func:`reload`: dispatch's call cache keys on it."""
    return _generation


def reload() -> None:
    """Re-read the tables (after a sweep wrote one)."""
    global _generation
    _generation += 1
    _db.cache_clear()
