"""Choose the chunking of every node of a graph: EinDecomp's dynamic programming, the baseline
strategies, and an exhaustive search for testing.

A *chunking* of a node maps each of its labels to a number of pieces. Candidates are powers of
two (plus the piece counts of stored inputs), at least ``workers`` join tasks per node, and a
projected peak within the memory budget. The optimizer sees shapes only, never data.

Dynamic programming runs over the graph in topological order: for every candidate chunking of
a node it keeps the cheapest cost of the node and everything upstream of it. An edge from a
producer used by this node alone costs either nothing (the producer already makes the tiling
this node needs) or a retile of the producer's value. Values used by several nodes are where
the DAG is cut into trees: their tiling is fixed first — by enumerating all combinations when
there are few (then the result is the exact optimum), else greedily (each fixed to its
producer's best, or to a baseline's choice), refined by coordinate descent: each cut value in
turn gets its best tiling with the others held, until no change helps or a fixed number of
node evaluations is spent.

Speed (planning must cost less than running): a DP pass is a few numpy operations per edge
over arrays indexed by candidate, and each tree's result is memoized on the tilings of the
cut values it reads, so a coordinate-descent trial re-runs only the trees that read the cut
value being changed (the tree it is the root of is a lookup by tiling).

>>> from eindecomp_sql.graph import Graph
>>> g = Graph(); x = g.input("x", (256, 32)); w = g.input("w", (32, 16))
>>> y = g.einsum("bi,io->bo", x, w)
>>> choice = optimize(g.nodes, {v.name: v for v in g.inputs}, {}, workers=4)
>>> choice.pieces["v1"]            # data-parallel on the big batch label is cheapest here
{'b': 4, 'i': 1, 'o': 1}
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import EinsumError
from ..graph import EinsumNode, ValueInfo
from .cost import (DEFAULT_COSTS, CostModel, Costs, max_batches, nbytes, needed_batches, retile_max_batches,
                   retile_peak, step_costs, step_peak)
from . import partials
from .steps import format_bytes
from .tiling import Chunking, ceil_div, moves_whole_rows, pieces_of, tile_of

STRATEGIES = ("eindecomp", "data-parallel", "model-parallel", "square-tiles")
EXACT_CUT_LIMIT = 256  # enumerate cut tilings exactly up to this many combinations
MAX_PRODUCT_FACTOR = 8  # candidates have between workers and 8x workers join tasks...
# ...and a memory budget may push that up to this many, no further: cutting finer only to fit
# a budget ended in plans such as 72M tile pairs of (2, 12000) x (12000, 1) for a 12000² GEMM
# under 300 MB (still running after 600 s, numpy ~20 s). Such a budget is refused instead.
MAX_JOIN_TASKS = 1 << 14
# the price of a retile over the budget: a plan that cannot avoid one costs at least this
FORBIDDEN = 10**30
RESTORE_TRIES = 8  # re-store advice a refusal checks by planning with it (``_Problem._fewest_restores``)
BUDGET_WIDENING = 2  # under a budget, candidates go this many x4 steps finer than the first that fit
GREEDY_WORK = 4000  # node evaluations the coordinate descent may spend (not a clock)


# a stored input's uneven tile side is read as stored when within this fraction of the even
# side of its pieces (``_Problem._stored_sides``)
SIDE_SLACK = 1 / 16


@dataclass(frozen=True)
class Choice:
    """A chunking for every node and the tiling of every free input."""

    pieces: dict[str, dict[str, int]]  # node result name -> label -> pieces
    input_tiles: dict[str, tuple[int, ...]]  # free graph inputs -> tile shape
    costs: Costs = field(default_factory=Costs)
    # element-wise nodes priced as epilogues in this chunking (their producer cuts their operand
    # as they read it): the fuse pass may still refuse them (graph_plan then compares)
    priced: tuple[str, ...] = ()
    # node result name -> label -> {pieces: tile side}: a stored input's side where it is not
    # ceil(size / pieces) (``_Problem.sides``)
    sides: dict = field(default_factory=dict)

    def chunking(self, node) -> Chunking:
        """The chunking chosen for ``node`` (what the planner cuts by)."""
        c = Chunking.from_pieces(node.size, self.pieces[node.result.name])
        mine = self.sides.get(node.result.name)
        if not mine:
            return c
        p = self.pieces[node.result.name]
        return Chunking(c.sizes, tuple((lab, mine.get(lab, {}).get(p[lab], t)) for lab, t in c.tiles))


class _Problem:
    def __init__(self, nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]], workers, budget,
                 tile_bytes=None, model: CostModel = DEFAULT_COSTS, fuse_into: frozenset | None = None):  # noqa: PLR0913
        self.tile_bytes = tile_bytes
        self.model = model
        self.nodes = list(nodes)
        self.inputs = inputs
        self.fixed = fixed  # input name -> stored tile shape
        self.workers = max(1, int(workers))
        self.budget = budget
        self.values: dict[str, ValueInfo] = dict(inputs)
        for n in self.nodes:
            self.values[n.result.name] = n.result
        self.producer = {n.result.name: n for n in self.nodes}
        self.consumers: dict[str, list[tuple[EinsumNode, int]]] = {}
        for n in self.nodes:
            for k, op in enumerate(n.operands):
                self.consumers.setdefault(op.value, []).append((n, k))
        self.bytes = {name: nbytes(v.shape, v.dtype) for name, v in self.values.items()}
        self.sides = self._stored_sides()
        self.dtypes = {name: v.dtype for name, v in self.values.items()}
        # fuse_into: the plan's outputs when element-wise nodes fuse (None: they do not)
        self.epilogue = {} if fuse_into is None else self._epilogues(fuse_into)
        self._cands: dict[str, list[dict[str, int]]] | None = None
        self._tables: dict | None = None  # built on the first DP (see _build)

    def _stored_sides(self) -> dict[str, dict[str, dict[int, int]]]:
        """Per node and label, the tile side of a stored input that cuts the label into a number
        of pieces whose even side, ceil(size / pieces), it is not (node -> label -> {pieces:
        side}). Chunkings are chosen as pieces and cut by the even side; a user's round
        number (rows of 4,096 out of 200,000: 49 pieces, even side 4,082) was re-tiled by every
        plan, 3x its bytes (a trial). With this, those pieces cut by the stored side. Two
        stored inputs that cut a label into the same pieces by different sides (even or not):
        the even side. Only a side within 1/16 of the even one (``SIDE_SLACK``): peaks and costs
        count even sides, and (2000, 2000) tiles of a 2001² array, 2 pieces of even side 1001,
        were projected at a quarter of their bytes (a review: 144 MB measured under a 90 MB plan
        budget)."""
        out = {}
        for n in self.nodes:
            found: dict[str, dict[int, int | None]] = {}
            for lab, t in self._stored_axes(n):
                d = found.setdefault(lab, {})
                p = pieces_of(n.size[lab], t)
                if d.setdefault(p, t) != t:
                    d[p] = None  # two sides for these pieces: the even one
            for lab, d in found.items():
                d = {p: t for p, t in d.items() if t is not None and t != tile_of(n.size[lab], p)
                     and t <= tile_of(n.size[lab], p) * (1 + SIDE_SLACK)}
                if d:
                    out.setdefault(n.result.name, {})[lab] = d
        return out

    def side(self, node: EinsumNode, lab: str, p: int) -> int:
        """The tile side of ``lab`` cut into ``p`` pieces in ``node`` (``_stored_sides``)."""
        t = self.sides.get(node.result.name, {}).get(lab, {}).get(p)
        return t if t is not None else tile_of(node.size[lab], p)

    def _epilogues(self, keep: frozenset) -> dict[str, int]:
        """Element-wise nodes the fuse pass can run as an epilogue of the step producing their
        operand k (node name -> k) when that step cuts the operand as the node reads it: the
        conditions of ``passes/fuse.py`` that the chunking does not decide. Without this the
        optimizer priced such a node as a step of its own whatever its tiling, and under a tile
        cap it took a tiling that needed a retile in front of the node and so never fused
        (an FFN's relu under a device budget: 4 steps where 3, the relu fused, would do)."""
        found = {}
        for n in self.nodes:
            if not n.elementwise:
                continue
            for k, op in enumerate(n.operands):
                u = op.value
                if (u in self.producer and u not in keep and not op.dropped
                        and len(op.labels) == len(n.output) and set(op.labels) == set(n.output)
                        and [o.value for o in n.operands].count(u) == 1
                        and [c for c, _ in self.consumers.get(u, [])] == [n]):
                    found[n.result.name] = k
                    break
        return found

    def priced(self, pieces: dict[str, dict[str, int]]) -> tuple[str, ...]:
        """The nodes ``epilogue_saving`` applies to under ``pieces`` (their operand is always a
        value a node produces, so its tiling is that node's output tile)."""
        out = []
        for name, k in self.epilogue.items():
            node = self.producer[name]
            u = node.operands[k].value
            if self.out_tile(self.producer[u], pieces[u]) == self.required(node, k, pieces[name]):
                out.append(name)
        return tuple(out)

    def epilogue_saving(self, node: EinsumNode, pieces: dict[str, int]) -> Costs:
        """What fusing ``node`` into its producer's step saves: its own read of the operand
        and its statements (its other operands are still joined, inside the fused step)."""
        k = self.epilogue[node.result.name]
        return Costs(join=-self.bytes[node.operands[k].value], model=self.model,
                     statements=-self.statements(node, pieces))

    @property
    def cands(self) -> dict[str, list[dict[str, int]]]:
        if self._cands is None:  # only the optimizer needs them, not the baselines
            # nodes alike in everything candidates depend on (the layers of a deep network)
            # share one list; nobody edits it (chosen pieces are copied out)
            shared: dict[tuple, list[dict[str, int]]] = {}
            self._cands = {}
            for n in self.nodes:
                key = (n.output, n.sizes, n.whole, n.held, n.result.dtype, tuple(
                    (op.labels, op.dropped, self.dtypes[op.value], self.fixed.get(op.value),
                     len(self.values[op.value].shape)) for op in n.operands))
                if key not in shared:
                    shared[key] = self._candidates(n)
                self._cands[n.result.name] = shared[key]
        return self._cands

    def _node_costs(self, node: EinsumNode, pieces: np.ndarray, col: dict[str, int]) -> np.ndarray:
        """``step_costs(node, p, ...).total`` for every candidate (a row of ``pieces``) at once;
        the same sums in the same order (tests check the DP against ``evaluate``)."""
        def prod(labels):
            idx = [col[lab] for lab in labels]
            return pieces[:, idx].prod(axis=1) if idx else np.ones(len(pieces), dtype=np.int64)

        join = np.zeros(len(pieces), dtype=np.int64)
        red = prod(node.reduced)
        for op in node.operands:
            rep = prod([lab for lab in node.labels if lab not in op.labels])
            own = [col[lab] for lab in node.reduced if lab in op.labels]
            # ``step_costs``: an operand with no cut reduced label is handed once per group
            shared = (red > 1) & ((pieces[:, own] == 1).all(axis=1) if own else True) & self.model.shares_group_operands
            join += self.bytes[op.value] * np.where(shared, rep // red, rep)
        agg = nbytes(node.result.shape, node.result.dtype) * (red - 1)
        group = np.where(red > 1, join, 0)
        m = self.model
        if m.broadcast_bytes is not None and m.broadcast_bytes >= 0 and len(node.operands) == 2:
            # ``cost.repartition_label``, every candidate at once: only the left operand is grouped
            left, right = (self.bytes[op.value] for op in node.operands)
            outs = [col[lab] for lab in node.output if lab in node.operands[0].labels]
            if right <= m.broadcast_bytes and right <= left and outs:
                group = np.where((red > 1) & (pieces[:, outs] > 1).any(axis=1), left, group)
        statements = np.array([self.statements(node, dict(zip(col, row))) for row in pieces.tolist()],
                              dtype=np.int64) if self.budget is not None else 1
        total = m.join * join + m.group * group + m.agg * agg + m.statement * statements
        if node.reduced and m.splits_reductions:  # candidates run as partial and combine steps cost those
            for r, row in enumerate(pieces.tolist()):
                p = dict(zip(col, row))
                if partials.splits(node, p, self.dtypes, self.budget, m, self.bytes):
                    total[r] = self.node_cost(node, p).total
        return total

    def _axes(self, node: EinsumNode, k: int) -> tuple[str | None, ...]:
        """The label of every axis of operand ``k``'s value (None: a dropped size-1 axis)."""
        op = node.operands[k]
        it = iter(op.labels)
        return tuple(None if ax in op.dropped else next(it) for ax in range(len(self.values[op.value].shape)))

    # -- candidates -------------------------------------------------------------------------
    def _label_options(self, node: EinsumNode) -> dict[str, list[int]]:
        size = node.size
        opts: dict[str, set[int]] = {}
        for lab in node.labels:
            n = size[lab]
            tiles = {tile_of(n, 1 << e) for e in range(0, max(n - 1, 1).bit_length() + 1)}
            opts[lab] = {pieces_of(n, t) for t in tiles}
        for op in node.operands:  # the cut of a stored input is always a candidate
            if op.value in self.fixed:
                kept = [t for ax, t in enumerate(self.fixed[op.value]) if ax not in op.dropped]
                for lab, t in zip(op.labels, kept):
                    opts[lab].add(pieces_of(size[lab], t))
        for lab in node.whole:  # a fused chain's (graph/node.py): never cut
            opts[lab] = {1}
        return {lab: sorted(v) for lab, v in opts.items()}

    def _candidates(self, node: EinsumNode) -> list[dict[str, int]]:
        out = self._candidates_fitting(node, split=False)
        if not out and self.budget is not None:
            # any split only where no step fits as one otherwise: a split's partial results
            # are as big as the output per piece of the reduced labels, which a GEMM's plan
            # never needed (plan/partials.py)
            out = self._candidates_fitting(node, split=True)
        if not out:
            self._refuse(node)
        return out

    def _candidates_fitting(self, node: EinsumNode, split: bool) -> list[dict[str, int]]:
        opts = self._label_options(node)
        labels = list(node.labels)
        most = math.prod(max(v) for v in opts.values())
        lo = min(self.workers, most)
        hi = max(lo, self.workers) * MAX_PRODUCT_FACTOR
        cap = max(hi, MAX_JOIN_TASKS)
        extra = BUDGET_WIDENING if self.budget is not None else 0
        while True:
            out = []
            for combo in _bounded_products([opts[lab] for lab in labels], lo, hi):
                pieces = dict(zip(labels, combo))
                if self._fits(node, pieces, split):
                    out.append(pieces)
            if hi >= min(most, cap):
                break
            if out:
                # under a budget, finer cuts than the first that fit stay candidates: the
                # coarsest chunkings of two neighbours may only meet through a retile over the
                # budget (an FFN whose 256 MB intermediate planned under 128 MB and not 160 MB)
                if extra == 0:
                    break
                extra -= 1
            hi = min(hi * 4, cap)  # ...unless the memory budget needs finer cuts
        # the baselines' chunkings are always candidates, so EinDecomp never costs more
        for strategy in STRATEGIES[1:]:
            p = baseline_pieces(strategy, node, self.workers)
            if p not in out and self._fits(node, p, split):
                out.append(p)
        # so is reading stored inputs as they are cut, where their cuts agree: under a budget
        # the first candidates that fit may all need a re-tile over it (a 2048² GEMM of
        # 128x128 stored tiles under 25 MB was refused with i:16 j:16 k:16 never tried)
        stored = self._stored_pieces(node)
        if stored is not None and stored not in out and self._fits(node, stored, split):
            out.append(stored)
        if node.whole:  # a baseline's or a stored cut may cut what a fused chain needs whole (and,
            # with those labels put back to one piece, leave fewer join tasks than workers)
            out = [p for p in out if all(p[lab] == 1 for lab in node.whole) and math.prod(p.values()) >= lo]
        return out

    def _refuse(self, node: EinsumNode) -> None:
        """Raise the EinsumError that says why no chunking of ``node`` is a candidate."""
        labels = list(node.labels)
        cap = max(self.workers * MAX_PRODUCT_FACTOR, MAX_JOIN_TASKS)  # as _candidates_fitting's
        if self.budget is None:  # only the tile cap can refuse every candidate
            item = max(np.dtype(self.dtypes[v]).itemsize for v in {node.result.name, *(o.value for o in node.operands)})
            raise EinsumError(
                f"no chunking of node {node.describe()} -> {node.result.name} keeps the tiles it makes under "
                f"tile_bytes = {format_bytes(self.tile_bytes)} with at most {cap} tile tuples per step (one element "
                f"takes up to {item} B); give a larger tile_bytes")
        peaks = self._peaks(node)
        smallest, pieces = min(peaks, key=lambda t: t[0])
        restore: dict[str, tuple[int, ...]] = {}
        if smallest <= self.budget:
            # what it says to store is the coarsest chunking whose step fits, not the one of the
            # smallest peak: a 144 MB stored tile was told to be stored as tile=(6, 6007)
            fitting = sorted(((peak, p) for peak, p in peaks if peak <= self.budget),
                             key=lambda t: (math.prod(t[1].values()), t[0]))
            peak, pieces = fitting[0]
            # ... among those that re-storing the fewest operands lets plan: the coarsest alone
            # re-tiled both operands of a GEMM, and the advice named the one whose re-store did
            # not help (a budget trial: A named, re-storing B alone ran)
            found = self._fewest_restores(node, fitting)
            if found is not None:
                peak, pieces, restore = found
        # the cap on tiles, where it is what keeps the peak up (next to a 1 MB budget, "tiles
        # capped at 789.6 MB" only confused a trial)
        capped = ('' if self.tile_bytes is None or self.tile_bytes >= smallest
                  else f' (tiles capped at {format_bytes(self.tile_bytes)})')
        head = (f"no chunking of node {node.describe()} -> {node.result.name} fits the memory budget of "
                f"{format_bytes(self.budget)}: ")
        if smallest <= self.budget:  # the step fits; what it reads or makes does not (a new user's
            # report: "the smallest projected peak is 537 MB" against a budget of 1.2 GB, and no why)
            restore = restore or self._restores(node, pieces)
            why, advice = self._why_not(node, pieces, restore)
            capped = capped if "tile_bytes" in why else ""  # (the cap is what refuses, or says nothing)
            error = EinsumError(head + f"the step itself fits ({format_bytes(peak)} at "
                                f"{' '.join(f'{lab}:{pieces[lab]}' for lab in labels)}), but {why}{capped}; "
                                f"{advice}")
            if restore:  # "or give more memory": how much, for a chunking with its re-tiles (a session
                # says it in its memory=: "fits the memory budget of 60.0 MB" under memory="100MB" is
                # the plans' share, a trial)
                needed = min(max([at] + [self._retile_peak(node.operands[k].value, need)
                                         for k, need in self._stored_retiles(node, p)]) for at, p in peaks)
                error.needed = needed
                others = [n for n in self.nodes if n is not node]
                error.needed_by_all = lambda: max([needed] + [min(at for at, _ in self._peaks(n)) for n in others])
            raise error
        error = EinsumError(
            head + f"the smallest projected peak with at most {cap} tile tuples per step is "
            f"{format_bytes(smallest)}{capped}; give more memory"
        )
        # what a budget must be at least (a session says it in its memory=): every node's
        # smallest peak, not this one's only (at the figure said for a graph's first node its
        # next was refused with a bigger one: a trial)
        error.needed = smallest
        # computed only where a session says it (a plan's fusion attempt and the pipeline's
        # retry catch refusals: eagerly, a 60-node chain's refusal took 16x as long, a review)
        others = [n for n in self.nodes if n is not node]
        error.needed_by_all = lambda: max([smallest] + [min(p for p, _ in self._peaks(n)) for n in others])
        raise error

    def _peaks(self, node: EinsumNode) -> list[tuple[int, dict[str, int]]]:
        """The smallest projected peak of each chunking of ``node`` a refusal weighs."""
        opts = self._label_options(node)
        labels = list(node.labels)
        cap = max(self.workers * MAX_PRODUCT_FACTOR, MAX_JOIN_TASKS)  # as _candidates_fitting's
        return [(self._best_peak(node, p), p) for p in
                (dict(zip(labels, c)) for c in _bounded_products([opts[lab] for lab in labels], 1, cap))]

    def _stored_pieces(self, node: EinsumNode) -> dict[str, int] | None:
        """Pieces of every label as the node's stored inputs are cut (None: a label no stored
        input has, or two that cut one label differently)."""
        pieces: dict[str, int] = {}
        for lab, t in self._stored_axes(node):
            p = pieces_of(node.size[lab], t)
            if pieces.setdefault(lab, p) != p:
                return None
        return pieces if set(pieces) == set(node.labels) else None

    def _stored_axes(self, node: EinsumNode):
        """``(label, tile side)`` of every labelled axis of the node's stored operands."""
        for k, op in enumerate(node.operands):
            tile = self.fixed.get(op.value)
            if tile is not None:
                yield from ((lab, t) for lab, t in zip(self._axes(node, k), tile) if lab is not None)

    def _best_peak(self, node: EinsumNode, pieces: dict[str, int], split: bool = True) -> int:
        """The smallest projected peak of the node's step(s) under ``pieces``: as one step, or,
        where that is over the budget and it can, as partial and combine steps
        (``plan/partials.py``): always with ``split``, else where the partial results are small
        (a reduction to a small output; ``partials.small_partials``)."""
        peak = step_peak(node, pieces, self.dtypes, max_batches(node, pieces, self.model), self.model)
        if (self.budget is not None and peak > self.budget and partials.can_split(node, pieces, self.model)
                and (split or partials.small_partials(node, pieces, self.bytes, self.budget))):
            return min(peak, partials.split_peak(node, pieces, self.dtypes, self.model))
        return peak

    def _stored_retiles(self, node: EinsumNode, pieces: dict[str, int]):
        """``(k, tile)`` of every stored operand ``pieces`` reads in other tiles than stored."""
        for k, op in enumerate(node.operands):
            have, need = self.fixed.get(op.value), self.required(node, k, pieces)
            if have is not None and have != need:
                yield k, need

    def _restores(self, node: EinsumNode, pieces: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """The stored operands ``pieces`` re-tiles over the budget (``_fits`` refuses it for
        them) -> the tiles it reads them in: what to store them in again."""
        out: dict[str, tuple[int, ...]] = {}
        for k, need in self._stored_retiles(node, pieces):
            value = node.operands[k].value
            if self.retile(value, need).retile >= FORBIDDEN:
                out.setdefault(value, need)  # (a value read in two tilings: no re-store serves both)
        return out

    def _fewest_restores(self, node: EinsumNode, fitting: list) -> tuple | None:
        """``(peak, pieces, restores)`` of the chunking among ``fitting`` (``(peak, pieces)``,
        coarsest first) whose ``_restores`` are fewest (then fewest bytes) and, stored again so,
        let the node plan (checked: a planner with those tiles finds a candidate); None where
        no re-store tried does. The coarsest fitting chunking may re-tile operands that another
        reads as stored; advice from it sent a user to re-store the wrong one."""
        # then the fewest re-tiles that fit, so the operands not named are read as stored
        ranked = sorted(((self._restores(node, p), peak, p) for peak, p in fitting),
                        key=lambda t: (len(t[0]), sum(self.bytes[v] for v in t[0]),
                                       len(list(self._stored_retiles(node, t[2])))))  # stable: coarsest first
        tried = set()
        for restore, peak, p in ranked:
            key = tuple(sorted(restore.items()))
            if not restore or key in tried:
                continue
            if len(tried) == RESTORE_TRIES:  # (each try costs about what the refusal's search did)
                break
            tried.add(key)
            after = _Problem(self.nodes, self.inputs, {**self.fixed, **restore}, self.workers, self.budget,
                             self.tile_bytes, self.model)
            if after._candidates_fitting(node, split=False) or after._candidates_fitting(node, split=True):
                return peak, p, restore
        return None

    def _why_not(self, node: EinsumNode, pieces: dict[str, int],
                 restore: dict[str, tuple[int, ...]]) -> tuple[str, str]:
        """What refuses a chunking whose step fits the budget (``_fits``' other checks), and
        what to do about it (``restore``: the stored operands to store again, and in what tiles)."""
        if restore:
            # every one at once (after re-storing the one named, a trial was refused naming the next)
            # (each statement of a re-tile reads whole source tiles: one stored before the budget
            # was set, as big as the machine's tile cap allowed, may not fit it, a trial)
            # (re-cut by store, it is read whole: under a budget that cannot hold ~3x its bytes,
            # store refuses it, so the advice says both ways: a budget trial followed the first)
            # (each clause as sql_functions._said_of_tables finds it, to name a table instead)
            reads = ", and ".join(f"stored {v!r} (tiles {self.fixed[v]}) in tiles {need}" for v, need in restore.items())
            those = "that re-tile does not" if len(restore) == 1 else "those re-tiles do not"
            stores = ", and ".join(
                f"store {v!r} again in tiles of {need} (db.store({v!r}, <its source data>, tile={need}, replace=True), "
                f"or db.store({v!r}, {v!r}, tile={need}, replace=True) in a session whose memory= holds ~3x {v!r}'s "
                f"bytes)" for v, need in restore.items())
            return f"it reads {reads}, and {those} fit", f"{stores}, or give more memory"
        if self.tile_bytes is not None and (
                nbytes(self.out_tile(node, pieces), node.result.dtype) > self.tile_bytes
                or any(self.required(node, k, pieces) != self.fixed.get(op.value)
                       and nbytes(self.required(node, k, pieces), self.dtypes[op.value]) > self.tile_bytes
                       for k, op in enumerate(node.operands))):
            return "the tiles it makes exceed tile_bytes", "give a larger tile_bytes, or more memory"
        return "every chunking that fits needs more tile tuples per step than a step may have", "give more memory"

    def _fits(self, node: EinsumNode, pieces: dict[str, int], split: bool = False) -> bool:
        """Whether ``pieces`` is a candidate: its step within the budget (``split``: or its
        partial and combine steps), what it re-tiles too, and its tiles under the cap."""
        if self.budget is not None and self._best_peak(node, pieces, split) > self.budget:
            return False
        if self.budget is not None:  # and a stored input it would re-tile can be re-tiled within it
            for k, op in enumerate(node.operands):
                have, need = self.fixed.get(op.value), self.required(node, k, pieces)
                if have is not None and have != need and self.retile(op.value, need).retile >= FORBIDDEN:
                    return False
        if self.tile_bytes is not None:
            # tiles this plan creates stay under the cap; a stored input used as it is may be larger
            if nbytes(self.out_tile(node, pieces), node.result.dtype) > self.tile_bytes:
                return False
            for k, op in enumerate(node.operands):
                need = self.required(node, k, pieces)
                if need != self.fixed.get(op.value) and nbytes(need, self.dtypes[op.value]) > self.tile_bytes:
                    return False
        return True

    # -- tilings ----------------------------------------------------------------------------
    def out_tile(self, node: EinsumNode, pieces: dict[str, int]) -> tuple[int, ...]:
        return tuple(self.side(node, lab, pieces[lab]) for lab in node.output)

    def required(self, node: EinsumNode, k: int, pieces: dict[str, int]) -> tuple[int, ...]:
        return tuple(1 if lab is None else self.side(node, lab, pieces[lab]) for lab in self._axes(node, k))

    def node_cost(self, node: EinsumNode, pieces: dict[str, int]) -> Costs:
        if partials.splits(node, pieces, self.dtypes, self.budget, self.model, self.bytes):
            c = partials.split_costs(node, pieces, self.bytes, self.model)
        else:
            c = step_costs(node, pieces, self.bytes, model=self.model)
        return Costs(c.join, c.agg, c.retile, c.group, self.model, self.statements(node, pieces))

    def statements(self, node: EinsumNode, pieces: dict[str, int]) -> int:
        """Statements the node's step runs as: one, or under a budget the batches it needs (two
        steps' where it runs as partial and combine steps)."""
        if partials.splits(node, pieces, self.dtypes, self.budget, self.model, self.bytes):
            return partials.split_statements(node, pieces, self.dtypes, self.budget, self.model)
        if self.budget is None:
            return 1
        return needed_batches(node, pieces, self.dtypes, self.budget, self.model)

    def _retile_peak(self, value: str, target: tuple[int, ...]) -> int:
        v = self.values[value]
        return retile_peak(v.shape, v.dtype, target, retile_max_batches(v.shape, target, self.model), self.model,
                           self.fixed.get(value, target))

    def retile(self, value: str, target: tuple[int, ...]) -> Costs:
        if self.budget is not None:
            # a stored input's tiles are known (each is read, copied and cut whole); an
            # intermediate's depend on its producer's chunking, which this cost does not see:
            # tiles of the target's size stand in (the finished plan's budget check knows them)
            if self._retile_peak(value, target) > self.budget:
                return Costs(retile=FORBIDDEN, model=self.model)  # forbidden: optimize() refuses such a plan
        have = self.fixed.get(value)  # a stored input's tiling is known; an intermediate's is the producer's choice
        if have is not None and moves_whole_rows(self.values[value].shape, have, target):
            return Costs(row_retile=self.bytes[value], model=self.model, statements=1)
        return Costs(retile=self.bytes[value], model=self.model, statements=1)

    # -- evaluation of a full assignment ----------------------------------------------------
    def evaluate(self, pieces: dict[str, dict[str, int]], input_tiles: dict[str, tuple[int, ...]]) -> Costs:
        total = Costs(model=self.model)
        made: dict[str, tuple[int, ...]] = dict(input_tiles)
        made.update(self.fixed)
        for n in self.nodes:
            p = pieces[n.result.name]
            total = total + self.node_cost(n, p)
            for k, op in enumerate(n.operands):
                need = self.required(n, k, p)
                if made[op.value] != need:
                    total = total + self.retile(op.value, need)
                elif self.epilogue.get(n.result.name) == k:
                    total = total + self.epilogue_saving(n, p)
            made[n.result.name] = self.out_tile(n, p)
        return total

    # -- dynamic programming ----------------------------------------------------------------
    # The DP runs over numpy arrays indexed by candidate: a pass is a handful of vector
    # operations per edge instead of a Python loop per (candidate, operand), and values used by
    # several nodes cut the graph into trees whose results are memoized on the tilings of the
    # cut values they read, so coordinate descent re-runs only the trees a change touches.
    def cut_values(self) -> list[str]:
        cuts = []
        for name, uses in self.consumers.items():
            if len(uses) > 1 and name not in self.fixed:
                cuts.append(name)
        return cuts

    def cut_options(self, name: str) -> list[tuple[int, ...]]:
        if name in self.producer:
            n = self.producer[name]
            return sorted({self.out_tile(n, p) for p in self.cands[name]})
        opts = set()
        for n, k in self.consumers[name]:
            for p in self.cands[n.result.name]:
                opts.add(self.required(n, k, p))
        return sorted(opts)

    def _build(self) -> None:
        """Per node, arrays over its candidates; tilings of every value interned as ints."""
        if self._tables is not None:
            return
        ids: dict[str, dict[tuple, int]] = {name: {} for name in self.values}

        def intern(value, tile):
            d = ids[value]
            return d.setdefault(tile, len(d))

        retile_of: dict[tuple[str, tuple], float] = {}

        def retile_cost(value, tile):
            key = (value, tile)
            if key not in retile_of:
                retile_of[key] = self.retile(value, tile).total
            return retile_of[key]

        def intern_rows(value, mat):
            """Tiling ids of the rows of ``mat`` (candidates x axes), and those rows as tuples."""
            d = ids[value]
            rows = list(map(tuple, mat.tolist()))
            return np.array([d.setdefault(row, len(d)) for row in rows], dtype=np.intp), rows

        tables = {}
        for n in self.nodes:
            name = n.result.name
            cands = self.cands[name]
            labels = n.labels
            col = {lab: i for i, lab in enumerate(labels)}
            pieces = np.array([[p[lab] for lab in labels] for p in cands], dtype=np.int64).reshape(len(cands), -1)
            size = np.array([n.size[lab] for lab in labels], dtype=np.int64)
            tile = ceil_div(size, pieces)  # tile_of, per candidate and label
            for lab, d in self.sides.get(name, {}).items():  # ... or a stored input's side
                c = col[lab]
                for p, side in d.items():
                    tile[:, c] = np.where(pieces[:, c] == p, side, tile[:, c])
            t = _Tables()
            t.cost = self._node_costs(n, pieces, col)
            t.saving = None
            if name in self.epilogue:  # subtracted where the producer cuts the operand as read
                if self.budget is None:  # one statement whatever the pieces: one saving for all
                    t.saving = np.full(len(cands), self.epilogue_saving(n, cands[0]).total)
                else:
                    t.saving = np.array([self.epilogue_saving(n, p).total for p in cands], dtype=np.float64)
            t.made = intern_rows(name, tile[:, [col[lab] for lab in n.output]])[0]
            t.needs, t.retile = [], []
            for k, op in enumerate(n.operands):
                axes = self._axes(n, k)
                ones = np.ones(len(cands), dtype=np.int64)
                mat = np.stack([ones if lab is None else tile[:, col[lab]] for lab in axes], axis=1) if axes \
                    else np.zeros((len(cands), 0), dtype=np.int64)
                need, rows = intern_rows(op.value, mat)
                t.needs.append(need)
                t.retile.append(np.array([retile_cost(op.value, row) for row in rows], dtype=np.float64))
            tables[name] = t
        for value, tile in self.fixed.items():
            if value in ids:
                intern(value, tile)
        for n in self.nodes:  # the domains are complete now: group candidates by output tiling
            t = tables[n.result.name]
            order = np.argsort(t.made, kind="stable")  # stable: ties go to the lowest candidate
            uniq, first, counts = np.unique(t.made[order], return_index=True, return_counts=True)
            groups = np.full((len(uniq), int(counts.max())), len(t.made), dtype=np.intp)
            for r, (a, c) in enumerate(zip(first, counts)):
                groups[r, :c] = order[a:a + c]
            t.groups, t.rows = groups, np.arange(len(uniq))
            t.cost_ext = np.append(t.cost, np.inf)
            # tiling id -> row of groups; ids no candidate makes go to the extra (inf) row
            t.pos = np.full(len(ids[n.result.name]), len(uniq), dtype=np.intp)
            t.pos[uniq] = t.rows
        for n in self.nodes:
            t = tables[n.result.name]
            t.at = [tables[op.value].pos[need] if op.value in tables else None
                    for op, need in zip(n.operands, t.needs)]
        self._ids = ids
        self._tables = tables
        self._fixed_ids = {v: ids[v][t] for v, t in self.fixed.items() if v in ids}
        # trees: a node's result read by exactly one node belongs to that node's tree
        cuts = set(self.cut_values())
        self._cuts = cuts
        root_of: dict[str, str] = {}
        for n in reversed(self.nodes):
            name = n.result.name
            uses = self.consumers.get(name, [])
            root_of[name] = root_of[uses[0][0].result.name] if len(uses) == 1 else name
        trees: dict[str, list[EinsumNode]] = {}
        for n in self.nodes:
            trees.setdefault(root_of[n.result.name], []).append(n)
        self._trees = trees
        self._leaves = {
            root: tuple(dict.fromkeys(op.value for n in tree for op in n.operands if op.value in cuts))
            for root, tree in trees.items()
        }
        self._memo: dict[tuple, tuple] = {}
        self.work = 0  # node evaluations so far (bounds the coordinate descent)

    def _tile_id(self, value: str, tile) -> int:
        return self._ids[value].get(tile, -1)  # -1: a tiling no candidate makes or needs

    def _eval_node(self, node: EinsumNode, have: dict[str, int], state: dict) -> list:
        """Cheapest cost of every candidate of ``node`` and everything upstream in ``state``;
        ``have``: values whose tiling is given (stored inputs, fixed cut values). Stores the
        node's (best per output tiling, its candidate, overall best, its candidate) in
        ``state`` and returns, per producer read, the producer candidate each candidate uses."""
        t = self._tables[node.result.name]
        ext = t.cost_ext.copy()  # one slot more, always inf: where a missing tiling points
        rows = ext[:-1]
        picks = []
        for k, op in enumerate(node.operands):
            u = op.value
            h = have.get(u)
            if h is not None:
                rows += np.where(t.needs[k] == h, 0.0, t.retile[k])
            elif u in state:
                best, arg, mn, mnarg = state[u]
                at = t.at[k]  # the producer's row for each needed tiling (or its inf slot)
                same = best[at]
                if t.saving is not None and self.epilogue[node.result.name] == k:
                    same = same + t.saving  # fused as an epilogue: no step of its own
                other = t.retile[k] + mn
                take = same <= other
                rows += np.where(take, same, other)
                picks.append((u, np.where(take, arg[at], mnarg)))
            # else: a free input read once is stored the way each candidate wants it
        grid = ext[t.groups]
        a = grid.argmin(axis=1)
        best = np.append(grid[t.rows, a], np.inf)
        arg = np.append(t.groups[t.rows, a], 0)
        mnarg = int(rows.argmin())
        state[node.result.name] = (best, arg, float(rows[mnarg]), mnarg)
        self.work += 1
        return picks

    def _tree(self, root: str, leaf_ids: tuple[int, ...]):
        key = (root, leaf_ids)
        hit = self._memo.get(key)
        if hit is None:
            have = dict(self._fixed_ids)
            have.update(zip(self._leaves[root], leaf_ids))
            state: dict = {}
            picks = {n.result.name: self._eval_node(n, have, state) for n in self._trees[root]}
            hit = self._memo[key] = (state[root], picks)
        return hit

    def _root_cost(self, root: str, ids: dict[str, int]) -> tuple[float, int, dict]:
        (best, arg, mn, mnarg), picks = self._tree(root, tuple(ids[v] for v in self._leaves[root]))
        if root not in self._cuts:
            return mn, mnarg, picks
        t = ids[root]
        r = self._tables[root].pos[t] if t >= 0 else -1  # -1: the inf slot
        return float(best[r]), int(arg[r]), picks

    def solve(self, fix: dict[str, tuple[int, ...]]):
        """The cheapest total with every cut value's tiling fixed by ``fix``, and its pieces
        per node (None when nothing fits)."""
        self._build()
        ids = {c: self._tile_id(c, t) for c, t in fix.items()}
        total = 0.0
        chosen: dict[str, int] = {}
        for root in self._trees:
            cost, ci, picks = self._root_cost(root, ids)
            total += cost
            _pick(root, ci, picks, chosen)
        if total == math.inf:
            return math.inf, None
        return total, {name: dict(self.cands[name][ci]) for name, ci in chosen.items()}

    def relaxed(self):
        """Pieces per node with every cut value free: each consumer pays for its producer as
        if it were its only one (a lower bound; its cut tilings seed the search)."""
        self._build()
        state: dict = {}
        picks = {n.result.name: self._eval_node(n, self._fixed_ids, state) for n in self.nodes}
        chosen: dict[str, int] = {}
        for n in reversed(self.nodes):
            name = n.result.name
            if name not in self.consumers:
                _, _, mn, mnarg = state[name]
                if mn == math.inf:
                    return None
                _pick(name, mnarg, picks, chosen)
        return {name: dict(self.cands[name][ci]) for name, ci in chosen.items()}

    def free_input_tiles(self, pieces, fix) -> dict[str, tuple[int, ...]]:
        tiles = {}
        for v in self.inputs:
            if v in self.fixed:
                continue
            if v in fix:
                tiles[v] = fix[v]
            elif v in self.consumers:
                n, k = self.consumers[v][0]
                tiles[v] = self.required(n, k, pieces[n.result.name])
        return tiles


class _Tables:
    """A node's candidates as arrays: ``cost`` (node cost; ``cost_ext`` with an inf slot
    appended), ``made`` (output tiling id), ``needs[k]`` / ``retile[k]`` (tiling id operand k
    must have, cost of re-tiling it to that), ``at[k]`` (the row of operand k's producer that
    makes that tiling), ``groups`` (candidate indices per output tiling, one row per tiling,
    padded with the inf slot), ``pos`` (tiling id -> row of ``groups``)."""

    __slots__ = ("cost", "cost_ext", "made", "needs", "retile", "at", "groups", "rows", "pos", "saving")


def _bounded_products(options: list[list[int]], lo: int, hi: int):
    """The combinations of ``itertools.product(*options)`` whose product lies in [lo, hi], in
    the same order, without visiting the (many more) combinations whose prefix already
    exceeds ``hi``: options are sorted ascending and positive, so a prefix only grows."""
    rest = [math.prod(max(o) for o in options[k:]) for k in range(len(options))] + [1]

    def walk(k: int, prefix: tuple[int, ...], prod: int):
        if k == len(options):
            if prod >= lo:
                yield prefix
            return
        for d in options[k]:
            p = prod * d
            if p > hi:
                break
            if p * rest[k + 1] >= lo:  # the largest completion still reaches lo
                yield from walk(k + 1, prefix + (d,), p)

    return walk(0, (), 1)


def _pick(name: str, ci: int, picks: dict, chosen: dict[str, int]) -> None:
    """Walk back from a node's chosen candidate to the producer candidates it was built on
    (the first walk to reach a value wins, as values read twice only arise when relaxed)."""
    stack = [(name, ci)]
    while stack:
        name, ci = stack.pop()
        if name in chosen:
            continue
        chosen[name] = ci
        # reversed: the first operand's producers are walked first (depth first, in order)
        stack.extend((u, int(arr[ci])) for u, arr in reversed(picks[name]))


def optimize(nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]], workers: int = 1,
             budget: int | None = None, tile_bytes: int | None = None, model: CostModel = DEFAULT_COSTS,
             fuse_into: frozenset | None = None) -> Choice:
    """EinDecomp: the cheapest chunking of every node under the cost model. ``fuse_into``: the
    plan's outputs, when element-wise nodes fuse into the steps producing their operands (an
    epilogue then costs what it saves only under a chunking that lets it fuse)."""
    prob = _Problem(nodes, inputs, fixed, workers, budget, tile_bytes, model, fuse_into)
    cuts = prob.cut_values()
    options = {c: prob.cut_options(c) for c in cuts}
    combos = math.prod(len(o) for o in options.values()) if cuts else 1
    if combos <= EXACT_CUT_LIMIT:
        best = (math.inf, None, None)
        for combo in itertools.product(*(options[c] for c in cuts)):
            fix = dict(zip(cuts, combo))
            total, pieces = prob.solve(fix)
            if pieces is not None and total < best[0]:
                best = (total, pieces, fix)
        total, pieces, fix = best
    else:
        total, pieces, fix = _greedy(prob, cuts, options)
    if pieces is None or total >= FORBIDDEN:
        # every chunking needs a retile the budget forbids (priced FORBIDDEN, not excluded)
        raise EinsumError("no chunking fits the memory budget: every one needs a re-tile over it; give more memory")
    tiles = prob.free_input_tiles(pieces, fix)
    return Choice(pieces, tiles, prob.evaluate(pieces, tiles), prob.priced(pieces), prob.sides)


def _greedy(prob: _Problem, cuts, options, work: int = GREEDY_WORK):
    """Fix every cut value to what its producer (or its first consumer, for inputs) likes best,
    or to what a baseline does, whichever is cheapest; then coordinate descent: give each cut
    in turn its best option with the others held, sweeping until nothing improves. The number
    of node evaluations (not a clock) bounds the work, so a plan does not depend on how busy
    the machine is."""
    def cut_tilings(pieces):
        fix = {}
        for c in cuts:
            if c in prob.producer:
                fix[c] = prob.out_tile(prob.producer[c], pieces[c])
            else:
                n, k = prob.consumers[c][0]
                fix[c] = prob.required(n, k, pieces[n.result.name])
        return fix

    # start from the best of: every cut at its producer's favourite, or at what each baseline
    # strategy does (so the result never costs more than a baseline)
    starts = []
    free_pieces = prob.relaxed()
    if free_pieces is not None:
        starts.append(cut_tilings(free_pieces))
    for strategy in STRATEGIES[1:]:
        starts.append(cut_tilings({n.result.name: baseline_pieces(strategy, n, prob.workers) for n in prob.nodes}))
    total, fix = math.inf, None
    for start in starts:
        t, p = prob.solve(start)
        if p is not None and t < total:
            total, fix = t, start
    if fix is None:
        return total, None, {}
    # which trees a cut's tiling reaches: those reading it, and the one it is the root of
    touches = {c: [r for r, leaves in prob._leaves.items() if c in leaves or r == c] for c in cuts}
    ids = {c: prob._tile_id(c, t) for c, t in fix.items()}
    improved = True
    while improved and prob.work < work:
        improved = False
        for c in cuts:
            near = touches[c]
            rest = sum(prob._root_cost(r, ids)[0] for r in prob._trees if r not in near)
            best_opt, best = fix[c], total
            for opt in options[c]:
                if opt == fix[c] or prob.work >= work:
                    continue
                ids[c] = prob._tile_id(c, opt)
                t = rest + sum(prob._root_cost(r, ids)[0] for r in near)
                if t < best:
                    best_opt, best = opt, t
            fix[c] = best_opt
            ids[c] = prob._tile_id(c, best_opt)
            if best < total:
                total, improved = best, True
    total, pieces = prob.solve(fix)
    return total, pieces, fix


def exhaustive(nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]], workers: int = 1,
               budget: int | None = None, tile_bytes: int | None = None,
               model: CostModel = DEFAULT_COSTS, fuse_into: frozenset | None = None) -> tuple[float, Choice]:
    """The true optimum by enumerating every candidate of every node (tests only: exponential)."""
    prob = _Problem(nodes, inputs, fixed, workers, budget, tile_bytes, model, fuse_into)
    names = [n.result.name for n in prob.nodes]
    free_multi = [v for v in prob.inputs if v not in prob.fixed and len(prob.consumers.get(v, [])) > 1]
    free_opts = [prob.cut_options(v) for v in free_multi]
    best = (math.inf, None)
    for combo in itertools.product(*(prob.cands[n] for n in names)):
        pieces = dict(zip(names, combo))
        single = prob.free_input_tiles(pieces, {})
        for tiles in itertools.product(*free_opts):
            it = dict(single)
            it.update(zip(free_multi, tiles))
            c = prob.evaluate(pieces, it)
            if c.total < best[0]:
                best = (c.total, Choice(pieces, it, c, sides=prob.sides))
    return best


def baseline(strategy: str, nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]],
             workers: int = 1, budget: int | None = None, model: CostModel = DEFAULT_COSTS) -> Choice:
    """The chunking a fixed strategy gives every node (no search)."""
    if strategy not in STRATEGIES[1:]:
        raise EinsumError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    prob = _Problem(nodes, inputs, fixed, workers, None, model=model)
    pieces = {n.result.name: baseline_pieces(strategy, n, workers) for n in prob.nodes}
    tiles = prob.free_input_tiles(pieces, {})
    return Choice(pieces, tiles, prob.evaluate(pieces, tiles), sides=prob.sides)


def baseline_pieces(strategy: str, node: EinsumNode, workers: int) -> dict[str, int]:
    """data-parallel: cut the leading output label ``workers`` ways; model-parallel: the last
    output label; square-tiles: one tile side for every label, the largest power of two that
    still gives ``workers`` join tasks."""
    size = node.size
    w = 1 << max(workers - 1, 0).bit_length()  # workers rounded up to a power of two
    p = {lab: 1 for lab in node.labels}
    if not node.labels:  # scalars: nothing to cut
        return p
    if strategy == "data-parallel":
        lab = node.output[0] if node.output else node.labels[0]
        p[lab] = pieces_of(size[lab], tile_of(size[lab], min(w, size[lab])))
    elif strategy == "model-parallel":
        lab = node.output[-1] if node.output else node.labels[-1]
        p[lab] = pieces_of(size[lab], tile_of(size[lab], min(w, size[lab])))
    else:
        side = 1 << max(size.values()).bit_length()
        while side > 1 and math.prod(pieces_of(size[lab], min(side, size[lab])) for lab in node.labels) < workers:
            side //= 2
        p = {lab: pieces_of(size[lab], min(side, size[lab])) for lab in node.labels}
    p.update((lab, 1) for lab in node.whole)  # a fused chain's labels stay whole (graph/node.py)
    return p
