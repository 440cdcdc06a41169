"""Pruning by memory: the estimator the search asks before it runs a candidate, and the limit.

The search needs only ``Estimate``: a callable from a candidate's ds_config (a dict) to the bytes
one rank is expected to need. Any estimator fits behind it (``dslaunch estimate``'s, when
installed); ``model_states_estimate`` is the built-in fallback: ZeRO's model states (fp32 Adam:
parameters 4 B, gradients 4 B, optimizer state 8 B per parameter, divided over the data-parallel
ranks by stage, moved off the device by offload) plus the fixed cost measured by the profiling
experiment. It leaves activations out, so it never prunes a candidate for its micro batch: the
search's own rule does (a micro batch that ran out of memory rules out larger ones, ``dominates``).

``memory_limit``: ``autotuning.memory_per_device`` if given, else the GPU's memory, else the
host's RAM over its ranks. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Estimate", "ModelInfo", "model_states_estimate", "memory_limit"]

Estimate = Callable[[Mapping[str, Any]], int]
"""A candidate's ds_config -> estimated peak bytes on one rank."""


@dataclass(frozen=True)
class ModelInfo:
    """What the profiling experiment (or ``autotuning.model_info``) says about the model."""

    num_params: int
    overhead: int = 0
    """Bytes a rank holds beside model states and activations (the framework, buffers), as
    measured by the profiling experiment; 0 when not measured."""


def model_states_bytes(num_params: int, zero: Mapping[str, Any], dp_world: int) -> int:
    """fp32 Adam's model states on one rank under ``zero`` (a ``zero_optimization`` dict)."""
    stage = int(zero.get("stage", 0))
    params, grads, optim = 4.0 * num_params, 4.0 * num_params, 8.0 * num_params
    if stage >= 1:
        optim /= dp_world
    if stage >= 2:
        grads /= dp_world
    if stage >= 3:
        params /= dp_world
    if _offloaded(zero, "offload_optimizer"):
        optim, grads = 0.0, grads if stage < 2 else 0.0  # the partitioned gradients go to the host too
    if _offloaded(zero, "offload_param"):
        params = 0.0
    return int(params + grads + optim)


def _offloaded(zero: Mapping[str, Any], key: str) -> bool:
    return (zero.get(key) or {}).get("device", "none") not in ("none", None)


def model_states_estimate(info: ModelInfo, dp_world: int) -> Estimate:
    """The fallback estimator: model states plus the measured overhead (no activations)."""

    def estimate(cfg: Mapping[str, Any]) -> int:
        return info.overhead + model_states_bytes(info.num_params, cfg.get("zero_optimization") or {}, dp_world)

    return estimate


def memory_limit(given: int | None, local_ranks: int, gpu_bytes: Callable[[], int | None]) -> int:
    """Bytes one rank may use: ``given``, else the GPU's memory (``gpu_bytes``), else host RAM / ranks."""
    if given is not None:
        return given
    gpu = gpu_bytes()
    if gpu:
        return gpu
    return _host_ram() // max(1, local_ranks)


def _host_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40  # unknown: no limit worth pruning by
