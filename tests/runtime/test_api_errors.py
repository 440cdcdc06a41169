"""A config mistake in a worker prints one line naming the key, not a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


_RESUME_SCRIPT = """
import sys, torch
import dslaunch as deepspeed
model = torch.nn.Linear(2, 2)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), dist_init_required=False,
                                  config={"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
if len(sys.argv) > 1:
    engine.save_checkpoint(sys.argv[1])
print("STEP", engine.global_steps)
"""


@pytest.mark.timeout(120)
def test_a_restart_that_finds_no_checkpoint_stops_before_any_step_with_exit_2(tmp_path, monkeypatch,
                                                                            capsys) -> None:
    import runpy

    script, saved, empty = tmp_path / "train.py", tmp_path / "saved", tmp_path / "empty"
    script.write_text(_RESUME_SCRIPT)
    empty.mkdir()

    def in_process(restart: int, resume: Path, *argv: str) -> tuple[str, str]:
        # The save and the resume that works end as the script does: in this process (no torch
        # import of its own); only an exit code needs a process of its own.
        monkeypatch.setenv("DSLAUNCH_RESTART_COUNT", str(restart))
        monkeypatch.setenv("DSLAUNCH_RESUME_FROM", str(resume))
        monkeypatch.setattr(sys, "argv", [str(script), *argv])
        runpy.run_path(str(script), run_name="__main__")
        out = capsys.readouterr()
        return out.out, out.err

    def expected(where: Path, what: str) -> list[str]:
        return [f"dslaunch: error: restart 1 of the job cannot resume: --resume_from {where} {what} (the script "
                "must save its checkpoints into that directory); not starting over at step 0"]

    out, err = in_process(0, saved, str(saved))  # the first run saves where restarts resume from
    assert "STEP 0" in out and "dslaunch: error" not in err, err
    out, err = in_process(1, saved)
    assert "STEP 0" in out and "dslaunch: error" not in err, err
    typo = tmp_path / "saevd"  # elsewhere, a typo: stops before any step, as SystemExit(2)
    with pytest.raises(SystemExit) as stop:
        in_process(1, typo)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and "STEP" not in out and err.strip().splitlines()[-1:] == expected(
        typo, "does not exist"), err
    # and a real process exits with that code, the error its last line
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSLAUNCH_RESTART_COUNT": "1", "DSLAUNCH_RESUME_FROM": str(empty)}
    lost = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=100)
    assert lost.returncode == 2 and "STEP" not in lost.stdout, lost.stdout + lost.stderr
    assert lost.stderr.strip().splitlines()[-1:] == expected(empty, "holds no checkpoint"), lost.stderr


@pytest.mark.timeout(60)
def test_no_model_is_an_assertion_error_as_in_deepspeed(tmp_path, caplog) -> None:
    import argparse

    import torch

    import dslaunch

    config = {"train_batch_size": 2}
    with pytest.raises(AssertionError, match=r"needs model=<torch.nn.Module>$"):
        dslaunch.initialize(model=None, config=config)
    with pytest.raises(ValueError, match="the first positional argument is args"):
        dslaunch.initialize(torch.nn.Linear(2, 2), config=config)  # DeepSpeed's signature: args first
    # DeepSpeed's deprecated --deepscale_config still names the config, with a warning
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "gradient_accumulation_steps": 2}))
    args = dslaunch.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepscale_config", str(path)])
    engine, *_ = dslaunch.initialize(args=args, model=torch.nn.Linear(2, 2), dist_init_required=False)
    assert engine.gradient_accumulation_steps() == 2 and "--deepscale_config is deprecated" in caplog.text
