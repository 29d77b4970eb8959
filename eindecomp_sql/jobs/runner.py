"""Running a job: planned as one graph, executed one step at a time, each step's result
committed on its own, and resumed after a crash from what is not done.

**Planning.** The job's steps become one ``Graph`` (a step of three or more operands lowers to
several nodes) and are planned together (``plan_graph``, every step's result an output), so the
optimizer chooses every node's chunking knowing its neighbours. The plan's steps are then split
by job step: a job step runs its own einsum steps plus the re-tiles feeding them (a re-tile two
job steps read runs in each), as a sub-plan whose inputs are graph inputs and the stored results
of earlier steps, each in the tiles the plan computed them in, or, for a result done before this
run, stored them in (``Session.run_graph_plan`` checks that). So each step's result is committed by the session's own transaction (table +
catalog row) and what runs is exactly the graph plan's steps.

**Loads.** A file input is loaded into the database as a tensor of the input's name (cut as the
plan reads it), committed the same way, before the steps.

**Done, and what "unchanged" means.** Table ``eds_jobs`` holds one row per tensor a job writes:
the fingerprint (sha256 over canonical JSON of what defines the result; the JSON is kept so a
refusal can say what changed, with the plan and tiles it was computed in, not fingerprinted),
and a state. A step's fingerprint covers its spec, operands, join, agg, its result's shape and
dtype, the package version, and the fingerprint of every input it reads: an earlier step's
fingerprint (a chain: its definition and inputs, recursively), a loaded file's (sha256 of the
file's bytes, its shape and dtype), or a stored tensor's (shape, dtype and an md5 over its tiles
computed in SQL: ``md5(string_agg(md5(tile) ORDER BY keys))``). A file is re-hashed only when
its size or mtime differ from those recorded with its load. Only the parts not done are planned
(``prepare``): done results are graph inputs, cut as they are stored, so settings that change
a plan's chunking (memory, workers, tile_bytes) leave done parts done.

**Crash safety.** For each part (load or step) not done: (1) drop its old result, if any;
(2) write its row with the new fingerprint, state 'pending'; (3) run it, committing table and
catalog row in one transaction; (4) set the row 'done' with timings. A part is done when its
row's fingerprint equals the current one *and* its result is in the catalog with the expected
shape and dtype (its tiles are read as they are) *and*, for a done row, the md5 recorded. Since the result is dropped before the row is written and written after,
a result next to a matching row was computed under that fingerprint, whether the row says
pending (killed between 3 and 4) or done. Killed anywhere else, the part has no result and runs
again. DuckDB rolls back an uncommitted transaction when the file is reopened, so the catalog
never holds a half-written tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field

from .. import __version__
from ..errors import EinsumError
from ..plan.steps import (
    EinsumStep,
    FillStep,
    Plan,
    ProgramStep,
    RetileStep,
    TiledValue,
    output_tiles,
    step_reads,
    step_target,
)
from .spec import InputSpec, Job, JobError

TABLE = "eds_jobs"
SCHEMA = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    tensor VARCHAR PRIMARY KEY,  -- lower-case name of the tensor a job writes (names ignore case)
    name VARCHAR NOT NULL,       -- as the job spells it
    kind VARCHAR NOT NULL,       -- 'load' (a file loaded as this tensor) or 'step' (an einsum step)
    job VARCHAR,                 -- the job file that wrote it
    fingerprint VARCHAR NOT NULL,-- sha256 of detail
    detail VARCHAR NOT NULL,     -- JSON: what the fingerprint covers
    file_stat VARCHAR,           -- JSON {{size, mtime_ns}} of a loaded file (not in the fingerprint)
    state VARCHAR NOT NULL,      -- 'pending' (written before the part runs) or 'done'
    seconds DOUBLE,
    tiles BIGINT,
    bytes BIGINT,
    peak_bytes BIGINT,
    updated TIMESTAMP,
    content_md5 VARCHAR          -- content_md5() of the result when done: a tensor replaced by hand is not done
)"""

# Tests set this to a callable(event, part name) to kill the process at a chosen point:
# events 'start', 'dropped', 'pending', 'progress' (from the progress callback, while the step's
# transaction is open), 'committed', 'done'.
HOOK = None


def _hook(event: str, name: str) -> None:
    if HOOK is not None:
        HOOK(event, name)


def digest(detail: dict) -> str:
    return hashlib.sha256(json.dumps(detail, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _value_json(v: TiledValue) -> dict:
    return {"shape": list(v.shape), "dtype": v.dtype, "tile": list(v.tile), "keys": list(v.keys)}


def _nbytes(v: TiledValue) -> int:
    return v.nbytes


@dataclass
class Part:
    """What commits on its own: a file loaded as a tensor, or a job step's result."""

    name: str
    kind: str  # 'load' | 'step'
    line: int | None
    value: TiledValue  # the stored result, as the plan reads/computes it
    source: InputSpec | None = None  # a load's input
    gplan: object = None  # a step's sub-plan (a GraphPlan)
    bind: dict = field(default_factory=dict)  # sub-plan input value -> stored tensor name
    detail: dict = field(default_factory=dict)
    fingerprint: str = ""
    file_stat: dict | None = None
    status: str = "todo"  # 'done' | 'todo' | 'changed' | 'conflict' | 'blocked'
    why: str = ""
    committed_not_done: bool = False  # done, but its row still 'pending' (killed between (3) and (4))
    new_data: bool = False  # changed only because input data changed (a new file, a stored input rewritten)
    recorded_stat: dict | None = None  # a load's file_stat as its row has it (refreshed once re-hashed)

    @property
    def tiles(self) -> int:
        if self.kind == "load" or self.gplan is None:  # (a done step: its stored tiles)
            return int(_prod(self.value.grid)) if self.value.shape else 1
        return sum(output_tiles(s) for s in self.gplan.plan.steps)

    @property
    def peak(self) -> int | None:
        """The sub-plan's projected peak (bytes; None for a load)."""
        return self.gplan.plan.peak_bytes if self.gplan is not None else None

    @property
    def what(self) -> str:
        return f"step {self.name!r}" if self.kind == "step" else f"input {self.name!r}"


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


@dataclass
class Prepared:
    """A job planned and fingerprinted against a database (or against none yet)."""

    job: Job
    graph: object
    gplan: object
    parts: list[Part]
    stored: dict[str, object]  # input name -> its stored Tensor

    def problems(self) -> list[Part]:
        return [p for p in self.parts if p.status in ("changed", "conflict", "blocked")]


# -- planning ------------------------------------------------------------------------------
def _one_line(e: Exception) -> str:
    """An error's message on one line (a parse error's caret lines become 'at character N')."""
    lines = str(e).split("\n")
    if len(lines) == 3 and lines[2].strip() == "^":
        col = len(lines[2]) - len(lines[2].lstrip()) - 4
        return f"{lines[0]} (at character {col + 1} of {lines[1].strip()!r})"
    return " ".join(x.strip() for x in lines if x.strip())


def input_shapes(job: Job, db=None) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, object]]:
    """Shape and dtype of every input (files from their headers, stored tensors from the
    catalog of ``db``), and the stored inputs' Tensors."""
    from . import files

    shapes, stored = {}, {}
    for i in job.inputs.values():
        if i.file is not None:
            try:
                shape, dtype = files.info(i.file, i.dtype, i.table_options())
            except EinsumError as e:
                raise job.error(_one_line(e), "inputs", i.name, "file", input=i.name) from None
            if i.dtype is not None:
                from ..notation.checks import can_cast

                if not can_cast(dtype, i.dtype, "same_kind"):
                    raise job.error(f"cannot cast the file's {dtype} values to dtype {i.dtype} (numpy's same_kind "
                                    "rule)", "inputs", i.name, "dtype", input=i.name)
                dtype = i.dtype
            shapes[i.name] = (shape, dtype)
        else:
            if db is None:
                raise job.error(f"reads stored tensor {i.tensor!r}, but the database {str(job.database)!r} "
                                "does not exist", "inputs", i.name, input=i.name)
            t = lookup(db, i.tensor)
            if t is None:
                names = tensor_names(db)
                raise job.error(f"no stored tensor {i.tensor!r} in {str(job.database)!r}; stored: "
                                f"{', '.join(names) or 'none'}", "inputs", i.name, "tensor", input=i.name)
            stored[i.name] = t
            shapes[i.name] = (t.shape, t.dtype.name)
    return shapes, stored


def lookup(db, name: str):
    """The stored Tensor ``name``, or None (also in a read-only database without a catalog)."""
    v = db.backend.lookup(name)
    return None if v is None else db.tensor(v.name)


def tensor_names(db) -> list[str]:
    try:
        return db.tensors()
    except Exception:  # noqa: BLE001 - a read-only database that never had a catalog
        return []


def build_graph(job: Job, shapes: dict, done: frozenset = frozenset()):
    """The job as a Graph; returns it and the job step owning each node's result. ``done``: job
    steps whose stored results are read as they are (graph inputs, not nodes); the graph then
    holds the other steps, and the inputs and done steps they read."""
    from ..graph import Graph

    g = Graph()
    todo = [name for name in job.order if name not in done]
    read = {op for name in todo for op in job.steps[name].operands}
    for i in job.inputs.values():
        if done and i.name not in read:
            continue
        shape, dtype = shapes[i.name]
        try:
            g.input(i.name, shape, dtype)
        except EinsumError as e:
            # the graph's message names the input too: once is enough ("input 'Z': input 'Z': ...")
            msg = _one_line(e).removeprefix(f"input {i.name!r}: ")
            if min(shape, default=1) < 1 and "dimension" in msg:
                msg += " (jobs plan their steps as one graph, which has no empty dimensions yet; " \
                       "eindecomp-sql einsum and the Python API take them)"
            raise job.error(msg, "inputs", i.name, input=i.name) from None
        if i.tile is not None:
            from ..plan.tiling import check_tile

            try:
                check_tile(shape, i.tile)
            except EinsumError as e:
                raise job.error(f"{_one_line(e)}", "inputs", i.name, "tile", input=i.name) from None
    owner: dict[str, str] = {}
    values = {n: shapes[n] for n in job.inputs}
    for name in job.order:
        s = job.steps[name]
        if name in done:
            values[name] = shapes[name]
            if name in read:
                g.input(name, *shapes[name])
            continue
        before = len(g.nodes)
        try:
            g.einsum(s.spec, *s.operands, join=s.join, agg=s.agg, name=name)
        except EinsumError as e:
            ops = ", ".join(f"{op} {tuple(values[op][0])}" for op in s.operands)
            msg = _one_line(e)
            head = msg.split(":")[0]  # "join expression", "unknown join 'frobnicate'", "unknown agg ..."
            key = "join" if "join" in head and s.join is not None else "agg" if "agg" in head else "spec"
            raise job.error(f"{msg} (spec {s.spec!r} over {ops})", "steps", name, key, step=name) from None
        for n in g.nodes[before:]:
            owner[n.result.name] = name
        v = g.value(name)
        values[name] = (v.shape, v.dtype)
    return g, owner


def plan_job(job: Job, db=None, shapes=None, stored=None, done: dict | None = None):
    """Plan the job as one graph (stored inputs as they are cut, files as the plan chooses unless
    the job gives a tile). ``done``: parts (loads and steps) found done, name -> their stored
    Tensor: read as they are stored, the steps among them not planned again. Returns (graph,
    owner, graph plan or None where every step is done, stored inputs)."""
    from ..plan.cost import DEFAULT_COSTS, plan_share
    from ..plan.graph_plan import plan_graph
    from ..plan.tiling import DEFAULT_TILE_BYTES

    if shapes is None:
        shapes, stored = input_shapes(job, db)
    done = done or {}
    g, owner = build_graph(job, shapes, frozenset(n for n in done if n in job.steps))
    fixed = dict(stored)
    fixed.update({i.name: i.tile for i in job.inputs.values() if i.file is not None and i.tile is not None})
    fixed.update(done)
    fixed = {name: t for name, t in fixed.items() if name in {v.name for v in g.inputs}}
    todo = [name for name in job.order if name not in done]
    if not todo:
        return g, owner, None, stored
    try:
        # the job's session gets job.memory; its plans, that session's share of it
        gplan = plan_graph(g, workers=job.workers, memory=plan_share(job.memory),
                           tile_bytes=job.tile_bytes or DEFAULT_TILE_BYTES, outputs=todo,
                           inputs=fixed, costs=db.backend.cost_model if db is not None else DEFAULT_COSTS)
    except EinsumError as e:
        # the setting the refusal is about, at its line (none where the command line gave it)
        text = str(e)
        key = ("tile_bytes" if "larger tile_bytes" in text else "memory" if "memory" in text
               else "tile_bytes" if "tile_bytes" in text else None)
        raise JobError(f"cannot plan the job: {_one_line(e)}", job.path, job.line(key) if key else None) from None
    return g, owner, gplan, stored


def split(job: Job, g, owner: dict[str, str], gplan) -> dict[str, object]:
    """One sub-plan (a GraphPlan) per job step: its einsum steps and the re-tiles feeding them."""
    from ..graph import ValueInfo

    steps = gplan.plan.steps
    # a reduction run as partial results and a combine step (plan/partials.py): the partial
    # value is no graph node's; it belongs to the job step whose combine step reads it
    from ..plan.graph_plan import step_reads_by

    owner = dict(owner)
    for s in steps:
        if isinstance(s, EinsumStep) and s.node.kept:
            owner[s.result.name] = owner[step_reads_by(gplan.plan, s.result.name)]
    planned = [name for name in job.order if any(o == name for o in owner.values())]
    mine: dict[str, list[int]] = {name: [] for name in planned}
    readers: dict[str, set[str]] = {}  # a value -> job steps whose einsum steps read it
    # a program (plan/passes/program.py) never spans job steps: each job step's result is kept
    for s in steps:
        if isinstance(s, (EinsumStep, ProgramStep)):
            for v in s.inputs:
                readers.setdefault(v.name, set()).add(owner[s.result.name])
    for k, s in enumerate(steps):
        if isinstance(s, (EinsumStep, ProgramStep)):
            mine[owner[s.result.name]].append(k)
        elif isinstance(s, FillStep):
            mine[owner[s.result.name]].append(k)
        elif isinstance(s, RetileStep):
            for o in readers.get(s.target.name, ()):
                mine[o].append(k)
    outputs = {v.name: v for v in gplan.plan.outputs}
    plan_inputs = {v.name: v for v in gplan.plan.inputs}
    nodes = {n.result.name: n for n in gplan.nodes}
    subs = {}
    for name in planned:
        own = [steps[k] for k in sorted(mine[name])]
        made = {step_target(s).name for s in own}
        read: dict[str, TiledValue] = {}
        for s in own:
            for v in step_reads(s):
                if v.name not in made:
                    known = plan_inputs.get(v.name) or outputs.get(v.name)
                    if known != v:  # cannot happen: every value a step reads is made or given
                        raise EinsumError(f"step {name!r} reads {v.name!r}, which no earlier step stores as it reads it")
                    read.setdefault(v.name, v)
        plan = Plan(tuple(own), tuple(read.values()), (outputs[name],), gplan.plan.model)
        infos = tuple(ValueInfo(v.name, v.shape, v.dtype) for v in read.values())
        subs[name] = dataclasses.replace(
            gplan, nodes=tuple(n for r, n in nodes.items() if owner.get(r) == name), inputs=infos,
            outputs=(g.value(name),), plan=plan, single=True, unused_inputs=())
    return subs


# -- fingerprints ----------------------------------------------------------------------------
def content_md5(db, t) -> str:
    """md5 over a stored tensor's tiles, in key order, computed by DuckDB (docs/cli.md)."""
    from sqlglot import exp

    from ..compile.sql import DIALECT, col, table

    tiles = exp.func("md5", col("tile"))
    if t.keys:
        tiles = exp.Order(this=tiles, expressions=[exp.Ordered(this=col(k), desc=False) for k in t.keys])
    # string_agg(md5(tile), '' ORDER BY keys): sqlglot prints it as LISTAGG, DuckDB's alias
    agg = exp.GroupConcat(this=tiles, separator=exp.Literal.string(""))
    query = exp.select(exp.func("md5", agg), exp.func("count", exp.Star())).from_(table(t.name))
    cur = db.connection.cursor()
    try:
        row = cur.execute(query.sql(dialect=DIALECT)).fetchone()
    finally:
        cur.close()
    return f"{row[0]}:{row[1]}"


def read_rows(db, names) -> dict[str, dict]:
    if db is None:
        return {}
    cur = db.connection.cursor()
    try:
        have = cur.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND schema_name = 'main'",
                           [TABLE]).fetchone()[0]
        if not have:
            return {}
        low = [n.lower() for n in names]
        rel = cur.execute(f"SELECT tensor, name, kind, fingerprint, detail, file_stat, state, content_md5 FROM {TABLE} "
                          "WHERE tensor IN (SELECT unnest(?))", [low]).fetchall()
    finally:
        cur.close()
    out = {}
    for tensor, name, kind, fp, detail, stat, state, md5 in rel:
        out[tensor] = {"name": name, "kind": kind, "fingerprint": fp, "detail": json.loads(detail),
                       "file_stat": json.loads(stat) if stat else None, "state": state, "content_md5": md5}
    return out


def stale(rows: dict[str, dict]) -> dict[str, str]:
    """Step results (by lower-case name) computed from an input that has since been loaded or
    computed again (its row's fingerprint is no longer the one the step read), or from such a
    stale result: what ``ls`` flags, from the job rows alone (a trial: after a renamed step and
    a new input file, the old step's result was listed "step done", yesterday's numbers)."""
    out: dict[str, str] = {}
    for _ in range(len(rows) + 1):  # (a chain: until nothing new is found)
        found = False
        for name, r in rows.items():
            if name in out or r["kind"] != "step":
                continue
            stored = r["detail"].get("stored_inputs")
            stored = stored if isinstance(stored, dict) else {}
            for op, fp in (r["detail"].get("inputs") or {}).items():
                if op.lower() in stored:
                    # a stored input: the tensor it named, if a job wrote it, with other tiles since
                    # (a tensor of the input's own name another job wrote is not it: a review)
                    named = (stored[op.lower()] or {}).get("tensor")
                    now = rows.get(named) if named else None
                    if now is None or (named not in out
                                       and now.get("content_md5") in (None, stored[op.lower()].get("md5"))):
                        continue
                    out[name] = f"input {op} (tensor {now['name']}) {'is stale' if named in out else 'changed since'}"
                    found = True
                    break
                now = rows.get(op.lower())
                if op.lower() in out:
                    out[name] = f"input {now['name'] if now else op} is stale"
                elif now is not None and now["fingerprint"] != fp:
                    out[name] = f"input {now['name']} changed since"
                else:
                    continue
                found = True
                break
        if not found:
            break
    return out


def _plain_table_exists(db, name: str) -> bool:
    cur = db.connection.cursor()
    try:
        from ..backends.tables import COUNT_NAMED, WHERE_CURRENT_SCHEMA

        here = f"{WHERE_CURRENT_SCHEMA} AND NOT temporary"
        return bool(cur.execute(COUNT_NAMED.format(where=here), [name]).fetchone()[0])
    finally:
        cur.close()


# the fingerprint's form: 2 covers what defines a result (not its tiles or plan); rows an earlier
# eindecomp_sql wrote (form 1, the plan included) are refused as changed, once
FINGERPRINT_FORM = 2


def prepare(job: Job, db=None) -> Prepared:
    """Fingerprint every part by what defines its result, decide what is done, and plan the
    rest (``db`` None: the database does not exist yet, nothing is). A done part is read as it
    is stored by the steps planned after it, whatever tiles a plan made now would give it: a
    job killed for want of memory resumes under a larger ``--memory`` (a trial: every step was
    "changed", its plan's chunking being in the fingerprint)."""
    from . import files

    shapes, stored = input_shapes(job, db)
    g, _ = build_graph(job, shapes)  # the whole job: every step checked, every result's shape
    for name in job.order:
        v = g.value(name)
        shapes[name] = (tuple(v.shape), v.dtype)
    rows = read_rows(db, list(job.inputs) + list(job.steps))
    fps: dict[str, str] = {}
    parts: list[Part] = []
    reads: dict[str, dict] = {}  # a stored input -> the tensor it names and its tiles' md5 (not fingerprinted)
    for i in job.inputs.values():
        shape, dtype = shapes[i.name]
        if i.file is None:
            t = stored[i.name]
            md5 = content_md5(db, t)
            reads[i.name.lower()] = {"tensor": t.name.lower(), "md5": md5}
            fps[i.name] = digest({"kind": "stored", "tensor": t.name, "shape": list(shape), "dtype": dtype,
                                  "content_md5": md5})
            continue
        st = i.file.stat()
        stat = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        row = rows.get(i.name.lower())
        where = _file_key(job, i.file)
        recorded = dict(row["file_stat"] or {}) if row is not None and row["kind"] == "load" else None
        if recorded is not None and recorded.get("file") == str(i.file):
            recorded["file"] = where  # recorded as the command's path spelt it (before 2026-11-28)
        if (recorded is not None and recorded == {**stat, "file": where}
                and "sha256" in row["detail"]):
            sha = row["detail"]["sha256"]  # size and mtime unchanged: the recorded hash stands
        else:
            sha = files.file_digest(i.file)
        # (a table file's index= / value= choose what is read: a change re-loads it)
        detail = {"form": FINGERPRINT_FORM, "kind": "load", "version": __version__, "sha256": sha,
                  "shape": list(shape), "dtype": dtype,
                  **{k: list(x) if isinstance(x, tuple) else x for k, x in i.table_options().items()
                     if k != "shape"}}
        p = Part(i.name, "load", i.line, None, source=i, detail=detail, fingerprint=digest(detail),
                 file_stat={**stat, "file": where}, recorded_stat=recorded if recorded is not None else
                 (row["file_stat"] if row is not None else None))
        fps[i.name] = p.fingerprint
        parts.append(p)
    for name in job.order:
        s = job.steps[name]
        shape, dtype = shapes[name]
        # (names ignore case, as the database's do: [steps.h] renamed [steps.H] changes nothing;
        # nor does a spec, join or agg spelt otherwise with the same meaning: the recorded
        # spelling is fingerprinted again)
        spec, join, agg = _recorded_spelling(s, rows.get(name.lower()), [shapes[op][0] for op in s.operands])
        detail = {"form": FINGERPRINT_FORM, "kind": "step", "version": __version__, "spec": spec,
                  "operands": [op.lower() for op in s.operands], "join": join, "agg": agg,
                  "result": {"shape": list(shape), "dtype": dtype},
                  "inputs": {op.lower(): fps[op] for op in dict.fromkeys(s.operands)}}
        p = Part(name, "step", s.line, None, detail=detail, fingerprint=digest(detail))
        fps[name] = p.fingerprint
        parts.append(p)
    done: dict[str, object] = {}
    if db is not None:
        fresh: set[str] = set()  # parts changed by new data only
        for p in parts:
            row = rows.get(p.name.lower())
            _status(db, p, row)
            if p.status == "done":
                done[p.name] = lookup(db, p.name)
                p.value = done[p.name].value
            elif (p.status == "changed" and row["fingerprint"] != p.fingerprint  # (not a result replaced by hand)
                  and _new_data(row, p, fresh, reads)):
                p.new_data = True
                fresh.add(p.name.lower())
    g, owner, gplan, _ = plan_job(job, db, shapes, stored, done)
    subs = split(job, g, owner, gplan) if gplan is not None else {}
    plan_inputs = {v.name: v for v in gplan.plan.inputs} if gplan is not None else {}
    for p in parts:
        if p.name in done:
            continue
        # how the part is stored and computed now: recorded with it, not fingerprinted
        if p.kind == "load":
            if p.name in plan_inputs:
                p.value = dataclasses.replace(plan_inputs[p.name], name=p.name)
            else:  # no step still to run reads it (dropped or replaced by hand, its readers done):
                # loaded as the job says, or cut as a store would cut it (a review: KeyError)
                p.value = _unread_load(job, p.name, shapes[p.name], db)
            p.detail = {**p.detail, "tile": list(p.value.tile), "keys": list(p.value.keys)}
        else:
            sub = subs[p.name]
            p.gplan, p.value = sub, sub.plan.outputs[0]
            p.detail = {**p.detail, "plan": [st.describe() for st in sub.plan.steps], "stored": _value_json(p.value),
                        # inputs read where they are stored: the tensor each names and its md5
                        # (stale() and --refresh tell new data from an edited job by them)
                        "stored_inputs": {op.lower(): reads[op.lower()] for op in job.steps[p.name].operands
                                          if op.lower() in reads}}
            p.bind = {x.name: (job.inputs[x.name].tensor or x.name) if x.name in job.inputs else x.name
                      for x in sub.plan.inputs}
    return Prepared(job, g, gplan, parts, stored)


def _meanings(spec, join, agg, shapes) -> tuple:
    """What a step's spec, join and agg mean, whatever their spelling: the parsed spec's labels,
    the join's name (its case and blanks ignored; ``None`` is ``mul``) or its expression as
    Python prints it back (``relu(x-y)`` is ``relu(x - y)``), the aggregation's name."""
    import ast

    from ..notation.functions import parse_agg, parse_join
    from ..notation.spec import parse_spec

    e = parse_spec(spec, [tuple(x) for x in shapes])
    f = parse_join(join, len(shapes))
    return ((e.inputs, e.output, e.squeezed),
            ("expr", ast.unparse(ast.parse(f.expr, mode="eval"))) if f.expr else ("name", f.name),
            parse_agg(agg).name)


def _recorded_spelling(s, row: dict | None, shapes) -> tuple:
    """The step's (spec, join, agg) to fingerprint: each as its row recorded it where it means
    what the job says now, else as the job spells it. A respelt join (``MUL`` for ``mul``,
    ``x*y`` for ``x * y``) made a changed job that only ``--force`` ran (a trial); the recorded
    spelling keeps every fingerprint a job has stored, its later steps' included, and a
    refusal names only what changed in meaning."""
    now = (s.spec, s.join, s.agg)
    if row is None or row.get("kind") != "step" or not isinstance(row.get("detail"), dict):
        return now
    was = tuple(row["detail"].get(k) for k in ("spec", "join", "agg"))
    if was == now or not all(x is None or isinstance(x, str) for x in was) or not isinstance(was[0], str):
        return now
    try:
        m_was, m_now = _meanings(*was, shapes), _meanings(*now, shapes)
    except (EinsumError, SyntaxError, ValueError):  # a recorded text this version reads otherwise
        return now
    return tuple(w if a == b else n for w, n, a, b in zip(was, now, m_was, m_now))


def _file_key(job: Job, file) -> str:
    """A loaded file as the job's record names it: its path from the job file's directory, so
    that the job run from another directory, or by an absolute path, reads the same file (it
    was the path as the command spelt it: ``run proj/job.toml --refresh`` after ``run job.toml``
    in proj/ was refused as a file pointed elsewhere, a trial)."""
    return os.path.relpath(os.path.abspath(file), os.path.abspath(job.path.parent))


def _new_data(row: dict, p: Part, fresh: set[str], reads: dict[str, dict]) -> bool:
    """Whether a part whose fingerprint changed did so only because the data it reads changed:
    a load whose file (the same path) holds other bytes, or a step whose every changed input is
    such a load, such a step, or a stored input naming the same tensor as before (its tiles
    rewritten); its definition, the job's text, unchanged. ``run --refresh`` recomputes those
    and still refuses an edited job (a trial: a nightly job's new input files needed --force,
    which waves edits through too; a review: a tensor= or file= pointed elsewhere is an edit)."""
    old, new = row["detail"], p.detail

    def same(*keys):
        return all(old.get(k) == new.get(k) for k in keys)

    if not same("form", "kind", "version"):
        return False
    if new.get("kind") == "load":  # (a new file may hold more rows: its shape is data too)
        was = (p.recorded_stat or {}).get("file")  # (an old record's spelling made the job's: ``prepare``)
        return same("dtype", "index", "value") and not same("sha256") and was == (p.file_stat or {}).get("file")
    oi, ni = old.get("inputs") or {}, new.get("inputs") or {}
    named = {n: (x or {}).get("tensor") for n, x in (old.get("stored_inputs") or {}).items()} \
        if isinstance(old.get("stored_inputs"), dict) else {}
    return (same("spec", "operands", "join", "agg") and set(oi) == set(ni)
            and all(oi[n] == ni[n] or n in fresh or (n in reads and named.get(n) == reads[n]["tensor"])
                    for n in ni))


def _unread_load(job: Job, name: str, shape_dtype, db) -> TiledValue:
    """A load no step still to run reads: its value, in the job's ``tile`` or a store's tile."""
    import numpy as np

    from ..plan.tiling import auto_tile

    shape, dtype = shape_dtype
    i = job.inputs[name]
    tile_bytes = db.store_tile_bytes if db is not None else job.tile_bytes
    tile = i.tile or (auto_tile(tuple(shape), np.dtype(dtype).itemsize, tile_bytes,
                                square=getattr(db, "store_square", False)) if tile_bytes else tuple(shape))
    return TiledValue(name, tuple(shape), dtype, tuple(tile), tuple(f"d{k}" for k in range(len(shape))))


def _status(db, p: Part, row: dict | None) -> None:
    cur = db.backend.lookup(p.name)
    if cur is None:
        if _plain_table_exists(db, p.name):
            p.status, p.why = "blocked", (f"the database has a table or view named {p.name!r} that is not a stored "
                                          "tensor (rename the step, or drop that table)")
        else:
            p.status = "todo"  # nothing stored to lose (a pending row: killed before it committed)
        return
    want = p.detail["result"] if p.kind == "step" else p.detail
    # the shape and dtype: the tiles a done result is stored in are read as they are
    matches = (list(cur.shape), cur.dtype) == (want["shape"], want["dtype"])
    if row is None:
        p.status, p.why = "conflict", f"tensor {cur.name!r} is stored in the database, but no job wrote it"
    elif row["fingerprint"] != p.fingerprint:
        p.status, p.why = "changed", changes(row["detail"], p.detail)
    elif not matches:
        p.status, p.why = "changed", (f"stored tensor {cur.name!r} ({cur.shape} {cur.dtype}) is not what the job "
                                      "wrote there")
    elif row["state"] == "done" and row.get("content_md5") != content_md5(db, cur):
        p.status, p.why = "changed", (f"stored tensor {cur.name!r} was replaced since the job wrote it (its tiles "
                                      "differ from what the job recorded)")
    else:
        p.status = "done"
        p.committed_not_done = row["state"] != "done"


def changes(old: dict, new: dict) -> str:
    """What differs between two fingerprints' details, in words."""
    out = []
    if old.get("form") != new.get("form"):
        return ("recorded by an earlier eindecomp_sql, whose fingerprints covered the plan's tiles too (run with "
                "--force once)")
    if old.get("kind") != new.get("kind"):
        return f"it was {'a loaded file' if old.get('kind') == 'load' else 'a step'} and is now " \
               f"{'a loaded file' if new.get('kind') == 'load' else 'a step'}"
    for k in ("spec", "operands", "join", "agg"):
        if old.get(k) != new.get(k):
            out.append(f"{k} {old.get(k)!r} -> {new.get(k)!r}")
    if old.get("sha256") != new.get("sha256"):
        out.append("the file's content changed")
    for k in ("shape", "dtype", "index", "value"):  # (the tiles a part is stored in are no change)
        if (k in new or k in old) and old.get(k) != new.get(k):
            out.append(f"{k} {old.get(k)} -> {new.get(k)}")
    if "result" in new and old.get("result") != new.get("result"):
        r0, r1 = old.get("result") or {}, new["result"]
        out.append("result " + ", ".join(f"{k} {r0.get(k)} -> {r1.get(k)}" for k in r1 if r0.get(k) != r1.get(k)))
    defined = any(old.get(k) != new.get(k) for k in ("spec", "operands", "join", "agg"))
    oi, ni = old.get("inputs") or {}, new.get("inputs") or {}
    changed = [n for n in ni if n in oi and oi[n] != ni[n]]
    if changed:
        out.append(f"input{'s' if len(changed) > 1 else ''} {', '.join(changed)} changed")
    added = [n for n in ni if n not in oi]
    if added and not defined:
        out.append(f"reads {', '.join(added)} now")
    if old.get("version") != new.get("version"):
        out.append(f"package version {old.get('version')} -> {new.get('version')}")
    return "; ".join(out) or "its fingerprint changed"


def refusal(prep: Prepared) -> JobError:
    """The error ``run`` gives (without --force) when stored results do not match the job."""
    items, blocked = [], False
    for p in prep.problems():
        at = f" (line {p.line})" if p.line is not None else ""
        items.append(f"{p.what}{at}: {p.why}")
        blocked |= p.status == "blocked"
    changed = any(p.status == "changed" for p in prep.problems())
    head = ("the job changed since its results were stored" if changed else
            "the job would replace stored tensors that no job wrote")
    tail = "" if blocked else ". Run with --force to recompute these (their stored tensors are replaced)"
    if not blocked and all(p.new_data for p in prep.problems()):
        tail = (". Only input data changed: run with --refresh to recompute these (--refresh still refuses an "
                "edited job; --force recomputes anything)")
    return JobError(f"{head}: " + "; ".join(items) + tail, prep.job.path)


# -- running -----------------------------------------------------------------------------------
class Reporter:
    """What the runner tells whoever watches; the command line draws bars or writes lines."""

    def skipped(self, part: Part, k: int, n: int) -> None: ...

    def started(self, part: Part, k: int, n: int) -> None: ...

    def progress(self, part: Part, k: int, n: int, tiles_done: int, tiles: int, bytes_done: int,
                 elapsed: float) -> None: ...

    def finished(self, part: Part, k: int, n: int, seconds: float) -> None: ...


def _max_rss() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


def entry(p: Part, skipped: bool, seconds: float) -> dict:
    return {"name": p.name, "kind": p.kind, "line": p.line, "skipped": skipped, "seconds": round(seconds, 4),
            "tiles": p.tiles, "bytes": _nbytes(p.value), "projected_peak_bytes": p.peak,
            "max_rss_bytes": _max_rss(), "fingerprint": p.fingerprint}


class Runner:
    def __init__(self, db, prep: Prepared, reporter: Reporter | None = None):
        self.db = db
        self.prep = prep
        self.reporter = reporter or Reporter()
        self.cur = db.connection.cursor()
        self.cur.execute(SCHEMA)
        self.entries: list[dict] = []
        self.watched = False  # a step ran with a progress callable (see close())

    def run(self) -> list[dict]:
        parts = self.prep.parts
        n = len(parts)
        for k, p in enumerate(parts, 1):
            if p.status == "done":
                if p.committed_not_done:  # (4) for a run killed after (3): record its md5 now, so a
                    # result replaced by hand from here on is found changed, as for any done part
                    self._write(p, "done", md5=content_md5(self.db, self.db.tensor(p.name)))
                elif p.kind == "load" and p.file_stat != p.recorded_stat:
                    # re-hashed (touched, or the job moved) and found the same: the size, mtime and
                    # path now, so the next run trusts them (a trial: every run hashed it again)
                    self._guarded(p, lambda: self.cur.execute(f"UPDATE {TABLE} SET file_stat = ? WHERE tensor = ?",
                                                              [json.dumps(p.file_stat), p.name.lower()]))
                self.reporter.skipped(p, k, n)
                self.entries.append(entry(p, True, 0.0))
                continue
            self.entries.append(self._run(p, k, n))
        return self.entries

    def _write(self, p: Part, state: str, seconds=None, md5=None) -> None:
        self._guarded(p, lambda: self.cur.execute(
            f"INSERT OR REPLACE INTO {TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, now(), ?)",
            [p.name.lower(), p.name, p.kind, str(self.prep.job.path), p.fingerprint,
             json.dumps(p.detail, sort_keys=True), json.dumps(p.file_stat) if p.file_stat else None, state,
             seconds, p.tiles if seconds is not None else None, _nbytes(p.value) if seconds is not None else None,
             p.peak, md5]))

    def _guarded(self, p: Part, write) -> None:
        """A write of the job's own records: the disk full or the WAL not writable is the part's
        failure, said with its file, line and step (an "internal error" naming nothing before)."""
        import duckdb

        try:
            write()
        except duckdb.Error as e:
            raise JobError(f"could not record its state in {TABLE}: {_one_line(e)}", self.prep.job.path, p.line,
                           step=p.name if p.kind == "step" else None,
                           input=p.name if p.kind == "load" else None) from None

    def _run(self, p: Part, k: int, n: int) -> dict:
        from . import files

        self.reporter.started(p, k, n)
        _hook("start", p.name)
        if p.status in ("changed", "conflict"):  # prepare() found a result; the file is ours alone
            self.db.drop(p.name)  # (1) the old result goes before the new fingerprint is written
        _hook("dropped", p.name)
        self._write(p, "pending")  # (2)
        _hook("pending", p.name)
        t0 = time.perf_counter()
        try:
            if p.kind == "load":
                files.store_file(self.db, p.name, p.source.file, tile=p.value.tile, dtype=p.source.dtype,
                                 keys=p.value.keys, **p.source.table_options())  # (3)
                self.reporter.progress(p, k, n, p.tiles, p.tiles, _nbytes(p.value), time.perf_counter() - t0)
            else:
                self.watched = True
                self.db.run_graph_plan(p.gplan, p.bind, out={p.name: p.name}, progress=self._watch(p, k, n))  # (3)
        except JobError:
            raise
        except EinsumError as e:  # say which part of which file failed
            raise JobError(_one_line(e), self.prep.job.path, p.line, step=p.name if p.kind == "step" else None,
                           input=p.name if p.kind == "load" else None) from e
        seconds = time.perf_counter() - t0
        _hook("committed", p.name)
        self._write(p, "done", seconds, content_md5(self.db, self.db.tensor(p.name)))  # (4)
        _hook("done", p.name)
        self.reporter.finished(p, k, n, seconds)
        return entry(p, False, seconds)

    def _watch(self, p: Part, k: int, n: int):
        """A ``progress=`` callable adding up the sub-plan's steps into one count for the part."""
        totals = [output_tiles(s) for s in p.gplan.plan.steps]
        before = [sum(totals[:j]) for j in range(len(totals))]
        all_tiles = sum(totals)
        done_bytes: dict[int, int] = {}

        def watch(sp) -> None:
            _hook("progress", p.name)
            done_bytes[sp.step] = max(done_bytes.get(sp.step, 0), sp.bytes_done)
            self.reporter.progress(p, k, n, before[sp.step - 1] + sp.tiles_done, all_tiles,
                                   sum(done_bytes.values()), sp.elapsed)

        return watch

    def close(self) -> None:
        try:
            self.cur.close()
        except Exception:  # noqa: BLE001
            pass
        if self.watched:
            settle_watchdog()


def settle_watchdog() -> None:
    """Wait one progress tick. The watchdog thread (backends/running.py) keeps the last plan's
    job, and with it the session's cursor, in a local variable until its next tick (up to 0.1 s
    after the plan); a process that exits within that tick makes DuckDB's binding print
    'nanobind: leaked ...' warnings at shutdown. Harmless, but not one clean line of output."""
    from ..backends.running import TICK_SECONDS

    time.sleep(TICK_SECONDS * 1.5)
