"""DeepSpeed's API: ``FlopsProfiler``'s methods, ``get_model_profile`` and the printed tables,
imported from DeepSpeed's path (``deepspeed.profiling.flops_profiler`` is this module)."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.profiling.flops_profiler import FlopsProfiler, get_model_profile
from tests.profiling.flops_profiler.gpt import GPT

pytestmark = pytest.mark.timeout(60)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


MLP_FWD = 2 * 5 * (16 * 32 + 32 * 4)  # batch 5


def test_get_model_profile_counts_one_forward_after_warm_up(tmp_path) -> None:
    model = _mlp()
    flops, macs, params = get_model_profile(model, input_shape=(5, 16), print_profile=False, as_string=False)
    assert (flops, macs, params) == (MLP_FWD, MLP_FWD // 2, 16 * 32 + 32 + 32 * 4 + 4)
    out = tmp_path / "profile.txt"
    strings = get_model_profile(model, args=[torch.randn(5, 16)], output_file=str(out), module_depth=1,
                                top_modules=2)
    assert strings == ("6.40 KFLOPs", "3.20 KMACs", "676")
    text = out.read_text()
    assert "fwd flops per GPU:" in text and "6.40 KFLOPs" in text
    assert "bwd flops per GPU (estimated: (2 + 0) x fwd)" in text  # no backward ran
    assert "(0): Linear" in text and "(2): Linear" in text and "Aggregated Profile per GPU" in text


def test_a_backward_while_profiling_is_measured_not_assumed(capsys) -> None:
    model = _mlp()
    x = torch.randn(5, 16)
    prof = FlopsProfiler(model, recompute_fwd_factor=1.0)
    with pytest.raises(UsageError, match="start_profile"):
        prof.get_total_flops()
    prof.start_profile()
    model(x).sum().backward()
    prof.stop_profile()
    # the first Linear's input needs no gradient: its backward is the weight gradient only
    assert prof.get_total_flops() == MLP_FWD + 2 * 2 * 5 * 32 * 4 + 2 * 5 * 16 * 32
    assert prof.get_total_flops(as_string=True).endswith("KFLOPs")
    assert prof.get_total_duration() > 0 and prof.get_total_duration(as_string=True).endswith("s")
    prof.print_model_profile(profile_step=3, detailed=False)
    text = capsys.readouterr().out
    assert "Profile Summary at step 3:" in text and "bwd flops per GPU (measured)" in text and "Detailed" not in text
    assert "fwd latency:" in text and "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:" in text
    prof.end_profile()
    assert prof.last is not None and prof.last.bwd_measured and prof.counter is None
    model(x)  # hooks are gone
    assert prof.last.rows[0].calls == 1


def test_the_counts_read_while_started_are_what_ran_so_far() -> None:
    # DeepSpeed's own example reads the totals between forward and backward, still started.
    model = _mlp()
    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(torch.randn(5, 16)).sum()
    assert prof.get_total_flops() == MLP_FWD
    loss.backward()
    prof.stop_profile()
    bwd = 2 * 2 * 5 * 32 * 4 + 2 * 5 * 16 * 32  # as below: the first Linear's input needs no gradient
    assert prof.get_total_flops() == MLP_FWD + bwd
    rows = {r.name: r for r in prof.profile().rows}
    assert rows["2"].bwd_flops == 2 * 2 * 5 * 32 * 4 and rows["0"].bwd_flops == 2 * 5 * 16 * 32  # still theirs


def test_bad_arguments_are_one_line_errors() -> None:
    model = GPT()
    with pytest.raises(UsageError, match="mode='backward'.*'forward' or 'generate'"):
        get_model_profile(model, input_shape=(2, 4), mode="backward")
    with pytest.raises(UsageError, match="has no generate"):
        get_model_profile(model, input_shape=(2, 4), mode="generate")
    with pytest.raises(UsageError, match="input_shape=.*positive ints"):
        get_model_profile(model, input_shape=(2, -1))
    with pytest.raises(UsageError, match="give input_shape"):
        get_model_profile(model)


def test_deepspeeds_import_path_is_this_module() -> None:
    import dslaunch

    assert dslaunch.profiling.flops_profiler.FlopsProfiler is FlopsProfiler
    from dslaunch.profiling.flops_profiler import flops_to_string, number_to_string

    assert number_to_string(12_345_678) == "12.35 M" and flops_to_string(2e12, units="G") == "2000.00 GFLOPs"


def test_deepspeeds_module_path_resolves_to_it() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    probe = ("import deepspeed, dslaunch.profiling.flops_profiler as ours\n"
             "from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile\n"
             "import deepspeed.profiling.flops_profiler.profiler as prof\n"
             "assert FlopsProfiler is ours.FlopsProfiler and prof is ours.profiler\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "compat" / "deepspeed"), str(root)])}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
