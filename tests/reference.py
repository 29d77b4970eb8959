"""A plain numpy reference for the extended einsum, written independently of the kernels:
take diagonals, broadcast every operand over all labels, apply the join, reduce the rest."""

from functools import reduce

import ml_dtypes  # noqa: F401 - numpy's "bfloat16"
import numpy as np

AGG = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
JOIN = {
    "mul": np.multiply, "add": np.add, "sub": np.subtract, "div": np.true_divide,
    "max": np.maximum, "min": np.minimum,
}
UNARY = {
    "exp": np.exp, "log": np.log, "relu": lambda x: np.maximum(x, np.zeros((), x.dtype)), "neg": np.negative,
    "square": np.square, "sqrt": np.sqrt, "abs": np.abs,
}


BFLOAT16 = np.dtype("bfloat16")


def reference(spec: str, *arrays, join="mul", agg="sum"):
    if any(np.asarray(a).dtype.name == "bfloat16" for a in arrays):  # either byte order
        return _bfloat16_reference(spec, *arrays, join=join, agg=agg)
    if join == "mul" and agg == "sum":
        return np.einsum(spec, *arrays)
    lhs, out = spec.split("->")
    ins = lhs.split(",")
    labels = list(dict.fromkeys("".join(ins) + out))
    sizes = {}
    for s, a in zip(ins, arrays):
        for ch, d in zip(s, np.shape(a)):
            # numpy broadcasting: a size-1 axis takes any size, size 0 included
            sizes[ch] = d if sizes.get(ch, 1) == 1 else sizes[ch]
    order = list(out) + [c for c in labels if c not in out]
    aligned = []
    for s, a in zip(ins, arrays):
        a = np.asarray(a)
        uniq = "".join(dict.fromkeys(s))
        if uniq != s:
            a = np.einsum(f"{s}->{uniq}", a)
        src = "".join(c for c in order if c in uniq)
        a = np.einsum(f"{uniq}->{src}", a)
        shape = [a.shape[src.index(c)] if c in uniq else 1 for c in order]
        aligned.append(a.reshape(shape))
    if callable(join):
        vals = join(*aligned)
    elif join in UNARY:
        vals = UNARY[join](aligned[0])
    else:
        vals = reduce(JOIN[join], aligned)
    vals = np.broadcast_to(vals, [sizes[c] for c in order])
    axes = tuple(range(len(out), len(order)))
    if not axes:  # nothing is aggregated: an element-wise join keeps the join's dtype
        return np.array(vals)
    return AGG[agg].reduce(vals, axis=axes)


def _bfloat16_reference(spec: str, *arrays, join, agg):
    """numpy has no bfloat16 arithmetic of its own (np.einsum refuses it), so the rule the
    project documents: the dtype numpy gives with float16 in bfloat16's place (float16 then
    meaning bfloat16, or float32 next to a real float16), the values computed in float32."""
    arrays = [np.asarray(a) for a in arrays]
    with np.errstate(all="ignore"):
        dt = reference(spec, *[a.astype(np.float16) if a.dtype.name == "bfloat16" else a for a in arrays],
                       join=join, agg=agg).dtype
        if dt == np.float16:
            dt = np.dtype(np.float32) if any(a.dtype.newbyteorder("=") == np.float16 for a in arrays) else BFLOAT16
        wide = reference(spec, *[a.astype(np.float32) if a.dtype.name == "bfloat16" else a for a in arrays],
                         join=join, agg=agg)
    return np.asarray(wide).astype(dt)
