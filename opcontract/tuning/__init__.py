"""Offline tuning that cannot change numerics: search spaces, bitwise verification of every
candidate against the canonical config, and the sweeps that write the runtime tables
(``opcontract.tables``) dispatch reads."""

from opcontract.tuning.space import search_space
from opcontract.tuning.verify import Verdict, verify_config

__all__ = ["Verdict", "search_space", "verify_config"]
