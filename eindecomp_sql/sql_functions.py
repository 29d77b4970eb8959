"""The SQL table functions' planner: ``einsum``, ``einsum_elements`` and ``einsum_topk`` as DuckDB
table macros call it (through the ``eds_einsum_sql`` UDF) to turn their arguments into one query.

>>> import eindecomp_sql as eds, numpy as np
>>> db = eds.connect()
>>> _ = db.store("A", np.arange(6.0).reshape(2, 3))
>>> db.connection.sql("SELECT * FROM einsum_topk('ij->ij', 2, 'A')").fetchall()
[(0, 1, 2, 2.0), (0, 2, 1, 1.0), (1, 1, 2, 5.0), (1, 2, 1, 4.0)]

Operands are names: a stored tensor (the catalog is asked first), else an ordinary table or view
in element form or with a fixed-size array column (``compile/sql_interface.py`` has the rules).
Stitches the layers like the session does: resolve operands, plan, compile; no SQL of its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from .backends.tables import read_table_operand
from .compile.sql_interface import (
    SQL_TYPES,
    ArrayTable,
    array_tile,
    fuses_topk,
    interface_query,
    settle_shapes,
)
from .errors import EinsumError
from .notation.checks import check_name
from .plan import TiledValue, plan_einsum
from .plan.steps import format_bytes

MODES = ("tiles", "elements", "topk")
_COUNT = re.compile(r"^\s*\+?\d+(\.0*)?\s*$")  # 2.0 too: a whole number (DuckDB passes 2.0 as text)



MAX_OPERANDS = 8  # sql_templates/macros.sql: o0 .. o7, then "join" and agg

def _names(names: list) -> list[str]:
    """The operand names given, in order; a NULL between two names is an error, not skipped."""
    names = list(names or [])
    while names and names[-1] is None:
        names.pop()
    if not names:
        raise EinsumError("einsum(): no operand given; name a stored tensor or a table after the spec")
    for p, n in enumerate(names):
        if n is None:
            raise EinsumError(f"einsum(): operand {p} is NULL but operand {p + 1} is given")
    return names


def _k_and_order(k) -> tuple[int, bool]:
    """``einsum_topk``'s k and ``largest`` as its macro passes them: ``'<k>;<largest>'`` (both
    cast to text in SQL, so a wrong type gets our message), or a bare k (largest)."""
    text, sep, largest = str(k).rpartition(";") if k is not None else ("", "", "")
    if not sep:
        return _k(k), True
    if largest.strip().lower() not in ("true", "false"):
        raise EinsumError(f"einsum_topk(): largest must be true or false, got {largest!r}")
    return _k(text if text != "NULL" else None), largest.strip().lower() == "true"


def _k(k) -> int:
    if k is None or not _COUNT.match(str(k)) or int(str(k).strip().split(".")[0]) < 1:
        raise EinsumError(f"einsum_topk(): k must be a whole number >= 1, got {k!r}")
    return min(int(str(k).strip().split(".")[0]), 1 << 62)


def check_not_qualified(name) -> None:
    """A dotted operand name (``s.t``, ``db.s.t``) refused, saying what to do instead."""
    if isinstance(name, str) and "." in name:
        raise EinsumError(f"einsum(): operand {name!r} names a table of another schema or database; einsum reads "
                          "tables of the main schema by name: make a view there (CREATE VIEW v AS SELECT * FROM "
                          f"{name})")


def _resolve(session, name: str):
    check_not_qualified(name)
    # a stored tensor or a table: named so (a table "my table" was "an invalid tensor name")
    check_name(name, "tensor or table name")
    value = session.backend.lookup(name)
    if value is not None:
        return value
    op = read_table_operand(session.backend.con, name, getattr(session.backend, "home", None))
    if op is None:
        raise EinsumError(
            f"einsum(): no stored tensor named {name!r}, nor a table or view (einsum reads tables from another "
            "connection to the database: TEMP tables, DataFrames registered on this connection and tables "
            "created in a transaction not yet committed are not visible; use CREATE TABLE / CREATE VIEW "
            "and COMMIT)")
    return op


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_dense(session, op) -> None:
    """A table is tiled dense: refuse one whose dense form cannot fit (a sparse table with large
    indices would otherwise run for hours writing zeros)."""
    nbytes = math.prod(op.shape) * np.dtype(op.dtype).itemsize
    limit = session.memory or _memory_bytes()
    if limit is not None and nbytes > limit:
        what = "the session's memory budget" if session.memory else "this machine's memory"
        raise EinsumError(
            f"einsum(): {op.describe()} is read as a dense {op.shape} {op.dtype} tensor of {format_bytes(nbytes)}, "
            f"more than {what} ({format_bytes(limit)}); einsum computes on dense tiles (renumber the indices "
            "densely, or select a part of the table in a view)")


def _said_of_tables(e: EinsumError, tables: dict) -> EinsumError:
    """``e`` with the tables the plan read under internal names (``_eds_op0``, ...) named as
    the user wrote them; its advice to re-store one in other tiles (which a table is not)
    replaced by what applies (a trial: "store '_eds_op0' with tile=(50000, 1)")."""
    text = str(e)
    for cte, op in tables.items():
        q = re.escape(repr(cte))
        text = re.sub(rf"store {q} again in tiles of \([0-9, ]*\) \(db\.store\({q}, <its source data>, .*? holds ~3x "
                      rf"{q}'s bytes\)",
                      "give a smaller tile_bytes (a table is cut into tiles of up to tile_bytes)", text)
        text = text.replace(f"stored {cte!r}", op.describe()).replace(repr(cte), op.describe())
        text = re.sub(rf"\b{re.escape(cte)}\b", f"table {op.table!r}", text)  # in a step's description
    return e if text == str(e) else type(e)(text)


def table_values(session, spec: str, operands: list) -> tuple[list, list[TiledValue], dict]:
    """``operands`` (plan values, and tables of the database as ``read_table_operand`` reads
    them) as plan values: each table sized by the spec (``settle_shapes``), refused where its
    dense form cannot fit, and named ``_eds_op<n>``, one value per table and shape. Returns the
    settled operands, the values, and each table's value name -> the table operand."""
    operands = settle_shapes(spec, operands)
    for op in operands:
        if not isinstance(op, TiledValue):
            _check_dense(session, op)
    values, tables = [], {}  # tables: value (CTE) name -> the table operand it tiles
    by_name: dict[tuple, TiledValue] = {}
    for op in operands:
        if isinstance(op, TiledValue):
            values.append(op)
            continue
        # one tiling per table and shape: a table used twice may be grown to two shapes
        key = (op.table.lower(), op.shape)
        if key not in by_name:
            cte = f"_eds_op{len(by_name)}"
            # whole rows, as many as a stored tensor's tile may hold (under a budget, sized from it:
            # one tile of a 154 MB table under memory="1GB" ran DuckDB out of memory, a trial)
            tile = array_tile(op, session.store_tile_bytes) if isinstance(op, ArrayTable) else None  # None: the plan cuts it
            # named after its CTE: the plan tells values apart by name, and one table may be two
            by_name[key] = TiledValue(cte, op.shape, op.dtype, tile, tuple(f"d{p}" for p in range(op.ndim)))
            tables[cte] = op
        values.append(by_name[key])
    return operands, values, tables


# one top-k candidate as DuckDB holds it: the kernel's (row, index, value) struct is 24 B, but
# unnested, ranked by the window and sorted it costs ~90-115 B of resident memory (k = 20,000
# over 150 x 20,000: +252 MiB for 3M candidates; 300 x 20,000: +598 MiB for 6M, plan included;
# a budget trial: ~115 B). Counted at 24 B, such a query was admitted and rose 1.8x the budget
CANDIDATE_BYTES = 100


def candidate_bytes(result: TiledValue, k: int) -> int:
    """What ``einsum_topk``'s candidates take: up to ``k`` a row of every result tile
    (``CANDIDATE_BYTES`` each, as DuckDB's window holds them), which the fused kernel returns
    for its call and the window holds for the query."""
    r = result
    return (math.prod(r.shape[:-1]) * -(-r.shape[-1] // r.tile[-1]) * min(k, r.tile[-1]) * CANDIDATE_BYTES
            if r.tile[-1] else 0)


def streamed_costs(model):
    """``model`` for a plan whose one einsum's results never leave its kernel (a fused top-k):
    one statement a step, no partial results."""
    return dataclasses.replace(model, streamed_result=True, splits_reductions=False)


def _streamed_topk_plan(session, spec, values, join, agg, k: int, budget: int | None = None):
    """A plan of ``einsum_topk``'s product for a result bigger than the session's budget, or
    None: one einsum step whose kernel is fused with the top-k (``fuse_topk``), so its result
    tiles never leave the kernel, which computes them a slice at a time and keeps only each
    row's ``k`` candidates (``CostModel.streamed_result``). Planned under the budget with that
    model, it is one query; the ordinary plan ran the product as several statements, each
    holding its share of the result, which one query cannot (it was refused, with a memory=
    the size of the whole result: an embeddings trial). ``budget``: a plans' share other than
    the session's (``_least_memory``)."""
    from .compile.sql_interface import _EXACT_IN_DOUBLE
    from .plan.steps import EinsumStep

    budget = session.plan_budget if budget is None else budget
    model = streamed_costs(session.backend.cost_model)
    try:
        plan = plan_einsum(spec, tuple(values), join, agg, workers=session.workers, budget=budget,
                           tile_bytes=session.tile_bytes, costs=model)
    except EinsumError:
        return None
    einsums = [s for s in plan.steps if isinstance(s, EinsumStep)]
    if (len(einsums) != 1 or plan.steps[-1] is not einsums[0] or any(s.batches > 1 for s in plan.steps)
            or plan.result.dtype not in _EXACT_IN_DOUBLE or not plan.result.shape):
        return None
    # the candidates counted: uncounted, a k as wide as a tile made every element one: 25x a
    # float32 result at ~100 B each (a review)
    if max(s.peak(model) for s in plan.steps) + candidate_bytes(plan.result, k) > budget:
        return None
    return plan if fuses_topk(plan, session.backend.compiler) else None


def _tables_tiled_under(session, values: list, tables: dict, memory: int) -> list:
    """``values`` with each array table cut as ``table_values`` cuts it in a session of
    ``memory=``: whole rows up to the store tile of that budget (``store_tile_bytes_under``)."""
    cap = session.store_tile_bytes_under(memory)
    return [dataclasses.replace(v, tile=array_tile(tables[v.name], cap))
            if isinstance(tables.get(v.name), ArrayTable) else v for v in values]


def _least_memory(session, spec, values, join, agg, k: int, held: int, tables: dict) -> str:
    """The ``memory=`` to name in a refusal of ``einsum_topk``: the least under which its
    streamed plan is one query, or else the one holding the plan with its candidates
    (``held``). The whole product's figure named 4.4 GB where 500MB ran it (top-5 over 2000 x
    100,000, a trial). Found by halving the gap between a share that does not stream and one
    that does, to within ~6% (each try is a plan: ~10-50 ms, on a refusal only), each share with
    the table operands cut as its ``memory=`` cuts them (a review: with the session's cuts, the
    figure named was refused again, its tables cut bigger), and checked as it is printed."""
    from .plan.cost import BUDGET_SHARE, parse_memory, plan_share, rounded_up

    def streams(share: int) -> bool:
        tiled = _tables_tiled_under(session, values, tables, int(share / BUDGET_SHARE))
        return _streamed_topk_plan(session, spec, tiled, join, agg, k, share) is not None

    hi = held
    if streams(hi):
        lo = session.plan_budget or 1
        while hi > lo * 1.06:
            mid = int(math.sqrt(lo * hi))
            if streams(mid):
                hi = mid
            else:
                lo = mid
        for _ in range(8):  # as printed (rounded up), the figure itself must stream
            if streams(plan_share(parse_memory(rounded_up(hi / BUDGET_SHARE)))):
                break
            hi = int(hi * 1.06)
    return rounded_up(hi / BUDGET_SHARE)


def _candidates_within(session, spec, values, join, agg, plan, k: int, tables) -> tuple:
    """``(plan, False)`` for a top-k that fits the session's budget, or else its streamed plan where
    its candidates fit with it, ``True``; refused otherwise. The query's window holds every candidate
    at once (up to ``k`` a row of every result tile), which the plan's steps do not count: a
    ``k`` near a tile's width makes every element a candidate, ~100 B in DuckDB where a float32 holds 4
    (k=20000 over a 150 x 20000 float32 result rose resident memory by 153 MiB under
    memory="100MB"). ``db.topk`` prunes them as they come, a batch at a time."""
    model = session.backend.cost_model
    held = max(s.peak(model) for s in plan.steps) + candidate_bytes(plan.result, k)
    if held <= session.plan_budget:
        return plan, False
    streamed = _streamed_topk_plan(session, spec, values, join, agg, k)
    if streamed is not None:
        return streamed, True

    candidates = candidate_bytes(plan.result, k)
    raise _said_of_tables(EinsumError(
        f"einsum_topk(): under the session's memory budget of {format_bytes(session.memory or 0)} its window "
        f"would hold {format_bytes(candidates)} of candidates (up to k = {k} a row of every "
        f"result tile, ~{CANDIDATE_BYTES} B each in DuckDB's window) beside the plan's {format_bytes(held - candidates)}, "
        f"over the plans' share of {format_bytes(session.plan_budget)}; db.topk(...) from Python ranks them a batch "
        f"at a time within the budget; or a smaller k, or connect with memory= of at least "
        f"{_least_memory(session, spec, values, join, agg, k, held, tables)}"), tables)


def einsum_sql(session, spec, names: list, mode: str, join=None, agg=None, k=None, own: bool = False) -> str:
    """The query answering ``einsum(spec, names...)`` in ``mode`` (tiles, elements or topk);
    ``own``: for the session to run as a call of its own (``db.topk``), not for the user's SQL."""
    if mode not in MODES:
        raise EinsumError(f"einsum(): unknown mode {mode!r}")
    if spec is None:
        raise EinsumError("einsum(): the spec is NULL")
    count, largest = _k_and_order(k) if mode == "topk" else (None, True)
    wanted = str(spec).split("->")[0].count(",") + 1
    if wanted > MAX_OPERANDS:  # (it said "9 operand(s) but 8 operand(s) were given": a documentation audit)
        raise EinsumError(f"einsum(): the spec {spec!r} names {wanted} operands, but einsum() takes at most "
                          f"{MAX_OPERANDS} (the Python API, db.einsum, takes any number)")
    operands, values, tables = table_values(session, spec, [_resolve(session, n) for n in _names(names)])
    try:
        try:
            plan = session._plan(spec, values, join, agg)
        except EinsumError as e:
            raise _said_of_tables(e, tables) from None
    except EinsumError as e:
        if len(operands) == MAX_OPERANDS and str(e).startswith(("unknown join", "unknown agg")):
            # a 9th (10th) name is read as the join (aggregation): "unknown join 'A'" alone
            # sent a new user looking at the wrong argument
            raise EinsumError(f"{e} (einsum() takes at most {MAX_OPERANDS} operands: the argument after the "
                              f"{MAX_OPERANDS}th is the join, the next the aggregation)") from None
        if "operand" not in str(e):
            raise
        # in SQL the operands are names: say which is which
        named = "; ".join(
            f"{p} = {op.describe() if not isinstance(op, TiledValue) else f'stored tensor {op.name!r}'}, "
            f"shape {op.shape}" for p, op in enumerate(operands))
        raise EinsumError(f"{e}\n    operands: {named}") from None
    check = getattr(session.backend, "check_tables", None)
    if check is not None:  # stored tensors edited out of shape in SQL: refused, as db.einsum refuses them
        check([(v, v.name) for v in plan.inputs if v.name not in tables])
    batched = [(k, s) for k, s in enumerate(plan.steps) if s.batches > 1]
    stream = False
    if batched and mode == "topk":
        streamed = _streamed_topk_plan(session, spec, values, join, agg, count)
        if streamed is not None:
            plan, batched, stream = streamed, [], True
    if batched:
        # a step over the budget runs as several statements, each committed before the next,
        # which is what keeps it within the budget; one query would hold all of it at once
        k, s = batched[0]
        if mode == "topk":
            # "call db.einsum(...)" led nowhere (a trial): db.topk runs the statements one after
            # another; or the memory= under which the plan is one query

            whole = plan_einsum(spec, tuple(values), join, agg, workers=session.workers, budget=None,
                                tile_bytes=session.tile_bytes, costs=session.backend.cost_model)
            # with its window's candidates: without them, the memory= named was refused again
            need = _least_memory(session, spec, values, join, agg, count,
                                 whole.peak_bytes + candidate_bytes(whole.result, count), tables)
            raise _said_of_tables(EinsumError(
                f"einsum_topk(): under the session's memory budget of {format_bytes(session.memory or 0)} the plan "
                f"runs step {k} ({s.describe()}) as {s.batches} statements, but a SQL table function is one query, "
                f"which db.topk(...) from Python runs one after another; or connect with memory= of at least "
                f"{need}, or rank fewer rows a query (WHERE on a smaller table of queries)"), tables)
        raise _said_of_tables(EinsumError(
            f"einsum(): under the session's memory budget of {format_bytes(session.memory or 0)} the plan runs step {k} "
            f"({s.describe()}) as {s.batches} statements, but a SQL table function is one query; call "
            "db.einsum(...) from Python, which runs them one after another, or connect with a larger memory="),
            tables)
    if mode == "topk" and not stream and session.plan_budget is not None and plan.result.shape:
        plan, stream = _candidates_within(session, spec, values, join, agg, plan, count, tables)
    result = plan.result
    if mode == "topk":
        if not result.shape:
            raise EinsumError(f"einsum_topk(): {spec!r} has no output label to rank (a row is every output "
                              "label but the last, and the last is ranked)")
        if result.dtype not in SQL_TYPES:
            raise EinsumError(f"einsum_topk(): the result is {result.dtype}, which has no order")
    # a plan that reads no input (a label of size 0) needs no tiling of the tables
    read = tuple((v.name, tables[v.name]) for v in plan.inputs if v.name in tables)
    rewritten = tuple(sorted(v.name for v in plan.inputs if v.name not in tables and v.name.lower() in session.rewritten))
    return interface_query(plan, read, mode, count, session.backend.compiler, getattr(session.backend, "home", None),
                           rewritten, stream, largest, own)
