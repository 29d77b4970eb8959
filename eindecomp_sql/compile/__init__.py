"""Compile: plan -> sqlglot ASTs -> SQL text. Pure: no connection is ever touched here."""

from .sql import (
    CompiledStep,
    compile_plan,
    compile_step,
    create_table_as,
    drop_table,
    elements_query,
    kernel_spec,
    select_value,
    single_query,
    sql_listing,
)

__all__ = [
    "CompiledStep",
    "compile_plan",
    "compile_step",
    "create_table_as",
    "drop_table",
    "elements_query",
    "kernel_spec",
    "select_value",
    "single_query",
    "sql_listing",
]
