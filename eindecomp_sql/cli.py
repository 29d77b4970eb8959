"""The command line: ``eindecomp-sql`` (or ``python -m eindecomp_sql``); docs/cli.md.

    eindecomp-sql store tensors.duckdb A a.npy --tile 1024x1024
    eindecomp-sql ls tensors.duckdb
    eindecomp-sql einsum tensors.duckdb 'ij,jk->ik' A B --out C
    eindecomp-sql run job.toml
    eindecomp-sql explain job.toml
    eindecomp-sql export tensors.duckdb C c.npy

Exit status: 0 done, 1 failed (one line on stderr: ``eindecomp-sql: error: ...``, naming the
file, line and step where there is one; ``--debug`` adds the traceback), 2 bad usage, 130
interrupted. The engine loads only when a command needs it, so ``--help`` is quick.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import sys
import threading
import time
import traceback

import click

from . import __version__

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# the reader of our output went away (``| head``): what a process killed by SIGPIPE reports,
# as cat or yes would, rather than 1, which said our command failed
EXIT_BROKEN_PIPE = 141
EXIT_TERMINATED = 143  # stopped by SIGTERM, cleanly (as Ctrl-C stops it: 130)


class Failure(Exception):
    """A command that cannot do what it was asked: printed as one line, exit status 1."""


def one_line(e: BaseException) -> str:
    """An error's message on one line; a parse error's caret lines become 'at character N'."""
    lines = str(e).split("\n")
    if len(lines) == 3 and lines[2].strip() == "^":
        col = len(lines[2]) - len(lines[2].lstrip()) - 4
        return f"{lines[0]} (at character {col + 1} of {lines[1].strip()!r})"
    text = " ".join(x.strip() for x in lines if x.strip()) or type(e).__name__
    from .jobs.spec import JobError

    if not isinstance(e, JobError):  # a job's errors name its file's keys (dtype = "bfloat16")
        # the library's advice names its keyword arguments; here they are the commands' options
        for api, option in _OPTION_ADVICE:
            text = text.replace(api, option)
    return text


_OPTION_ADVICE = (("pass replace=True", "pass --replace"), ("pass dtype='bfloat16'", "pass --dtype bfloat16"),
                  ("pass value='...'", "pass --value COLUMN"), ("pass index=[...] and value=", "pass --index COL,COL --value "),
                  ("name the columns with index= and value=", "name the columns with --index and --value"),
                  ("open it read_only=True from the others", "ls, export and explain open it read-only"))


def main(argv=None) -> None:
    """The ``eindecomp-sql`` entry point: run a command, exit with its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("EDS_DEBUG", "") not in ("", "0")
    from .backends.running import CtrlCMark, settle
    from .errors import EinsumError

    # a daemon or a cron wrapper may start us with fd 1 or 2 closed (Python then has None
    # there): the work needs neither, what it would print goes nowhere (a trial: "internal
    # error: AttributeError: 'NoneType' object has no attribute 'isatty'", and nothing ran)
    for stream in ("stdout", "stderr"):
        if getattr(sys, stream) is None:
            setattr(sys, stream, open(os.devnull, "w"))
    global _MARK
    # a Ctrl-C inside a statement run outside a session call (a job's md5 of a result, say)
    # reached us as duckdb-python's RuntimeError('Query interrupted'): "internal error", exit
    # 1, where the docs promise "interrupted", 130 (a new user's random SIGINTs, 3 of 16)
    _MARK = CtrlCMark()
    sigint_before = signal.getsignal(signal.SIGINT)
    sigterm = _on_sigterm()  # [the displaced handler], then the signal number once one came
    said: list[str] = []  # what a failure printed, for --json's error object

    def _fail(text: str) -> None:
        said.append(text.removeprefix("error: "))
        _err(text)
    try:
        _MARK.install()
        rv = cli.main(args=args, prog_name="eindecomp-sql", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        code = e.exit_code
    except SystemExit:
        # click (8.2+) catches a broken pipe itself, even with standalone_mode=False: it wraps
        # stdout and stderr to swallow further errors and exits 1, so `... | head` read as a
        # failure, not 141 (a documentation audit)
        if "PacifyFlushWrapper" not in type(sys.stdout).__name__:  # (8.1 named it without the _)
            raise
        code = EXIT_BROKEN_PIPE
    except click.ClickException as e:  # usage errors: exit 2, with click's own hint
        e.show()
        code = e.exit_code
        said.append(e.format_message())
        if args[:1] == ["run"] and "--json" in args:
            # a failed run prints its summary (docs/cli.md), a bad option value too: a script
            # reading stdout got nothing (a trial: --memory lots, --workers 0)
            job_file = next((a for a in args[1:] if a.endswith(".toml")), None)
            click.echo(json.dumps(_summary(None, [], time.perf_counter(), error=e.format_message(), path=job_file),
                                  indent=1))
    except (click.exceptions.Abort, KeyboardInterrupt) as e:
        _fail(_stopped(e, sigterm))
        code = EXIT_TERMINATED if len(sigterm) > 1 else EXIT_INTERRUPTED
    except BrokenPipeError:  # | head: not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        code = EXIT_BROKEN_PIPE
    except (EinsumError, Failure, OSError) as e:
        if debug:
            traceback.print_exc()
        if len(sigterm) > 1:  # what a SIGTERM interrupted (see _on_sigterm)
            _fail("terminated (SIGTERM)")
            code = EXIT_TERMINATED
        else:
            _fail(f"error: {one_line(e)}")
            code = EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - a bug of ours: still one line, the traceback on request
        if _interrupted(e) or len(sigterm) > 1:
            _fail(_stopped(e, sigterm))
            code = EXIT_TERMINATED if len(sigterm) > 1 else EXIT_INTERRUPTED
        elif type(e).__name__ == "OutOfMemoryException":  # the cap given, not a bug (store --memory 100KB)
            if debug:
                traceback.print_exc()
            _fail(f"error: DuckDB ran out of memory: {one_line(e)} (give a larger --memory)")
            code = EXIT_FAILED
        else:
            if debug:
                traceback.print_exc()
            _fail(f"internal error: {type(e).__name__}: {one_line(e)}"
                 + ("" if debug else " (run with --debug for the traceback)"))
            code = EXIT_FAILED
    finally:
        if sigterm:  # an in-process caller of main() gets its SIGTERM (and SIGINT) handlers back
            try:
                signal.signal(signal.SIGTERM, sigterm[0])
                if len(sigterm) > 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler \
                        and sigint_before == signal.SIG_IGN:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
            except (ValueError, OSError, TypeError):
                pass
        try:
            settle(_MARK.remove)
        except KeyboardInterrupt:  # a Ctrl-C just then: still ours to report
            _fail("interrupted")
            code = EXIT_INTERRUPTED
    command = next((a for a in args if not a.startswith("-")), None)
    if code not in (0, EXIT_BROKEN_PIPE) and said and command in ("einsum", "ls") and "--json" in args:
        # a script reading --json's stdout got nothing at all on a failure (a trial): an
        # object it can parse, with the message stderr has and the exit status
        try:
            click.echo(json.dumps({"error": said[-1], "exit_code": code}))
        except OSError:
            pass
    sys.exit(code)


def _stopped(e: BaseException, sigterm: list) -> str:
    """What a Ctrl-C or SIGTERM stopped, for stderr: a stop that came after the running
    operation committed says so (its result stands)."""
    said = "terminated (SIGTERM)" if len(sigterm) > 1 else "interrupted"
    if getattr(e, "eds_committed", False) or getattr(e.__cause__, "eds_committed", False):  # (click's Abort)
        said += " after the running operation committed (its result is written)"
    return said


def _on_sigterm() -> list:
    """SIGTERM (``timeout``, systemd, ``kill``) stops a command as Ctrl-C does: the running
    statement rolled back, an export's temporary file removed, ``run --json``'s summary
    printed; killed outright, a job printed nothing and an export left its temporary file (a
    trial). It is passed on as a SIGINT, which the session's Ctrl-C handling already stops
    cleanly everywhere, once the main thread runs Python again (a statement running then ends
    first: the watchdog that interrupts statements acts on SIGINT's byte only; not built). The
    list returned holds the handler displaced, then the signal once one came (exit 143)."""
    global _TERM
    came: list = []
    _TERM = came  # for what a command reports itself (run --json's summary)
    if threading.current_thread() is not threading.main_thread():
        return came

    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if not callable(signal.getsignal(signal.SIGINT)) and not ignored:  # a C handler: not ours to use
        return came

    def term(signum, frame):
        came.append(signum)
        if ignored:
            # SIGINT ignored (a script's background job, `cmd &`: killed outright by SIGTERM,
            # no summary, no message, a trial): the job is stopping, so Python's own SIGINT
            # handler takes it from here. The session's calls then running did not watch for
            # Ctrl-C, so the interruption may surface as a statement's or a kernel's error:
            # main() reports any failure after a SIGTERM as the SIGTERM (the transaction is
            # rolled back either way)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGINT)

    try:
        came.append(signal.signal(signal.SIGTERM, term))  # the handler it displaced, for main to put back
    except (ValueError, OSError):  # no signals here
        pass
    return came


def _json_value(x):
    """A result's values as strict JSON (RFC 8259 has no NaN or infinity: Python wrote ``NaN``
    and ``Infinity``, which JavaScript's and other strict parsers refuse; a new user's report):
    non-finite floats as the strings "NaN", "Infinity", "-Infinity"; complex numbers as
    [real, imaginary] pairs (they were null)."""
    if isinstance(x, list):
        return [_json_value(v) for v in x]
    if isinstance(x, complex):
        return [_json_value(x.real), _json_value(x.imag)]
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if x != x else "Infinity" if x > 0 else "-Infinity"
    return x


# elements of a result's last axis written as one piece of JSON text
JSON_RUN = 1 << 16


def _write_json_array(a, write) -> None:
    """``a``'s values as the nested JSON lists ``json.dumps(_json_value(a.tolist()))`` writes,
    a run of the last axis at a time: the whole text of a 134 MB result was 692 MB, and the
    process peaked at 3.16 GB building it (a trial)."""
    if a.ndim == 0:
        write(json.dumps(_json_value(a.item()), allow_nan=False))
        return
    write("[")
    if a.ndim == 1:
        for k in range(0, len(a), JSON_RUN):
            write((", " if k else "") + json.dumps(_json_value(a[k:k + JSON_RUN].tolist()), allow_nan=False)[1:-1])
    else:
        for k in range(len(a)):
            if k:
                write(", ")
            _write_json_array(a[k], write)
    write("]")


_MARK = None  # main()'s CtrlCMark: whether a Ctrl-C came during the command
_TERM: list = []  # main()'s SIGTERM record (``_on_sigterm``): more than one entry once one came


def _interrupted(e: BaseException) -> bool:
    """Whether ``e`` is a Ctrl-C: KeyboardInterrupt, or the RuntimeError DuckDB made of one."""
    return isinstance(e, KeyboardInterrupt) or (_MARK is not None and isinstance(_MARK.translate(e), KeyboardInterrupt))


def _err(text: str) -> None:
    print(f"eindecomp-sql: {text}", file=sys.stderr, flush=True)


# -- options shared by the commands -----------------------------------------------------------
def _debug_option(f):
    return click.option("--debug", is_flag=True, expose_value=False,
                        help="On an error, print the traceback too.")(f)


def _tile(ctx, param, value):
    if value is None:
        return None
    text = value.replace("×", "x").replace(",", "x").replace("*", "x")
    try:
        sides = tuple(int(s) for s in text.split("x"))
    except ValueError:
        raise click.BadParameter(f"{value!r}: write the tile's sides as 1024x1024 (or 1024,1024)") from None
    if not sides or any(s < 1 for s in sides):
        raise click.BadParameter(f"{value!r}: every tile side must be a positive integer")
    return sides


def _memory(ctx, param, value):
    if value is None:
        return None
    from .errors import EinsumError
    from .plan.cost import parse_memory

    try:
        return parse_memory(value)
    except EinsumError as e:
        raise click.BadParameter(str(e)) from None


_memory_option = click.option("--memory", callback=_memory, metavar="SIZE",
                              help="Memory budget, e.g. 2GB or 512MiB: plans fit it (one over it is refused "
                                   "before it runs) and DuckDB's memory_limit follows it (not counted: ~190 MB "
                                   "of interpreter and libraries).")
_workers_option = click.option("--workers", type=click.IntRange(min=1), metavar="N",
                               help="Join tasks per step the optimizer aims for (default 1: kernels use every "
                                    "core).")


def _connect(path, *, create: bool = False, read_only: bool = False, **options):
    """A session on database file ``path``; a missing file is an error unless ``create``."""
    import eindecomp_sql as eds

    p = pathlib.Path(path)
    if not create and not p.exists():
        raise Failure(f"no such database file {str(p)!r}")
    if p.exists() and p.is_dir():
        raise Failure(f"{str(p)!r} is a directory, not a database file")
    return eds.connect(str(p), read_only=read_only, **{k: v for k, v in options.items() if v is not None})


def _terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()


def _fmt_bytes(n) -> str:
    from .plan.steps import format_bytes

    return format_bytes(n)


def _shape(t) -> str:
    return "(" + ", ".join(str(x) for x in t) + ("," if len(t) == 1 else "") + ")"


# -- the commands ----------------------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="eindecomp-sql")
@_debug_option
def cli():
    """Extended einsums over tiled tensors stored in a DuckDB file.

    Store tensors from files, run einsums and whole jobs (a graph of named steps in a TOML
    file, planned as one graph, every step committed on its own and resumed after a crash),
    and export results. Exit status: 0 ok, 1 failed, 2 bad usage.
    """


@cli.command()
@click.argument("database", type=click.Path(dir_okay=False))
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--tile", callback=_tile, metavar="AxB", help="Tile shape, e.g. 1024x1024 (default: fit the "
                                                           "tile size: a 32nd of the machine's memory, 64 MiB to 1 GiB).")
@click.option("--dtype", help="Cast the values to this dtype (numpy's same_kind rule).")
@click.option("--shape", callback=_tile, metavar="AxB", help="Shape of an element-form table (default: the "
                                                             "largest index + 1).")
@click.option("--index", metavar="COL,COL", callback=lambda ctx, p, v: None if v is None else tuple(c.strip() for c in v.split(",")),
              help="The index columns of an element-form table, one per dimension, in order (default: every "
                   "integer column but the value).")
@click.option("--value", metavar="COL", help="The value column of an element-form table (default: the one "
                                            "named 'value', or the only non-index column).")
@click.option("--replace", is_flag=True, help="Overwrite a stored tensor of the same name.")
@click.option("--memory", callback=_memory, metavar="SIZE",
              help="Memory budget of the store, as connect(memory=): tiles are cut to fit it, and DuckDB's "
                   "cache stays within it (default: no budget, the cache capped at 256 MiB, or four of the "
                   "tensor's stored parts if more).")
@_debug_option
def store(database, name, file, tile, dtype, shape, index, value, replace, memory):
    """Store FILE (.npy, .parquet in tiled or element form, Arrow IPC .arrow/.feather) in
    DATABASE as tensor NAME. The database file is created if missing."""
    from .jobs import files

    path = pathlib.Path(file)
    files.kind(path)
    if not path.is_file():
        raise Failure(files.missing(path))
    t0 = time.perf_counter()
    # a store that fails leaves no database file it created (a bad name made an empty 270 kB
    # one, a trial); one that was there stays as it was (the store is atomic). Removed while
    # this process still holds DuckDB's lock on it: another store that created the file first,
    # and holds it, makes this one fail on the lock, before anything here could remove it
    created = database != ":memory:" and not os.path.exists(database)
    # --memory is the session's budget, as connect(memory=) is: tiles are cut to fit it (a
    # trial: a 144 MB .npy under --memory 100MB was stored as one 144 MB tile, and DuckDB ran out of
    # memory under the cap), and DuckDB's cache stays within it
    with _connect(database, create=True, memory=memory) as db:
        try:
            files.cap_cache(db, memory if memory is not None else files.store_cache_limit(db, path, tile, dtype))
            t = files.store_file(db, name, path, tile=tile, dtype=dtype, shape=shape, replace=replace, index=index,
                                 value=value)
        except BaseException:
            if created:
                for leftover in (database, f"{database}.wal"):
                    try:
                        os.remove(leftover)
                    except OSError:
                        pass
            raise
    click.echo(f"stored {t.name}: shape {_shape(t.shape)} {t.dtype} in tiles {_shape(t.tile)} "
               f"({_fmt_bytes(t.value.nbytes)}, {time.perf_counter() - t0:.2f} s)")


@cli.command(name="ls")
@click.argument("database", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@_debug_option
def ls(database, as_json):
    """List the tensors stored in DATABASE: name, shape, dtype, tile, tiles, bytes, and the job
    that wrote it (if one did)."""
    from .jobs import runner

    with _connect(database, read_only=True) as db:
        names = runner.tensor_names(db)
        rows = runner.read_rows(db, names)
        stale = runner.stale(rows)
        out = []
        for n in names:
            t = db.tensor(n)
            v = t.value
            r = rows.get(n.lower())
            job = None if r is None else f"{r['kind']} {r['state']}"
            if n.lower() in stale:
                job += f", STALE: {stale[n.lower()]}"
            out.append({"name": n, "shape": list(v.shape), "dtype": v.dtype, "tile": list(v.tile),
                        "tiles": runner._prod(v.grid) if v.shape else 1, "bytes": v.nbytes, "job": job})
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    if not out:
        click.echo("no tensors stored")
        return
    table = [("name", "shape", "dtype", "tile", "tiles", "bytes", "job")]
    table += [(r["name"], _shape(r["shape"]), r["dtype"], _shape(r["tile"]), f"{r['tiles']:,}", _fmt_bytes(r["bytes"]),
               r["job"] or "-") for r in out]
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    for row in table:
        click.echo("  ".join(c.rjust(w) if k in (4, 5) else c.ljust(w)
                             for k, (c, w) in enumerate(zip(row, widths))).rstrip())


@cli.command()
@click.argument("database", type=click.Path(dir_okay=False))
@click.argument("spec")
@click.argument("operands", nargs=-1, required=True)
@click.option("--out", help="Store the result as this tensor (without it the result is printed).")
@click.option("--join", help="Element-wise join: a name (mul, add, max, ...) or an expression such as "
                             "'relu(x - y)'. Default mul.")
@click.option("--agg", type=click.Choice(["sum", "max", "min", "prod"]), help="Aggregation over reduced "
                                                                               "labels. Default sum.")
@_memory_option
@_workers_option
@click.option("--replace", is_flag=True, help="Overwrite an existing --out tensor.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@_debug_option
def einsum(database, spec, operands, out, join, agg, memory, workers, replace, as_json):
    """Run SPEC (an extended einsum such as 'ij,jk->ik') over stored tensors OPERANDS in
    DATABASE."""
    t0 = time.perf_counter()
    progress = True if _terminal() and not as_json else None
    # without --out nothing is written: read-only, so a read-only file (or one other readers
    # have open) serves it too (a new user's report)
    with _connect(database, read_only=out is None, memory=memory, workers=workers) as db:
        if out is None:
            import numpy as np

            a = db.einsum_numpy(spec, *operands, join=join, agg=agg, progress=progress)
            if as_json:
                head = json.dumps({"shape": list(a.shape), "dtype": a.dtype.name, "seconds": time.perf_counter() - t0})
                def write(text):
                    click.echo(text, nl=False)

                write(head[:-1] + ', "value": ')
                _write_json_array(a, write)
                click.echo("}")
            else:
                click.echo(np.array2string(a, threshold=200))
            return
        t = db.einsum(spec, *operands, join=join, agg=agg, out=out, replace=replace, progress=progress)
        seconds = time.perf_counter() - t0
        v = t.value
        if as_json:
            click.echo(json.dumps({"out": t.name, "shape": list(v.shape), "dtype": v.dtype, "tile": list(v.tile),
                                   "bytes": v.nbytes, "seconds": round(seconds, 4)}))
        else:
            click.echo(f"stored {t.name}: shape {_shape(v.shape)} {v.dtype} in tiles {_shape(v.tile)} "
                       f"({_fmt_bytes(v.nbytes)}, {seconds:.2f} s)")
    if progress:
        from .jobs.runner import settle_watchdog

        settle_watchdog()


@cli.command()
@click.argument("database", type=click.Path(dir_okay=False))
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--form", type=click.Choice(["tiles", "elements"]), default="tiles", show_default=True,
              help="For .parquet/Arrow: the stored tiles, or one row per element.")
@click.option("--memory", callback=_memory, metavar="SIZE",
              help="Cap on DuckDB's cache while the tensor streams out (default: 128 MiB, or four times the "
                   "tensor's largest stored part if more).")
@click.option("--sync", is_flag=True,
              help="fsync the file and its rename before returning, so a power loss too leaves the old file "
                   "or the new one (waits for the disk).")
@_debug_option
def export(database, name, file, form, memory, sync):
    """Write tensor NAME of DATABASE to FILE (.npy, .parquet or Arrow IPC .arrow/.feather, by
    its suffix), atomically: a failure or a killed process leaves no half-written file."""
    from .jobs import files

    files.kind(file)
    with _connect(database, read_only=True) as db:
        t = db.tensor(name)
        files.cap_cache(db, memory if memory is not None else files.export_cache_limit(t.value))
        p = files.export(t, file, form, sync)
        click.echo(f"wrote {t.name} to {p} ({_fmt_bytes(p.stat().st_size)})")


# -- jobs ---------------------------------------------------------------------------------------
def _job_options(f):
    f = click.option("--db", "database", type=click.Path(dir_okay=False),
                     help="Use this database file instead of the job's 'database'.")(f)
    f = _memory_option(f)
    f = _workers_option(f)
    return f


def _load(job_file, database, memory, workers):
    from .jobs import load_job

    return load_job(job_file, database=database, memory=memory, workers=workers)


@cli.command()
@click.argument("job_file", metavar="JOB.toml", type=click.Path(dir_okay=False))
@_job_options
@click.option("--force", is_flag=True, help="Recompute steps whose definition or inputs changed since their "
                                            "result was stored (and tensors no job wrote), replacing them; "
                                            "without it such a job is refused.")
@click.option("--refresh", is_flag=True, help="Recompute the steps whose input data changed (a new input file, a "
                                              "stored input rewritten), replacing them; a job whose definition "
                                              "changed is still refused (--force recomputes that too).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout (per step: skipped, "
                                                      "seconds, tiles, bytes, projected peak).")
@click.option("--quiet", "-q", is_flag=True, help="No progress.")
@_debug_option
def run(job_file, database, memory, workers, force, refresh, as_json, quiet):
    """Run the job in JOB.toml: every step not done yet, in dependency order, each step's result
    committed to the database on its own. Run it again after a crash or Ctrl-C to resume."""
    from .jobs import runner

    t0 = time.perf_counter()
    job, r, entries = None, None, None
    try:
        job = _load(job_file, database, memory, workers)
        if not job.database.exists():
            runner.plan_job(job, None)  # a job that cannot be planned creates no database file
        stream = sys.stderr if as_json else sys.stdout
        reporter = runner.Reporter() if quiet else _BarReporter() if _terminal() and not as_json else _LineReporter(stream)
        with _connect(job.database, create=True, tile_bytes=job.tile_bytes, memory=job.memory) as db:
            prep = runner.prepare(job, db)
            blocked = [p for p in prep.parts if p.status == "blocked"]
            problems = prep.problems()
            if problems and (blocked or not (force or (refresh and all(p.new_data for p in problems)))):
                raise runner.refusal(prep)
            r = runner.Runner(db, prep, reporter)
            try:
                entries = r.run()
            finally:
                r.close()
    except BaseException as e:
        if entries is not None and isinstance(e, KeyboardInterrupt):
            # every step ran and committed; the stop came while the session closed: say the work
            # is written (it said only "terminated (SIGTERM)", ok false: a crash trial)
            e.eds_committed = True
        # a failed run still prints its summary (docs/cli.md), also when nothing ran: a job that
        # cannot be read, planned or is refused
        if as_json and not isinstance(e, (SystemExit, click.exceptions.Exit)):
            # what stderr says: a SIGTERM's failure is the SIGTERM's (the summary said
            # "interrupted", or DuckDB's "Query interrupted", for a kill: a crash trial)
            error = _stopped(e, _TERM) if _interrupted(e) or len(_TERM) > 1 else one_line(e)
            click.echo(json.dumps(_summary(job, r.entries if r is not None else [], t0, error=error, path=job_file),
                                  indent=1))
        raise
    summary = _summary(job, entries, t0)
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    elif not quiet:
        print(f"job {job.path}: {summary['ran']} step(s) run, {summary['skipped']} already done, "
              f"{summary['seconds']:.2f} s", file=stream, flush=True)


def _summary(job, entries, t0, error=None, path=None) -> dict:
    """The JSON summary of a run (``job`` None: the job file could not be read, ``path`` names it)."""
    return {"job": str(job.path if job is not None else path),
            "database": str(job.database) if job is not None else None, "ok": error is None,
            **({"error": error} if error is not None else {}),
            "seconds": round(time.perf_counter() - t0, 4), "ran": sum(not e["skipped"] for e in entries),
            "skipped": sum(e["skipped"] for e in entries), "steps": entries,
            "note": "projected_peak_bytes is the plan's projected peak of the step; max_rss_bytes the process's "
                    "resident high-water mark so far"}


@cli.command()
@click.argument("job_file", metavar="JOB.toml", type=click.Path(dir_okay=False))
@_job_options
@click.option("--dot", is_flag=True, help="Print the plan as Graphviz source instead.")
@click.option("--sql", is_flag=True, help="Add the SQL of every step.")
@_debug_option
def explain(job_file, database, memory, workers, dot, sql):
    """Show the plan of the job in JOB.toml without running it: how every step is cut, what it
    costs, its projected peak, and which steps are done in the database already."""
    from .jobs import runner

    job = _load(job_file, database, memory, workers)
    db = _connect(job.database, read_only=True) if job.database.exists() else None
    try:
        prep = runner.prepare(job, db)
        # every part done: the plan a fresh run would make, to show
        shown = prep.gplan if prep.gplan is not None else runner.plan_job(job, db)[2]
    finally:
        if db is not None:
            db.close()
    if dot:
        click.echo(shown.to_dot())
        return
    mem = "none" if job.memory is None else _fmt_bytes(job.memory)
    click.echo(f"job {job.path}: database {job.database}{'' if db is not None else ' (does not exist yet)'}, "
               f"{len(job.steps)} step(s), workers {job.workers}, memory budget {mem}")
    for p in prep.parts:
        state = {"done": "done (unchanged: skipped on run)", "todo": "to run",
                 # new input data only: run says --refresh is enough, and so does this (a trial)
                 "changed": f"CHANGED: {p.why} (run refuses without "
                            f"{'--refresh: new input data' if p.new_data else '--force'})",
                 "conflict": f"CONFLICT: {p.why} (run refuses without --force)",
                 "blocked": f"BLOCKED: {p.why}"}[p.status]
        at = f" (line {p.line})" if p.line is not None else ""
        if p.kind == "load":
            click.echo(f"  load {p.name}{at}: {p.source.file} -> tiles {_shape(p.value.tile)}, "
                       f"{_fmt_bytes(p.value.nbytes)}: {state}")
        else:
            s = job.steps[p.name]
            extra = "".join(f" {k}={getattr(s, k)}" for k in ("join", "agg") if getattr(s, k) is not None)
            head = (f"  step {p.name}{at}: {s.spec} of {', '.join(s.operands)}{extra} -> "
                    f"{_shape(p.value.shape)} {p.value.dtype} tiles {_shape(p.value.tile)}")
            if p.gplan is None:  # done: read as it is stored by the steps planned after it
                click.echo(f"{head} (stored): {state}")
                continue
            click.echo(f"{head}, {len(p.gplan.plan.steps)} plan step(s), peak {_fmt_bytes(p.peak)}: {state}")
            for st in p.gplan.plan.steps:
                click.echo(f"      {st.describe()}")
    click.echo("")
    if prep.gplan is None:
        click.echo("every part of the job is done: nothing to run. A run on a fresh database would plan:")
    click.echo(shown.explain(sql=sql))


# -- progress -----------------------------------------------------------------------------------
class _LineReporter:
    """Plain lines (stdout not a terminal): one per part started and finished, and one every
    ``interval`` seconds while a part runs."""

    def __init__(self, stream, interval: float = 5.0):
        self.stream, self.interval, self.last = stream, interval, 0.0

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def skipped(self, p, k, n):
        self._say(f"[{k}/{n}] {p.what}: done already, unchanged (skipped)")

    def started(self, p, k, n):
        self.last = time.monotonic()
        what = "loading " + str(p.source.file) if p.kind == "load" else f"{len(p.gplan.plan.steps)} plan step(s)"
        self._say(f"[{k}/{n}] {p.what}: {what}, {p.tiles:,} tile(s) ...")

    def progress(self, p, k, n, done, tiles, nbytes, elapsed):
        now = time.monotonic()
        if now - self.last < self.interval or done >= tiles:
            return
        self.last = now
        eta = f", ETA {elapsed * (tiles - done) / done:.0f} s" if done else ""
        self._say(f"[{k}/{n}] {p.what}: {done:,}/{tiles:,} tiles, {_fmt_bytes(nbytes)}, {elapsed:.0f} s{eta}")

    def finished(self, p, k, n, seconds):
        self._say(f"[{k}/{n}] {p.what}: done in {seconds:.2f} s ({p.tiles:,} tile(s), {_fmt_bytes(p.value.nbytes)})")


class _BarReporter:
    """A tqdm bar per part on a terminal: tiles done of total, bytes, elapsed and ETA."""

    def __init__(self):
        self.bar = None

    def skipped(self, p, k, n):
        from tqdm import tqdm

        tqdm.write(f"[{k}/{n}] {p.what}: done already, unchanged (skipped)")

    def started(self, p, k, n):
        from tqdm import tqdm

        self.bar = tqdm(total=p.tiles, desc=f"[{k}/{n}] {p.name}", unit="tile", leave=True, file=sys.stderr)

    def progress(self, p, k, n, done, tiles, nbytes, elapsed):
        if self.bar is not None:
            self.bar.update(max(0, min(done, tiles) - self.bar.n))
            self.bar.set_postfix_str(_fmt_bytes(nbytes), refresh=False)

    def finished(self, p, k, n, seconds):
        if self.bar is not None:
            self.bar.update(max(0, self.bar.total - self.bar.n))
            self.bar.close()
            self.bar = None
