"""A config mistake in a worker prints one line naming the key, not a traceback."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch
import dslaunch as deepspeed
deepspeed.initialize(model=torch.nn.Linear(2, 2), config={CONFIG!r}, dist_init_required=False)
"""


def _run(tmp_path, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 2, "overlap_com": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("{CONFIG!r}", repr(json.loads(json.dumps(config)))))
    env = {k: v for k, v in os.environ.items() if k != "DSLAUNCH_VERBOSE"}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.timeout(90)
def test_config_error_is_one_line(tmp_path) -> None:
    proc = _run(tmp_path, {})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        line for line in proc.stderr.strip().splitlines() if line.startswith("dslaunch: error:")]
    assert "'zero_optimization.overlap_com'" in proc.stderr and "did you mean 'overlap_comm'" in proc.stderr


@pytest.mark.timeout(90)
def test_verbose_keeps_the_traceback(tmp_path) -> None:
    proc = _run(tmp_path, {"DSLAUNCH_VERBOSE": "1"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


_SECTIONS = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}


def _client_objects(config: dict) -> tuple:
    import torch

    import dslaunch

    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1)
    engine, optimizer, _, lr_scheduler = dslaunch.initialize(model=model, optimizer=sgd, lr_scheduler=sched,
                                                             config=config, dist_init_required=False)
    return sgd, sched, optimizer, lr_scheduler


@pytest.mark.timeout(60)
def test_client_optimizer_and_scheduler_win_over_the_config_with_one_warning_each(capsys) -> None:
    sgd, sched, optimizer, lr_scheduler = _client_objects(_SECTIONS)
    assert optimizer is sgd and lr_scheduler is sched  # as DeepSpeed: the client objects are used
    assert optimizer.param_groups[0]["lr"] == 0.5
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["dslaunch: warning: the config's 'optimizer' section is ignored: initialize() was "
                     "given a client optimizer (DeepSpeed does the same)",
                     "dslaunch: warning: the config's 'scheduler' section is ignored: initialize() was "
                     "given a client scheduler (DeepSpeed does the same)"]
    _client_objects({"train_batch_size": 2})
    assert capsys.readouterr().err == ""  # nothing ignored, nothing said


def _warnings_on(rank: int, world: int) -> str:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        import torch

        import dslaunch

        model = torch.nn.Linear(2, 2)
        dslaunch.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            config={**_SECTIONS, "train_batch_size": 2 * world})
    return err.getvalue()


@pytest.mark.timeout(90)
def test_the_ignored_section_warning_is_printed_on_rank_0_only() -> None:
    from tests.distributed import run_world

    first, second = run_world(_warnings_on, 2)
    assert first.count("dslaunch: warning: the config's 'optimizer' section is ignored") == 1
    assert "warning" not in second
