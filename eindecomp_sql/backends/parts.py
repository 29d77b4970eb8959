"""A big stored tensor as several tables ("parts") behind a view of the tensor's name.

Why: DuckDB 2.0 fills one row group of a table up to 122,880 rows and handles a row group's
blob column whole. A tensor of 256 tiles of 4 MB is one row group of 1 GiB: storing it held the
transaction's rows, the commit's copy and the serialised block (+4.2 GB resident for 1 GiB), and
a scan read all 256 tiles into one vector whatever the WHERE (docs/LAYOUT.md has what else was
tried). Each part is its own table, created and committed by its own statement, so DuckDB holds
one part at a time. 1 GiB stored as 8 parts of 128 MB peaked at +932 MB, 32 of 32 MB at
+352 MB (+345 MB under a 300 MB ``memory_limit``, which a single table cannot be stored under at
all), 64 of 16 MB at about +290 MB, 128 of 8 MB no lower; so parts of 16 MiB. A 4 GiB ``.npy``
is stored by ``eindecomp-sql store`` at 435 MB peak resident (2-core development machine,
``bench/io_bench.py``; docs/DESIGN.md "Big tensors as parts").

The tensor's name is a view, ``SELECT * FROM part0 UNION ALL SELECT * FROM part1 ...``: every
reader (plan steps, the SQL interface, plain ``duckdb``) reads it as it read the table. The parts
are listed in ``eds_parts`` (tensor name, position, part table); the view, its ``eds_parts`` rows
and its catalog row are committed together after the last part, so a tensor is either whole or
absent. Parts a crash left behind (named ``_eds_part_w<run>_<k>``, listed nowhere) are dropped
when the database is next opened for writing.

A part's tile column is ``STRUCT(t BLOB)`` and the view unwraps it (``struct_extract(tile, 't')
AS tile``): DuckDB keeps distinct-count statistics of every BLOB column it appends to, hashing
every byte of a chunk's few rows (``DistinctStatistics::UpdateSample``: a 64 MiB tile hashed whole,
~12 ms at ~5 GB/s on the 2-core VM), and keeps none for a nested column. So a result or a store
of more than ``PART_BYTES`` is parts even when it is one tile: its bytes are then written without
that hash (``bench/blob_hash_probe.py``; docs/DESIGN.md "Tiles in a one-field struct"). Below
it, the view and the statements that replace parts cost about what the hash would (~2 ms at 16
MiB). Views a database written before this made over BLOB parts stay as they were.

A tensor of at most ``PART_BYTES`` stays one table, as before. A query over a view of many parts costs
binding time (a count over a 1,024-part view took 0.15 s, 2,048 parts 0.54 s): at most
``MAX_PARTS`` parts, bigger ones beyond ``MAX_PARTS × PART_BYTES``.
"""

from __future__ import annotations

import math
import os
import re
import secrets

import pyarrow as pa
from sqlglot import exp

from ..compile.sql import table
from ..plan.cost import nbytes

# about this much tile data per part (at least one tile); EDS_PART_BYTES sets it (the tests run
# whole suites with tiny parts, so every reader and writer meets parted tensors)
PART_BYTES = int(os.environ.get("EDS_PART_BYTES", 16 << 20))
MAX_PARTS = 1024
# a part's tile column: the tile's bytes as the one field of a struct
FIELD = "t"
WRAPPED = "w"  # after PREFIX in the names of parts that hold their tiles so
PREFIX = "_eds_part_"

# the list of every part of every parted tensor (the view's SQL says it too, but as text)
PARTS_TABLE = "eds_parts"
PARTS_SCHEMA = f"CREATE TABLE IF NOT EXISTS {PARTS_TABLE} (name VARCHAR NOT NULL, k INTEGER NOT NULL, part VARCHAR NOT NULL)"


def rows_per_part(value, part_bytes: int | None = None) -> int | None:
    """Tiles per part for stored tensor ``value`` (a TiledValue), or None when one table holds
    it: at most ``part_bytes`` of tiles (default ``PART_BYTES``). A bigger one is parts, one
    part of one tile where that is all it has."""
    part_bytes = PART_BYTES if part_bytes is None else part_bytes
    tile_bytes = nbytes(value.tile, value.dtype)
    tiles = math.prod(value.grid)
    if tiles * tile_bytes <= part_bytes:
        return None
    rows = max(1, part_bytes // max(tile_bytes, 1), math.ceil(tiles / MAX_PARTS))
    return min(rows, tiles)


def new_part_names(count: int):
    """``count`` fresh part table names, ``_eds_part_w<random>_<k>`` (no user name is in them;
    ``w``: its tiles in a struct, ``wrapped``)."""
    run = secrets.token_hex(6)
    return [f"{PREFIX}{WRAPPED}{run}_{k}" for k in range(count)]


def wrapped(parts: list[str]) -> bool:
    """Whether every one of ``parts`` holds its tiles in a struct (made since parts did: a
    database written before holds BLOB parts behind views of ``SELECT *``, named
    ``_eds_part_<hex>_<k>``, and hex has no ``w``)."""
    return bool(parts) and all(p.startswith(PREFIX + WRAPPED) for p in parts)


def split_reader(reader: pa.RecordBatchReader, rows: int):
    """``reader`` cut into consecutive readers of ``rows`` rows each (the last may be shorter),
    slicing batches where a part ends (zero-copy). Each must be read to its end before the next
    is taken: they share the source."""
    source = iter(reader)
    pending: list = []  # a batch (or the rest of one) not yet handed out

    def take():
        if pending:
            return pending.pop()
        return next(source, None)

    def part():
        left = rows
        while left > 0:
            b = take()
            if b is None:
                return
            if b.num_rows == 0:
                continue
            if b.num_rows > left:
                pending.append(b.slice(left))
                b = b.slice(0, left)
            left -= b.num_rows
            yield b

    while True:
        b = take()
        while b is not None and b.num_rows == 0:
            b = take()
        if b is None:
            return
        pending.append(b)
        yield pa.RecordBatchReader.from_batches(reader.schema, part())


def parts_read(view_sql_text: str) -> list[str]:
    """The part tables a view's SQL (as DuckDB keeps it) reads, in order."""
    return re.findall(rf'"?({re.escape(PREFIX)}[0-9A-Za-z]+_[0-9]+)"?', view_sql_text)


def create_part_sql(part: str, select, temporary: bool = False) -> str:
    """``CREATE [TEMP] TABLE part AS SELECT * REPLACE ({'t': tile} AS tile) FROM (select)``:
    ``select`` (key columns, then ``tile``: an expression, or the SQL text of a compiled
    statement) with its tile as a part holds it. The struct refers to the BLOB's vector, no copy."""
    if not isinstance(select, str):
        select = select.sql(dialect="duckdb")
    return (f"CREATE {'TEMP ' if temporary else ''}TABLE {table(part).sql(dialect='duckdb')} AS "
            f"SELECT * REPLACE ({{'{FIELD}': tile}} AS tile) FROM ({select}) AS _eds_w")


def _unwrapped(part: str) -> exp.Select:
    """A part's rows as the tensor's: ``SELECT * REPLACE (struct_extract(tile, 't') AS tile)``."""
    field = exp.func("struct_extract", exp.column("tile"), exp.Literal.string(FIELD))
    return exp.select(exp.Star(replace=[exp.alias_(field, "tile")])).from_(table(part))


def view_sql(name: str, parts: list[str], temporary: bool = False) -> str:
    """``CREATE VIEW "name" AS SELECT * REPLACE (struct_extract(tile, 't') AS tile) FROM part0
    UNION ALL ...`` (identifiers quoted by sqlglot; the branches joined as text: a left-deep
    sqlglot union of 1,024 branches would recurse past Python's limit when printed).
    ``temporary``: a TEMP view, replacing any."""
    props = exp.Properties(expressions=[exp.TemporaryProperty()]) if temporary else None
    head = exp.Create(this=table(name), kind="VIEW", expression=_unwrapped(parts[0]),
                      properties=props, replace=temporary)
    rest = [_unwrapped(p).sql(dialect="duckdb") for p in parts[1:]]
    return " UNION ALL ".join([head.sql(dialect="duckdb")] + rest)
