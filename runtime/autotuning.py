"""One autotuning experiment, measured from inside the run: an observer on the engine's event seam.

The tuner (``dslaunch --autotuning``) starts each experiment with ``autotuning.metric_path`` set
in its ds_config; only then does the engine add ``ExperimentProfile``. It times each optimizer
step after ``start_profile_step`` up to ``end_profile_step`` by the wall clock between consecutive
step records, so everything the script does between steps (data loading included) counts; the
steps up to ``start_profile_step`` are warm-up and not timed. The metrics are the median step's
(latency; throughput = its samples / the median step time): one slow step on a shared host (a
page fault, a neighbour's burst) moves a mean but not the median. At
``end_profile_step`` rank 0 writes the metrics file and every rank leaves (``SystemExit(0)``), as
DeepSpeed's engine does in an autotuning experiment.

Memory: each rank's peak since the engine was built (CUDA: the allocator's peak; CPU: the
process's peak resident set, reset when the engine is built, Linux's ``clear_refs``). On a CPU
host there is no device memory to run out of, so a rank whose peak passes
``autotuning.memory_per_device`` raises ``MemoryError`` itself at that step: the launcher records
the experiment as out of memory, as it would a CUDA OOM.

collective: the engine adds the observer on every rank (the peak is all-reduced at the end).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.config.autotuning import AutotuningConfig
from dslaunch.runtime.events import Observer, StepRecord
from dslaunch.safe_write import split_path, write_file

__all__ = ["ExperimentProfile", "peak_memory", "reset_peak_memory", "model_counts"]

_HWM = re.compile(r"VmHWM:\s+(\d+) kB")


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over: CUDA's allocator statistics, or the process's VmHWM (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size to the current one
    except OSError:
        pass  # not Linux, or not allowed: the peak counts from the process's start


def peak_memory(device: torch.device) -> int:
    """Bytes at the peak since the last reset (CPU: resident set, what a rank takes of the host)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            m = _HWM.search(f.read())
    except OSError:
        m = None
    if m is not None:
        return int(m[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ExperimentProfile(Observer):
    """Times the profiled steps, enforces the memory limit on CPU, writes the metrics, leaves.

    Args:
        cfg: the experiment's ``autotuning`` block (``metric_path`` set).
        rank: this rank.
        device: the engine's device.
        module: the model (its size goes into the metrics: the tuner's model info).
        flops_profiler: the engine's ``FlopsProfiler`` (the tuner enables it for ``metric: flops``): the
            flops of the step it counted, before ``start_profile_step``.
        clock: the wall clock (tests pass their own).
    """

    def __init__(self, cfg: AutotuningConfig, rank: int, device: torch.device, module: torch.nn.Module,
                 flops_profiler: Any = None, clock: Callable[[], float] = time.perf_counter):
        assert cfg.metric_path is not None
        self.cfg, self.rank, self.device = cfg, rank, device
        self.num_params, self.largest_layer = model_counts(module)
        self.flops_profiler, self.clock = flops_profiler, clock
        self._last: tuple[float, int] | None = None  # (time, samples) at the last profiled step's end
        self._steps: list[tuple[float, int]] = []  # (seconds, samples) of each profiled step
        reset_peak_memory(device)

    def on_step(self, record: StepRecord) -> None:
        peak = peak_memory(self.device)
        limit = self.cfg.memory_per_device
        if self.device.type != "cuda" and limit is not None and peak > limit:
            raise MemoryError(f"out of memory: rank {self.rank} peaked at {peak / 2**20:.0f} MiB by step "
                              f"{record.step}, above autotuning.memory_per_device ({limit / 2**20:.0f} MiB)")
        if self.cfg.start_profile_step <= record.step <= self.cfg.end_profile_step:
            now = self.clock()
            if self._last is not None:
                self._steps.append((max(now - self._last[0], 1e-9), record.samples - self._last[1]))
            self._last = (now, record.samples)
        if record.step == self.cfg.end_profile_step and self._steps:
            self._finish(peak)

    def _finish(self, peak: int) -> None:
        seconds, samples = _median_step(self._steps)
        peak = _max_over_ranks(peak, self.device)
        if self.rank == 0:
            metrics = {"throughput": samples / seconds, "latency": seconds,
                       "peak_memory": peak, "num_params": self.num_params, "largest_layer": self.largest_layer,
                       "steps": len(self._steps), "step_seconds": [round(t, 6) for t, _ in self._steps]}
            counted = getattr(self.flops_profiler, "last", None)  # its profile, once the step ended
            if counted is not None:
                metrics["FLOPS_per_gpu"] = (counted.fwd_flops + counted.bwd_flops) / seconds
            _write_json(self.cfg.metric_path, metrics)
            print(f"[dslaunch] autotuning experiment measured: {metrics}", flush=True)
        raise SystemExit(0)  # the experiment is done: the tuner reads the file


def _median_step(steps: list[tuple[float, int]]) -> tuple[float, float]:
    """The median step's seconds and samples (every step has the same samples but the last of an
    epoch's)."""
    return statistics.median(t for t, _ in steps), statistics.median(n for _, n in steps)


def model_counts(module: torch.nn.Module) -> tuple[int, int]:
    """(parameters, the most one module holds itself), whole sizes also when ZeRO-3 partitioned them."""
    def size(p: torch.nn.Parameter) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    own = [sum(size(p) for p in m.parameters(recurse=False)) for m in module.modules()]
    return sum(size(p) for p in module.parameters()), max(own, default=0)


def _max_over_ranks(value: int, device: torch.device) -> int:
    """collective: every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Atomically: the tuner never reads half a file."""
    write_file(*split_path(path), json.dumps(data))  # by safe_write's rule: never through a link
