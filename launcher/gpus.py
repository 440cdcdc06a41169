"""Local accelerator detection: NVIDIA GPUs through NVML (``pynvml``), else CPU workers.

Cheap on machines without a GPU: when no NVIDIA driver is present (``/dev/nvidiactl``,
``/proc/driver/nvidia``) NVML is not even imported. The fallback says why, so the CLI can tell
the user once that it starts CPU worker processes (gloo) instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

__all__ = ["Accelerators", "detect"]


@dataclass(frozen=True)
class Accelerators:
    """What this machine offers to workers."""

    kind: Literal["cuda", "cpu"]
    count: int
    """GPUs for ``cuda``; usable CPU cores for ``cpu``."""
    memory: tuple[int, ...] = ()
    """Bytes of memory per GPU (``cuda``), or the machine's RAM as one entry (``cpu``)."""
    reason: str = ""
    """For ``cpu``: why no GPU was used (shown to the user once)."""


def detect() -> Accelerators:
    """NVIDIA GPUs if NVML reports any, else the CPU with the reason."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")):
        return _cpu("no NVIDIA driver found")
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return _cpu("the pynvml module (nvidia-ml-py) is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return _cpu(f"NVML: {err}")
    try:
        count = pynvml.nvmlDeviceGetCount()
        memory = tuple(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                       for i in range(count))
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        return _cpu("NVML reports 0 GPUs")
    return Accelerators("cuda", count, memory)


def _cpu(reason: str) -> Accelerators:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Accelerators("cpu", len(os.sched_getaffinity(0)), (ram,), reason)
