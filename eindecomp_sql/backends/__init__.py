"""Backends own an engine, its catalog and its kernels, and execute plans (``base.Backend``).

``create_backend`` is the one constructor the session uses; each engine is imported inside its
own branch so optional engines stay optional.
"""

from __future__ import annotations

from .base import Backend, Target

BACKENDS = ("duckdb", "reference", "device-sim", "spark")


def create_backend(name: str = "duckdb", database=None, *, read_only: bool = False, **options) -> Backend:
    """The backend ``name`` over ``database`` (None: in memory); ``options`` are the backend's
    own (``device_memory`` for ``"device-sim"``, ``spark`` and ``spark_database`` for ``"spark"``)."""
    own = {"duckdb": {"device", "allow_tf32", "device_memory", "device_min_work"}, "device-sim": {"device_memory"}, "spark": {"spark", "spark_database"}}.get(name, set())
    if set(options) - own:
        from ..errors import EinsumError

        raise EinsumError(f"backend {name!r} takes no options {sorted(set(options) - own)}")
    if name == "duckdb":
        from .running import sigint_held

        with sigint_held():  # duckdb's first import runs Python from C++ (running.sigint_held)
            from .duckdb import DuckDBBackend

        return DuckDBBackend(database, read_only=read_only, **options)
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend(database, read_only=read_only)
    if name == "device-sim":
        from .device_sim import SimulatedDeviceBackend

        return SimulatedDeviceBackend(database, read_only=read_only, **options)
    if name == "spark":
        from .spark import SparkBackend

        return SparkBackend(database, read_only=read_only, **options)
    from ..errors import EinsumError

    raise EinsumError(f"unknown backend {name!r}; available: {', '.join(map(repr, BACKENDS))}")


__all__ = ["BACKENDS", "Backend", "Target", "create_backend"]
