"""Job files: a ``job.toml`` read and checked before anything is computed.

A job names a database, its input tensors (files to load, or tensors already stored) and named
einsum steps; each step's result is stored as a tensor of its own name. Everything that can be
checked without data is checked here, and every error names the file and, where it can, the
line and the step (``JobError``). ``docs/cli.md`` describes the format.

>>> job = parse_job('''
... database = "t.duckdb"
... [inputs]
... A = { tensor = "A" }
... [steps.C]
... spec = "ij,jk->ik"
... operands = ["A", "A"]
... ''', "job.toml")
>>> job.order, job.steps["C"].line
(('C',), 5)
>>> parse_job('[steps.C]\\nspec = "ij->i"\\noperands = ["B"]', "job.toml", database="t.duckdb")
Traceback (most recent call last):
...
eindecomp_sql.jobs.spec.JobError: job.toml:3: step 'C': unknown operand 'B'; inputs: none; steps: C
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import tomllib
from dataclasses import dataclass, field

from ..errors import EinsumError
from ..notation.checks import check_dtype, check_name
from ..plan.cost import parse_memory
from ..plan.tiling import check_count

TOP_KEYS = ("database", "memory", "workers", "tile_bytes", "inputs", "steps")
INPUT_KEYS = ("file", "tensor", "tile", "dtype", "shape", "index", "value")
STEP_KEYS = ("spec", "operands", "join", "agg")
# files a job (and ``eindecomp-sql store``) reads, by suffix
FILE_SUFFIXES = (".npy", ".parquet", ".arrow", ".feather")


class JobError(EinsumError):
    """A job that cannot run as written: the message starts with ``file:line:`` (when a line is
    known) and names the step or input."""

    def __init__(self, message: str, file=None, line: int | None = None, column: int | None = None,
                 step: str | None = None, input: str | None = None):
        self.file, self.line, self.column, self.step, self.input = file, line, column, step, input
        self.reason = message
        where = "" if file is None else str(file)
        if where and line is not None:
            where += f":{line}" + (f":{column}" if column is not None else "")
        what = f"step {step!r}: " if step is not None else f"input {input!r}: " if input is not None else ""
        super().__init__(f"{where + ': ' if where else ''}{what}{message}")


@dataclass(frozen=True)
class InputSpec:
    """An input tensor: a ``file`` loaded into the database as tensor ``name``, or a stored
    ``tensor`` read where it is. ``tile``: how to cut a file (None: as the plan chooses);
    ``dtype``: cast a file's values to it; ``shape``, ``index``, ``value``: a table file in
    element or array form, as ``store`` reads it (its shape where empty last rows would cut it
    short, its index columns, its value column)."""

    name: str
    file: pathlib.Path | None
    tensor: str | None
    tile: tuple[int, ...] | None
    dtype: str | None
    line: int | None
    shape: tuple[int, ...] | None = None
    index: tuple[str, ...] | None = None
    value: str | None = None

    def table_options(self) -> dict:
        """``shape``, ``index`` and ``value`` as ``store`` takes them, those given only."""
        return {k: v for k, v in (("shape", self.shape), ("index", self.index), ("value", self.value))
                if v is not None}


@dataclass(frozen=True)
class StepSpec:
    """``name = einsum(spec, *operands, join=, agg=)``, stored as tensor ``name``."""

    name: str
    spec: str
    operands: tuple[str, ...]
    join: str | None
    agg: str | None
    line: int | None


@dataclass(frozen=True)
class Job:
    path: pathlib.Path
    database: pathlib.Path
    memory: int | None
    workers: int
    tile_bytes: int | None
    inputs: dict[str, InputSpec]
    steps: dict[str, StepSpec]
    order: tuple[str, ...]  # the steps in an order where each comes after what it reads
    lines: Lines = field(repr=False, compare=False, default=None)
    # settings the command line gave (--memory, ...): an error about one names no line of the file
    overridden: frozenset = field(compare=False, default=frozenset())

    def line(self, *path) -> int | None:
        if len(path) == 1 and path[0] in self.overridden:
            return None
        return self.lines.line(*path) if self.lines is not None else None

    def error(self, message: str, *path, step: str | None = None, input: str | None = None) -> JobError:
        return JobError(message, self.path, self.line(*path) if path else None, step=step, input=input)


# -- where things are in the text --------------------------------------------------------------
_BARE = r"[A-Za-z0-9_-]+|\"(?:[^\"\\]|\\.)*\"|'[^']*'"
_DOTTED = rf"(?:{_BARE})(?:\s*\.\s*(?:{_BARE}))*"
_HEADER = re.compile(rf"^\[\[?\s*({_DOTTED})\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(rf"^({_DOTTED})\s*=")


def _split(dotted: str) -> tuple[str, ...]:
    parts = re.findall(_BARE, dotted)
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


class Lines:
    """The line where each table and key of a TOML text is written (a line scan: good for the
    headers and ``key =`` lines of a job file; a key inside an inline table reports the line of
    the table)."""

    def __init__(self, text: str):
        self.where: dict[tuple[str, ...], int] = {}
        table: tuple[str, ...] = ()
        for n, raw in enumerate(text.splitlines(), 1):
            s = raw.strip()
            m = _HEADER.match(s)
            if m:
                table = _split(m.group(1))
                for k in range(1, len(table) + 1):
                    self.where.setdefault(table[:k], n)
                continue
            m = _KEY.match(s)
            if m:
                path = table + _split(m.group(1))
                for k in range(len(table) + 1, len(path) + 1):
                    self.where.setdefault(path[:k], n)

    def line(self, *path: str) -> int | None:
        for k in range(len(path), 0, -1):
            if path[:k] in self.where:
                return self.where[path[:k]]
        return None


# -- reading -----------------------------------------------------------------------------------
def load_job(path, *, database=None, memory=None, workers=None, tile_bytes=None) -> Job:
    """Read and check job file ``path``; the keyword arguments override the file's settings
    (``database`` relative to the current directory, the file's relative to the file)."""
    path = pathlib.Path(os.fspath(path))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError("no such job file", path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"cannot read the job file: {e}", path) from None
    return parse_job(text, path, database=database, memory=memory, workers=workers, tile_bytes=tile_bytes)


_TOML_AT = re.compile(r"^(.*?)\s*\(at line (\d+), column (\d+)\)\s*$", re.DOTALL)
_TOML_END = re.compile(r"^(.*?)\s*\(at end of document\)\s*$", re.DOTALL)


def parse_job(text: str, path, *, database=None, memory=None, workers=None, tile_bytes=None) -> Job:
    path = pathlib.Path(os.fspath(path))
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = _TOML_AT.match(msg)
        if m:
            raise JobError(f"invalid TOML: {m.group(1)}", path, int(m.group(2)), int(m.group(3))) from None
        m = _TOML_END.match(msg)
        if m:
            raise JobError(f"invalid TOML: {m.group(1)} (at the end of the file)", path,
                           text.count("\n") + 1) from None
        raise JobError(f"invalid TOML: {msg}", path) from None
    lines = Lines(text)
    base = path.parent

    def err(message, *where, step=None, input=None):
        return JobError(message, path, lines.line(*where) if where else None, step=step, input=input)

    _no_unknown(doc, TOP_KEYS, (), err, "the job")

    # settings: the file's, unless overridden
    if database is not None:
        db = pathlib.Path(os.fspath(database))
    else:
        if "database" not in doc:
            raise err("missing field 'database' (the DuckDB file the job reads and writes)")
        if not isinstance(doc["database"], str) or not doc["database"]:
            raise err(f"database must be a file path (a string), got {doc['database']!r}", "database")
        # "~/x.duckdb" is the user's home, as in a shell (it became <job dir>/~/x.duckdb)
        db = base / os.path.expanduser(doc["database"])
    # what opening it would refuse, said before anything runs and with the line (a trial met
    # "'x.npy' is not a DuckDB database file" and DuckDB's raw IO error, no file or line)
    where = () if database is not None else ("database",)
    if db.is_dir():
        raise err(f"database {str(db)!r} is a directory; name a DuckDB file", *where)
    if not db.exists() and not db.parent.is_dir():
        raise err(f"database {str(db)!r}: its folder {str(db.parent)!r} does not exist", *where)
    if db.is_file() and db.stat().st_size > 0:
        try:
            with open(db, "rb") as f:
                head = f.read(12)
        except OSError as e:
            raise err(f"cannot read database {str(db)!r}: {e.strerror}", *where) from None
        if head[8:12] != b"DUCK":
            raise err(f"database {str(db)!r} is not a DuckDB database file", *where)

    def setting(key, given, check):
        if given is not None:
            return check(given)
        if key not in doc:
            return check(None)
        try:
            return check(doc[key])
        except EinsumError as e:
            raise err(f"{key}: {e}", key) from None

    mem = setting("memory", memory, parse_memory)
    nworkers = setting("workers", workers, lambda w: 1 if w is None else check_count(w, "workers"))
    tbytes = setting("tile_bytes", tile_bytes, lambda t: None if t is None else parse_memory(t, "tile_bytes"))

    raw_inputs = doc.get("inputs", {})
    if not isinstance(raw_inputs, dict):
        raise err("[inputs] must be a table of name = { file = \"...\" } or name = { tensor = \"...\" }", "inputs")
    inputs: dict[str, InputSpec] = {}
    for name, spec in raw_inputs.items():
        inputs[name] = _input(name, spec, base, lines, err)

    raw_steps = doc.get("steps")
    if raw_steps is None:
        raise err("missing [steps]: the job has nothing to compute (add [steps.NAME] tables)")
    if not isinstance(raw_steps, dict) or not raw_steps:
        raise err("[steps] must hold at least one [steps.NAME] table", "steps")
    steps: dict[str, StepSpec] = {}
    for name, spec in raw_steps.items():
        steps[name] = _step(name, spec, lines, err)

    # names: one tensor each in the database, whose names ignore case
    lower_inputs = {n.lower(): n for n in inputs}
    stored = {i.tensor.lower(): i.name for i in inputs.values() if i.tensor is not None}
    for s in steps.values():
        if s.name.lower() in lower_inputs:
            raise err(f"writes over input {lower_inputs[s.name.lower()]!r}: a step's result is stored under the "
                      "step's name; rename the step", "steps", s.name, step=s.name)
        if s.name.lower() in stored:
            raise err(f"writes over stored tensor {s.name!r}, which input {stored[s.name.lower()]!r} reads; "
                      "rename the step", "steps", s.name, step=s.name)
    for i in inputs.values():
        if i.tensor is None and i.name.lower() in stored and stored[i.name.lower()] != i.name:
            raise err(f"loads a file as tensor {i.name!r}, which input {stored[i.name.lower()]!r} reads as a stored "
                      "tensor: it would write over it; rename the input", "inputs", i.name)
    seen: dict[str, str] = {}
    for name in list(inputs) + list(steps):
        low = name.lower()
        if low in seen:
            kind = "step" if name in steps else "input"
            raise err(f"{kind} {name!r} and {seen[low]!r} are one name to the database (names ignore case)",
                      "steps" if name in steps else "inputs", name)
        seen[low] = name
    for s in list(steps.values()):
        for op in s.operands:
            if op.lower() not in seen:
                raise err(f"unknown operand {op!r}; inputs: {', '.join(inputs) or 'none'}; "
                          f"steps: {', '.join(steps)}", "steps", s.name, "operands", step=s.name)
        # names ignore case, an operand's too ("X" reads input x: it was refused, a trial)
        steps[s.name] = dataclasses.replace(s, operands=tuple(seen[op.lower()] for op in s.operands))
    for s in steps.values():
        # before the unread-input check: a step given too few operands left an input unread,
        # and the error said to remove the input the user had forgotten to pass (a trial)
        wanted = len(s.spec.split("->")[0].split(","))
        if wanted != len(s.operands):
            raise err(f"einsum spec {s.spec!r} has {wanted} operand(s) but {len(s.operands)} "
                      "operand(s) were given", "steps", s.name, "operands", step=s.name)
    order = _order(steps, err)
    read = {op for s in steps.values() for op in s.operands}
    for i in inputs.values():
        if i.name not in read:
            raise err("no step reads this input; remove it or use it", "inputs", i.name, input=i.name)
    given = {"database": database, "memory": memory, "workers": workers, "tile_bytes": tile_bytes}
    return Job(path, db, mem, nworkers, tbytes, inputs, steps, order, lines,
               frozenset(k for k, v in given.items() if v is not None))


def _no_unknown(table: dict, known, where: tuple, err, what: str, **who) -> None:
    for k in table:
        if k not in known:
            raise err(f"unknown key {k!r} in {what}; known keys: {', '.join(known)}", *where, k, **who)


def _input(name, spec, base: pathlib.Path, lines: Lines, err) -> InputSpec:
    where = ("inputs", name)
    try:
        check_name(name, "input name")
    except EinsumError as e:
        raise err(str(e), *where) from None
    if not isinstance(spec, dict):
        raise err(f"write {name} = {{ file = \"{name}.npy\" }} (a file to load) or {name} = {{ tensor = \"{name}\" }} "
                  f"(a stored tensor), got {spec!r:.60}", *where, input=name)
    _no_unknown(spec, INPUT_KEYS, where, err, f"input {name!r}", input=name)
    has = [k for k in ("file", "tensor") if k in spec]
    if len(has) != 1:
        raise err("give exactly one of 'file' (a file to load) and 'tensor' (a stored tensor)"
                  + (", not both" if len(has) == 2 else ""), *where, input=name)
    file = tensor = tile = dtype = None
    if "file" in spec:
        f = spec["file"]
        if not isinstance(f, str) or not f:
            raise err(f"file must be a path (a string), got {f!r}", *where, "file", input=name)
        file = base / os.path.expanduser(f)
        if file.suffix.lower() not in FILE_SUFFIXES:
            raise err(f"file {f!r}: unknown kind of file; reads {', '.join(FILE_SUFFIXES)}", *where, "file", input=name)
        if not file.is_file():
            from .files import missing
            raise err(missing(file), *where, "file", input=name)
    else:
        t = spec["tensor"]
        try:
            tensor = check_name(t, "tensor name")
        except EinsumError as e:
            raise err(str(e), *where, "tensor", input=name) from None
        for k in ("tile", "dtype", "shape", "index", "value"):
            if k in spec:
                raise err(f"'{k}' is for a file; a stored tensor is read as it is stored", *where, k, input=name)
    if "tile" in spec:
        t = spec["tile"]
        if not isinstance(t, list) or not t or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                       for x in t):
            raise err(f"tile must be a list of positive integers, one per dimension, got {t!r}", *where, "tile",
                      input=name)
        tile = tuple(t)
    if "dtype" in spec:
        try:
            dtype = check_dtype(spec["dtype"])
        except (EinsumError, TypeError) as e:
            raise err(f"dtype: {e}", *where, "dtype", input=name) from None
    shape = index = value = None
    if "shape" in spec:
        t = spec["shape"]
        if not isinstance(t, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in t):
            raise err(f"shape must be a list of integers >= 0, one per dimension, got {t!r}", *where, "shape",
                      input=name)
        shape = tuple(t)
    if "index" in spec:
        t = spec["index"]
        t = [t] if isinstance(t, str) else t
        if not isinstance(t, list) or not all(isinstance(x, str) and x for x in t):
            raise err(f"index must be the index column names (a list of strings), got {spec['index']!r}", *where,
                      "index", input=name)
        index = tuple(t)
    if "value" in spec:
        if not isinstance(spec["value"], str) or not spec["value"]:
            raise err(f"value must be the value column's name, got {spec['value']!r}", *where, "value", input=name)
        value = spec["value"]
    if (shape, index, value) != (None, None, None) and file is not None and file.suffix.lower() == ".npy":
        raise err("shape, index and value describe a table file (element or array form); a .npy file brings its "
                  "own shape", *where, next(k for k in ("shape", "index", "value") if k in spec), input=name)
    return InputSpec(name, file, tensor, tile, dtype, lines.line(*where), shape, index, value)


def _step(name, spec, lines: Lines, err) -> StepSpec:
    where = ("steps", name)
    try:
        check_name(name, "step name")
    except EinsumError as e:
        raise err(str(e), *where, step=name) from None
    if not isinstance(spec, dict):
        raise err(f"a step is a table [steps.{name}] with spec = \"...\" and operands = [...], got {spec!r:.60}",
                  *where, step=name)
    _no_unknown(spec, STEP_KEYS, where, err, f"step {name!r}", step=name)
    for k in ("spec", "operands"):
        if k not in spec:
            raise err(f"missing field {k!r}" + (" (an einsum such as \"ij,jk->ik\")" if k == "spec" else
                                                " (a list of input and step names)"), *where, step=name)
    s = spec["spec"]
    if not isinstance(s, str) or not s.strip():
        raise err(f"spec must be an einsum string such as \"ij,jk->ik\", got {s!r}", *where, "spec", step=name)
    ops = spec["operands"]
    if not isinstance(ops, list) or not ops or not all(isinstance(o, str) for o in ops):
        raise err(f"operands must be a non-empty list of input and step names, got {ops!r}", *where, "operands",
                  step=name)
    for k in ("join", "agg"):
        if k in spec and not isinstance(spec[k], str):
            raise err(f"{k} must be a string, got {spec[k]!r}", *where, k, step=name)
    # join and agg are checked for what they mean when the graph is built (with the operand count)
    return StepSpec(name, s, tuple(ops), spec.get("join"), spec.get("agg"), lines.line(*where))


def _order(steps: dict[str, StepSpec], err) -> tuple[str, ...]:
    """The steps in file order, moved after what they read; a cycle is an error naming it."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the path, 2: placed

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = path[path.index(name):] + [name]
            raise err(f"the steps form a cycle: {' -> '.join(cycle)} (each reads the next's result)",
                      "steps", name, step=name)
        state[name] = 1
        for op in steps[name].operands:
            if op in steps:
                visit(op, path + [name])
        state[name] = 2
        order.append(name)

    for name in steps:
        visit(name, [])
    return tuple(order)
