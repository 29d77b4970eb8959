"""Notation: parse extended einsum specs and join/aggregation functions. Pure; no engine."""

from .functions import AGGREGATIONS, Aggregation, JoinFunction, parse_agg, parse_join
from .spec import EinsumSpec, parse_spec

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "EinsumSpec",
    "JoinFunction",
    "parse_agg",
    "parse_join",
    "parse_spec",
]
