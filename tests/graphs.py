"""Graph workloads shared by the tests and the benchmark, each with a numpy reference."""

from __future__ import annotations

import numpy as np

from eindecomp_sql.graph import Graph


def chain(sizes=(30, 7, 45, 12, 60, 5, 20), dtype="float64"):
    g = Graph()
    mats = [g.input(f"m{k}", (a, b), dtype) for k, (a, b) in enumerate(zip(sizes, sizes[1:]))]
    out = mats[0]
    for m in mats[1:]:
        out = g.einsum("ij,jk->ik", out, m)

    def ref(**xs):
        r = xs["m0"]
        for k in range(1, len(mats)):
            r = r @ xs[f"m{k}"]
        return r

    return g, ref


def ffn(b=64, d=32, f=96, dtype="float64"):
    g = Graph()
    x = g.input("x", (b, d), dtype)
    w1 = g.input("w1", (d, f), dtype)
    w2 = g.input("w2", (f, d), dtype)
    h = g.einsum("bi,io->bo", x, w1)
    a = g.map("relu", h)
    g.einsum("bo,oi->bi", a, w2, name="y")

    def ref(x, w1, w2):
        return np.maximum(x @ w1, 0) @ w2

    return g, ref


def swiglu(b=64, d=32, f=96, dtype="float64"):
    """LLaMA's FFN: ``(silu(x @ w1) * (x @ w3)) @ w2``."""
    g = Graph()
    x = g.input("x", (b, d), dtype)
    w1, w3 = g.input("w1", (d, f), dtype), g.input("w3", (d, f), dtype)
    w2 = g.input("w2", (f, d), dtype)
    act = g.elementwise("x * sigmoid(x) * y", g.einsum("bi,io->bo", x, w1), g.einsum("bi,io->bo", x, w3))
    g.einsum("bo,oi->bi", act, w2, name="y")

    def ref(x, w1, w3, w2):
        gt = x @ w1
        return (gt / (1 + np.exp(-gt)) * (x @ w3)) @ w2

    return g, ref


def _softmax_rows(g: Graph, s, spec_in: str):
    """Numerically stable softmax over the last label, in the extended notation only:
    max-aggregate, subtract + exp, sum-aggregate, divide."""
    keep = spec_in[:-1]
    m = g.einsum(f"{spec_in}->{keep}", s, agg="max")
    e = g.einsum(f"{spec_in},{keep}->{spec_in}", s, m, join="exp(x - y)")
    z = g.einsum(f"{spec_in}->{keep}", e)
    return g.einsum(f"{spec_in},{keep}->{spec_in}", e, z, join="div")


def _np_softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _attention(g: Graph, x, wq, wk, wv, wo, e_dim):
    q = g.einsum("sd,dhe->hse", x, wq)
    k = g.einsum("sd,dhe->hse", x, wk)
    v = g.einsum("sd,dhe->hse", x, wv)
    s = g.einsum("hse,hte->hst", q, k)
    s = g.map(f"x * {float(1.0 / np.sqrt(e_dim))!r}", s)
    p = _softmax_rows(g, s, "hst")
    o = g.einsum("hst,hte->hse", p, v)
    return g.einsum("hse,hed->sd", o, wo)


def _np_attention(x, wq, wk, wv, wo):
    q = np.einsum("sd,dhe->hse", x, wq)
    k = np.einsum("sd,dhe->hse", x, wk)
    v = np.einsum("sd,dhe->hse", x, wv)
    s = np.einsum("hse,hte->hst", q, k) / np.sqrt(q.shape[-1])
    p = _np_softmax(s)
    return np.einsum("hse,hed->sd", np.einsum("hst,hte->hse", p, v), wo)


def attention(s=16, d=24, h=3, e=8, dtype="float64"):
    g = Graph()
    x = g.input("x", (s, d), dtype)
    ws = [g.input(n, (d, h, e), dtype) for n in ("wq", "wk", "wv")]
    wo = g.input("wo", (h, e, d), dtype)
    _attention(g, x, *ws, wo, e)

    def ref(x, wq, wk, wv, wo):
        return _np_attention(x, wq, wk, wv, wo)

    return g, ref


def _rmsnorm(g: Graph, x, w, d: int):
    ss = g.einsum("sd->s", x, join="square")
    inv = g.map(f"1 / sqrt(x / {d} + 1e-6)", ss)
    return g.einsum("sd,s,d->sd", x, inv, w)


def _np_rmsnorm(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w


def llama_block(s=16, d=32, h=4, e=8, f=64, dtype="float64"):
    """RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU FFN -> residual."""
    g = Graph()
    x = g.input("x", (s, d), dtype)
    n1 = g.input("n1", (d,), dtype)
    n2 = g.input("n2", (d,), dtype)
    ws = [g.input(n, (d, h, e), dtype) for n in ("wq", "wk", "wv")]
    wo = g.input("wo", (h, e, d), dtype)
    w1 = g.input("w1", (d, f), dtype)
    w3 = g.input("w3", (d, f), dtype)
    w2 = g.input("w2", (f, d), dtype)
    a = _attention(g, _rmsnorm(g, x, n1, d), *ws, wo, e)
    r = g.add(x, a)
    xn = _rmsnorm(g, r, n2, d)
    gate = g.einsum("sd,df->sf", xn, w1)
    up = g.einsum("sd,df->sf", xn, w3)
    act = g.elementwise("x * sigmoid(x) * y", gate, up)
    ff = g.einsum("sf,fd->sd", act, w2)
    g.add(r, ff, name="out")

    def ref(x, n1, n2, wq, wk, wv, wo, w1, w3, w2):
        r = x + _np_attention(_np_rmsnorm(x, n1), wq, wk, wv, wo)
        xn = _np_rmsnorm(r, n2)
        gt, up = xn @ w1, xn @ w3
        return r + (gt / (1 + np.exp(-gt)) * up) @ w2

    return g, ref


def random_inputs(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: (rng.standard_normal(v.shape) / np.sqrt(v.shape[0])).astype(v.dtype) for v in g.inputs}
