"""The one exception family of eindecomp_sql.

Every bad input a user can give (malformed spec, operand count or shape mismatch, unknown
tensor name, unsupported dtype, bad join/agg, a name that tries SQL injection, an existing
table without ``replace=True``) raises :class:`EinsumError`. It subclasses :class:`ValueError`
so ``except ValueError`` keeps working for code written against ``numpy.einsum``; where numpy
raises TypeError the error is an :class:`EinsumTypeError`, a TypeError too.
"""

from __future__ import annotations


class EinsumError(ValueError):
    """Bad input to eindecomp_sql: the message says what is wrong and where."""


class EinsumTypeError(EinsumError, TypeError):
    """An EinsumError where ``numpy.einsum`` raises TypeError: a casting rule refused (operands,
    ``dtype=``, ``out=``), not a dtype, a subscript that is not an int, an ``out=`` that is not
    an array, a path not understood. ``except TypeError`` written for numpy still catches it (a
    new user's report); it is an EinsumError (a ValueError) as every bad input is."""


class ExecutionError(EinsumError):
    """A plan failed while running in the engine (the message names the step)."""


class Interrupted(ExecutionError):
    """``Session.interrupt()`` (called from another thread) stopped the session's call: what
    the call was writing was rolled back (a job keeps the steps it had committed)."""


def caret(text: str, pos: int) -> str:
    """Two lines that point at character ``pos`` of ``text`` (for parse errors)."""
    return f"    {text}\n    {' ' * pos}^"


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the first caller outside this package (the user's line),
    however deep in the package it is called (Python 3.12's ``skip_file_prefixes``, by hand)."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def duckdb_said(error: Exception) -> str:
    """DuckDB's message without its advice about its own settings (SET threads, memory_limit):
    a user of this package sets memory= (a trial was pointed at SET memory_limit)."""
    import re

    return re.split(r"\n\s*Possible solutions:", str(error), maxsplit=1)[0].rstrip()


def duckdb_fatal(error: BaseException) -> BaseException | None:
    """The DuckDB fatal error in ``error``'s chain (itself, its cause or context), if any: after
    one (a disk that filled during a checkpoint) DuckDB refuses everything on that database
    ("database has been invalidated") until it is opened again."""
    seen = 0
    while error is not None and seen < 8:
        if type(error).__name__ == "FatalException" or "database has been invalidated" in str(error):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


FATAL_ADVICE = ("DuckDB has stopped this database after a fatal error: nothing more runs on this session; close "
                "it and open the database again with eds.connect() once the cause is fixed (what was committed "
                "before is kept)")
