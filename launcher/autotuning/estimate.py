"""Pruning by memory: the estimator the search asks before it runs a candidate, and the limit.

The search needs only ``Estimate``: a callable from a candidate's ds_config (a dict) to the bytes
one rank is expected to need. ``engine_estimate`` is dslaunch's memory estimator
(``dslaunch.runtime.estimate``, what ``dslaunch estimate`` prints: the engine's own buffers by
stage, offload and precision) for the model the profiling experiment measured; on a CPU host a
rank's process holds its "device" and its "host" parts alike (offload saves nothing there), so
it counts both. The tuner adds what the profiling experiment held beyond the estimate (the
framework, the activations of its batch) to every candidate's estimate. The tuner knows the
model's size, not its shapes, so activations come from the experiments instead (``ActivationFit``):
a rank's peak beyond that estimate grows linearly with the micro batch (the estimator's own
activation formula is linear in it), with one slope per checkpointing setting; once two micro
batches of a setting were measured, every open candidate whose estimate plus its fitted
activations is above the limit is pruned before it runs.
``model_states_estimate`` is the small fallback (fp32 Adam's 16 bytes per parameter divided by
stage) for a build without the estimator.

``memory_limit``: ``autotuning.memory_per_device`` if given, else the GPU's memory, else the
host's RAM over its ranks. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Estimate", "ModelInfo", "ActivationFit", "engine_estimate", "model_states_estimate", "memory_limit"]

Estimate = Callable[[Mapping[str, Any]], int]
"""A candidate's ds_config -> estimated peak bytes on one rank."""


@dataclass(frozen=True)
class ModelInfo:
    """What the profiling experiment (or ``autotuning.model_info``) says about the model."""

    num_params: int
    largest_layer: int = 0
    """The most parameters one module holds itself (what ZeRO-3 gathers at once); 0: unknown."""


class ActivationFit:
    """Activation bytes as a line in the micro batch, one per checkpointing setting, fitted (least
    squares) to what measured experiments held beyond the model-states estimate.

    A setting with fewer than two micro batches measured predicts nothing (None): one point cannot
    tell the framework's constant from the batch's share. Not thread-safe; one per search.
    """

    def __init__(self) -> None:
        self._points: dict[bool | None, list[tuple[int, float]]] = {}

    def add(self, checkpointing: bool | None, micro_batch: int, beyond_estimate: float) -> None:
        """An experiment of ``micro_batch`` held ``beyond_estimate`` bytes more than estimated."""
        self._points.setdefault(checkpointing, []).append((micro_batch, beyond_estimate))

    def slope(self, checkpointing: bool | None) -> tuple[float, float] | None:
        """(bytes at micro batch 0, bytes per sample) of the setting, or None."""
        points = self._points.get(checkpointing, [])
        if len({mb for mb, _ in points}) < 2:
            return None
        n = len(points)
        mx, my = sum(mb for mb, _ in points) / n, sum(y for _, y in points) / n
        k = sum((mb - mx) * (y - my) for mb, y in points) / sum((mb - mx) ** 2 for mb, _ in points)
        k = max(k, 0.0)  # noise can tilt two close points; activations never shrink with the batch
        return my - k * mx, k

    def predict(self, checkpointing: bool | None, micro_batch: int) -> float | None:
        """Bytes beyond the model-states estimate at ``micro_batch``, or None (not fitted yet)."""
        line = self.slope(checkpointing)
        return None if line is None else line[0] + line[1] * micro_batch


def engine_estimate(info: ModelInfo, gpus_per_node: int, nodes: int, accelerator: str) -> Estimate:
    """dslaunch's memory estimator for ``info``'s model on this cluster."""
    from dslaunch.runtime.estimate import ModelShape, estimate_memory

    shape = ModelShape.from_counts(info.num_params, largest_layer=min(info.largest_layer, info.num_params))

    def estimate(cfg: Mapping[str, Any]) -> int:
        est = estimate_memory(shape, cfg, gpus_per_node=gpus_per_node, nodes=nodes, accelerator=accelerator)
        return est.rank_bytes if accelerator == "cpu" else est.device_bytes

    return estimate


def model_states_bytes(num_params: int, zero: Mapping[str, Any], dp_world: int) -> int:
    """fp32 Adam's model states on one rank under ``zero`` (a ``zero_optimization`` dict), all on the device."""
    stage = int(zero.get("stage", 0))
    params, grads, optim = 4.0 * num_params, 4.0 * num_params, 8.0 * num_params
    if stage >= 1:
        optim /= dp_world
    if stage >= 2:
        grads /= dp_world
    if stage >= 3:
        params /= dp_world
    return int(params + grads + optim)


def model_states_estimate(info: ModelInfo, dp_world: int) -> Estimate:
    """The fallback estimator: fp32 Adam's model states by stage (no offload, no activations)."""

    def estimate(cfg: Mapping[str, Any]) -> int:
        return model_states_bytes(info.num_params, cfg.get("zero_optimization") or {}, dp_world)

    return estimate


def memory_limit(given: int | None, local_ranks: int, gpu_bytes: int | None) -> int:
    """Bytes one rank may use: ``given``, else the GPU's memory, else host RAM / ranks."""
    if given is not None:
        return given
    if gpu_bytes:
        return gpu_bytes
    return _host_ram() // max(1, local_ranks)


def _host_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40  # unknown: no limit worth pruning by
