"""Provenance: what ran for a call, under which contract version, with which config."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any

_local = threading.local()


@dataclass(frozen=True)
class Provenance:
    op: str
    contract_version: int
    contract_sha256: str
    backend: str
    implementation: str
    config: dict[str, Any]
    device: str
    dtypes: dict[str, str]
    mode: str
    params: dict[str, Any] = field(default_factory=dict)
    tuning_entry: str | None = None
    backward_plan: str | None = None  # the contract plan the backward runs (if it has plans)
    backward_bytes: int | None = None  # what that plan allocates beyond inputs and gradients

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def record(p: Provenance) -> None:
    _local.last = p


def last_provenance() -> Provenance | None:
    """Provenance of the last op call that ran on this thread (None before any)."""
    return getattr(_local, "last", None)
