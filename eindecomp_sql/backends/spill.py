"""What a killed process's spilling left behind, found and removed.

DuckDB spills to ``temp_directory`` in files named ``duckdb_temp_<pid>_...`` and deletes them
when its database closes; a process killed (SIGKILL, the OOM killer, a SIGTERM without
handler) leaves them: 460 MB in ``<file>.tmp`` beside a file database after one killed GEMM
under a 200 MB budget, still there after the database was reopened, used and closed; 1 GB in
the private folder a session in memory spills to (a new user's report). Nothing reused them:
each process writes files of its own pid, each in-memory session makes a fresh folder.

So a session sweeps what only a dead process can have left: files named for a pid that is not
running, and our private folders named for one (``eindecomp_sql-spill-<pid>-...``). A file of
a live process, or of this one, is never touched, whatever database it belongs to.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

FOLDER_PREFIX = "eindecomp_sql-spill-"
_DUCKDB_FILE = re.compile(r"duckdb_temp_(\d+)_")
_OUR_FOLDER = re.compile(re.escape(FOLDER_PREFIX) + r"(\d+)-")


def running(pid: int) -> bool:
    """Whether process ``pid`` is running (this one is)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say: running
        return True
    return True


def sweep_files(directory: str) -> int:
    """Remove DuckDB's spill files of processes no longer running from ``directory``; how
    many. Anything unreadable or not DuckDB's is left alone."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _DUCKDB_FILE.match(name)
        if m is None or running(int(m.group(1))):
            continue
        try:
            os.remove(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def sweep_named(directory: str, pattern: re.Pattern) -> int:
    """Remove the files of ``directory`` whose name ``pattern`` matches with a pid (its first
    group) no longer running; how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or running(int(m.group(1))):
            continue
        try:
            os.remove(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def sweep_folders(parent: str | None = None) -> int:
    """Remove the private spill folders of sessions whose process is no longer running (from
    the system's temp directory); how many."""
    parent = parent or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        m = _OUR_FOLDER.match(name)
        if m is None or running(int(m.group(1))):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed += 1
    return removed


def new_folder() -> str:
    """A private spill folder for this process, named for its pid (so that a later session can
    tell it was left by a dead one)."""
    return tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
