"""Keep big freed buffers in the process for reuse (glibc only).

Every tile that crosses DuckDB <-> Arrow lands in a fresh buffer: DuckDB's Arrow appender and
numpy allocate with ``malloc``, and glibc serves anything above 32 MiB with a new ``mmap`` and
returns it with ``munmap`` when freed. Touching fresh memory costs one page fault per 4 KiB; on
the virtual machines we measured on that is ~5 us a fault, so handing one 64 MiB tile to a UDF
took ~100 ms (16,390 faults) against ~20 ms once the buffer is reused: on the 4096² GEMM the
faults were most of what the SQL path spent beyond numpy (docs/DESIGN.md, item 9, "Freed
buffers stay in the process").

``retain_freed_memory()`` raises glibc's mmap threshold to ``MMAP_BYTES`` (256 MiB; a larger
buffer still gets its own ``mmap`` and goes back when freed) and its trim threshold to
``RETAIN_BYTES`` (1 GiB), so freed buffers below them stay in the heap, and keeps one malloc
arena (a thread's own arena cannot hold a 64 MiB block and falls back to ``mmap``). The trade:
the process holds freed memory instead of handing it back at once. That is bounded:
``bound_free_memory()``, after every plan the backend runs, trims the heap when more than
``FREE_CAP_BYTES`` of free heap are resident (whoever freed them), and ``detach()`` trims when
the last backend of the process closes.

Why buffers above 256 MiB are not kept: they exceed what a plan may leave behind anyway, and
kept through a one-call step they are its fourth copy. At 6000² float64 (288 MB tiles) the
freed Arrow input copies sat in the heap while DuckDB took the result back from its own
allocator: a peak rise of 1,152 MB (4.0x numpy's) against 864 MB (3.0x) when they are mapped
per call, for 1.08-1.14x numpy's time against 1.03x when the heap was reused (docs/DESIGN.md,
"What a plan leaves resident"). Set the environment variable ``EDS_RETAIN_MEMORY=0`` to leave
the allocator alone. It is process-wide, applied once, before DuckDB's threads start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import threading

from .._malloc import _M_ARENA_MAX, tuning_disabled
from . import duckdb_allocator

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

RETAIN_BYTES = 1 << 30
MMAP_BYTES = 256 << 20
FREE_CAP_BYTES = 320 << 20
# DuckDB's jemalloc serves a block of 256-320 MiB (a 6000² float64 or 8192² float32 tile) from a
# 320 MiB extent plus one page (its cache-oblivious padding): its cap is one size class (64 MiB)
# above the heap's, so that one such block freed stays for the next call (duckdb_allocator.bound_dirty)
JEMALLOC_CAP_BYTES = FREE_CAP_BYTES + (64 << 20)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_lock = threading.Lock()
_state: dict = {"tried": False, "retaining": False, "users": 0}
_ODD = bytes(k & 1 for k in range(256))  # mincore's resident bit is a byte's lowest
_SLACK = 16 << 20  # what the free count or the resident set may move before we look again


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
        ok = all(libc.mallopt(p, v) == 1 for p, v in ((_M_MMAP_THRESHOLD, MMAP_BYTES),
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
        cap = max(1 << 20, min(MMAP_BYTES, budget // 8, _state.get("bound", MMAP_BYTES)))
        libc = _libc()
        if libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, cap) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, cap) == 1:
            _state["bound"] = cap
        # under a budget DuckDB trims and purges by time again, inside plans too: pages kept
        # until a plan ends would count against the budget's share (plan/cost.py)
        duckdb_allocator.restore()


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
    """Trim the heap when more than ``FREE_CAP_BYTES`` of free heap are resident: what a 4096²
    float32 GEMM reuses is ~190 MB; memory freed beyond the cap (by anyone) is handed back.
    A 256 MiB trim threshold instead let glibc trim on free and re-faulted both input tiles.

    Cheap when nothing moved: the estimate (``mincore`` over the heap, ~1 ms for a heap that
    once grew to 3 GB) is taken again only when the free bytes or the resident set changed by
    more than ``_SLACK`` since the last one; the resident free heap cannot grow otherwise."""
    if not _state["retaining"]:
        return
    cap = min(FREE_CAP_BYTES, _state.get("bound", FREE_CAP_BYTES))
    with _lock:  # DuckDB's habits (duckdb_allocator.py): its freed pages under the same cap
        if _state["users"] and "bound" not in _state:
            duckdb_allocator.quiet_trim()  # again: a lazily bound first call may have undone it
            duckdb_allocator.bound_dirty(JEMALLOC_CAP_BYTES)  # no budget here: cap is FREE_CAP_BYTES
    free = free_bytes()
    if free is None or free <= cap:  # mallinfo2 first: cheap, and an upper bound
        return
    rss = _resident_set()
    seen = _state.get("seen")  # (free, resident set, resident free) at the last reading
    if (seen is not None and rss is not None and None not in seen and seen[2] <= cap
            and abs(free - seen[0]) <= _SLACK and rss <= seen[1] + _SLACK):
        return  # nothing moved since a reading under the cap
    resident = resident_free_bytes()
    if resident is None or resident > cap:
        release_freed_memory()
        resident, free, rss = resident_free_bytes(), free_bytes(), _resident_set()
    _state["seen"] = (free, rss, resident)


def _resident_set() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def resident_free_bytes() -> int | None:
    """Free heap bytes that are resident, estimated as the heap's resident pages (``mincore``
    over the ``[heap]`` mapping, where the one arena lives) less the bytes in use; the free
    bytes themselves when the heap cannot be read, or None without ``mallinfo2``.

    Why not the free bytes: a trim that cannot shrink the heap (its top in use) releases the
    free pages in place, and mallinfo2 still counts them free. The next plan that reuses them
    faults them back in and frees them again, and the count has not moved: an earlier
    bookkeeping ("free beyond what the last trim released") then saw nothing to trim, and a
    process that ran two 6000² float64 GEMMs kept 879 MB resident for good."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    heap = _heap_resident(libc)
    if heap is None:
        return int(info.fordblks)
    return max(0, min(int(info.fordblks), heap - int(info.uordblks)))


def _heap_resident(libc) -> int | None:
    """Resident bytes of the ``[heap]`` mappings (numpy's ``madvise`` of a big array splits
    the heap into several), or None (no heap, or it shrank since ``/proc`` was read)."""
    try:
        with open("/proc/self/maps") as f:
            spans = [line.split(None, 1)[0] for line in f if line.endswith("[heap]\n")]
    except OSError:
        return None
    if not spans:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = 0
    for span in spans:
        lo, hi = (int(x, 16) for x in span.split("-"))
        pages = (ctypes.c_ubyte * ((hi - lo + page - 1) // page))()
        if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), pages) != 0:
            return None
        resident += bytes(pages).translate(_ODD).count(1) * page
    return resident


def attach() -> None:
    """A backend opened (count it, so the last one to close can hand memory back); while any
    is open, DuckDB's idle threads do not trim the heap and its jemalloc keeps freed pages
    until a plan ends above the cap (duckdb_allocator.py)."""
    with _lock:
        _state["users"] += 1
        if _state["retaining"] and "bound" not in _state:
            duckdb_allocator.quiet_trim()
            duckdb_allocator.keep_dirty_pages()


def detach() -> None:
    """A backend closes; the last one hands the free pages back."""
    with _lock:
        _state["users"] = max(_state["users"] - 1, 0)  # a session a forked child inherited
        last = _state["users"] == 0
        if last:
            duckdb_allocator.restore()
    if last:
        release_freed_memory()


def _after_fork_in_child() -> None:
    # the child has no session of its own (DuckDB's connections do not survive a fork), and a
    # lock another thread held at the fork would stay held in it for ever
    global _lock
    _lock = threading.Lock()
    _state["users"] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
