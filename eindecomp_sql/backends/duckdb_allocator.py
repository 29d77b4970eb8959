"""DuckDB's own allocators, kept from handing back the buffers our next call needs (Linux).

``backends/allocator.py`` keeps big freed buffers in the process so a tile crossing DuckDB <->
Arrow lands in memory already faulted in. Two habits of DuckDB's undid that on some calls: a 64
MiB buffer came back fresh, ~16,400 page faults and 20-40 ms on the VMs we measured, on 2-4 of
every 6 calls of ``bij,bjk`` 16x1024³ after a GEMM session (docs/DESIGN.md "DuckDB's idle threads
trimmed our heap"):

1. **It trims the system heap.** A DuckDB worker idle for 0.5 s calls
   ``Allocator::ThreadFlush``, and bulk frees call ``Allocator::FlushAll``; both call glibc's
   ``malloc_trim`` (at most every 100 ms), which releases every free chunk inside the heap
   whatever its pad. Inside our own statements a worker idles that long whenever the kernel
   runs on another thread, and between calls too. No setting turns it off
   (``allocator_flush_threshold`` is only the pad).
2. **Its jemalloc purges freed pages after a second** (``dirty_decay_ms`` 1000). The result
   tiles DuckDB copies out of a UDF live there, so calls a second apart fault them in anew.

While a session without a memory budget is open we (1) point DuckDB's import of
``malloc_trim`` (its GOT slots: the addresses its calls jump through) at a function that does
nothing, and (2) set the dirty decay of its jemalloc's arenas to -1 (never by time; DuckDB's
arena for blocks of 256 MiB and more purged them at once) and send blocks of 4 MiB and more, from
any thread, to that one arena (``SHARED_BLOCK_BYTES``; jemalloc reuses freed pages only inside
their arena, one per core). Freed memory is still bounded: after
every plan ``allocator.bound_free_memory`` trims glibc's heap and purges jemalloc's arenas,
each when more than the cap is resident (``bound_dirty``), and the last session to close
restores both. Both are process-wide, as DuckDB's allocators are: the process's other DuckDB
connections see them too. Once any session of the process has a memory budget, both are put
back for the rest of the process (``allocator.bound_retained``): inside a plan under a budget,
pages kept until it ends would count against the plan's share. ``EDS_RETAIN_MEMORY=0`` leaves
DuckDB alone, as it does glibc.

Where a slot cannot be found or is not what we expect (not ELF, section headers stripped,
someone else's hook, a DuckDB without jemalloc), nothing is changed for that part: the cost is
the faults above.
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
# what was changed, to undo: each patched slot's address and old value; the arenas' old decays
# and the per-core arenas' old oversize thresholds; "off": leave_alone() was called
_state: dict = {"slots": {}, "decay": None, "oversize": {}, "off": False}
# blocks of this size and more go to jemalloc's one oversize arena, whichever thread allocates them
SHARED_BLOCK_BYTES = 4 << 20

# ELF relocation types that fill a symbol's GOT slot: (JUMP_SLOT, GLOB_DAT) per e_machine
_SLOT_TYPES = {62: (7, 6), 183: (1026, 1025)}  # x86-64, aarch64
_RTLD_DI_LINKMAP = 2
_MALLCTL_ARENAS_ALL = 4096  # jemalloc's "every arena" index


def _duckdb_library() -> str | None:
    mod = sys.modules.get("_duckdb") or sys.modules.get("duckdb.duckdb")
    return getattr(mod, "__file__", None)


@functools.lru_cache(maxsize=8)
def got_slot_offsets(path: str, symbol: str) -> tuple[int, ...]:
    """The offsets from the library's load address of every GOT slot its calls to ``symbol``
    go through (an ELF64 little-endian shared object's JUMP_SLOT and GLOB_DAT relocations, read
    from its section headers); empty when there are none or the file cannot be read so."""
    found = []
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
                return ()
            types = _SLOT_TYPES.get(struct.unpack_from("<H", data, 0x12)[0])
            if types is None:
                return ()
            shoff = struct.unpack_from("<Q", data, 0x28)[0]
            shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
            sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
            want = symbol.encode() + b"\0"
            for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
                if sh_type != 4 or entsize != 24 or link >= len(sections):  # SHT_RELA
                    continue
                symtab = sections[link]
                if symtab[6] >= len(sections):
                    continue
                strtab = sections[symtab[6]]
                for k in range(size // 24):
                    r_offset, r_info, _ = struct.unpack_from("<QQq", data, offset + 24 * k)
                    if (r_info & 0xFFFFFFFF) not in types or not r_info >> 32:
                        continue
                    name_at = strtab[4] + struct.unpack_from("<I", data, symtab[4] + 24 * (r_info >> 32))[0]
                    if data[name_at:name_at + len(want)] == want:
                        found.append(r_offset)
    except (OSError, ValueError, struct.error, IndexError):
        return ()
    return tuple(found)


@functools.lru_cache(maxsize=8)
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


def _mappings() -> list[tuple[int, int, str, str]]:
    """(start, end, permissions, path) of every mapping of this process."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1], parts[5].strip() if len(parts) == 6 else ""))
    except (OSError, ValueError, IndexError):
        return []
    return out


def _library_span(path: str, maps) -> tuple[int, int] | None:
    """The lowest and highest address the library is mapped at (the kernel writes the real
    path in ``/proc/self/maps``; a replaced file reads "(deleted)" and matches nothing)."""
    real = os.path.realpath(path)
    spans = [(lo, hi) for lo, hi, _, name in maps if name == real]
    return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None


def _write_word(address: int, value: int, maps) -> bool:
    """Store one pointer-sized word, making its page writable for the store if it is not
    (a library linked with full RELRO has a read-only GOT)."""
    perms = next((p for lo, hi, p, _ in maps if lo <= address < hi), None)
    if perms is None:
        return False
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = address & ~(mmap.PAGESIZE - 1)
    writable = "w" in perms
    if not writable and libc.mprotect(start, mmap.PAGESIZE, 3) != 0:  # PROT_READ | PROT_WRITE
        return False
    ctypes.c_size_t.from_address(address).value = value  # an aligned word: one store
    if not writable:
        libc.mprotect(start, mmap.PAGESIZE, 1)  # PROT_READ, as the loader left it
    return True


@functools.lru_cache(maxsize=1)
def _noop_address() -> int:
    # DuckDB calls malloc_trim(size_t) and ignores what it returns: labs(long) takes one
    # integer register and touches nothing else, on every ABI we patch
    return ctypes.cast(ctypes.CDLL(None).labs, ctypes.c_void_p).value


def quiet_trim() -> bool:
    """Point DuckDB's ``malloc_trim`` slots at a no-op; True when they are (or already were)."""
    with _lock:
        return _quiet_trim()


def _quiet_trim() -> bool:
    if _state["off"]:
        return False
    noop = _noop_address()
    if _state["slots"]:  # patched: the loader resolving a first call may have undone it
        for slot in _state["slots"]:
            if ctypes.c_size_t.from_address(slot).value != noop:
                _write_word(slot, noop, _mappings())
        return True
    path = _duckdb_library()
    if path is None:
        return False
    offsets, base = got_slot_offsets(path, "malloc_trim"), _load_address(path)
    maps = _mappings()
    span = _library_span(path, maps)
    if not offsets or base is None or span is None:
        return False
    real = ctypes.cast(ctypes.CDLL(None).malloc_trim, ctypes.c_void_p).value
    slots = [base + o for o in offsets]
    for slot in slots:
        old = ctypes.c_size_t.from_address(slot).value if span[0] <= slot < span[1] else None
        # resolved to glibc's, or not yet resolved (lazy binding: a stub inside the library)
        if old is None or (old != real and not span[0] <= old < span[1]):
            return False  # not what we expect, or someone else's hook: leave every slot alone
    for slot in slots:
        old = ctypes.c_size_t.from_address(slot).value
        if _write_word(slot, noop, maps):
            _state["slots"][slot] = old
    return bool(_state["slots"])


def trim_quieted() -> bool:
    """Whether DuckDB's ``malloc_trim`` is the no-op now."""
    slots = _state["slots"]
    return bool(slots) and all(ctypes.c_size_t.from_address(s).value == _noop_address() for s in slots)


@functools.lru_cache(maxsize=8)
def _mallctl_of(path: str):
    try:
        fn = ctypes.CDLL(path).duckdb_je_mallctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                   ctypes.c_size_t]
    return fn


def _mallctl():
    path = _duckdb_library()
    return None if path is None else _mallctl_of(path)


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


def _arenas() -> list[int]:
    """Every arena slot of DuckDB's jemalloc (``arenas.narenas``): one per core, each made when
    a thread first draws it, and the oversize arena, made at the first block of its threshold
    (256 MiB as DuckDB set it; 4 MiB while freed pages are kept). A slot with no arena yet
    answers nothing; it is taken up at a later plan's end."""
    return list(range(_ctl("arenas.narenas", ctype=ctypes.c_uint) or 0))


def keep_dirty_pages() -> bool:
    """Set the dirty decay of DuckDB's jemalloc's arenas to -1, and send every thread's blocks of
    SHARED_BLOCK_BYTES or more to its one oversize arena; True when a decay is set."""
    with _lock:
        if _state["off"]:
            return False
        if _state["decay"] is None:
            _state["decay"] = {}
        _new_arenas()
        if not _state["decay"]:
            _state["decay"] = None
            return False
        return True


def _new_arenas() -> None:
    per_core = _ctl("opt.narenas", ctype=ctypes.c_uint) or 0
    for k in _arenas():
        arena = f"arena.{k}"
        if arena not in _state["decay"]:
            old = _ctl(f"{arena}.dirty_decay_ms", -1)
            if old is not None:
                _state["decay"][arena] = old
        # One arena for big blocks. jemalloc reuses a freed page only inside the arena that
        # freed it, and gives each thread one of its per-core arenas; the result tile DuckDB
        # copies out of a UDF is allocated by whichever thread ran the UDF, so on 16 cores the
        # 64 MiB freed by the last call sat in another arena and every call faulted a fresh one
        # (16,400 faults a call), until every arena held a spare, past the cap. A thread's
        # arena sends blocks from its ``oversize_threshold`` up to the oversize arena, which
        # all threads share: lowered to SHARED_BLOCK_BYTES, every tile buffer meets the pages
        # the last one freed, while small blocks stay in each thread's own arena.
        if k < per_core and arena not in _state["oversize"] and not _state.get("unshared"):
            old = _ctl(f"{arena}.oversize_threshold", SHARED_BLOCK_BYTES, ctype=ctypes.c_size_t)
            if old is not None:
                _state["oversize"][arena] = old


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
    """Keep at most ``cap`` freed bytes in DuckDB's jemalloc (~50 us to ask): when it holds
    more, arenas are purged whole, the largest holding kept if it fits. That one is what the
    next call of the same work reuses: the freed tile blocks (4 MiB and more, a 256 MiB+ result
    among them) sit in the oversize arena, beside tens of MiB of the per-core arenas' pages that
    would otherwise take the total over the cap and purge it with them (a 6000² float64 result,
    275 MiB: 141,500 faults a call instead of 211,800). Past the cap, that arena goes whole."""
    with _lock:
        if _state["decay"] is None:
            return
        _new_arenas()  # arenas jemalloc made since
        dirty = dirty_bytes()
        if dirty is None or dirty <= cap:
            return
        fn, page = _mallctl(), _ctl("arenas.page", ctype=ctypes.c_size_t)
        # a slot whose arena jemalloc has not made (a core no thread drew yet) answers nothing
        held = [(pages, k) for k in _arenas()
                if (pages := _ctl(f"stats.arenas.{k}.pdirty", ctype=ctypes.c_size_t)) is not None]
        if page is None or not held:
            purge()
            return
        kept = 0
        for pages, k in sorted(held, reverse=True):
            if pages and kept + pages * page <= cap:
                kept += pages * page
            elif pages:
                fn(f"arena.{k}.purge".encode(), None, None, None, 0)


def unshare_big_blocks() -> None:
    """Each thread's big blocks go to its own arena again, as DuckDB left them, and stay so in
    arenas made later, until the next restore (a benchmark's before, ``bench/trim_bench.py``)."""
    with _lock:
        for arena, threshold in _state["oversize"].items():
            _ctl(f"{arena}.oversize_threshold", threshold, ctype=ctypes.c_size_t)
        _state["oversize"] = {}
        _state["unshared"] = True


def leave_alone() -> None:
    """Put DuckDB's allocators back and keep them as DuckDB runs them for the rest of the process,
    sessions opened later included (a benchmark's baseline, ``bench/trim_bench.py``: a plain
    ``restore()`` is undone by the next plan's end, which checks the patch again)."""
    restore()
    with _lock:
        _state["off"] = True


def restore_decay() -> None:
    """DuckDB's jemalloc decays freed pages by time again, each thread's big blocks go to its
    own arena again, and what it holds goes back."""
    with _lock:
        for arena, threshold in _state["oversize"].items():
            _ctl(f"{arena}.oversize_threshold", threshold, ctype=ctypes.c_size_t)
        _state["oversize"] = {}
        _state.pop("unshared", None)
        if _state["decay"] is not None:
            for arena, ms in _state["decay"].items():
                _ctl(f"{arena}.dirty_decay_ms", ms)
            _state["decay"] = None
            purge()


def restore() -> None:
    """Undo both (the last session closed, or a budget): DuckDB trims and decays as before."""
    with _lock:
        maps = _mappings() if _state["slots"] else []
        for slot, old in _state["slots"].items():
            _write_word(slot, old, maps)
        _state["slots"] = {}
    restore_decay()


def _after_fork_in_child() -> None:
    # a lock another thread held at the fork stays held in the child for ever; and the child
    # starts with no session of its own, so DuckDB's allocators go back to DuckDB's ways
    global _lock
    _lock = threading.Lock()
    restore()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
