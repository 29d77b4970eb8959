"""Tiles a session's device kernels keep on the device between kernel calls and between plans.

A stored tensor's tile is named by the tensor's token (its table's identity in this database:
``backends/duckdb.py`` gives one per table, new whenever the table is written anew) and the tile's
keys; a tile a step computes, or a tile of an array operand, by a token for its value and the
run (it leaves with the run, or after the run's last step that reads it).
Before a step's statement joins its operands, ``eds_resident(value, keys)`` asks whether a tile
is here; if it is, the tile is pinned and the SQL hands the kernel NULL instead of the bytes, so
DuckDB neither converts nor copies them; the kernel takes the device array from here. A tile
the SQL handed as bytes is still taken from here if an earlier call of the statement has sent
it since (``get``): a join hands a tile to every call it takes part in. A tile sent for a call
is kept for the next ones within the cache's budget; a tile that does not fit is used for its
call and let go. Pins last until the backend ends the step's statement (``unpin_all``).

What makes room (TURNIP's rule, the plan knows the future): while a plan runs, the backend says
which values each of its steps reads and which step runs (``KernelState.next_use``), and the
next plan is taken to be this one again (repeated inference: the weights come back in the same
order). A tile is evicted only for one needed sooner, the furthest-needed first; the running
step's tiles count as needed now, and make no room for each other (a step may re-read them in a
cycle longer than the cache, where each would be evicted just before its turn); a tile needed
no sooner than everything it would evict is used for its call and not kept. On the CPU
stand-in this sends Belady's count of bytes for the LLaMA block at half its working set, LRU
4.3x (bench/RESULTS.md, 2026-11-26). Without a plan's reads (``next_use`` None) the least recently used
unpinned tiles make room.

A step whose join hands a stored input's tiles more than once (a GEMM's operand tile meets
every tile of the other's; a grouped step's weight tile, every group) has them *sent ahead*
(``eds_send``, one statement before the step's): each tile crosses DuckDB and the bus once, is
kept and pinned for the step if room can be made, else *staged* (``stage``): held for this step
only, outside the budget, up to a quarter of it (a call holds its operand tiles on the device
anyway; staged, they come across once instead of once per row of the join). The step's
``eds_resident`` then finds them all and the join hands NULL. Staged tiles go when the step's
pins do (``unpin_all``).

A result whose every reader runs on the device is held (``hold``): its bytes never went back to
DuckDB, whose table has NULL in their place, so it is the only copy and is never evicted; the
backend drops it once its last reader has run. One that finds no room goes back as bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable


class DeviceCache:
    """Device arrays by tile id, at most ``budget`` bytes of them."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        # id -> [array, nbytes, pins, held (the only copy: never evicted)]
        self._tiles: OrderedDict[Hashable, list] = OrderedDict()
        self._lock = threading.Lock()
        self.used = 0
        self.peak = 0
        self.hits = 0  # tiles a call found here instead of receiving them
        self.kept = 0  # tiles put here after being sent
        self.evicted = 0
        self.held = 0  # results kept here instead of going back to DuckDB
        # tiles sent ahead for the running step that the budget had no room for (``stage``)
        self._staged: dict[Hashable, list] = {}
        self.staged_bytes = 0
        self.staged_peak = 0

    def __contains__(self, tid) -> bool:
        with self._lock:
            return tid in self._tiles or tid in self._staged

    def pin(self, tid) -> bool:
        """Pin the tile if it is here (True), else False."""
        with self._lock:
            if tid in self._staged:
                return True
            entry = self._tiles.get(tid)
            if entry is None:
                return False
            entry[2] += 1
            self._tiles.move_to_end(tid)
            return True

    def get(self, tid):
        """The tile's array if it is here (a hit), else None: a tile the SQL handed as bytes
        because it was not here when the statement read it, and that an earlier call of the
        same statement has sent since. The caller's reference keeps it alive if it is evicted."""
        with self._lock:
            entry = self._tiles.get(tid) or self._staged.get(tid)
            if entry is None:
                return None
            if tid in self._tiles:
                self._tiles.move_to_end(tid)
            self.hits += 1
            return entry[0]

    def take(self, tid):
        """The array of a tile pinned for this statement."""
        with self._lock:
            if tid in self._staged:
                self.hits += 1
                return self._staged[tid][0]
            entry = self._tiles.get(tid)
            if entry is None or entry[2] == 0:
                raise RuntimeError(f"eindecomp_sql device cache: tile {tid!r} was promised resident and is not")
            self._tiles.move_to_end(tid)
            self.hits += 1
            return entry[0]

    def put(self, tid, array, nbytes: int, next_use=None, pin: bool = False) -> bool:
        """Keep ``array`` (just sent) as tile ``tid`` if room can be made; whether it was kept.
        ``next_use(tid)``: how far off the tile's next use is (None: least recently used).
        ``pin``: pinned for the running step if kept (sent ahead of it)."""
        return self._admit(tid, array, nbytes, next_use, held=False, pin=pin)

    def would_keep(self, tid, nbytes: int, next_use=None) -> bool:
        """Whether ``put`` or ``stage`` would take a tile of ``nbytes`` now (a tile sent ahead
        that neither would take is not sent: the step's own calls send it)."""
        with self._lock:
            if tid in self._tiles or tid in self._staged:
                return True
            if self.staged_bytes + nbytes <= self.budget // 4:
                return True
            return self._victims(tid, nbytes, next_use) is not None

    def stage(self, tid, array, nbytes: int) -> bool:
        """Hold ``array`` for the running step only, outside the budget, if the tiles staged
        stay within a quarter of it (a tile sent ahead that ``put`` had no room for); whether
        it was. ``unpin_all`` lets go of them."""
        with self._lock:
            if tid in self._staged:
                return True
            if self.staged_bytes + nbytes > self.budget // 4:
                return False
            self._staged[tid] = [array, nbytes]
            self.staged_bytes += nbytes
            self.staged_peak = max(self.staged_peak, self.staged_bytes)
            return True

    def hold(self, tid, array, nbytes: int, next_use=None) -> bool:
        """Keep ``array``, a result whose bytes will not go back to the host, as tile ``tid``
        if room can be made (as ``put``); held tiles are never evicted (``drop`` lets go)."""
        return self._admit(tid, array, nbytes, next_use, held=True)

    def _victims(self, tid, nbytes: int, next_use) -> list | None:
        """The tiles to evict so that ``tid`` (``nbytes``) fits, [] if it fits already, None if
        no room can be made (the caller holds the lock)."""
        if nbytes > self.budget:
            return None
        room = self.budget - self.used
        if room >= nbytes:
            return []
        # unpinned tiles, least recently used first (the OrderedDict's order)
        victims = [t for t, e in self._tiles.items() if e[2] == 0 and not e[3]]
        if next_use is not None:
            mine = next_use(tid)
            # furthest-needed first (a stable sort keeps LRU among equals); only those
            # needed later than this tile may go for it (the running step's tiles are
            # needed now, 0: they make no room for each other, as a step re-reading its
            # tiles in a cycle longer than the cache would evict each before its turn)
            victims = [t for t in sorted(victims, key=lambda t: -next_use(t)) if next_use(t) > mine]
        chosen = []
        for victim in victims:
            if room >= nbytes:
                break
            chosen.append(victim)
            room += self._tiles[victim][1]
        return chosen if room >= nbytes else None

    def _admit(self, tid, array, nbytes: int, next_use, held: bool, pin: bool = False) -> bool:
        with self._lock:  # (pinned under the same lock: nothing evicts it in between)
            entry = self._tiles.get(tid)
            if entry is not None:  # sent, or computed, before: the same tile
                if held and not entry[3]:
                    entry[0], entry[3] = array, True
                    self.held += 1
                entry[2] += pin
                self._tiles.move_to_end(tid)
                return True
            chosen = self._victims(tid, nbytes, next_use)
            if chosen is None:
                return False  # all or nothing: this tile is used for its call and let go
            for victim in chosen:
                self.used -= self._tiles.pop(victim)[1]
                self.evicted += 1
            self._tiles[tid] = [array, nbytes, int(pin), held]
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.kept += 1
            self.held += held
            return True

    def drop(self, token) -> None:
        """Let go of every tile named by ``token`` (a finished run's results)."""
        with self._lock:
            for tid in [t for t in self._tiles if t[0] == token]:
                self.used -= self._tiles.pop(tid)[1]

    def unpin_all(self) -> None:
        """The running step's statements have ended: its pins, and the tiles staged for it, go."""
        with self._lock:
            for entry in self._tiles.values():
                entry[2] = 0
            self._staged.clear()
            self.staged_bytes = 0

    def clear(self) -> None:
        with self._lock:
            self._tiles.clear()
            self._staged.clear()
            self.used = self.staged_bytes = 0
