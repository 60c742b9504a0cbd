"""Offline tuning that cannot change numerics: search spaces, bitwise verification of every
candidate against the canonical config, and the tuning database dispatch reads."""

from opcontract.tuning.db import TuningDB, bucket_of, default_db, stamp
from opcontract.tuning.space import search_space
from opcontract.tuning.verify import Verdict, verify_config

__all__ = [
    "TuningDB",
    "Verdict",
    "bucket_of",
    "default_db",
    "search_space",
    "stamp",
    "verify_config",
]
