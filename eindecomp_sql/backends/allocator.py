"""Keep big freed buffers in the process for reuse (glibc only).

Every tile that crosses DuckDB <-> Arrow lands in a fresh buffer: DuckDB's Arrow appender and
numpy allocate with ``malloc``, and glibc serves anything above 32 MiB with a new ``mmap`` and
returns it with ``munmap`` when freed. Touching fresh memory costs one page fault per 4 KiB; on
the virtual machines we measured on that is ~5 us a fault, so handing one 64 MiB tile to a UDF
took ~100 ms (16,390 faults) against ~20 ms once the buffer is reused: on the 4096² GEMM the
faults were most of what the SQL path spent beyond numpy (docs/DESIGN.md, "Page faults").

``retain_freed_memory()`` raises glibc's mmap and trim thresholds so freed buffers up to
``RETAIN_BYTES`` stay in the heap, and keeps one malloc arena (threads' own arenas cannot hold
a 64 MiB block and would fall back to ``mmap``). The trade: the process keeps its high-water
mark of such buffers instead of handing it back at once; ``release_freed_memory()`` hands the
free part back, and ``detach()`` calls it when the last backend of the process closes. Set the
environment variable ``EDS_RETAIN_MEMORY=0`` to leave the allocator alone. It is process-wide,
applied once, before DuckDB's threads start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

RETAIN_BYTES = 1 << 30

_lock = threading.Lock()
_state: dict = {"tried": False, "retaining": False, "users": 0}


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl has no mallopt thresholds
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Apply the tuning once per process; True when glibc took it."""
    with _lock:
        if _state["tried"]:
            return _state["retaining"]
        _state["tried"] = True
        if os.environ.get("EDS_RETAIN_MEMORY", "1").strip().lower() in ("0", "false", "no", "off"):
            return False
        libc = _libc()
        if libc is None:
            return False
        ok = all(libc.mallopt(p, v) == 1 for p, v in ((_M_MMAP_THRESHOLD, RETAIN_BYTES),
                                                       (_M_TRIM_THRESHOLD, RETAIN_BYTES),
                                                       (_M_ARENA_MAX, 1)))
        _state["retaining"] = ok
        return ok


def retaining() -> bool:
    """Whether this process keeps freed buffers (``retain_freed_memory`` took effect)."""
    return _state["retaining"]


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``)."""
    if _state["retaining"]:
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)


def attach() -> None:
    """A backend opened (count it, so the last one to close can hand memory back)."""
    with _lock:
        _state["users"] += 1


def detach() -> None:
    """A backend closes; the last one hands the free pages back."""
    with _lock:
        _state["users"] -= 1
        last = _state["users"] == 0
    if last:
        release_freed_memory()
