"""What a killed process's spilling left behind, found and removed.

DuckDB spills to ``temp_directory`` in files named ``duckdb_temp_<pid>_...`` and deletes them
when its database closes; a process killed (SIGKILL, the OOM killer, a SIGTERM without
handler) leaves them: 460 MB in ``<file>.tmp`` beside a file database after one killed GEMM
under a 200 MB budget, still there after the database was reopened, used and closed; 1 GB in
the private folder a session in memory spills to (a new user's report). Nothing reused them:
each process writes files of its own pid, each in-memory session makes a fresh folder.

So a session sweeps what only a dead process can have left: DuckDB's files named for a pid
that is not running, in the folder beside a file database it opened for writing (DuckDB's lock
on the file keeps every other process out of it), and our own private folders and export
partials, which carry this host's tag and a pid (``eindecomp_sql-spill-<host>-<pid>-...``). A
pid is only known dead on this host, in this pid namespace: a folder shared between hosts or
containers (a working directory on NFS, a user's ``temp_directory``) is never swept, and a
sweep never fails what it runs in (a review found a pid too large for ``os.kill`` raising).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile

# this host, in our names: a pid means nothing on another host sharing the folder
HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
FOLDER_PREFIX = "eindecomp_sql-spill-"
_DUCKDB_FILE = re.compile(r"duckdb_temp_(\d+)_.*", re.DOTALL)
_OUR_FOLDER = re.compile(re.escape(f"{FOLDER_PREFIX}{HOST}-") + r"(\d+)-.*", re.DOTALL)


def running(pid: int) -> bool:
    """Whether process ``pid`` is running (this one is)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # another user's, or no pid at all: left alone
        return True
    return True


def sweep_named(directory: str, pattern: re.Pattern, remove=os.remove) -> int:
    """Remove (``remove``) the entries of ``directory`` whose name ``pattern`` matches whole
    with a pid (its first group) no longer running; how many."""
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
            remove(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def sweep_files(directory: str) -> int:
    """Remove DuckDB's spill files of processes no longer running from ``directory``; how
    many. Anything unreadable or not DuckDB's is left alone."""
    return sweep_named(directory, _DUCKDB_FILE)


def sweep_folders(parent: str | None = None) -> int:
    """Remove the private spill folders of sessions whose process is no longer running (from
    the system's temp directory); how many."""
    return sweep_named(parent or tempfile.gettempdir(), _OUR_FOLDER, remove=shutil.rmtree)


def new_folder() -> str:
    """A private spill folder for this process, named for its host and pid (so that a later
    session on this host can tell it was left by a dead one)."""
    return tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{HOST}-{os.getpid()}-")


def partial_name() -> str:
    """The name of an export's partial file: this host, this process, random."""
    import secrets

    return f".eds-{HOST}-{os.getpid()}-{secrets.token_hex(6)}.tmp"


PARTIAL = re.compile(re.escape(f".eds-{HOST}-") + r"(\d+)-[0-9a-f]{12}\.tmp")


def quietly(sweep, *args) -> int:
    """Run a sweep; never let it fail what it runs in (an unreadable folder, a race)."""
    try:
        return sweep(*args)
    except Exception:  # noqa: BLE001 - tidying up is best effort
        return 0
