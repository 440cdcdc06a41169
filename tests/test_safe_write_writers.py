"""Every writer of dslaunch against a hostile local user, on real jobs: links to a root-only file
planted where the monitors, the flops profiler, autotuning and checkpoints write, and output
directories another user owns or everyone may write. Nothing outside is written (the victim's
contents and mtime stay), and the job says why in one line: observers (monitors, profiler) warn
and training goes on; a checkpoint or an autotuning result is an error naming the path.

As root (the suite's usual user), with a second user made for the test (``tests.hostile``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import run_world
from tests.hostile import Victim, as_root, give, other_uid
from tests.launcher.helpers import DSLAUNCH, FAKE, new_tag, tagged_env

pytestmark = [as_root, pytest.mark.timeout(180)]


def _capture_warnings() -> list[str]:
    """What this rank prints on stderr and logs at WARNING, line by line (appended as it comes)."""
    import io
    import logging

    lines: list[str] = []

    class Lines(io.TextIOBase):
        def write(self, s: str) -> int:
            lines.extend(x for x in s.splitlines() if x.strip())
            return len(s)

    sys.stderr = Lines()
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logging.getLogger("dslaunch").addHandler(handler)
    return lines


def _train_with(rank: int, world: int, extra: dict, steps: int) -> dict:
    import torch

    import dslaunch

    said = _capture_warnings()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(8, 4), config=cfg)
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 8)).square().mean())
        engine.step()
    if engine.monitor is not None:
        engine.monitor.flush()
        engine.monitor.close()
    return {"steps": engine.global_steps, "said": [s for s in said if "warning" in s.lower()]}


# ----- monitors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("monitor", ["csv_monitor", "tensorboard"])
def test_a_monitor_dir_another_user_owns_is_refused_with_one_warning_and_training_goes_on(tmp_path, monitor):
    victim = Victim(tmp_path)
    run_dir = tmp_path / "out" / "run"
    run_dir.mkdir(parents=True)
    for name in ("Train_Samples_train_loss.csv", "Train_Samples_lr.csv"):
        victim.plant(run_dir / name, other_uid())
    give(run_dir, other_uid())
    [got] = run_world(_train_with, 1, {monitor: {"enabled": True, "output_path": str(tmp_path / "out"),
                                                 "job_name": "run"}}, 3)
    assert got["steps"] == 3
    assert len(got["said"]) == 1, got["said"]
    assert f"{run_dir}: directory owned by another user (uid {other_uid()})" in got["said"][0]
    assert victim.untouched()
    assert sorted(os.listdir(run_dir)) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]


def test_a_world_writable_monitor_dir_is_refused_with_one_warning(tmp_path):
    victim = Victim(tmp_path)
    run_dir = tmp_path / "out" / "run"
    run_dir.mkdir(parents=True)
    os.chmod(run_dir, 0o777)
    victim.plant(run_dir / "Train_Samples_lr.csv", other_uid())
    [got] = run_world(_train_with, 1, {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "out"),
                                                        "job_name": "run"}}, 2)
    assert got["steps"] == 2 and len(got["said"]) == 1, got["said"]
    assert f"{run_dir}: directory writable by every user and not sticky" in got["said"][0]
    assert victim.untouched()


def test_a_csv_file_planted_as_a_link_in_the_jobs_own_dir_is_not_written_through(tmp_path):
    victim = Victim(tmp_path)
    run_dir = tmp_path / "out" / "run"
    run_dir.mkdir(parents=True)
    victim.plant(run_dir / "Train_Samples_train_loss.csv")
    [got] = run_world(_train_with, 1, {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "out"),
                                                        "job_name": "run"}}, 2)
    assert got["steps"] == 2 and len(got["said"]) == 1, got["said"]
    assert "Train_Samples_train_loss.csv: a symbolic link or FIFO is there; not written through" in got["said"][0]
    assert victim.untouched()


def test_the_csv_torn_row_repair_never_writes_through_a_planted_tmp(tmp_path):
    """A resumed run drops rows past its checkpoint by rewriting the file: the old fixed
    ``<file>.tmp`` name, planted as a link, would have been truncated; now it is never used."""
    from dslaunch.monitor.config import CSVConfig
    from dslaunch.monitor.csv_monitor import csvMonitor

    victim = Victim(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "Train_Samples_lr.csv").write_text("step,lr\n2,0.1\n4,0.1\n6,0.1\n8,0.")
    victim.plant(run_dir / "Train_Samples_lr.csv.tmp")
    mon = csvMonitor(CSVConfig(enabled=True, output_path=str(tmp_path), job_name="run"))
    mon.start_at(4)
    mon.write_events([("Train/Samples/lr", 0.2, 6)])
    mon.close()
    assert (run_dir / "Train_Samples_lr.csv").read_text() == "step,lr\n2,0.1\n4,0.1\n6,0.2\n"
    assert victim.untouched()


# ----- flops profiler ---------------------------------------------------------------------------

def test_a_bad_flops_profiler_output_file_warns_and_training_goes_on(tmp_path):
    victim = Victim(tmp_path)
    (tmp_path / "a_dir").mkdir()
    victim.plant(tmp_path / "link.txt")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    give(theirs, other_uid())
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(full)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs to fill (a full disk)")
    try:
        with open(full / "filler", "wb") as f:  # the disk is full before the profiler writes
            try:
                f.write(b"x" * 65536)
            except OSError:
                pass
        cases = {
            str(tmp_path / "missing" / "flops.txt"): f"{tmp_path}/missing/flops.txt: No such file or directory",
            str(tmp_path / "a_dir"): f"{tmp_path}/a_dir: Is a directory",
            str(tmp_path / "link.txt"): f"{tmp_path}/link.txt: a symbolic link or FIFO is there; not written through",
            str(theirs / "flops.txt"): f"{theirs}: directory owned by another user",
            str(full / "flops.txt"): f"{full}/flops.txt: No space left on device",
        }
        for out, why in cases.items():
            [got] = run_world(_train_with, 1, {"flops_profiler": {"enabled": True, "profile_step": 1,
                                                                  "output_file": out}}, 3)
            assert got["steps"] == 3, out
            assert len(got["said"]) == 1, (out, got["said"])
            line = got["said"][0]
            assert "cannot write flops_profiler.output_file" in line and why in line, (out, line)
            assert "training goes on" in line
    finally:
        subprocess.run(["umount", str(full)])
    assert victim.untouched() and os.listdir(theirs) == [] and os.listdir(tmp_path / "a_dir") == []


# ----- checkpoints ------------------------------------------------------------------------------

def _save(rank: int, world: int, save_dir: str) -> str:
    import torch

    import dslaunch

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(8, 4), config=cfg)
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    try:
        engine.save_checkpoint(save_dir, tag="t1")
    except Exception as err:  # the error the user sees
        return f"{type(err).__name__}: {err}"
    return "saved"


def test_a_checkpoint_dir_another_user_controls_is_an_error_naming_it(tmp_path):
    victim = Victim(tmp_path)
    for name, mode in (("theirs", None), ("open", 0o777)):
        save_dir = tmp_path / name
        save_dir.mkdir()
        victim.plant(save_dir / "latest", other_uid())
        if mode is None:
            give(save_dir, other_uid())
        else:
            os.chmod(save_dir, mode)
        [said] = run_world(_save, 1, str(save_dir))
        assert said.startswith("CheckpointError: checkpoint save of tag 't1' failed"), said
        assert f"{save_dir}: directory {'owned by another user' if mode is None else 'writable by every'}" in said
        assert "the checkpoint is not written" in said and "\n" not in said
        assert "secret" not in said  # the planted latest is not read through either
        assert os.listdir(save_dir) == ["latest"]
    assert victim.untouched()


def test_links_planted_in_ones_own_checkpoint_dir_are_replaced_not_written_through(tmp_path):
    victim = Victim(tmp_path)
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    victim.plant(save_dir / "latest")
    victim.plant(save_dir / ".latest.tmp-t1")
    assert run_world(_save, 1, str(save_dir)) == ["saved"]
    assert victim.untouched()
    assert not os.path.islink(save_dir / "latest") and (save_dir / "latest").read_text() == "t1"


def test_an_export_into_another_users_dir_is_an_error_and_a_planted_link_is_replaced(tmp_path):
    from dslaunch.errors import UsageError
    from dslaunch.runtime.checkpoint.export import convert_zero_checkpoint_to_fp32_state_dict

    victim = Victim(tmp_path)
    assert run_world(_save, 1, str(tmp_path / "ckpt")) == ["saved"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    victim.plant(theirs / "pytorch_model.bin", other_uid())
    give(theirs, other_uid())
    with pytest.raises(UsageError, match=rf"^cannot write {theirs}: directory owned by another user"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", theirs)
    mine = tmp_path / "mine"
    mine.mkdir()
    victim.plant(mine / "pytorch_model.bin")
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", mine)
    assert victim.untouched() and not os.path.islink(mine / "pytorch_model.bin")
    assert set(__import__("torch").load(mine / "pytorch_model.bin")) == {"weight", "bias"}


# ----- autotuning -------------------------------------------------------------------------------

def _tune(tmp_path, results: str, exps: str) -> subprocess.CompletedProcess:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "autotuning": {"enabled": True, "results_dir": results, "exps_dir": exps, "tuner_type": "gridsearch",
                          "offload": False, "activation_checkpointing": False, "experiment_timeout": 60,
                          "max_train_micro_batch_size_per_gpu": 2, "num_tuning_micro_batch_sizes": 1}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    return subprocess.run([*DSLAUNCH, "--num_gpus", "1", "--autotuning", "tune", FAKE, "--deepspeed_config",
                           str(tmp_path / "ds.json")], capture_output=True, text=True, timeout=120,
                          env=tagged_env(new_tag()), cwd=tmp_path)


@pytest.mark.parametrize("which", ["results_dir", "exps_dir"])
def test_autotuning_refuses_a_results_or_experiments_dir_another_user_owns_before_any_experiment(tmp_path, which):
    victim = Victim(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in ("summary.txt", "results.json", "ds_config_optimal.json"):
        victim.plant(theirs / name, other_uid())
    give(theirs, other_uid())
    dirs = {"results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"), which: str(theirs)}
    r = _tune(tmp_path, dirs["results_dir"], dirs["exps_dir"])
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"dslaunch: error: autotuning.{which}: {theirs}: directory owned by another user (uid {other_uid()}); "
        "dslaunch writes only into directories of this user's (or root's): give one you own"), r.stderr
    assert "Traceback" not in r.stderr and victim.untouched()
    assert not (tmp_path / "exps").exists() or os.listdir(tmp_path / "exps") == []


def test_an_experiment_dir_planted_by_another_user_is_an_error_naming_it(tmp_path):
    from dslaunch.errors import LaunchError
    from dslaunch.launcher.autotuning.experiments import Experiment, ExperimentRunner

    victim = Victim(tmp_path)
    exps = tmp_path / "exps"
    planted = exps / "z1_mb2_gas1"
    planted.mkdir(parents=True)
    for name in ("ds_config.json", "output.log", "result.json"):
        victim.plant(planted / name, other_uid())
    give(planted, other_uid())
    runner = ExperimentRunner(["--num_gpus", "1"], [FAKE, "--deepspeed_config", "x"], "--deepspeed_config",
                              str(exps), timeout=30, hang_timeout=30, reuse=True)
    with pytest.raises(LaunchError, match=rf"^autotuning: cannot write the experiment's directory: {planted}: "
                                          "directory owned by another user"):
        runner.run(Experiment("z1_mb2_gas1", {"train_batch_size": 1}))
    assert victim.untouched()


def test_an_experiments_files_planted_as_links_are_replaced_and_the_results_too(tmp_path):
    from dslaunch.launcher.autotuning.experiments import Experiment, ExperimentRunner, Outcome
    from dslaunch.launcher.autotuning.search import SearchResult
    from dslaunch.launcher.autotuning.space import Candidate
    from dslaunch.launcher.autotuning.tune import write_results

    victim = Victim(tmp_path)
    exp_dir = tmp_path / "exps" / "e"
    exp_dir.mkdir(parents=True)
    for name in ("ds_config.json", "output.log", "result.json", "metrics.json"):
        victim.plant(exp_dir / name)
    runner = ExperimentRunner(["--num_gpus", "1"], [FAKE, "--deepspeed_config", "x"], "--deepspeed_config",
                              str(tmp_path / "exps"), timeout=60, hang_timeout=60)
    outcome = runner.run(Experiment("e", {"train_batch_size": 1}))
    assert victim.untouched()
    assert json.loads((exp_dir / "result.json").read_text())["status"] == outcome.status
    assert not any(os.path.islink(exp_dir / n) for n in ("ds_config.json", "output.log", "result.json"))

    results = tmp_path / "results"
    results.mkdir()
    for name in ("summary.txt", "results.json", "ds_config_optimal.json"):
        victim.plant(results / name)
    c = Candidate(stage=1, micro_batch=2, gas=1, offload=None, checkpointing=False)
    job = type("Job", (), {"base": {"train_micro_batch_size_per_gpu": 1}, "dp_world": 1,
                           "at": type("At", (), {"metric": "throughput"})()})()
    best = write_results(str(results), SearchResult(((c, Outcome(c.name, "ok", {"throughput": 1.0}, "", 1.0)),), c),
                         job)
    assert best == str(results / "ds_config_optimal.json")
    assert victim.untouched()
    assert sorted(os.listdir(results)) == ["ds_config_optimal.json", "results.json", "summary.txt"]
    assert not any(os.path.islink(results / n) for n in os.listdir(results))
