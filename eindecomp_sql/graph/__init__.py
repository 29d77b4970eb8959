"""Graph: einsum nodes over named values, the Graph builder, and the lowering of
many-operand einsums to binary trees."""

from .builder import Graph, GraphValue
from .lower import lower_einsum
from .node import EinsumNode, Operand, ValueInfo

__all__ = ["EinsumNode", "Graph", "GraphValue", "Operand", "ValueInfo", "lower_einsum"]
