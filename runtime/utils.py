"""DeepSpeed's ``deepspeed.runtime.utils`` (minimum: ``set_random_seed``, ``see_memory_usage``;
helper h35-catalogue owns this module's full catalogue)."""

from __future__ import annotations

import logging
import random
import resource

import torch

__all__ = ["set_random_seed", "see_memory_usage"]

log = logging.getLogger("dslaunch")


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (all devices)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with the device's allocated/peak memory and the process's peak host memory,
    when ``force`` (DeepSpeed's switch; without it nothing is measured)."""
    if not force:
        return
    host_peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    device = ""
    if torch.cuda.is_available():
        device = (f" | device allocated {torch.cuda.memory_allocated() / 2**30:.2f} GB, "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GB")
    log.info("%s%s | host peak %.2f GB", message, device, host_peak_gb)
