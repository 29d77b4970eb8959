"""Reading an ordinary DuckDB table or view as an einsum operand: its columns and types, then one
statistics scan (sizes, NULLs, negative indices, repeated keys). What the answers mean is decided
in ``compile/sql_interface.py``; this module only asks DuckDB.

Runs while DuckDB binds ``SELECT * FROM einsum(...)`` (inside the ``eds_einsum_sql`` UDF), so it
uses a cursor of its own: the query's own connection cannot run anything until the UDF returns
(DuckDB refuses with "code running inside a query cannot use that query's connection"). A cursor
is another connection to the same database, so it sees committed, non-temporary tables and views
only: TEMP tables, DataFrames registered on the user's connection and tables created in a
transaction that has not committed yet are not visible from here.
"""

from __future__ import annotations

import re

import duckdb
from sqlglot import exp

from ..compile.sql import DIALECT, table
from ..compile.sql_interface import (
    TableOperand,
    classify_table,
    stats_query,
    with_stats,
)
from ..errors import EinsumError


# How many tables and views by the name $1 exist where a bare name resolves: the connection's
# current database and schema, or the temp catalog. A table of that name in another schema or
# an attached database is not one (it blocked db.store("A") as "a table or view of the
# database that is not a stored tensor"; a new user's report).
WHERE_CURRENT_SCHEMA = "(database_name = current_database() AND schema_name = current_schema())"
WHERE_BARE_NAMES_RESOLVE = f"({WHERE_CURRENT_SCHEMA} OR database_name = 'temp')"
COUNT_NAMED = ("SELECT (SELECT count(*) FROM duckdb_tables() WHERE lower(table_name) = lower($1) AND {where}) + "
               "(SELECT count(*) FROM duckdb_views() WHERE lower(view_name) = lower($1) AND {where})")


def read_table_operand(con: duckdb.DuckDBPyConnection, name: str, home: tuple | None = None) -> TableOperand | None:
    """The table or view ``name`` as an operand, or None if there is none by that name.
    ``home``: the (database, schema) the session works in, where the einsum's query reads the
    name (a new cursor starts in the default catalog: after ``USE`` of an attached file, a
    table of the same name in memory was read for its shape and dtype)."""
    cur = con.cursor()
    try:
        if home is not None:
            cur.execute(f"USE {'.'.join(exp.to_identifier(str(n), quoted=True).sql(dialect=DIALECT) for n in home)}")
        try:
            rel = cur.sql(exp.select("*").from_(table(name)).limit(0).sql(dialect=DIALECT))
            columns, types = list(rel.columns), [str(t) for t in rel.types]
        except duckdb.CatalogException as e:
            exists = cur.execute(COUNT_NAMED.format(where=WHERE_BARE_NAMES_RESOLVE), [name]).fetchone()[0]
            if exists:  # a view whose own tables are gone: it exists, it does not bind
                if re.search(r"Table Function with name einsum\w* does not exist", str(e)):
                    # the table macros are TEMP, on the caller's connection: the operand is read
                    # while its einsum is planned, on a cursor of its own, which has none
                    raise EinsumError(
                        f"einsum(): view {name!r} is itself over einsum(), which cannot be read while another "
                        f"einsum is planned; store its result first (CREATE TABLE ... AS SELECT * FROM {name}, "
                        "or db.einsum(..., out=...))") from None
                raise EinsumError(f"einsum(): view {name!r} cannot be read: {e}") from None
            return None
        except duckdb.Error as e:
            raise EinsumError(f"einsum(): table or view {name!r} cannot be read: {e}") from None
        op = classify_table(name, columns, types)
        row = cur.execute(stats_query(op).sql(dialect=DIALECT)).fetchone()
        return with_stats(op, row)
    finally:
        cur.close()
