"""nn.Module front ends of the contract-checked ops."""

from opcontract.nn.strict_linear import StrictLinear

__all__ = ["StrictLinear"]
