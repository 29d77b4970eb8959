"""Tiles a session's device kernels keep on the device between kernel calls and between plans.

A stored tensor's tile is named by the tensor's token (its table's identity in this database:
``backends/duckdb.py`` gives one per table, new whenever the table is written anew) and the tile's
keys. Before a step's statement joins its operands, ``eds_resident(value, keys)`` asks whether a
tile is here; if it is, the tile is pinned and the SQL hands the kernel NULL instead of the
bytes, so DuckDB neither converts nor copies them; the kernel takes the device array from here.
A tile sent for a call is kept for the next ones, the least recently used unpinned tiles
making room, within the cache's budget (a tile that does not fit is used for its call and
let go). Pins last until the backend ends the step's statement (``unpin_all``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable


class DeviceCache:
    """Device arrays by tile id, at most ``budget`` bytes of them."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self._tiles: OrderedDict[Hashable, list] = OrderedDict()  # id -> [array, nbytes, pins]
        self._lock = threading.Lock()
        self.used = 0
        self.peak = 0
        self.hits = 0  # tiles a call found here instead of receiving them
        self.kept = 0  # tiles put here after being sent
        self.evicted = 0

    def __contains__(self, tid) -> bool:
        with self._lock:
            return tid in self._tiles

    def pin(self, tid) -> bool:
        """Pin the tile if it is here (True), else False."""
        with self._lock:
            entry = self._tiles.get(tid)
            if entry is None:
                return False
            entry[2] += 1
            self._tiles.move_to_end(tid)
            return True

    def take(self, tid):
        """The array of a tile pinned for this statement."""
        with self._lock:
            entry = self._tiles.get(tid)
            if entry is None or entry[2] == 0:
                raise RuntimeError(f"eindecomp_sql device cache: tile {tid!r} was promised resident and is not")
            self._tiles.move_to_end(tid)
            self.hits += 1
            return entry[0]

    def put(self, tid, array, nbytes: int) -> bool:
        """Keep ``array`` (just sent) as tile ``tid`` if room can be made; whether it was kept."""
        with self._lock:
            if tid in self._tiles or nbytes > self.budget:
                return tid in self._tiles
            if self.used + nbytes > self.budget:
                free = sum(e[1] for e in self._tiles.values() if e[2] == 0)
                if self.used - free + nbytes > self.budget:
                    return False  # all or nothing: evicting cannot make the room
                for victim in [t for t, e in self._tiles.items() if e[2] == 0]:
                    if self.used + nbytes <= self.budget:
                        break
                    self.used -= self._tiles.pop(victim)[1]
                    self.evicted += 1
            self._tiles[tid] = [array, nbytes, 0]
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.kept += 1
            return True

    def unpin_all(self) -> None:
        with self._lock:
            for entry in self._tiles.values():
                entry[2] = 0

    def clear(self) -> None:
        with self._lock:
            self._tiles.clear()
            self.used = 0
