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
producer's best), refined by one coordinate-descent sweep.

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

from ..errors import EinsumError
from ..graph import EinsumNode, ValueInfo
from .cost import (Costs, max_batches, nbytes, pieces_of, retile_max_batches, retile_peak, step_costs, step_peak,
                   tile_of)

STRATEGIES = ("eindecomp", "data-parallel", "model-parallel", "square-tiles")
EXACT_CUT_LIMIT = 256  # enumerate cut tilings exactly up to this many combinations
MAX_PRODUCT_FACTOR = 8  # candidates have between workers and 8x workers join tasks...


@dataclass(frozen=True)
class Choice:
    """A chunking for every node and the tiling of every free input."""

    pieces: dict[str, dict[str, int]]  # node result name -> label -> pieces
    input_tiles: dict[str, tuple[int, ...]]  # free graph inputs -> tile shape
    costs: Costs = field(default_factory=Costs)

    def tiles(self, nodes) -> dict[str, dict[str, int]]:
        """Tile size per label of every node (what the planner cuts by)."""
        out = {}
        for n in nodes:
            size = n.size
            out[n.result.name] = {lab: tile_of(size[lab], d) for lab, d in self.pieces[n.result.name].items()}
        return out


class _Problem:
    def __init__(self, nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]], workers, budget,
                 max_tile_bytes=None):  # noqa: PLR0913
        self.max_tile = max_tile_bytes
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
        self.dtypes = {name: v.dtype for name, v in self.values.items()}
        self._cands: dict[str, list[dict[str, int]]] | None = None
        self._facts: dict[str, list[tuple]] = {}

    @property
    def cands(self) -> dict[str, list[dict[str, int]]]:
        if self._cands is None:  # only the optimizer needs them, not the baselines
            self._cands = {n.result.name: self._candidates(n) for n in self.nodes}
        return self._cands

    def facts(self, node: EinsumNode) -> list[tuple]:
        """Per candidate: (pieces, node cost total, output tile, required tile per operand)."""
        name = node.result.name
        if name not in self._facts:
            self._facts[name] = [
                (p, self.node_cost(node, p).total, self.out_tile(node, p),
                 tuple(self.required(node, k, p) for k in range(len(node.operands))))
                for p in self.cands[name]
            ]
        return self._facts[name]

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
        return {lab: sorted(v) for lab, v in opts.items()}

    def _candidates(self, node: EinsumNode) -> list[dict[str, int]]:
        opts = self._label_options(node)
        labels = list(node.labels)
        most = math.prod(max(v) for v in opts.values())
        lo = min(self.workers, most)
        hi = max(lo, self.workers) * MAX_PRODUCT_FACTOR
        while True:
            out = []
            for combo in itertools.product(*(opts[lab] for lab in labels)):
                p = math.prod(combo)
                if lo <= p <= hi:
                    pieces = dict(zip(labels, combo))
                    if self._fits(node, pieces):
                        out.append(pieces)
            if out or hi >= most:
                break
            hi *= 4  # ...unless the memory budget needs finer cuts
        # the baselines' chunkings are always candidates, so EinDecomp never costs more
        for strategy in STRATEGIES[1:]:
            p = baseline_pieces(strategy, node, self.workers)
            if p not in out and self._fits(node, p):
                out.append(p)
        if not out:
            raise EinsumError(
                f"no chunking of node {node.describe()} -> {node.result.name} fits the memory budget of "
                f"{self.budget} bytes (smallest projected peak: "
                f"{min(self._best_peak(node, dict(zip(labels, c))) for c in itertools.product(*(opts[lab] for lab in labels)))} bytes"
                f"{'' if self.max_tile is None else f'; tiles capped at {self.max_tile} bytes'})"
            )
        return out

    def _best_peak(self, node: EinsumNode, pieces: dict[str, int]) -> int:
        return step_peak(node, pieces, self.dtypes, max_batches(node, pieces))

    def _fits(self, node: EinsumNode, pieces: dict[str, int]) -> bool:
        if self.budget is not None and step_peak(node, pieces, self.dtypes, max_batches(node, pieces)) > self.budget:
            return False
        if self.max_tile is not None:
            # tiles this plan creates stay under the cap; a stored input used as it is may be larger
            if nbytes(self.out_tile(node, pieces), node.result.dtype) > self.max_tile:
                return False
            for k, op in enumerate(node.operands):
                need = self.required(node, k, pieces)
                if need != self.fixed.get(op.value) and nbytes(need, self.dtypes[op.value]) > self.max_tile:
                    return False
        return True

    # -- tilings ----------------------------------------------------------------------------
    def out_tile(self, node: EinsumNode, pieces: dict[str, int]) -> tuple[int, ...]:
        size = node.size
        return tuple(tile_of(size[lab], pieces[lab]) for lab in node.output)

    def required(self, node: EinsumNode, k: int, pieces: dict[str, int]) -> tuple[int, ...]:
        op = node.operands[k]
        v = self.values[op.value]
        size = node.size
        it = iter(op.labels)
        out = []
        for ax in range(len(v.shape)):
            if ax in op.dropped:
                out.append(1)
            else:
                lab = next(it)
                out.append(tile_of(size[lab], pieces[lab]))
        return tuple(out)

    def node_cost(self, node: EinsumNode, pieces: dict[str, int]) -> Costs:
        return step_costs(node, pieces, self.bytes)

    def retile(self, value: str, target: tuple[int, ...]) -> Costs:
        if self.budget is not None:
            v = self.values[value]
            if retile_peak(v.shape, v.dtype, target, retile_max_batches(v.shape, target)) > self.budget:
                return Costs(retile=10**30)  # effectively forbidden
        return Costs(retile=self.bytes[value])

    # -- evaluation of a full assignment ----------------------------------------------------
    def evaluate(self, pieces: dict[str, dict[str, int]], input_tiles: dict[str, tuple[int, ...]]) -> Costs:
        total = Costs()
        made: dict[str, tuple[int, ...]] = dict(input_tiles)
        made.update(self.fixed)
        for n in self.nodes:
            p = pieces[n.result.name]
            total = total + self.node_cost(n, p)
            for k, op in enumerate(n.operands):
                need = self.required(n, k, p)
                if made[op.value] != need:
                    total = total + self.retile(op.value, need)
            made[n.result.name] = self.out_tile(n, p)
        return total

    # -- dynamic programming ----------------------------------------------------------------
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

    def dp(self, fix: dict[str, tuple[int, ...]]):
        """Best cost per candidate of every node given fixed tilings of the cut values.

        Returns (total cost, argmin pieces per node)."""
        best: dict[str, list[tuple[float, Costs, dict]]] = {}
        by_tile: dict[str, dict[tuple, tuple[float, int]]] = {}
        min_of: dict[str, tuple[float, int]] = {}
        for n in self.nodes:
            name = n.result.name
            rows = []
            for _p, cost, made, needs in self.facts(n):
                if name in fix and made != fix[name]:
                    rows.append(None)
                    continue
                total = cost
                picks = {}
                for k, op in enumerate(n.operands):
                    u = op.value
                    need = needs[k]
                    if u in fix or u in self.fixed:
                        have = fix.get(u, self.fixed.get(u))
                        if have != need:
                            total += self.retile(u, need).total
                    elif u not in self.producer:
                        pass  # a free input used once: stored the way this node wants it
                    else:
                        same = by_tile[u].get(need)
                        other = min_of[u][0] + self.retile(u, need).total
                        if same is not None and same[0] <= other:
                            total += same[0]
                            picks[u] = same[1]
                        else:
                            total += other
                            picks[u] = min_of[u][1]
                rows.append((total, picks))
            best[name] = rows
            bt: dict[tuple, tuple[float, int]] = {}
            facts = self.facts(n)
            for ci, row in enumerate(rows):
                if row is None:
                    continue
                t = facts[ci][2]
                if t not in bt or row[0] < bt[t][0]:
                    bt[t] = (row[0], ci)
            by_tile[name] = bt
            if not bt:
                return math.inf, None
            min_of[name] = min(bt.values())
        # roots: values no single-consumer edge accounts for (sinks and cut values)
        total = 0.0
        chosen: dict[str, int] = {}
        for n in reversed(self.nodes):
            name = n.result.name
            if name in self.consumers and name not in fix:
                continue  # paid for by its one consumer
            cost, ci = min_of[name]
            total += cost
            self._pick(name, ci, best, chosen)
        pieces = {name: self.cands[name][ci] for name, ci in chosen.items()}
        return total, pieces

    def _pick(self, name, ci, best, chosen):
        if name in chosen:
            return
        chosen[name] = ci
        for u, uci in best[name][ci][1].items():
            self._pick(u, uci, best, chosen)

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


def optimize(nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]], workers: int = 1,
             budget: int | None = None, max_tile_bytes: int | None = None) -> Choice:
    """EinDecomp: the cheapest chunking of every node under the cost model."""
    prob = _Problem(nodes, inputs, fixed, workers, budget, max_tile_bytes)
    cuts = prob.cut_values()
    options = {c: prob.cut_options(c) for c in cuts}
    combos = math.prod(len(o) for o in options.values()) if cuts else 1
    if combos <= EXACT_CUT_LIMIT:
        best = (math.inf, None, None)
        for combo in itertools.product(*(options[c] for c in cuts)):
            fix = dict(zip(cuts, combo))
            total, pieces = prob.dp(fix)
            if pieces is not None and total < best[0]:
                best = (total, pieces, fix)
        total, pieces, fix = best
    else:
        total, pieces, fix = _greedy(prob, cuts, options)
    if pieces is None:
        raise EinsumError("no chunking satisfies the constraints (memory budget too small for a retile?)")
    tiles = prob.free_input_tiles(pieces, fix)
    return Choice(pieces, tiles, prob.evaluate(pieces, tiles))


def _greedy(prob: _Problem, cuts, options, work: int = 1200):
    """Fix every cut value to what its producer (or its first consumer, for inputs) likes best,
    then try each cut's other options once, keeping improvements. A fixed number of DP passes
    (not a clock) bounds the work, so a plan does not depend on how busy the machine is: about
    ``work`` node visits per pass count, well under a second for 100 nodes here."""
    max_passes = max(8, work // max(len(prob.nodes), 1))
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
    _, free_pieces = prob.dp({})
    if free_pieces is not None:
        starts.append(cut_tilings(free_pieces))
    for strategy in STRATEGIES[1:]:
        starts.append(cut_tilings({n.result.name: baseline_pieces(strategy, n, prob.workers) for n in prob.nodes}))
    total, pieces, fix = math.inf, None, None
    for start in starts:
        t, p = prob.dp(start)
        if p is not None and t < total:
            total, pieces, fix = t, p, start
    if pieces is None:
        return total, None, {}
    passes = 0
    for c in cuts:
        for opt in options[c]:
            if opt == fix[c]:
                continue
            if passes >= max_passes:
                return total, pieces, fix
            passes += 1
            trial = dict(fix)
            trial[c] = opt
            t, p = prob.dp(trial)
            if p is not None and t < total:
                total, pieces, fix = t, p, trial
    return total, pieces, fix


def exhaustive(nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]], workers: int = 1,
               budget: int | None = None, max_tile_bytes: int | None = None) -> tuple[float, Choice]:
    """The true optimum by enumerating every candidate of every node (tests only: exponential)."""
    prob = _Problem(nodes, inputs, fixed, workers, budget, max_tile_bytes)
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
                best = (c.total, Choice(pieces, it, c))
    return best


def baseline(strategy: str, nodes, inputs: dict[str, ValueInfo], fixed: dict[str, tuple[int, ...]],
             workers: int = 1, budget: int | None = None) -> Choice:
    """The chunking a fixed strategy gives every node (no search)."""
    if strategy not in STRATEGIES[1:]:
        raise EinsumError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    prob = _Problem(nodes, inputs, fixed, workers, None)
    pieces = {n.result.name: baseline_pieces(strategy, n, workers) for n in prob.nodes}
    tiles = prob.free_input_tiles(pieces, {})
    return Choice(pieces, tiles, prob.evaluate(pieces, tiles))


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
    return p
