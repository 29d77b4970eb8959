"""Parse numpy einsum subscripts into an :class:`EinsumSpec`.

The whole numpy language: explicit and implicit output, repeated labels inside one operand
(diagonals, traces), ellipsis broadcasting and scalar operands. Ellipsis dimensions become
labels named ``e0, e1, ...`` counted from the right (numpy aligns broadcast dimensions on the
right); letters stay themselves, so a label is a ``str`` everywhere below this module.

>>> parse_spec("ij,jk", [(2, 3), (3, 4)]).output
('i', 'k')
"""

from __future__ import annotations

import math

import string
from dataclasses import dataclass

from ..errors import EinsumError, caret

LETTERS = frozenset(string.ascii_letters)


@dataclass(frozen=True)
class EinsumSpec:
    """A parsed einsum: labels per operand (in axis order), output labels, size of every label.

    ``squeezed[k]`` lists the axes of operand ``k`` of size 1 whose label is larger (or 0) in
    another operand, numpy's broadcasting; those axes carry no label (the operand is broadcast
    along the label), every occurrence of a repeated label included.
    """

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    squeezed: tuple[tuple[int, ...], ...]
    text: str

    @property
    def size(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def labels(self) -> tuple[str, ...]:
        """Every label, in order of first appearance (inputs first, then output)."""
        return first_appearance(*self.inputs, self.output)



def first_appearance(*label_lists) -> tuple[str, ...]:
    """Every label of the lists, once, in order of first appearance."""
    seen: dict[str, None] = {}
    for labels in label_lists:
        seen.update(dict.fromkeys(labels))
    return tuple(seen)


def _ellipsis_label(k: int) -> str:
    return f"e{k}"


def describe_label(label: str) -> str:
    """How an error message names a label: 'i', or an ellipsis dimension."""
    return f"{label!r}" if len(label) == 1 else f"of ellipsis dimension {label[1:]} (from the right)"


def _scan_operand(text: str, start: int, end: int) -> tuple[list[str], int | None]:
    """Letters of one operand's subscripts; ``None`` or the index of its ellipsis."""
    labels: list[str] = []
    ellipsis_at: int | None = None
    pos = start
    while pos < end:
        ch = text[pos]
        if ch == ".":
            if text[pos : pos + 3] != "..." or pos + 3 > end:
                raise EinsumError(f"einsum spec: '.' must be part of an ellipsis '...'\n{caret(text, pos)}")
            if ellipsis_at is not None:
                raise EinsumError(f"einsum spec: more than one ellipsis in one operand\n{caret(text, pos)}")
            ellipsis_at = len(labels)
            pos += 3
            continue
        if ch == " ":
            pos += 1
            continue
        if ch not in LETTERS:
            raise EinsumError(
                f"einsum spec: invalid subscript {ch!r}; subscripts are letters a-z, A-Z\n{caret(text, pos)}"
            )
        labels.append(ch)
        pos += 1
    return labels, ellipsis_at


# the most elements an einsum's join space may span (2^56: its bytes and costs stay in int64)
MAX_JOIN_SPACE = 1 << 56
MAX_LABELS = 52  # a-z and A-Z: what numpy's einsum, in the kernels, can name


def check_join_space(text: str, sizes: dict, labels) -> None:
    """Refuse a join over ``labels`` (one node of einsum ``text``) spanning more than
    ``MAX_JOIN_SPACE`` elements: its bytes, times the pieces a plan cuts, are priced in int64
    (a raw OverflowError from the optimizer before, for (2**31, 2**31) inputs: a trial)."""
    space = math.prod(sizes[lab] for lab in labels)
    if space > MAX_JOIN_SPACE:
        raise EinsumError(f"einsum {text!r} over sizes {dict(sorted(sizes.items()))} spans {space:.3g} elements in "
                          f"one join (the product of the sizes of {''.join(sorted(labels))}), beyond the "
                          f"{MAX_JOIN_SPACE:.3g} this library plans")


def parse_spec(text: str, shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...]) -> EinsumSpec:
    """Parse ``text`` against the operands' shapes, with numpy's rules and error cases."""
    if not isinstance(text, str):
        raise EinsumError(f"einsum spec must be a str, got {type(text).__name__}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    arrow = text.find("->")
    if text.count("->") > 1:
        raise EinsumError(f"einsum spec: more than one '->'\n{caret(text, text.rfind('->'))}")
    for bad in ("-", ">"):
        pos = text.find(bad)
        while pos != -1:
            if not (arrow != -1 and arrow <= pos <= arrow + 1):
                raise EinsumError(f"einsum spec: stray {bad!r}; the output arrow is '->'\n{caret(text, pos)}")
            pos = text.find(bad, pos + 1)
    lhs_end = arrow if arrow != -1 else len(text)
    # operand boundaries on the left-hand side
    bounds: list[tuple[int, int]] = []
    start = 0
    for pos in range(lhs_end + 1):
        if pos == lhs_end or text[pos] == ",":
            bounds.append((start, pos))
            start = pos + 1
    if len(bounds) != len(shapes):
        raise EinsumError(
            f"einsum spec {text!r} has {len(bounds)} operand(s) but {len(shapes)} operand(s) were given"
        )
    if arrow != -1 and "," in text[arrow:]:
        raise EinsumError(f"einsum spec: ',' in the output\n{caret(text, text.index(',', arrow))}")

    sizes: dict[str, int] = {}
    size_origin: dict[str, tuple[int, int]] = {}
    inputs: list[tuple[str, ...]] = []
    squeezed: list[tuple[int, ...]] = []
    max_ell = 0
    parsed = [_scan_operand(text, a, b) for a, b in bounds]
    for k, ((letters, ell), shape, (a, _)) in enumerate(zip(parsed, shapes, bounds)):
        n_ell = len(shape) - len(letters)
        if ell is None and n_ell != 0:
            raise EinsumError(
                f"einsum operand {k} has {len(shape)} dimension(s) (shape {shape}) but its subscripts "
                f"{''.join(letters)!r} name {len(letters)}\n{caret(text, a)}"
            )
        if n_ell < 0:
            raise EinsumError(
                f"einsum operand {k} has {len(shape)} dimension(s) (shape {shape}) but its subscripts "
                f"name {len(letters)}\n{caret(text, a)}"
            )
        max_ell = max(max_ell, n_ell)
        if ell is None:
            labels = list(letters)
        else:
            ell_labels = [_ellipsis_label(n_ell - 1 - q) for q in range(n_ell)]
            labels = letters[:ell] + ell_labels + letters[ell:]
        inputs.append(tuple(labels))

    # sizes. numpy broadcasts a size-1 axis against any size of the same label in another
    # operand (not only under an ellipsis); inside one operand a repeated label must agree.
    for k, (labels, shape) in enumerate(zip(inputs, shapes)):
        local: dict[str, int] = {}
        for lab, d in zip(labels, shape):
            if lab in local and local[lab] != d:
                raise EinsumError(
                    f"einsum label {lab!r} is repeated in operand {k} with different sizes "
                    f"({local[lab]} != {d}); shape {shape}"
                )
            local[lab] = d
        for ax, (lab, d) in enumerate(zip(labels, shape)):
            if lab not in sizes or (sizes[lab] == 1 and d != 1):
                sizes[lab] = d
                size_origin[lab] = (k, ax)
            elif d not in (1, sizes[lab]):
                j, jax = size_origin[lab]
                raise EinsumError(
                    f"einsum label {describe_label(lab)} has size {d} in operand {k} (axis {ax}) but size "
                    f"{sizes[lab]} in operand {j} (axis {jax}); shapes {shapes}"
                )
    # an axis of size 1 whose label is larger (or 0) elsewhere is broadcast: it carries no
    # label. Every occurrence of such a label in an operand goes, a repeated one included:
    # numpy's "ii,i->i" with a (1, 1) and b (3,) is a[0, 0] * b (the size-1 diagonal of a
    # broadcast along i), not a diagonal of a 3 x 3 tile that a does not have.
    final_inputs: list[tuple[str, ...]] = []
    for labels, shape in zip(inputs, shapes):
        keep, sq = [], []
        for ax, (lab, d) in enumerate(zip(labels, shape)):
            if d == 1 and sizes[lab] != 1:
                sq.append(ax)
            else:
                keep.append(lab)
        final_inputs.append(tuple(keep))
        squeezed.append(tuple(sq))
    ell_out = tuple(_ellipsis_label(max_ell - 1 - q) for q in range(max_ell))

    if arrow == -1:
        counts: dict[str, int] = {}
        for letters, _ in parsed:
            for ch in letters:
                counts[ch] = counts.get(ch, 0) + 1
        output = ell_out + tuple(sorted(ch for ch, c in counts.items() if c == 1))
    else:
        out_text_start = arrow + 2
        letters, ell = _scan_operand(text, out_text_start, len(text))
        seen: set[str] = set()
        for ch in letters:
            pos = text.index(ch, out_text_start)
            if ch in seen:
                raise EinsumError(f"einsum output subscript {ch!r} appears more than once\n{caret(text, pos)}")
            if ch not in sizes:
                raise EinsumError(
                    f"einsum output subscript {ch!r} does not appear in any input\n{caret(text, pos)}"
                )
            seen.add(ch)
        if ell is None:
            if max_ell:
                # numpy sums away broadcast dims not named in the output only in implicit mode
                raise EinsumError(
                    f"einsum output of {text!r} has no ellipsis but the inputs broadcast "
                    f"{max_ell} dimension(s); write '...' in the output"
                )
            output = tuple(letters)
        else:
            output = tuple(letters[:ell]) + ell_out + tuple(letters[ell:])
    named = {lab for labels in final_inputs for lab in labels} | set(output)
    if len(named) > MAX_LABELS:
        # the tile kernels run numpy's einsum, whose subscripts are 52 letters (numpy's own
        # einsum takes more only as broadcast dimensions); an IndexError in a UDF before
        raise EinsumError(f"einsum {text!r} has {len(named)} distinct labels (each dimension an ellipsis stands for "
                          f"counts as one): at most {MAX_LABELS}")
    # (the join space is checked per node, once a product of many operands is lowered to pairs:
    # ``check_join_space``; nine 100x100 matrices span 1e20 together, 1e6 a pair, a trial)
    return EinsumSpec(
        inputs=tuple(final_inputs),
        output=output,
        sizes=tuple(sorted(sizes.items())),
        squeezed=tuple(squeezed),
        text=text,
    )
