"""Compile: plan -> sqlglot ASTs -> SQL text. Pure: no connection is ever touched here.

The compiler is a class: ``SQLCompiler`` (``compiler.py``) builds every statement with sqlglot's
expression builders and keeps the dialect and the tactics as class attributes;
``DuckDBCompiler`` (``duckdb.py``) holds DuckDB's. A backend holds an instance
(``DuckDBCompiler()``) and calls ``compile_plan(plan)`` on it; the functions below are the same
over a default ``DuckDBCompiler()`` (``COMPILER``).
"""

from .compiler import CompiledStep, SQLCompiler
from .duckdb import DuckDBCompiler
from .sql import (
    COMPILER,
    bind_sql,
    compile_plan,
    compile_step,
    create_table_as,
    drop_table,
    elements_query,
    kernel_spec,
    select_value,
    single_query,
    slot,
    sql_listing,
)

__all__ = [
    "COMPILER",
    "CompiledStep",
    "DuckDBCompiler",
    "SQLCompiler",
    "bind_sql",
    "compile_plan",
    "compile_step",
    "create_table_as",
    "drop_table",
    "elements_query",
    "kernel_spec",
    "select_value",
    "single_query",
    "slot",
    "sql_listing",
]
