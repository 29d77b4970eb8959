"""Compile: plan -> sqlglot ASTs -> SQL text. Pure: no connection is ever touched here."""

from .sql import (
    CompiledStep,
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
    "CompiledStep",
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
