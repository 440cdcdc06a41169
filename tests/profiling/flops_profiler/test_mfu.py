"""Achieved FLOP/s and MFU: the GPU peak table by device name and dtype, the environment
override, and the CPU peak measured once and read back from its cache."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import pytest
import torch

from dslaunch.errors import UsageError, quote
from dslaunch.runtime.profiling import mfu
from dslaunch.runtime.profiling.mfu import _gpu_peak, peak_flops, throughput

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


@pytest.fixture
def measured(tmp_path, monkeypatch) -> list[torch.dtype]:
    """A cache under a fresh directory tree, and a fake (instant) measurement that records its calls."""
    calls: list[torch.dtype] = []
    monkeypatch.setenv(mfu.CACHE_ENV, str(tmp_path / "new" / "dir" / "peak.json"))
    monkeypatch.delenv(mfu.PEAK_ENV, raising=False)
    monkeypatch.setattr(mfu, "measure_cpu_matmul", lambda dtype: calls.append(dtype) or 5e9)
    return calls


def test_the_cpu_peak_cache_is_created_owner_only_and_reused(tmp_path, measured) -> None:
    cache = tmp_path / "new" / "dir" / "peak.json"
    assert peak_flops(torch.device("cpu")).flops == 5e9 and len(measured) == 1
    assert cache.stat().st_mode & 0o777 == 0o600
    assert (cache.parent.stat().st_mode & 0o777, cache.parent.parent.stat().st_mode & 0o777) == (0o700, 0o700)
    assert peak_flops(torch.device("cpu")).flops == 5e9 and len(measured) == 1  # read back, not measured
    assert sorted(p.name for p in cache.parent.iterdir()) == ["peak.json", "peak.json.lock"]  # no temporary file


def test_ranks_of_one_machine_measure_one_at_a_time(measured, monkeypatch) -> None:
    def slow(dtype: torch.dtype) -> float:  # long enough for both threads to ask before it ends
        measured.append(dtype)
        time.sleep(0.3)
        return 5e9

    monkeypatch.setattr(mfu, "measure_cpu_matmul", slow)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        peaks = list(pool.map(lambda _: peak_flops(torch.device("cpu")).flops, range(2)))
    assert peaks == [5e9, 5e9] and len(measured) == 1  # the second waited and read the first's


@pytest.mark.parametrize("spoil, why", [
    (lambda f: f.write_text("{not json"), "it is not a JSON file of peaks"),
    (lambda f: f.write_text("[1, 2]"), "it is not a JSON file of peaks"),
    (lambda f: f.chmod(0o666), "it is writable by others (mode 0666)"),
])
def test_a_spoiled_cache_is_measured_again_with_one_line(tmp_path, measured, caplog, spoil, why) -> None:
    cache = tmp_path / "new" / "dir" / "peak.json"
    peak_flops(torch.device("cpu"))
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: 123.0}))
    spoil(cache)
    with caplog.at_level("WARNING", logger="dslaunch.profiling"):
        assert peak_flops(torch.device("cpu")).flops == 5e9  # not the planted 123
    assert [r.getMessage() for r in caplog.records] == [f"dslaunch: measuring the CPU peak again over {quote(str(cache))}: {why}"]
    assert len(measured) == 2 and cache.stat().st_mode & 0o777 == 0o600 and json.loads(cache.read_text()) == {key: 5e9}


def test_a_cache_owned_by_another_user_is_ignored(tmp_path, measured, caplog, monkeypatch) -> None:
    cache = tmp_path / "new" / "dir" / "peak.json"
    peak_flops(torch.device("cpu"))
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: 123.0}))
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)  # the file now reads as another user's
    with caplog.at_level("WARNING", logger="dslaunch.profiling"):
        assert peak_flops(torch.device("cpu")).flops == 5e9
    assert [r.getMessage() for r in caplog.records] == [
        f"dslaunch: measuring the CPU peak again over {quote(str(cache))}: it is owned by uid {me}, not by this user "
        f"(uid {me + 1})"]


def test_ranks_that_oversubscribe_the_cores_each_get_their_share_of_the_cpu_peak(measured, monkeypatch) -> None:
    cores = len(os.sched_getaffinity(0))
    if 2 * cores <= (os.cpu_count() or cores):
        pytest.skip("this process may use at most half the machine: taken for a rank bound to its cores")
    threads = torch.get_num_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = peak_flops(torch.device("cpu"))
    assert alone.flops == 5e9
    torch.set_num_threads(cores)  # 2 ranks of `cores` threads each on `cores` cores: half each
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        shared = peak_flops(torch.device("cpu"))
        assert shared.flops == pytest.approx(5e9 / 2)
        assert shared.source.endswith(f"x 0.50: 2 ranks of {cores} threads share {cores} cores")
        if cores >= 2:  # 2 ranks of cores/2 threads: no oversubscription, the whole measured peak
            torch.set_num_threads(cores // 2)
            assert peak_flops(torch.device("cpu")).flops == 5e9
    finally:
        torch.set_num_threads(threads)
