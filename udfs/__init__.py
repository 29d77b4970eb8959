"""Tile kernels: the only code that touches tile bytes. Registered on a DuckDB connection as
vectorized Arrow UDFs (``register``); each call gets a whole Arrow batch of tiles and runs numpy
kernels over it on a small pool of kernel threads (``pool``)."""

from .register import register_kernels

__all__ = ["register_kernels"]
