"""The one kernel dispatch point: ``get(op, device)`` -> a fused implementation or the reference.

A ``KernelTable`` maps each op to its reference implementation (torch code, always available) and
to the fused implementations registered for it (``Kernel``: device types it runs on, and a check
that it can run here, e.g. that its extension loads). ``get`` picks by the ``DSLAUNCH_KERNELS``
mode, read at every call:

- ``auto`` (default): the first fused kernel for the device's type whose check passes, else the
  reference;
- ``reference``: always the reference (to rule a fused kernel out, or to compare against it);
- ``fused``: a fused kernel or ``UsageError`` naming the op and the device (to be sure one runs).

Implementations are named ``"module:qualname"`` and imported on first use, so importing this
module imports no torch and no extension.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dslaunch.errors import UsageError

__all__ = ["ENV", "MODES", "Kernel", "KernelTable", "KERNELS", "get", "mode"]

ENV = "DSLAUNCH_KERNELS"
MODES = ("auto", "reference", "fused")

Target = str | Callable[..., Any]  # "module:qualname", or the callable itself


@dataclass(frozen=True)
class Kernel:
    """A fused implementation of one op.

    Attributes:
        target: the implementation, with the op's signature.
        device_types: the ``torch.device.type`` values it runs on (``"cpu"``, ``"cuda"``).
        available: returns whether it can run in this process (its extension loads, the
            hardware has the instructions); None: always. Called at every ``get``: cache inside.
    """

    target: Target
    device_types: tuple[str, ...]
    available: Target | None = None

    def runs_on(self, device_type: str) -> bool:
        return device_type in self.device_types and (self.available is None or bool(_load(self.available)()))


@dataclass(frozen=True)
class KernelTable:
    """Each op's reference implementation and the fused kernels registered for it."""

    reference: Mapping[str, Target]
    fused: Mapping[str, tuple[Kernel, ...]] = field(default_factory=dict)

    def get(self, op: str, device: Any, mode: str = "auto") -> Callable[..., Any]:
        """The implementation of ``op`` for ``device`` (a ``torch.device`` or its string) in ``mode``.

        Raises:
            UsageError: unknown op, or mode ``fused`` and no fused kernel runs on this device.
        """
        if op not in self.reference:
            raise UsageError(f"unknown kernel op {op!r}; known: {', '.join(sorted(self.reference))}")
        device_type = getattr(device, "type", None) or str(device).split(":")[0]
        if mode != "reference":
            for kernel in self.fused.get(op, ()):
                if kernel.runs_on(device_type):
                    return _load(kernel.target)
            if mode == "fused":
                raise UsageError(f"{ENV}=fused: no fused {op!r} kernel runs on {device_type!r} here; "
                                 f"unset {ENV} (or set it to auto) to use the reference implementation")
        return _load(self.reference[op])


@functools.cache  # an optimizer asks at every step: importlib's lookup was ~10% of a small step
def _load(target: Target) -> Callable[..., Any]:
    if callable(target):
        return target
    module, qualname = target.split(":")
    obj: Any = importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return obj


# The C kernels of kernels/cpu/, built on first use (build.py); unavailable without a compiler.
_CPU_AVAILABLE = "dslaunch.kernels.cpu.build:available"
_CPU_KERNELS = {
    "adam": "dslaunch.kernels.cpu.ops:adam_op",
    "cpu_adam": "dslaunch.kernels.cpu.ops:cpu_adam_op",
    "lion": "dslaunch.kernels.cpu.ops:lion_op",
    "adagrad": "dslaunch.kernels.cpu.ops:adagrad_op",
    "torch.adam": "dslaunch.kernels.cpu.torch_steps:adam_step",
    "torch.adamw": "dslaunch.kernels.cpu.torch_steps:adam_step",
    "torch.adagrad": "dslaunch.kernels.cpu.torch_steps:adagrad_step",
    "onebit_pack": "dslaunch.kernels.cpu.compress:onebit_pack",
    "onebit_unpack": "dslaunch.kernels.cpu.compress:onebit_unpack",
}
# The Triton kernels of kernels/triton/: available where triton imports and a CUDA device exists.
_TRITON_AVAILABLE = "dslaunch.kernels.triton:available"
_TRITON_KERNELS = {
    "adam": "dslaunch.kernels.triton.adam:adam_op",
    "layer_norm": "dslaunch.kernels.triton.norms:layer_norm",
    "rms_norm": "dslaunch.kernels.triton.norms:rms_norm",
    "bias_gelu": "dslaunch.kernels.triton.bias_gelu:bias_gelu",
    "onebit_pack": "dslaunch.kernels.triton.onebit:onebit_pack",
    "onebit_unpack": "dslaunch.kernels.triton.onebit:onebit_unpack",
    "cross_entropy": "dslaunch.kernels.triton.cross_entropy:cross_entropy_rows",
    "block_sparse_sdd": "dslaunch.kernels.triton.block_sparse:sdd",
    "block_sparse_spmm": "dslaunch.kernels.triton.block_sparse:spmm",
}


def _fused(*backends: tuple[tuple[str, ...], str, Mapping[str, str]]) -> dict[str, tuple[Kernel, ...]]:
    """Each op's kernels from ``(device types, availability check, {op: target})`` backends."""
    table: dict[str, tuple[Kernel, ...]] = {}
    for device_types, available, targets in backends:
        for op, target in targets.items():
            table[op] = (*table.get(op, ()), Kernel(target, device_types, available=available))
    return table


# The ops and their signatures are listed in the package docstring (``dslaunch.kernels``).
KERNELS = KernelTable(
    reference={
        "adam": "dslaunch.kernels.reference:adam_update",
        "cpu_adam": "dslaunch.kernels.reference:cpu_adam_update",
        "lion": "dslaunch.kernels.reference:lion_update",
        "adagrad": "dslaunch.kernels.reference:adagrad_update",
        "torch.adam": "dslaunch.kernels.reference:torch_step",
        "torch.adamw": "dslaunch.kernels.reference:torch_step",
        "torch.sgd": "dslaunch.kernels.reference:torch_step",
        "torch.adagrad": "dslaunch.kernels.reference:torch_step",
        "layer_norm": "dslaunch.kernels.reference:layer_norm",
        "rms_norm": "dslaunch.kernels.reference:rms_norm",
        "bias_gelu": "dslaunch.kernels.reference:bias_gelu",
        "onebit_pack": "dslaunch.kernels.reference:pack_reference",
        "onebit_unpack": "dslaunch.kernels.reference:unpack_reference",
        "cross_entropy": "dslaunch.kernels.reference:cross_entropy_rows",
        "block_sparse_sdd": "dslaunch.kernels.block_sparse.format:sdd",
        "block_sparse_spmm": "dslaunch.kernels.block_sparse.format:spmm",
    },
    fused=_fused((("cpu",), _CPU_AVAILABLE, _CPU_KERNELS), (("cuda",), _TRITON_AVAILABLE, _TRITON_KERNELS)),
)


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """The dispatch mode from ``DSLAUNCH_KERNELS`` (default ``auto``).

    Raises:
        UsageError: a value other than auto, reference or fused.
    """
    value = environ.get(ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise UsageError(f"{ENV}={environ[ENV]!r} is not one of {', '.join(MODES)}")
    return value


def get(op: str, device: Any) -> Callable[..., Any]:
    """``op``'s implementation for ``device``: fused where registered and available, else the
    reference; ``DSLAUNCH_KERNELS`` overrides (see the module docstring).

    Raises:
        UsageError: unknown op, a bad ``DSLAUNCH_KERNELS``, or ``fused`` without a fused kernel.
    """
    return KERNELS.get(op, device, mode())
