"""The graph IR: values (shape + dtype) and extended einsum nodes that produce them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..notation import Aggregation, JoinFunction
from ..notation.spec import first_appearance


@dataclass(frozen=True)
class ValueInfo:
    """A tensor in a graph, described by shape alone: ``name``, ``shape``, ``dtype`` (numpy name).

    ``dtype_given``: False for a graph input declared without a dtype (float32 by default), so
    that an array of a wider dtype bound to it is cast with a warning; it takes no part in
    equality or hashing (plans are cached by value)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    dtype_given: bool = field(default=True, compare=False, repr=False)


@dataclass(frozen=True)
class Operand:
    """One input of a node: a value read with one label per kept axis.

    ``dropped`` are size-1 axes the einsum broadcasts (numpy's broadcasting): they carry no
    label, and since a size-1 axis never changes a C-order tile's bytes, dropping one is free.
    """

    value: str
    labels: tuple[str, ...]
    dropped: tuple[int, ...] = ()


@dataclass(frozen=True)
class EinsumNode:
    """out[output] = agg over the other labels of join(inputs...), one extended einsum."""

    operands: tuple[Operand, ...]
    output: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    join: JoinFunction
    agg: Aggregation
    result: ValueInfo
    # labels every chunking keeps in one piece: a chain fused into one step
    # (plan/passes/chains.py) computes its producer's tile inside the kernel, which needs the
    # labels that producer reduces whole, and computes it once only if no consumer label the
    # producer lacks is cut
    whole: tuple[str, ...] = ()
    # ... and the values its kernel computes and holds per output tile, (labels, dtype) each:
    # what its projected peak counts besides the tiles it joins (plan/cost.py: step_peak)
    held: tuple[tuple[tuple[str, ...], str], ...] = ()
    # reduced labels whose pieces the result keeps apart: it has one key per kept label (as many
    # keys as the label has pieces, each of extent 1), and each of its tiles aggregates over one
    # piece of them only. A partial result, which a combine step finishes (plan/partials.py);
    # the kernel contracts them within a tile as any reduced label
    kept: tuple[str, ...] = ()

    # cached: the optimizer asks these thousands of times (frozen dataclasses allow it, as
    # cached_property writes the instance __dict__ directly)
    @cached_property
    def size(self) -> dict[str, int]:
        return dict(self.sizes)

    @cached_property
    def labels(self) -> tuple[str, ...]:
        return first_appearance(*(op.labels for op in self.operands))

    @cached_property
    def reduced(self) -> tuple[str, ...]:
        return tuple(lab for lab in self.labels if lab not in self.output)

    @cached_property
    def keys(self) -> tuple[str, ...]:
        """The labels the result has a key for: the output's, then the kept ones."""
        return self.output + self.kept

    @cached_property
    def summed(self) -> tuple[str, ...]:
        """The reduced labels whose pieces meet in the aggregation (all but the kept ones)."""
        return tuple(lab for lab in self.reduced if lab not in self.kept)

    @property
    def elementwise(self) -> bool:
        """Reduces nothing, and no operand takes a diagonal (labels distinct in every operand):
        what fuses into the step next to it (``plan/passes/fuse.py``)."""
        return not self.reduced and all(len(set(op.labels)) == len(op.labels) for op in self.operands)

    def describe(self) -> str:
        """The node as the spec it computes, in its own labels: ``bo,oi->bi``, plus the join
        when it is not ``mul`` and the aggregation when the node reduces a label and it is not
        ``sum`` (an aggregation over nothing never runs, so naming it would only mislead)."""
        lhs = ",".join("".join(_short(lab) for lab in op.labels) for op in self.operands)
        text = f"{lhs}->{''.join(_short(lab) for lab in self.output)}"
        if self.join.name != "mul":
            text += f" join={self.join.label}"
        if self.reduced and self.agg.name != "sum":
            text += f" agg={self.agg.name}"
        if self.kept:  # a partial result (plan/partials.py)
            text += f" partial over {','.join(_short(lab) for lab in self.kept)}"
        return text


def _short(label: str) -> str:
    return label if len(label) == 1 else f"[{label}]"
