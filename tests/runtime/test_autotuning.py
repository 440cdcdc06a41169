"""The engine's side of an autotuning experiment: the profiled steps, the metrics file, the exit,
and the memory limit on CPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dslaunch.runtime.autotuning import ExperimentProfile, peak_memory, reset_peak_memory
from dslaunch.runtime.config.autotuning import AutotuningConfig
from dslaunch.runtime.events import StepRecord

pytestmark = pytest.mark.timeout(30)

CPU = torch.device("cpu")


def _record(step: int, batch: int = 8) -> StepRecord:
    return StepRecord(step=step, samples=step * batch, micro_steps=step, loss=None, lr=(0.1,), loss_scale=1.0,
                      grad_norm=None, skipped=False, skipped_steps=0)


def test_the_median_step_between_start_and_end_is_the_metric_then_every_rank_leaves(tmp_path):
    path = tmp_path / "metrics.json"
    cfg = AutotuningConfig(start_profile_step=2, end_profile_step=5, metric_path=str(path))
    # steps 2-5 end at these times: steps 3, 4, 5 took 0.2, 0.7 (a stall) and 0.2 s
    now = iter([10.0, 10.2, 10.9, 11.1]).__next__
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))  # 110 + 22 parameters
    counted = SimpleNamespace(last=SimpleNamespace(fwd_flops=1000, bwd_flops=2000))  # a FlopsProfiler's
    profile = ExperimentProfile(cfg, rank=0, device=CPU, module=model, flops_profiler=counted, clock=now)
    for step in (1, 2, 3, 4):
        profile.on_step(_record(step))
    assert not path.exists()
    with pytest.raises(SystemExit) as leave:
        profile.on_step(_record(5))
    assert leave.value.code == 0
    m = json.loads(path.read_text())
    # the median step, not the mean: the stall does not count (warm-up steps 1-2 are not timed)
    assert m["throughput"] == pytest.approx(8 / 0.2) and m["latency"] == pytest.approx(0.2)
    assert m["FLOPS_per_gpu"] == pytest.approx(3000 / 0.2) and m["steps"] == 3
    assert m["step_seconds"] == pytest.approx([0.2, 0.7, 0.2])
    assert (m["num_params"], m["largest_layer"]) == (132, 110)
    assert m["peak_memory"] > 50 * 2**20  # this process's resident set: torch alone is more


def test_other_ranks_leave_without_writing(tmp_path):
    path = tmp_path / "metrics.json"
    profile = ExperimentProfile(AutotuningConfig(start_profile_step=1, end_profile_step=2, metric_path=str(path)),
                                rank=1, device=CPU, module=torch.nn.Linear(1, 1))
    profile.on_step(_record(1))
    with pytest.raises(SystemExit):
        profile.on_step(_record(2))
    assert not path.exists()


def test_a_rank_above_the_memory_limit_fails_as_out_of_memory(tmp_path):
    cfg = AutotuningConfig(metric_path=str(tmp_path / "m.json"), memory_per_device=2**20)
    profile = ExperimentProfile(cfg, rank=3, device=CPU, module=torch.nn.Linear(1, 1))
    with pytest.raises(MemoryError, match=r"out of memory: rank 3 peaked at \d+ MiB by step 1, above "
                                          r"autotuning.memory_per_device \(1 MiB\)"):
        profile.on_step(_record(1))


def test_the_peak_is_reset_to_what_the_process_holds_now():
    held = bytearray(200 * 2**20)
    held[::4096] = b"x" * len(held[::4096])  # touch every page
    del held
    high = peak_memory(CPU)
    reset_peak_memory(CPU)
    assert peak_memory(CPU) < high - 150 * 2**20
