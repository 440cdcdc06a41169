"""Achieved FLOP/s and MFU (model FLOPs utilisation): a flops count and a time against the peak.

``throughput(flops, seconds, device, dtype)`` is the one call (the flops profiler's summary uses
it; monitors can call it with a step's flops and time). The peak comes from:

- ``$DSLAUNCH_PEAK_FLOPS`` (FLOP/s per device), when set: the user knows their hardware best;
- on a GPU, ``GPU_PEAKS``: dense (no sparsity) peaks from the vendors' datasheets, by the name
  CUDA reports and the math dtype (bf16/fp16 tensor cores, tf32 when torch allows it, fp32);
- on a CPU, a square-matmul microbenchmark in that dtype at the process's torch thread count,
  times this rank's share when the machine's ranks oversubscribe its cores (``cpu_share``),
  measured once (~0.5 s; ranks of one machine take turns on a lock file) and cached in
  ``$DSLAUNCH_PEAK_CACHE`` (default ``~/.cache/dslaunch/peak_flops.json``) under the CPU model, thread count, dtype and torch
  version, so a later run (or another rank of the same machine) reads it. The cache is the
  user's own (0700 directory, 0600 file); one that another user owns or may write, or that is not
  JSON, is ignored with one warning line and replaced by a new measurement.

An unknown GPU has no peak: MFU is None (the FLOP/s are still given).

Limitations: the CPU peak is what torch's matmul reaches on this machine, not the silicon's
theoretical peak, so CPU MFU reads higher than a datasheet-based figure would; on a machine shared
with other work the measurement is as noisy as the machine (delete the cache file to remeasure).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dslaunch.errors import UsageError, quote

# The same trust rules as the CPU kernels' cache.
from dslaunch.safe_write import write_file
from dslaunch.utils.private_cache import Untrusted, make_private_dirs, open_private_file

__all__ = ["GpuPeak", "GPU_PEAKS", "Peak", "Throughput", "peak_flops", "throughput", "cpu_share", "PEAK_ENV",
           "CACHE_ENV"]

log = logging.getLogger("dslaunch.profiling")

PEAK_ENV = "DSLAUNCH_PEAK_FLOPS"
CACHE_ENV = "DSLAUNCH_PEAK_CACHE"
_T = 1e12


@dataclass(frozen=True)
class GpuPeak:
    """One GPU's dense peaks in FLOP/s, and where the numbers come from."""

    match: str
    """A lower-case substring of ``torch.cuda.get_device_name()``."""
    bf16: float
    tf32: float
    fp32: float
    source: str


# Most specific names first (``h100`` alone would also match an H100 PCIe).
GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak("h200", 989.4 * _T, 494.7 * _T, 66.9 * _T, "NVIDIA H200 datasheet (SXM, dense)"),
    GpuPeak("h100 pcie", 756.5 * _T, 378.0 * _T, 51.2 * _T, "NVIDIA H100 datasheet (PCIe, dense)"),
    GpuPeak("h100", 989.4 * _T, 494.7 * _T, 66.9 * _T, "NVIDIA H100 datasheet (SXM, dense)"),
    GpuPeak("a100", 312.0 * _T, 156.0 * _T, 19.5 * _T, "NVIDIA A100 datasheet (dense)"),
    GpuPeak("a10g", 70.0 * _T, 35.0 * _T, 31.2 * _T, "NVIDIA A10G (AWS) datasheet (dense)"),
    GpuPeak("l4", 121.0 * _T, 60.0 * _T, 30.3 * _T, "NVIDIA L4 datasheet (dense)"),
    GpuPeak("v100", 125.0 * _T, 15.7 * _T, 15.7 * _T, "NVIDIA V100 SXM2 datasheet (fp16 tensor cores)"),
)


@dataclass(frozen=True)
class Peak:
    flops: float
    """FLOP/s of one device in the dtype asked for."""
    source: str
    """Where the number comes from (a datasheet, a measurement, the environment)."""


@dataclass(frozen=True)
class Throughput:
    flops_per_s: float
    mfu: float | None
    """``flops_per_s / peak`` (0..1, may exceed 1 against a measured CPU peak); None: no peak known."""
    peak: Peak | None


def throughput(flops: float, seconds: float, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, peak: Peak | None = None) -> Throughput:
    """Achieved FLOP/s of ``flops`` done in ``seconds`` on one ``device``, and its MFU.

    Args:
        flops: floating-point operations done by this device in that time (forward + backward).
        seconds: wall time they took (> 0).
        device: the device that did them (its type and, for CUDA, its name pick the peak).
        dtype: the math dtype (bf16/fp16 pick the tensor-core peak).
        peak: the peak to use, e.g. ``peak_flops(...)`` looked up earlier, outside a timed step
            (the first CPU lookup measures for ~0.5 s); None: look it up now.

    Returns:
        ``Throughput``; ``mfu`` is None where no peak is known (an unlisted GPU).
    """
    rate = flops / seconds if seconds > 0 else 0.0
    peak = peak if peak is not None else peak_flops(torch.device(device), dtype)
    return Throughput(rate, rate / peak.flops if peak is not None else None, peak)


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> Peak | None:
    """The peak FLOP/s of one ``device`` in ``dtype`` (see the module docstring); None: unknown."""
    if os.environ.get(PEAK_ENV):
        return Peak(_env_peak(os.environ[PEAK_ENV]), f"${PEAK_ENV}")
    if device.type == "cuda":
        return _gpu_peak(torch.cuda.get_device_name(device), dtype, torch.backends.cuda.matmul.allow_tf32)
    return _cpu_peak(dtype, _cache_file())


def _env_peak(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"${PEAK_ENV}={quote(text)}: must be a number > 0, the FLOP/s of one device "
                         "(e.g. 989e12 for an H100's bf16 peak)")
    return value


def _gpu_peak(name: str, dtype: torch.dtype, allow_tf32: bool) -> Peak | None:
    row = next((p for p in GPU_PEAKS if p.match in name.lower()), None)
    if row is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        return Peak(row.bf16, f"{row.source}, {_short(dtype)}")
    if allow_tf32:
        return Peak(row.tf32, f"{row.source}, tf32")
    return Peak(row.fp32, f"{row.source}, fp32")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_file() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dslaunch" / "peak_flops.json"


def _cpu_key(dtype: torch.dtype) -> str:
    return f"{_cpu_model()}|threads={torch.get_num_threads()}|{_short(dtype)}|torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_peak(dtype: torch.dtype, cache: Path) -> Peak:
    key = _cpu_key(dtype)
    with _one_at_a_time(cache):  # the ranks of one machine: one measures, the others read its result
        known = _read_cache(cache)
        if key not in known:
            known[key] = measure_cpu_matmul(dtype)
            _write_cache(cache, known)
    share, why = cpu_share()
    return Peak(known[key] * share, f"measured: {key} (cached in {cache}){why}")


def cpu_share(ranks: int | None = None, threads: int | None = None) -> tuple[float, str]:
    """This rank's share of the peak measured alone at its thread count, and why (for the source).

    The peak is measured by one rank at a time; when the ``LOCAL_WORLD_SIZE`` ranks of this machine
    run together at ``threads`` each on fewer cores than that, each gets ``cores / (ranks x threads)``
    of it. ``cores`` = the CPUs this process may run on; ranks whose CPU sets cannot overlap (each
    has at most its 1/ranks of the machine: ``--bind_cores_to_rank``) share nothing.
    Limitations: in a container limited to a CPU set that the machine's CPU count does not show,
    ranks that do share it are taken for bound ones.
    """
    ranks = ranks if ranks is not None else _int_env("LOCAL_WORLD_SIZE", 1)
    threads = threads if threads is not None else torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if ranks <= 1 or ranks * cores <= (os.cpu_count() or cores) or ranks * threads <= cores:
        return 1.0, ""
    share = cores / (ranks * threads)
    return share, f" x {share:.2f}: {ranks} ranks of {threads} threads share {cores} cores"


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


@contextlib.contextmanager
def _one_at_a_time(cache: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<cache>.lock`` while held: measuring side by side, each rank would
    get a share of the cores and cache a fraction of the peak. Without a lock file (a read-only
    home), no lock."""
    try:
        make_private_dirs(cache.parent)
        fd = os.open(cache.with_name(f"{cache.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_cache(cache: Path) -> dict[str, float]:
    """The cached peaks, or {} when there is no cache or it cannot be trusted (one warning line:
    another user's file, or one others may write, or not JSON): measured again and rewritten."""
    try:
        fd = open_private_file(cache)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        return _distrusted(cache, f"cannot open it ({exc.strerror})")
    except Untrusted as why:
        return _distrusted(cache, str(why))
    try:
        with os.fdopen(fd, encoding="utf-8", closefd=False) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return _distrusted(cache, "it is not a JSON file of peaks")
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return _distrusted(cache, "it is not a JSON file of peaks")
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and v > 0}


def _distrusted(cache: Path, why: str) -> dict[str, float]:
    log.warning("dslaunch: measuring the CPU peak again over %s: %s", quote(str(cache)), why)
    return {}


def _write_cache(cache: Path, known: dict[str, float]) -> None:
    # Owner-only (0700 directories, a 0600 file), written to a temporary name and renamed: ranks
    # of one machine may measure at once, and a rename replaces a distrusted file, never writes through it.
    try:
        make_private_dirs(cache.parent)
        write_file(cache.parent, cache.name, json.dumps(known, indent=1, sort_keys=True), mode=0o600)
    except OSError:
        pass  # a read-only home: measure again next time rather than fail the run


def measure_cpu_matmul(dtype: torch.dtype = torch.float32, size: int = 1024, budget_s: float = 0.5) -> float:
    """The best FLOP/s of ``size``-square matmuls in ``dtype`` over about ``budget_s`` seconds."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm up (thread pool, packing buffers)
    best, end = 0.0, time.perf_counter() + budget_s
    while time.perf_counter() < end:
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - t))
    return best
