"""DuckDB's compiler: the dialect and the tactics measured on DuckDB.

Pure like the rest of ``compile`` (sqlglot only; this module does not import duckdb). The
backend (``backends/duckdb.py``) holds a ``DuckDBCompiler()`` and runs what it compiles.
"""

from __future__ import annotations

import re

from .compiler import SQLCompiler

# the names duckdb's source registry gives the arrays a plan reads (backends/duckdb.py: _arrays)
_REGISTRY_NAME = re.compile(r"__duckdb_source_[A-Za-z0-9_]*")


class DuckDBCompiler(SQLCompiler):
    """``SQLCompiler`` with DuckDB's dialect and the tactics that measured faster there."""

    dialect = "duckdb"
    # One row each: pair them by position. Measured on two 64 MB tiles (4096² GEMM), the step
    # took 1.02 s this way against 1.19 s with a hash join and 1.15 s with a cross product,
    # which both copy a whole side into a hash table / collection first.
    positional_join_single_tiles = True
    # A label in one piece has key 0 everywhere, so its condition is redundant. Dropping it
    # turns the join into a cross product: ~1 ms faster on small tiles, but ~80 ms slower on
    # two 64 MB tiles (the cross product copies its right side; a hash join's build is cheaper).
    small_tile_bytes = 1 << 20

    def quote(self, table_name: str) -> str:
        """Arrays are read by names the client's source registry makes afresh on every run:
        plain identifiers, quoted here directly (what sqlglot prints for them) rather than
        through the shared cache, which they would churn. Every other name, a user's included,
        is quoted by sqlglot."""
        if _REGISTRY_NAME.fullmatch(table_name):
            return f'"{table_name}"'
        return super().quote(table_name)
