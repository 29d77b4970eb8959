"""A stand-in for CuPy on machines without a GPU: the device path's tests run the real kernels
with this as their namespace, so what would break on CuPy breaks here too.

Its arrays (``DeviceArray``) are numpy arrays of a class of their own, and it is as strict as
CuPy about mixing them with host memory:

- its functions take its arrays, Python scalars and numpy scalars; a numpy array passed where
  CuPy wants a device array is a ``TypeError`` (CuPy's "Unsupported type");
- numpy's ufuncs on its arrays compute here (CuPy implements ``__array_ufunc__``), and refuse a
  host array among the operands as CuPy does;
- ``asarray`` uploads (a copy, counted), ``ndarray.get(out=)`` downloads (counted);
- any other numpy function on its arrays is a ``TypeError`` naming it, so a kernel that slips
  into numpy on device data is caught, not silently run on the host.
"""

from __future__ import annotations

import numpy as np

ndarray_base = np.ndarray
uploads = [0, 0]  # transfers, bytes
downloads = [0, 0]
tf32 = [False]  # float32 products on TF32 (set_tf32): their inputs rounded to a 10-bit mantissa


def reset() -> None:
    uploads[:] = [0, 0]
    downloads[:] = [0, 0]
    tf32[0] = False


def _host(a):
    return a.view(np.ndarray) if isinstance(a, DeviceArray) else a


def _check(args, where: str) -> None:
    for a in args:
        if isinstance(a, (list, tuple)):
            _check(a, where)
        elif isinstance(a, np.ndarray) and not isinstance(a, DeviceArray):
            raise TypeError(f"simcupy.{where}: Unsupported type {type(a)} (a host array where a device array "
                            "is wanted)")


def _dev(r):
    if isinstance(r, np.ndarray) and not isinstance(r, DeviceArray):
        return r.view(DeviceArray)
    if isinstance(r, tuple):
        return tuple(_dev(x) for x in r)
    return r


# numpy functions (not ufuncs) the kernels' joins call, which CuPy implements for its arrays
CUPY_FUNCTIONS = {"where"}


class DeviceArray(np.ndarray):
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        _check(inputs, f"{ufunc.__name__}.{method}")
        if out is not None:
            _check(out, f"{ufunc.__name__}.{method}(out=)")
            kw["out"] = tuple(_host(o) for o in out)
        r = getattr(ufunc, method)(*[_host(x) for x in inputs], **kw)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _dev(r)

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ in CUPY_FUNCTIONS:  # CuPy runs these numpy functions on its arrays (NEP 18)
            _check(args, func.__name__)
            return _dev(func(*[_host(a) for a in args], **kwargs))
        raise TypeError(f"simcupy: numpy.{func.__name__} called on a device array (the host's numpy cannot "
                        "read device memory)")

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Device -> host, into ``out`` if given (CuPy's ``ndarray.get``)."""
        host = self.view(np.ndarray)
        downloads[0] += 1
        downloads[1] += host.nbytes
        if out is None:
            return host.copy()
        if isinstance(out, DeviceArray) or out.shape != host.shape or out.dtype != host.dtype:
            raise ValueError("simcupy.get: out must be a host array of the same shape and dtype")
        np.copyto(out, host)
        return out

    # methods numpy implements through functions a device array refuses above
    def astype(self, dtype, *a, **kw):
        return _dev(self.view(np.ndarray).astype(dtype, *a, **kw))

    def sum(self, *a, **kw):
        return _dev(np.asarray(self.view(np.ndarray).sum(*a, **kw)))


def is_available() -> bool:
    return True


def asarray(a, dtype=None):
    if isinstance(a, DeviceArray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    host = np.asarray(a, dtype=dtype)
    if isinstance(a, np.ndarray):
        uploads[0] += 1
        uploads[1] += host.nbytes
    return np.array(host, copy=True).view(DeviceArray)


def asnumpy(a):
    return a.get() if isinstance(a, DeviceArray) else np.asarray(a)


def empty(shape, dtype=float):
    return np.empty(shape, dtype).view(DeviceArray)


def set_tf32(on: bool) -> None:
    """What ``udfs/devices.float32_products`` calls (CuPy: cuBLAS's compute type)."""
    tf32[0] = bool(on)


def _product_input(x):
    """A float32 operand as TF32 tensor cores read it (10 mantissa bits, rounded) when TF32 is
    on: the emulation makes ``allow_tf32`` observable in the results."""
    x = _host(x)
    if not tf32[0] or x.dtype != np.float32:
        return x
    bits = np.ascontiguousarray(x).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).reshape(x.shape)


def einsum(spec, *operands, optimize=False):
    _check(operands, "einsum")
    return _dev(np.asarray(np.einsum(spec, *[_product_input(x) for x in operands], optimize=optimize)))


def matmul(x, y, out=None):
    _check((x, y), "matmul")
    if out is not None:
        _check((out,), "matmul(out=)")
        np.matmul(_product_input(x), _product_input(y), out=_host(out))
        return out
    return _dev(np.matmul(_product_input(x), _product_input(y)))


def copyto(dst, src, casting="same_kind"):
    _check((dst, src), "copyto")
    np.copyto(_host(dst), _host(src), casting=casting)


def broadcast_to(a, shape):
    _check((a,), "broadcast_to")
    return _dev(np.broadcast_to(_host(a), shape))


add, maximum, minimum, multiply = np.add, np.maximum, np.minimum, np.multiply
