"""``deepspeed.utils.torch``: ``required_torch_version``, the torch version gate scripts use."""

from __future__ import annotations

import re

import torch

__all__ = ["required_torch_version"]


def _release(version: object) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); 1.13 -> (1, 13)."""
    m = re.match(r"[0-9]+(?:\.[0-9]+)*", str(version))
    if m is None:
        raise ValueError(f"required_torch_version: {version!r} is not a version like '2.1'")
    return tuple(int(part) for part in m.group().split("."))


def _compare(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """Whether the running torch is within ``[min_version, max_version]`` (either may be None).

    Raises:
        ValueError: neither bound given, or a bound that is not a version.
    """
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version, max_version or both")
    running = _release(torch.__version__)
    if min_version is not None and _compare(_release(min_version), running) > 0:
        return False
    return max_version is None or _compare(_release(max_version), running) >= 0
