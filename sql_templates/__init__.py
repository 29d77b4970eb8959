"""SQL the backend runs as it is, outside any plan: the catalog table (``catalog.sql``), the SQL
interface's table macros (``macros.sql``) and a plain-SQL reader of stored tensors for DuckDB
users without this package (``elements_macro.sql``). Plan steps are built by the compiler with
sqlglot builders (``compile/compiler.py``), not from text."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=None)
def template(name: str) -> str:
    text = resources.files(__name__).joinpath(f"{name}.sql").read_text()
    # drop the comment header: it documents the shape, it is not part of the statement
    return "\n".join(line for line in text.splitlines() if not line.startswith("--")).strip()
