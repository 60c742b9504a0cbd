"""Op contracts: the YAML files under ``ops/``, their schema and their loader."""

from opcontract.contracts.loader import get_contract, load_all, load_contract_file, parse_contract
from opcontract.contracts.schema import Contract, Reduction, ReductionPlan

__all__ = [
    "Contract",
    "Reduction",
    "ReductionPlan",
    "get_contract",
    "load_all",
    "load_contract_file",
    "parse_contract",
]
