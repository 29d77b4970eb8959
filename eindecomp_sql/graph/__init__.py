"""Graph: einsum nodes over named values, and the lowering of many-operand einsums to binary trees."""

from .lower import lower_einsum
from .node import EinsumNode, Operand, ValueInfo

__all__ = ["EinsumNode", "Operand", "ValueInfo", "lower_einsum"]
