"""Turn plan steps into SQL statements, one statement per step: the module-level API.

The compiler itself is a class (``compiler.SQLCompiler``; DuckDB's dialect and tactics are
``duckdb.DuckDBCompiler``); the functions here are thin wrappers over a default
``DuckDBCompiler()`` (``COMPILER``) so callers that want DuckDB's SQL need no instance. Every
statement is built with sqlglot's expression builders (identifiers quoted by sqlglot, never by
string formatting), so the same plan prints for any dialect. Plans name values, not tables: the
SQL reads and writes each value through a placeholder table (``slot``) that ``bind_sql``
replaces with the table the backend binds the value to, so one compiled plan serves every run
of it. Tile kernels are generic UDFs taking a JSON description of their step as first argument
(``kernel_spec``): the SQL names no per-query function, and ``SELECT * FROM einsum(...)`` can
run without registering anything at query time.
"""

from __future__ import annotations

from sqlglot import exp

from ..plan import Plan, Step, TiledValue
from ..plan.kernel_spec import kernel_spec
from .compiler import (
    SLOT_PREFIX,
    TILE,
    CompiledStep,
    SQLCompiler,
    _compiled,
    batch_bounds,
    col,
    ident,
    slot,
    table,
)
from .duckdb import DuckDBCompiler

COMPILER = DuckDBCompiler()  # the compiler behind this module's functions
DIALECT = DuckDBCompiler.dialect
SMALL_TILE_BYTES = DuckDBCompiler.small_tile_bytes


def bind_sql(text: str, tables: dict[str, str]) -> str:
    """``text`` with every value's placeholder replaced by its table (``tables``: value name ->
    table name; each is quoted by sqlglot)."""
    return COMPILER.bind_sql(text, tables)


def sql(e: exp.Expression) -> str:
    return COMPILER.sql(e)


def compile_step(step: Step, batch: tuple[int, int] | None = None) -> exp.Expression:
    """The SELECT computing one step's tiled result (or one batch of it)."""
    return COMPILER.compile_step(step, batch)


def compile_plan(plan: Plan) -> tuple[CompiledStep, ...]:
    """Every step as SQL (cached per plan and compiler class; see ``SQLCompiler.compile_plan``)."""
    return COMPILER.compile_plan(plan)


compile_plan.cache_info = _compiled.cache_info  # the cache every compiler shares
compile_plan.cache_clear = _compiled.cache_clear


def single_query(plan: Plan, tables: dict[str, str]) -> exp.Expression:
    """The whole plan as one query reading its inputs from ``tables`` (value name -> table)."""
    return COMPILER.single_query(plan, tables)


def sql_listing(plan: Plan, tables: dict[str, str] | None = None) -> str:
    """Every step's SQL, pretty-printed, with the value it computes."""
    return COMPILER.sql_listing(plan, tables)


def select_value(value: TiledValue, table_name: str) -> exp.Expression:
    return COMPILER.select_value(value, table_name)


def elements_query(value: TiledValue, labels: tuple[str, ...], source: exp.Expression | None = None) -> exp.Expression:
    """One row per element of ``value``: a column per label, then ``value``."""
    return COMPILER.elements_query(value, labels, source)


def create_table_as(name: str, select: exp.Expression, temporary: bool = False, replace: bool = False) -> exp.Expression:
    """``CREATE [OR REPLACE] [TEMP] TABLE "table" AS select``."""
    return COMPILER.create_table_as(name, select, temporary, replace)


def drop_table(name: str) -> exp.Expression:
    return COMPILER.drop_table(name)


__all__ = [
    "COMPILER", "DIALECT", "SLOT_PREFIX", "SMALL_TILE_BYTES", "TILE", "CompiledStep", "DuckDBCompiler",
    "SQLCompiler", "batch_bounds", "bind_sql", "col", "compile_plan", "compile_step", "create_table_as",
    "drop_table", "elements_query", "ident", "kernel_spec", "select_value", "single_query", "slot", "sql",
    "sql_listing", "table",
]
