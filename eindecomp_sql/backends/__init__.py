"""Backends own an engine connection, register the tile kernels, and execute plans.

A registry imports each engine inside its own branch so optional engines stay optional."""

from __future__ import annotations

from .base import Backend


def create_backend(name: str = "duckdb", **kwargs) -> Backend:
    if name == "duckdb":
        from .duckdb import DuckDBBackend

        return DuckDBBackend(**kwargs)
    from ..errors import EinsumError

    raise EinsumError(f"unknown backend {name!r}; available: 'duckdb'")


__all__ = ["Backend", "create_backend"]
