"""numpy's sublist form of einsum, ``einsum(a, [0, 1], b, [1, 2], [0, 2])``, as a spec string.

Labels are integers in ``[0, 52)``; numpy's C einsum maps 0-25 to ``A``-``Z`` and 26-51 to
``a``-``z``, which keeps an implicit output (labels in sorted order) in numeric order, so the
same letters are used here. ``Ellipsis`` stands for ``...``.

>>> sublist_spec(("a", [0, 1], "b", [1, 2], [0, 2]))
('AB,BC->AC', ['a', 'b'])
>>> sublist_spec(("a", [Ellipsis, 30]))[0]
'...e'
"""

from __future__ import annotations

import numbers
import string

from ..errors import EinsumError, EinsumTypeError

_SYMBOLS = string.ascii_uppercase + string.ascii_lowercase
FORMS = ("a spec string and operands, einsum('ij,jk->ik', a, b), or numpy's sublist form, "
         "einsum(a, [0, 1], b, [1, 2], [0, 2])")


def _subscripts(sub, where: str) -> str:
    if isinstance(sub, (str, bytes)) or not hasattr(sub, "__len__") or not hasattr(sub, "__getitem__"):
        raise EinsumTypeError(f"einsum: {where} must be a list of ints (or Ellipsis), got "
                          f"{type(sub).__name__} {sub!r:.60}; einsum takes {FORMS}")
    out, ellipses = [], 0
    for item in sub:
        if item is Ellipsis:
            ellipses += 1
            if ellipses > 1:
                raise EinsumError(f"einsum: {where} {list(sub)!r:.80} has more than one Ellipsis")
            out.append("...")
            continue
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise EinsumTypeError(f"einsum: {where} holds {item!r:.40}; each subscript must be an int in [0, 52) "
                              f"or Ellipsis (einsum takes {FORMS})")
        k = int(item)
        if not 0 <= k < len(_SYMBOLS):
            raise EinsumError(f"einsum: {where} holds {k}, not within the valid range [0, 52)")
        out.append(_SYMBOLS[k])
    return "".join(out)


def sublist_spec(args) -> tuple[str, list]:
    """``(operand, sublist, operand, sublist, ..., [output sublist])`` -> (spec, operands)."""
    args = tuple(args)
    if not args:
        raise EinsumError(f"einsum: no operands; einsum takes {FORMS}")
    operands = list(args[0:len(args) - len(args) % 2:2])
    subs = [_subscripts(s, f"the subscript list of operand {k}") for k, s in enumerate(args[1::2])]
    spec = ",".join(subs)
    if len(args) % 2:
        if len(args) == 1:
            raise EinsumError(f"einsum: an operand without a subscript list; einsum takes {FORMS}")
        spec += "->" + _subscripts(args[-1], "the output subscript list")
    return spec, operands
