"""Achieved FLOP/s and MFU: the GPU peak table by device name and dtype, the environment
override, and the CPU peak measured once and read back from its cache."""

from __future__ import annotations

import json

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.profiling.flops_profiler import mfu
from dslaunch.profiling.flops_profiler.mfu import _gpu_peak, peak_flops, throughput

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name, dtype, tf32, want", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4e12),
    ("NVIDIA H100 PCIe", torch.float16, False, 756.5e12),
    ("NVIDIA H200", torch.bfloat16, False, 989.4e12),
    ("NVIDIA H200", torch.float32, False, 66.9e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156e12),
])
def test_gpu_peaks_come_from_the_table(name: str, dtype: torch.dtype, tf32: bool, want: float) -> None:
    peak = _gpu_peak(name, dtype, tf32)
    assert peak is not None and peak.flops == pytest.approx(want) and "datasheet" in peak.source


def test_an_unknown_gpu_has_no_mfu() -> None:
    assert _gpu_peak("Some Future GPU", torch.bfloat16, False) is None


def test_the_environment_wins_and_bad_values_are_one_line(monkeypatch) -> None:
    monkeypatch.setenv(mfu.PEAK_ENV, "2e12")
    tp = throughput(1e12, 2.0, "cpu")
    assert tp.flops_per_s == 5e11 and tp.mfu == pytest.approx(0.25) and tp.peak.source == f"${mfu.PEAK_ENV}"
    monkeypatch.setenv(mfu.PEAK_ENV, "fast")
    with pytest.raises(UsageError, match=f"{mfu.PEAK_ENV}='fast': must be a number > 0"):
        throughput(1e12, 2.0, "cpu")


def test_the_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "peak.json"
    monkeypatch.setenv(mfu.CACHE_ENV, str(cache))
    monkeypatch.delenv(mfu.PEAK_ENV, raising=False)
    first = peak_flops(torch.device("cpu"))
    assert first is not None and first.flops > 1e8 and "measured" in first.source
    stored = json.loads(cache.read_text())
    (key,) = stored
    assert f"threads={torch.get_num_threads()}" in key and "float32" in key
    cache.write_text(json.dumps({key: 123.0}))  # a later call reads the cache, never measures again
    assert peak_flops(torch.device("cpu")).flops == 123.0
    assert throughput(246.0, 1.0).mfu == pytest.approx(2.0)
