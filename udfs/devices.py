"""Tile kernels per device: the module holding a device's kernels and the array namespace they
compute with.

A kernel spec names its device (``plan/kernel_spec.py``); the UDFs build the kernel from the
module registered under that name, handing it the device's array namespace. The numpy kernels
(``kernels.py``) are ``"cpu"``; kernels for CuPy or PyTorch would be a new module registered
here under their device name, next to the numpy one rather than inside it. A spec for a device
with no kernels here is an ``EinsumError`` listing those there are.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from eindecomp_sql.errors import EinsumError

# device -> (module with EinsumKernel, FusedKernel and RetileKernel classes, array namespace module);
# both imported on first use, so a GPU library loads only when a spec asks for its device
KERNELS: dict[str, tuple[str, str]] = {
    "cpu": (f"{__package__}.kernels", "numpy"),
}


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


def kernel_module(device: str) -> ModuleType:
    """The module holding ``device``'s kernel classes."""
    return importlib.import_module(_entry(device)[0])


def namespace(device: str) -> ModuleType:
    """The array namespace ``device``'s kernels compute with (numpy for ``"cpu"``)."""
    return importlib.import_module(_entry(device)[1])
