"""Spark tables as the Spark backend's storage: a Spark database (schema) is the catalog.

``eds.connect(backend="spark", spark_database="tensors")`` keeps each stored tensor as a managed
Parquet table of that database, with the key columns and ``tile`` as the directory form has them,
and its description (name, shape, dtype, tile, keys) in the table property ``eindecomp_sql.tensor``.
Other tables of the database are the user's: never listed, read or written over. Spark SQL users
see the tensors in ``SHOW TABLES`` and query their tiles like any table.

A run's values (step results, arrays bound for the run, temporary results) are tables of the same
database named ``_eds_<session>_<n>``: written where Spark's warehouse is, so a cluster's
executors write and read them as they do any table, and dropped when the run ends (a temporary
result when it is dropped or the session closes). Outputs are written as such tables, and only
when every step has run are they given their description and renamed into place, so a failed
plan leaves the catalog as it was. Replacing a tensor renames the old table aside first and
drops it last: at no moment is there a half-written table under the tensor's name.

Every table name reaches Spark SQL as a sqlglot-quoted identifier; the description is a quoted
string literal (it holds names, which are plain identifiers, numbers and dtype names: nothing a
literal would need escaped). What Spark keeps of the catalog is the session's: with Spark's default in-memory
catalog the tables live as long as the Spark session (their files stay in the warehouse); a
session with Hive support (``enableHiveSupport()``) or another persistent catalog keeps them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from dataclasses import replace as _replace

from sqlglot import exp

from ..compile.compiler import ident
from ..errors import EinsumError
from ..plan import TiledValue

PROPERTY = "eindecomp_sql.tensor"
SCRATCH_PREFIX = "_eds_"


def describe(value: TiledValue) -> str:
    """A tensor's description (the table property's text, and a directory's ``_eds_tensor.json``):
    what ``from_description`` reads back."""
    return json.dumps({"name": value.name, "shape": list(value.shape), "dtype": value.dtype,
                       "tile": list(value.tile), "keys": list(value.keys)})


def from_description(text: str, name: str, where: str) -> TiledValue:
    """The tensor a description says, found under ``name`` (its directory or table). The name is
    the catalog's, not the description's: a directory copied (or a table renamed) by hand keeps
    the description of the tensor it was copied from, and named so a plan read that tensor's
    tiles instead (a trial: the copy of a replaced tensor summed to the new one's 32.0, not 16.0)."""
    try:
        m = json.loads(text)
        value = TiledValue(m["name"], tuple(m["shape"]), m["dtype"], tuple(m["tile"]), tuple(m["keys"]))
    except (ValueError, KeyError, TypeError) as e:
        raise EinsumError(f"stored tensor {name!r}: its description is not readable ({e}); was it edited by hand? "
                          f"Remove {where} by hand") from None
    return value if value.name.lower() == name.lower() else _replace(value, name=name.lower())


def split_database(database) -> tuple[str | None, str]:
    """``"db"`` or ``"catalog.db"`` as (catalog or None, database); anything else refused."""
    if not isinstance(database, str) or not database.strip():
        raise EinsumError(f"spark_database must be the name of a Spark database, such as 'tensors', got {database!r}")
    parts = database.split(".")
    if len(parts) > 2 or not all(re.fullmatch(r"[A-Za-z0-9_]+", p) for p in parts):
        # Spark's own rule for its session catalog's names (INVALID_SCHEMA_OR_RELATION_NAME)
        raise EinsumError(f"spark_database {database!r}: give a database name, or catalog.database, each of "
                          "letters, digits and _ only (Spark's rule for its database names)")
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


class SparkTables:
    """The tensors of one Spark database (see the module docstring). Callers hold the backend's
    lock; every method is a few catalog statements, no Spark job, except ``write``."""

    def __init__(self, spark, database, read_only: bool, session_id: str):
        self.spark = spark
        self.catalog, self.database = split_database(database)
        self._session_id = session_id
        self._counter = itertools.count()
        try:
            exists = self._database_exists()
            if not exists and not read_only:
                self.sql(f"CREATE DATABASE IF NOT EXISTS {self._database_sql()}")
        except Exception as e:  # noqa: BLE001 - Spark's errors come as many classes
            # a catalog Spark does not know, a namespace it does not take (x.y in spark_catalog)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EinsumError(f"spark_database {database!r}: Spark refused it: {first}") from None
        if not exists and read_only:
            raise EinsumError(f"no Spark database {database!r} to open read-only")
        self.scratch: set[str] = set()  # this session's run tables not yet dropped (lower-cased)

    def sql(self, text: str):
        return self.spark.sql(text)

    def _database_sql(self) -> str:
        db = exp.Table(this=ident(self.database), db=ident(self.catalog) if self.catalog else None)
        return db.sql("spark")

    def _database_exists(self) -> bool:
        name = self._database_sql()
        return bool(self.spark.catalog.databaseExists(name))

    def location(self) -> str | None:
        """The local directory the database's tables are kept in, or None (not on this
        machine's file system, or Spark cannot say)."""
        try:
            uri = str(self.spark.catalog.getDatabase(self._database_sql()).locationUri)
        except Exception:  # noqa: BLE001 - a catalog that does not say
            return None
        if not uri.startswith("file:"):
            return None
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(uri).path)

    def qualified(self, name: str, catalog: bool = True) -> str:
        """Table ``name`` of this database as Spark SQL: every part quoted by sqlglot. Tensor
        names compare case-insensitively, as the directory form's do, whatever
        ``spark.sql.caseSensitive`` says: the table is named in lower case. ``catalog=False``:
        without the catalog, as ``RENAME TO`` wants its target."""
        t = exp.Table(this=ident(name.lower()), db=ident(self.database),
                      catalog=ident(self.catalog) if self.catalog and catalog else None)
        return t.sql("spark")

    # -- the catalog --------------------------------------------------------------------------
    def _exists(self, name: str) -> bool:
        return bool(self.spark.catalog.tableExists(self.qualified(name)))

    def _properties(self, name: str) -> dict[str, str] | None:
        """The table's properties, or None where there is no such table."""
        if not self._exists(name):
            return None
        return {r[0]: r[1] for r in self.sql(f"SHOW TBLPROPERTIES {self.qualified(name)}").collect()}

    def find(self, name: str) -> TiledValue | None:
        """The tensor stored as table ``name``; None where there is none, or the table is not one
        of ours (no description)."""
        props = self._properties(name)
        if props is None or PROPERTY not in props:
            return None
        return from_description(props[PROPERTY], name, f"Spark table {self.qualified(name)} (DROP TABLE)")

    def occupied(self, name: str) -> bool:
        """A table or view of that name that is no tensor: the user's, never written over."""
        props = self._properties(name)
        return props is not None and PROPERTY not in props

    def names(self) -> list[str]:
        rows = self.sql(f"SHOW TABLES IN {self._database_sql()}").collect()
        found = (self.find(r["tableName"]) for r in rows
                 if not r["isTemporary"] and not r["tableName"].lower().startswith(SCRATCH_PREFIX))
        return sorted(v.name for v in found if v is not None)

    # -- writing ------------------------------------------------------------------------------
    def new_scratch(self) -> str:
        name = f"{SCRATCH_PREFIX}{self._session_id}_{next(self._counter)}"
        self.scratch.add(name)
        return name

    def write(self, df, options: dict[str, str]) -> str:
        """``df`` written as a new run table of this database; its name."""
        name = self.new_scratch()
        try:
            df.write.options(**options).format("parquet").saveAsTable(self.qualified(name))
        except BaseException:
            with contextlib.suppress(Exception):  # whatever the failed write left
                self.discard(name)
            raise
        return name

    def discard(self, name: str) -> None:
        """Drop run table ``name``; it is forgotten only once dropped (else ``close`` tries again)."""
        self.sql(f"DROP TABLE IF EXISTS {self.qualified(name)}")
        self.scratch.discard(name)

    def install(self, written: str, value: TiledValue) -> None:
        """Run table ``written`` becomes tensor ``value.name`` (replacing one of that name): its
        description first, then the old table renamed aside, the new one renamed into place,
        the old one dropped. A failure puts the old table back."""
        desc = exp.Literal.string(describe(value)).sql("spark")
        self.sql(f"ALTER TABLE {self.qualified(written)} SET TBLPROPERTIES ({exp.Literal.string(PROPERTY).sql('spark')} "
                 f"= {desc})")
        target, old = self.qualified(value.name), None
        if self.find(value.name) is not None:
            old = f"{SCRATCH_PREFIX}{self._session_id}_old_{next(self._counter)}"  # not a run table:
            # close() never drops it, whatever happens below
            self.sql(f"ALTER TABLE {target} RENAME TO {self.qualified(old, catalog=False)}")
        try:
            try:
                self.sql(f"ALTER TABLE {self.qualified(written)} RENAME TO "
                         f"{self.qualified(value.name, catalog=False)}")
            except Exception as e:  # noqa: BLE001 - Spark's errors come as many classes
                if "LOCATION_ALREADY_EXISTS" not in str(e):
                    raise
                raise EinsumError(
                    f"cannot store tensor {value.name!r} as Spark table {target}: the table's location in the "
                    "warehouse already holds files, left by a table of that name from an earlier Spark session "
                    "(Spark's default in-memory catalog forgets its tables when the session stops, not their "
                    "files). Remove that directory, keep tensors in a persistent catalog (enableHiveSupport()), "
                    f"or in a directory (database=). Spark said: {str(e).strip().splitlines()[0]}") from None
        except BaseException as e:
            if old is not None:
                try:
                    self.sql(f"ALTER TABLE {self.qualified(old)} RENAME TO {self.qualified(value.name, catalog=False)}")
                except BaseException as again:
                    raise EinsumError(f"replacing tensor {value.name!r} failed, and so did putting the old one back: "
                                      f"it is kept as Spark table {self.qualified(old)}; rename it back with ALTER "
                                      f"TABLE ... RENAME TO") from again
            raise e
        self.scratch.discard(written)
        if old is not None:
            # the new tensor is in place: a failed drop of the old one leaves a hidden table, no error
            with contextlib.suppress(Exception):
                self.sql(f"DROP TABLE IF EXISTS {self.qualified(old)}")

    def drop(self, name: str) -> None:
        if self.find(name) is not None:
            self.sql(f"DROP TABLE {self.qualified(name)}")

    def close(self) -> None:
        """Drop this session's run tables still there (temporary results, a run cut short)."""
        for name in sorted(self.scratch):
            try:
                self.discard(name)
            except Exception:  # noqa: BLE001 - a stopped Spark session: nothing left to drop in
                self.scratch.discard(name)


__all__ = ["PROPERTY", "SparkTables", "describe", "from_description", "split_database"]
