"""One glibc malloc arena for the process, set when ``eindecomp_sql`` is imported.

Why at import: the first thread to allocate gets an arena of its own, and importing pyarrow
starts such a thread. Threads started later (DuckDB's) then share the arenas round robin, even
with ``M_ARENA_MAX = 1``. A secondary arena's heap holds at most 64 MiB. So a DuckDB thread that
drew one got every block of 64 MiB or more from a fresh ``mmap``, unmapped when freed: a 64 MiB
tile's two Arrow copies and its result were faulted in anew on every call. On `bij,bjk` 16x1024³
that was 33,800 faults and 280-300 ms a call against ~0 and 170-200 ms, in whichever process the
UDF's thread drew that arena (docs/DESIGN.md, "One malloc arena"). Set before pyarrow is
imported, every thread shares the main arena, whose freed blocks ``backends/allocator.py`` keeps
for reuse. Nothing else is imported here (ctypes only), so ``import eindecomp_sql`` stays light.
``EDS_RETAIN_MEMORY=0`` leaves the allocator alone, as it does for the rest of the tuning.
"""

from __future__ import annotations

import os
import sys

_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def tuning_disabled() -> bool:
    """Whether the environment asks to leave malloc alone (``EDS_RETAIN_MEMORY=0``)."""
    return os.environ.get("EDS_RETAIN_MEMORY", "1").strip().lower() in ("0", "false", "no", "off")


def one_arena() -> bool:
    """``M_ARENA_MAX = 1`` (glibc on Linux only); True when glibc took it."""
    if not sys.platform.startswith("linux") or tuning_disabled():
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)  # the process's own symbols: libc's among them
        libc.gnu_get_libc_version  # glibc only: musl has no arenas to bound
        return libc.mallopt(_M_ARENA_MAX, 1) == 1
    except (OSError, AttributeError):
        return False


ONE_ARENA = one_arena()
