"""Keep big freed buffers in the process for reuse (glibc only).

Every tile that crosses DuckDB <-> Arrow lands in a fresh buffer: DuckDB's Arrow appender and
numpy allocate with ``malloc``, and glibc serves anything above 32 MiB with a new ``mmap`` and
returns it with ``munmap`` when freed. Touching fresh memory costs one page fault per 4 KiB; on
the virtual machines we measured on that is ~5 us a fault, so handing one 64 MiB tile to a UDF
took ~100 ms (16,390 faults) against ~20 ms once the buffer is reused: on the 4096² GEMM the
faults were most of what the SQL path spent beyond numpy (docs/DESIGN.md, item 9, "Freed
buffers stay in the process").

``retain_freed_memory()`` raises glibc's mmap and trim thresholds to ``RETAIN_BYTES`` (1 GiB;
a larger array still gets its own ``mmap``), so freed buffers below it stay in the heap, and keeps
one malloc arena (a thread's own arena cannot hold a 64 MiB block and falls back to ``mmap``).
The trade: the process holds freed memory instead of handing it back at once. That is bounded:
``bound_free_memory()``, after every plan the backend runs, trims the heap when more than
``FREE_CAP_BYTES`` lie free in it (whoever freed them), and ``detach()`` trims when the last
backend of the process closes. Set the environment variable ``EDS_RETAIN_MEMORY=0`` to leave
the allocator alone. It is process-wide, applied once, before DuckDB's threads start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading

from .._malloc import _M_ARENA_MAX, tuning_disabled

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

RETAIN_BYTES = 1 << 30
FREE_CAP_BYTES = 320 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_lock = threading.Lock()
# "trimmed": free heap bytes that the last trim handed back to the system. malloc_trim cannot
# shrink a heap whose top is in use; it then releases the free pages in place (madvise), and
# mallinfo2 still counts them as free. Without this baseline every later plan would trim
# again, handing back the very buffers the tuning keeps for reuse.
_state: dict = {"tried": False, "retaining": False, "users": 0, "trimmed": 0}


@functools.lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl has no mallopt thresholds
        if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
            libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Apply the tuning once per process; True when glibc took it."""
    with _lock:
        if _state["tried"]:
            return _state["retaining"]
        _state["tried"] = True
        if tuning_disabled():
            return False
        libc = _libc()
        if libc is None:
            return False
        ok = all(libc.mallopt(p, v) == 1 for p, v in ((_M_MMAP_THRESHOLD, RETAIN_BYTES),
                                                       (_M_TRIM_THRESHOLD, RETAIN_BYTES),
                                                       (_M_ARENA_MAX, 1)))
        _state["retaining"] = ok
        return ok


def bound_retained(budget: int) -> None:
    """Under a session's memory budget, keep at most an 8th of it (at least 1 MiB, at most
    ``RETAIN_BYTES``) of freed memory: buffers above that get their own ``mmap`` again and are
    handed back when freed, and the heap is trimmed above it. A GEMM 4x its 25 MB budget
    otherwise peaked at 290-300 MB in most runs and 767 MB in one (freed buffers piling up in
    the heap over 256 statements). Process-wide, like the tuning itself: the smallest budget
    any session gave wins."""
    with _lock:
        if not _state["retaining"]:
            return
        cap = max(1 << 20, min(RETAIN_BYTES, budget // 8, _state.get("bound", RETAIN_BYTES)))
        libc = _libc()
        if libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, cap) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, cap) == 1:
            _state["bound"] = cap


def retaining() -> bool:
    """Whether this process keeps freed buffers (``retain_freed_memory`` took effect)."""
    return _state["retaining"]


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``)."""
    if _state["retaining"]:
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)


def free_bytes() -> int | None:
    """Bytes free in malloc's heap (glibc >= 2.33's ``mallinfo2``), or None."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


def bound_free_memory() -> None:
    """Trim the heap when more than ``FREE_CAP_BYTES`` lie free in it: what a 4096² GEMM
    reuses is ~190 MB of free heap; memory freed beyond the cap (by anyone) is handed back.
    A 256 MiB trim threshold instead let glibc trim on free and re-faulted both input tiles."""
    if _state["retaining"]:
        free = resident_free_bytes()
        if free is not None and free > min(FREE_CAP_BYTES, _state.get("bound", FREE_CAP_BYTES)):
            release_freed_memory()
            _state["trimmed"] = free_bytes() or 0


def resident_free_bytes() -> int | None:
    """Free heap bytes that are still resident: free bytes beyond what the last trim handed
    back (memory reused since then lowers that baseline: it is resident again)."""
    free = free_bytes()
    if free is None:
        return None
    _state["trimmed"] = min(_state["trimmed"], free)
    return free - _state["trimmed"]


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
