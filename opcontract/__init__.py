"""opcontract: declarative operator contracts with contract-checked backend dispatch."""

from opcontract.errors import ContractFileError, ContractViolation, NoBackendError

__version__ = "0.1.0"
__all__ = ["ContractFileError", "ContractViolation", "NoBackendError", "__version__"]
