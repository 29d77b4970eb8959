"""The SQL shapes the compiler fills in. Holes ``{name}`` take SQL fragments rendered by
sqlglot (identifiers quoted there); the filled text is parsed back with sqlglot, so every
statement exists as an AST before it becomes text for a dialect."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=None)
def template(name: str) -> str:
    text = resources.files(__name__).joinpath(f"{name}.sql").read_text()
    # drop the comment header: it documents the shape, it is not part of the statement
    return "\n".join(line for line in text.splitlines() if not line.startswith("--")).strip()
