"""DuckDB's own allocators, kept from handing back the buffers our next call needs (Linux).

``backends/allocator.py`` keeps big freed buffers in the process so a tile crossing DuckDB <->
Arrow lands in memory already faulted in. Two habits of DuckDB's undid that on some calls: a 64
MiB buffer came back fresh, ~16,400 page faults and 20-40 ms on the VMs we measured, on 2-4 of
every 6 calls of ``bij,bjk`` 16x1024³ after a GEMM session (docs/DESIGN.md "DuckDB's idle threads
trimmed our heap"):

1. **Its idle threads trim the system heap.** A DuckDB worker idle for 0.5 s calls
   ``Allocator::ThreadFlush``, which calls glibc's ``malloc_trim`` (at most every 100 ms). That
   releases every free chunk inside the heap whatever its pad. Inside our own statements a
   worker idles that long whenever the kernel runs on another thread, and between calls too.
   No setting turns it off (``allocator_flush_threshold`` is only the pad).
2. **Its jemalloc purges freed pages after a second** (``dirty_decay_ms`` 1000). The result
   tiles DuckDB copies out of a UDF live there, so calls a second apart fault them in anew.

While a session is open we (1) point DuckDB's import of ``malloc_trim`` (its GOT slot: the
address its calls jump through) at a function that does nothing, and (2) set its jemalloc's
dirty decay to -1 (never by time). Freed memory is still bounded: after every plan
``allocator.bound_free_memory`` trims glibc's heap and purges jemalloc's dirty pages, each when
more than the cap is resident, and the last session to close restores both and hands everything
back. ``EDS_RETAIN_MEMORY=0`` leaves DuckDB alone, as it does glibc.

Where the slot cannot be found or is not what we expect (not ELF, another library hooked it,
a DuckDB without jemalloc), nothing is changed for that part: the cost is the faults above.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import struct
import sys
import threading

_lock = threading.Lock()
# what was changed, to undo: the slot's address and its old value; the arenas' old decays
_state: dict = {"slot": None, "old": None, "decay": None}

# ELF relocation types that fill a symbol's GOT slot: (JUMP_SLOT, GLOB_DAT) per e_machine
_SLOT_TYPES = {62: (7, 6), 183: (1026, 1025)}  # x86-64, aarch64
_RTLD_DI_LINKMAP = 2
_MALLCTL_ARENAS_ALL = 4096  # jemalloc's "every arena" index


def _duckdb_library() -> str | None:
    mod = sys.modules.get("_duckdb") or sys.modules.get("duckdb.duckdb")
    return getattr(mod, "__file__", None)


def got_slot_offset(path: str, symbol: str) -> int | None:
    """The offset from the library's load address of the GOT slot its calls to ``symbol`` go
    through (an ELF64 little-endian shared object's relocations), or None."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
                return None
            types = _SLOT_TYPES.get(struct.unpack_from("<H", data, 0x12)[0])
            if types is None:
                return None
            shoff = struct.unpack_from("<Q", data, 0x28)[0]
            shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
            sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
            want = symbol.encode()
            for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
                if sh_type != 4 or entsize != 24 or link >= len(sections):  # SHT_RELA
                    continue
                symtab = sections[link]
                strtab = sections[symtab[6]] if symtab[6] < len(sections) else None
                if strtab is None:
                    continue
                for k in range(size // 24):
                    r_offset, r_info, _ = struct.unpack_from("<QQq", data, offset + 24 * k)
                    if (r_info & 0xFFFFFFFF) not in types or not r_info >> 32:
                        continue
                    name_at = strtab[4] + struct.unpack_from("<I", data, symtab[4] + 24 * (r_info >> 32))[0]
                    if data[name_at:name_at + len(want) + 1] == want + b"\0":
                        return r_offset
    except (OSError, ValueError, struct.error, IndexError):
        return None
    return None


def _load_address(path: str) -> int | None:
    """The library's load address (its link map's ``l_addr``), through ``dlinfo``."""
    try:
        handle = ctypes.CDLL(path)._handle  # already loaded: the same handle, no second copy
        libc = ctypes.CDLL(None)
        libc.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        link_map = ctypes.c_void_p()
        if libc.dlinfo(handle, _RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0 or not link_map.value:
            return None
        return ctypes.c_size_t.from_address(link_map.value).value  # l_addr is the first field
    except (OSError, AttributeError):
        return None


def _library_span(path: str) -> tuple[int, int] | None:
    """The lowest and highest address the library is mapped at."""
    real = os.path.realpath(path)
    lo = hi = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.realpath(parts[5].strip()) == real:
                    a, b = (int(x, 16) for x in parts[0].split("-"))
                    lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    except OSError:
        return None
    return None if lo is None else (lo, hi)


def _write_word(address: int, value: int) -> bool:
    """Store one pointer-sized word, making its page writable for the store if it is not
    (a library linked with full RELRO has a read-only GOT)."""
    libc = ctypes.CDLL(None)
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    writable = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(None, 2)[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= address < hi:
                    writable = "w" in perms
                    break
    except OSError:
        return False
    if writable is None:
        return False
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if not writable and libc.mprotect(start, page, 3) != 0:  # PROT_READ | PROT_WRITE
        return False
    ctypes.c_size_t.from_address(address).value = value  # an aligned word: one store
    if not writable:
        libc.mprotect(start, page, 1)  # PROT_READ, as the loader left it
    return True


@functools.lru_cache(maxsize=1)
def _noop_address() -> int:
    # DuckDB calls malloc_trim(size_t) and ignores what it returns: labs(long) takes one
    # integer register and touches nothing else, on every ABI we patch
    return ctypes.cast(ctypes.CDLL(None).labs, ctypes.c_void_p).value


def quiet_trim() -> bool:
    """Point DuckDB's ``malloc_trim`` slot at a no-op; True when it is (or already was)."""
    with _lock:
        return _quiet_trim()


def _quiet_trim() -> bool:
    noop = _noop_address()
    if _state["slot"] is not None:  # patched: the loader resolving a first call may have undone it
        slot = _state["slot"]
        if ctypes.c_size_t.from_address(slot).value != noop:
            _write_word(slot, noop)
        return True
    path = _duckdb_library()
    if path is None:
        return False
    offset, base, span = got_slot_offset(path, "malloc_trim"), _load_address(path), _library_span(path)
    if offset is None or base is None or span is None:
        return False
    slot = base + offset
    if not span[0] <= slot < span[1]:
        return False
    old = ctypes.c_size_t.from_address(slot).value
    real = ctypes.cast(ctypes.CDLL(None).malloc_trim, ctypes.c_void_p).value
    # resolved to glibc's, or not yet resolved (lazy binding: a stub inside the library)
    if old != real and not span[0] <= old < span[1]:
        return False  # someone else's hook: leave it
    if not _write_word(slot, noop):
        return False
    _state["slot"], _state["old"] = slot, old
    return True


def trim_quieted() -> bool:
    """Whether DuckDB's ``malloc_trim`` is the no-op now."""
    slot = _state["slot"]
    return slot is not None and ctypes.c_size_t.from_address(slot).value == _noop_address()


def _mallctl():
    path = _duckdb_library()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).duckdb_je_mallctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                   ctypes.c_size_t]
    return fn


def _ctl(name: str, value=None, ctype=ctypes.c_ssize_t):
    """Read (and with ``value``, write) a jemalloc setting; None when it cannot."""
    fn = _mallctl()
    if fn is None:
        return None
    old, size = ctype(), ctypes.c_size_t(ctypes.sizeof(ctype))
    new = ctype(value) if value is not None else None
    rc = fn(name.encode(), ctypes.byref(old), ctypes.byref(size),
            ctypes.byref(new) if new is not None else None, ctypes.sizeof(ctype) if new is not None else 0)
    return old.value if rc == 0 else None


def _arenas() -> list[str]:
    n = _ctl("arenas.narenas", ctype=ctypes.c_uint) or 0
    return ["arenas"] + [f"arena.{k}" for k in range(n)]  # "arenas": the default for new arenas


def keep_dirty_pages() -> bool:
    """Set DuckDB's jemalloc dirty decay to -1 on every arena (and for new ones); True when set."""
    with _lock:
        if _state["decay"] is not None:
            _new_arenas()
            return True
        old = {a: _ctl(f"{a}.dirty_decay_ms", -1) for a in _arenas()}  # an arena never used: None
        old = {a: v for a, v in old.items() if v is not None}
        if "arenas" not in old:
            return False
        _state["decay"] = old
        return True


def _new_arenas() -> None:
    """Arenas DuckDB created since (the one for blocks above 256 MiB, on first use) get -1
    too (``arenas.dirty_decay_ms`` set their decay as they were made; this is for safety)."""
    for arena in _arenas():
        if arena not in _state["decay"]:
            old = _ctl(f"{arena}.dirty_decay_ms", -1)
            if old is not None:
                _state["decay"][arena] = old


def dirty_bytes() -> int | None:
    """Bytes of freed pages DuckDB's jemalloc holds resident (its statistics, refreshed)."""
    fn = _mallctl()
    if fn is None:
        return None
    epoch = ctypes.c_uint64(1)
    if fn(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch)) != 0:
        return None
    pages = _ctl(f"stats.arenas.{_MALLCTL_ARENAS_ALL}.pdirty", ctype=ctypes.c_size_t)
    page = _ctl("arenas.page", ctype=ctypes.c_size_t)
    return None if pages is None or page is None else pages * page


def purge() -> None:
    """Hand every dirty page of DuckDB's jemalloc back to the system."""
    fn = _mallctl()
    if fn is not None:
        fn(f"arena.{_MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0)


def bound_dirty(cap: int) -> None:
    """Purge when DuckDB's jemalloc holds more than ``cap`` freed bytes (~7 us to ask)."""
    with _lock:
        if _state["decay"] is None:
            return
        _new_arenas()
    dirty = dirty_bytes()
    if dirty is not None and dirty > cap:
        purge()


def restore_decay() -> None:
    """DuckDB's jemalloc decays freed pages by time again, and what it holds goes back."""
    with _lock:
        if _state["decay"] is not None:
            for arena, ms in _state["decay"].items():
                _ctl(f"{arena}.dirty_decay_ms", ms)
            _state["decay"] = None
            purge()


def restore() -> None:
    """Undo both (the last session closed): DuckDB trims and decays as it did before."""
    with _lock:
        if _state["slot"] is not None:
            _write_word(_state["slot"], _state["old"])
            _state["slot"] = _state["old"] = None
    restore_decay()
