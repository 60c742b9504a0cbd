"""Offline tuning that cannot change numerics: search spaces, bitwise verification of every
candidate against the canonical config, and the tuning database dispatch reads."""

from opcontract.tuning.db import TuningDB, bucket_of, default_db, stamp
from opcontract.tuning.space import search_space

__all__ = [
    "TuningDB",
    "Verdict",
    "bucket_of",
    "default_db",
    "search_space",
    "stamp",
    "verify_config",
]


def __getattr__(name: str):
    # verify imports the conformance kit, which imports dispatch, which imports this
    # package: load it on first use, not at import.
    if name in ("Verdict", "verify_config"):
        from opcontract.tuning import verify

        return getattr(verify, name)
    raise AttributeError(name)
