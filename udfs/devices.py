"""Tile kernels per device: the module holding a device's kernels and the array namespace they
compute with.

A kernel spec names its device (``plan/kernel_spec.py``); the UDFs build the kernel from the
module registered under that name, handing it the device's array namespace. The numpy kernels
(``kernels.py``) are ``"cpu"``; kernels for CuPy or PyTorch would be a new module registered
here under their device name, next to the numpy one rather than inside it. A spec for a device
with no kernels here is an ``EinsumError`` listing those there are.

``"cuda"`` runs the same kernel classes with CuPy as the namespace: CuPy mirrors numpy's
functions and ufuncs (``einsum``, ``matmul``, ``copyto`` with ``casting``, ``add.reduce``), so
one kernel module serves both, and bfloat16 comes from the same ``ml_dtypes`` type (CuPy 14).
The UDFs move a call's tiles to the device and its results back (``to_device`` / ``to_host``,
``udfs/register.py``); the kernels never see host arrays there. CuPy is an optional extra
(``pip install "eindecomp_sql[gpu]"``), imported only when a spec names ``"cuda"``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from types import ModuleType

import numpy as np

from eindecomp_sql.errors import EinsumError

# device -> (module with EinsumKernel, FusedKernel and RetileKernel classes, array namespace module);
# both imported on first use, so a GPU library loads only when a spec asks for its device
KERNELS: dict[str, tuple[str, str]] = {
    "cpu": (f"{__package__}.kernels", "numpy"),
    "cuda": (f"{__package__}.kernels", "cupy"),
}
# one kernel at a time on a device: DuckDB calls UDFs from several threads, and each call's
# transfers and kernels go on the device's one default stream anyway (the TURNIP worker,
# udfs/runtime.py, is what will overlap them)
DEVICE_LOCK = threading.Lock()


def devices() -> tuple[str, ...]:
    """The devices with kernels in this process."""
    return tuple(KERNELS)


def register_device(device: str, kernels: str, namespace: str) -> None:
    """Kernels for ``device``: the module named ``kernels`` (its ``EinsumKernel``,
    ``FusedKernel`` (a spec with a fused program) and ``RetileKernel`` take a spec and ``xp=``)
    computing with the array module ``namespace``."""
    KERNELS[device] = (kernels, namespace)


def _entry(device: str) -> tuple[str, str]:
    entry = KERNELS.get(device)
    if entry is None:
        raise EinsumError(f"no tile kernels for device {device!r}; devices with kernels: {', '.join(KERNELS)}")
    return entry


def available(device: str) -> bool:
    """Whether ``device`` can run kernels in this process: always for ``"cpu"``; for another,
    its namespace imports and says a device is there (CuPy's ``is_available()``). Asked once
    per process and registration (every ``connect()`` asks: a failed import is not cached)."""
    if device == "cpu":
        return True
    return _available(device, KERNELS.get(device))


@functools.lru_cache(maxsize=None)
def _available(device: str, entry) -> bool:
    if entry is None:
        return False
    try:
        xp = namespace(device)
    except Exception:  # noqa: BLE001 - not installed (EinsumError), or its import failed otherwise
        return False
    try:
        return bool(xp.is_available())
    except Exception:  # noqa: BLE001
        return False


def default_budget(device: str) -> int:
    """The bytes a session's device cache may hold when ``device_memory`` is not given: half
    the device's memory (the rest is the calls' own operands, results and temporaries), or
    1 GiB where the namespace cannot say (the CPU stand-in)."""
    try:
        return int(namespace(device).cuda.Device().mem_info[1]) // 2
    except Exception:  # noqa: BLE001 - no CUDA runtime to ask
        return 1 << 30


def release_memory(device: str) -> None:
    """Hand the device memory no array holds back to the driver (CuPy keeps freed blocks in its
    pool for reuse; a closed session's should not stay there for the next library)."""
    try:
        pool = namespace(device).get_default_memory_pool()
    except Exception:  # noqa: BLE001 - no such namespace, or no pool (the CPU stand-in)
        return
    pool.free_all_blocks()


def to_device(xp: ModuleType, a: np.ndarray):
    """``a`` (host memory) as an array of ``xp`` (itself for numpy; an upload for a device)."""
    return a if xp is np else xp.asarray(a)


def to_host(x, out: np.ndarray) -> None:
    """Copy ``x`` (an array of a device's namespace, or numpy) into the host array ``out``."""
    if not hasattr(x, "get"):  # a numpy array (a device's arrays copy themselves back with get)
        if x is not out:
            np.copyto(out, x, casting="unsafe")
        return
    if x.dtype != out.dtype:
        x = x.astype(out.dtype)
    x.get(out=out)  # CuPy: device -> host straight into the output buffer


@contextlib.contextmanager
def float32_products(xp: ModuleType, tf32: bool):
    """Within: float32 products of ``xp`` use TF32 if ``tf32``, else full float32 (set either
    way: CuPy's ``CUPY_TF32`` environment variable would otherwise decide). Process-wide in
    CuPy, so callers hold ``DEVICE_LOCK``. Nothing to do for numpy."""
    if xp is np:
        yield
        return
    setter = getattr(xp, "set_tf32", None) or _cupy_tf32
    setter(tf32)
    try:
        yield
    finally:
        if tf32:
            setter(False)


def _cupy_tf32(on: bool) -> None:
    # Two switches, as CuPy 14 has two GEMM paths: its compute type for float32, which its 2-D
    # products read (dot, tensordot, a 2-D matmul: cupy/_core/_routines_linalg.pyx, whose
    # constants these are), and the calling thread's cuBLAS handle's math mode, which its
    # batched matmul (gemmStridedBatchedEx with a float32 compute type) follows
    from cupy._core import _routines_linalg as linalg
    from cupy.cuda import cublas, device

    tf32, default = getattr(linalg, "COMPUTE_TYPE_TF32", 7), getattr(linalg, "COMPUTE_TYPE_DEFAULT", 1)
    linalg.set_compute_type(np.float32, tf32 if on else default)
    mode = getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3) if on else getattr(cublas, "CUBLAS_DEFAULT_MATH", 0)
    cublas.setMathMode(device.get_cublas_handle(), mode)


def kernel_module(device: str) -> ModuleType:
    """The module holding ``device``'s kernel classes."""
    return importlib.import_module(_entry(device)[0])


def namespace(device: str) -> ModuleType:
    """The array namespace ``device``'s kernels compute with (numpy for ``"cpu"``)."""
    name = _entry(device)[1]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise EinsumError(f"device {device!r} computes with {name}, which does not import here ({e}); "
                          "for 'cuda' install CuPy: pip install \"eindecomp_sql[gpu]\"") from e
