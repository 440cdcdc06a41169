"""``dslaunch --autotuning``: one real tune at world 2 whose experiments succeed, fail and hang,
then the job launched with the best config; and the command's one-line errors."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from dslaunch.launcher import cli
from tests.launcher.helpers import DSLAUNCH, FAKE, ROOT, new_tag, tagged_env

SCRIPT = str(ROOT / "scripts" / "examples" / "autotune_train.py")


def _config(tmp_path, **autotuning):
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
           "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3,
                          "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"),
                          **autotuning}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.timeout(240)
def test_a_tune_records_failed_and_hung_experiments_and_runs_the_best(tmp_path):
    """Micro batches 2, 4, 8 at ZeRO-1: 4 raises, 8 hangs (found by the hang detection after 5 s);
    the search goes on, 2 is the best, ``run`` trains with it."""
    config = _config(tmp_path, tuner_type="gridsearch", offload=False, activation_checkpointing=False,
                     max_train_micro_batch_size_per_gpu=8, num_tuning_micro_batch_sizes=3, hang_timeout=5,
                     experiment_timeout=120)
    started = time.monotonic()
    r = subprocess.run([*DSLAUNCH, "--num_gpus", "2", "--autotuning", "run", SCRIPT, "--vocab", "256", "--seq", "4", "--depth", "1",
                        "--steps", "4", "--fail_micro_batch", "4", "--hang_micro_batch", "8",
                        "--deepspeed_config", config], capture_output=True, text=True, timeout=230,
                       env=tagged_env(new_tag()), cwd=tmp_path)
    assert r.returncode == 0, f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    results = {row["name"]: row for row in json.loads((tmp_path / "results" / "results.json").read_text())}
    assert {n: row["status"] for n, row in results.items()} == {
        "z1_mb2_gas1": "ok", "z1_mb4_gas1": "failed", "z1_mb8_gas1": "hang"}
    assert "RuntimeError: this script fails at micro batch 4" in results["z1_mb4_gas1"]["message"]
    assert results["z1_mb2_gas1"]["metrics"]["throughput"] > 0
    best = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert best["train_micro_batch_size_per_gpu"] == 2 and best["zero_optimization"]["stage"] == 1
    assert "metric_path" not in best["autotuning"]  # the final job is no experiment
    assert "1 experiments run" not in r.stdout and "3 experiments run, 0 pruned; best: z1_mb2_gas1" in r.stdout
    assert "z1_mb8_gas1: hang" in r.stderr and "z1_mb4_gas1: failed" in r.stderr
    # the final job: trained with the best config to the script's own end (4 steps), not stopped at 3
    assert "[rank0] training: ZeRO stage 1, micro batch 2" in r.stdout.splitlines()[-1]
    hang_s = results["z1_mb8_gas1"]["seconds"]
    assert hang_s < 60, f"the hung experiment took {hang_s} s"  # the hang detection, not the 120 s timeout
    assert time.monotonic() - started < 200


@pytest.mark.timeout(60)
def test_an_experiment_past_its_timeout_is_stopped_and_recorded(tmp_path):
    from dslaunch.launcher.autotuning.experiments import Experiment, ExperimentRunner

    runner = ExperimentRunner(["--num_gpus", "1"], [FAKE, "sleep=600", "--deepspeed_config", "x"],
                              "--deepspeed_config", str(tmp_path), timeout=3, hang_timeout=300)
    started = time.monotonic()
    outcome = runner.run(Experiment("slow", {"train_batch_size": 1}))
    assert outcome.status == "timeout" and "experiment_timeout 3 s" in outcome.message
    assert time.monotonic() - started < 20
    assert json.loads((tmp_path / "slow" / "result.json").read_text())["status"] == "timeout"


def test_autotuning_needs_the_scripts_ds_config(capsys):
    assert cli.main(["--num_gpus", "1", "--autotuning", "tune", FAKE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dslaunch: error: --autotuning needs the script's ds_config") and err.count("\n") == 1


def test_a_bad_autotuning_block_is_one_line_before_anything_runs(tmp_path, capsys):
    config = _config(tmp_path, tuner_type="bayesian")
    assert cli.main(["--num_gpus", "1", "--autotuning", "tune", FAKE, "--deepspeed_config", config]) != 0
    err = capsys.readouterr().err
    assert "'autotuning.tuner_type'" in err and err.count("\n") == 1
    assert not (tmp_path / "exps").exists()


def test_autotuning_mode_must_be_tune_or_run(capsys):
    assert cli.main(["--autotuning", "search", FAKE]) == 2
    assert "invalid choice: 'search'" in capsys.readouterr().err


def test_the_experiment_config_asks_the_engine_to_measure(tmp_path):
    from dslaunch.launcher.autotuning.experiments import _measured

    base = {"train_batch_size": 8, "autotuning": {"metric": "FLOPS", "start_profile_step": 4}}
    cfg = _measured(base, "/m.json", str(tmp_path))
    assert cfg["autotuning"]["metric_path"] == "/m.json" and "metric_path" not in base["autotuning"]
    assert cfg["flops_profiler"]["enabled"] and cfg["flops_profiler"]["profile_step"] == 3  # before the timed steps
    assert "flops_profiler" not in _measured({"autotuning": {}}, "/m.json", str(tmp_path))


def test_set_flag_replaces_or_appends():
    from dslaunch.launcher.autotuning.experiments import set_flag

    assert set_flag(["--a", "1", "--deepspeed_config", "x.json"], "--deepspeed_config", "y") == [
        "--a", "1", "--deepspeed_config", "y"]
    assert set_flag(["--deepspeed_config=x.json"], "--deepspeed_config", "y") == ["--deepspeed_config=y"]
    assert set_flag(["--a"], "--bs", "4") == ["--a", "--bs", "4"]


def test_dry_run_lists_the_candidates_and_an_experiments_command(tmp_path, capsys):
    config = _config(tmp_path, max_train_micro_batch_size_per_gpu=4, num_tuning_micro_batch_sizes=2, offload=False)
    assert cli.main(["--num_gpus", "2", "--dry-run", "--autotuning", "tune", FAKE, "--deepspeed_config", config]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# autotuning: 4 candidates") and out[1:5] == [
        "z1_mb2_gas1", "z1_mb4_gas1", "z1_ckpt_mb2_gas1", "z1_ckpt_mb4_gas1"]
    assert "--num_gpus 2 --hang_timeout 60" in out[5] and "--dry-run" not in out[5]
    assert f"--deepspeed_config {tmp_path}/exps/z1_mb2_gas1/ds_config.json" in out[5]
    assert not (tmp_path / "exps").exists()


@pytest.mark.parametrize("code, timed_out, event, output, status", [
    (1, False, {"kind": "failure", "cause": "oom", "exception": "MemoryError: out of memory: rank 1"}, "", "oom"),
    (1, False, None, "dslaunch: error: rank 0 on localhost raised torch.OutOfMemoryError: "
                     "CUDA out of memory", "oom"),
    (124, False, {"kind": "failure", "cause": "hang"}, "dslaunch: error: rank 1 on localhost is hung", "hang"),
    (143, True, None, "", "timeout"),
    (0, False, None, "", "no_metric"),
    (1, False, {"kind": "failure", "cause": "exception"}, "dslaunch: error: rank 0 ... raised ValueError: x", "failed"),
])
def test_an_experiments_end_is_judged_from_its_files(tmp_path, code, timed_out, event, output, status):
    from dslaunch.launcher.autotuning.experiments import _judge

    if event is not None:
        job = tmp_path / "logs" / "20260101-000000-1"
        job.mkdir(parents=True)
        (job / "events.jsonl").write_text(json.dumps({"t": 1.0, **event}) + "\n")
    (tmp_path / "output.log").write_text(f"[rank0] hello\n{output}\n")
    got, message, metrics = _judge(code, timed_out, str(tmp_path / "metrics.json"), str(tmp_path), 30)
    assert got == status and metrics == {}
    if output:
        assert message == output.split("dslaunch: error: ", 1)[1]
    (tmp_path / "metrics.json").write_text('{"throughput": 3.0}')
    assert _judge(code, timed_out, str(tmp_path / "metrics.json"), str(tmp_path), 30)[::2] == ("ok", {"throughput": 3.0})


@pytest.mark.timeout(60)
def test_model_info_path_is_bounded_and_one_line(tmp_path):
    import os

    from dslaunch.errors import ConfigError
    from dslaunch.launcher.autotuning.tune import _given_info
    from dslaunch.runtime.config.autotuning import AutotuningConfig

    fifo, big, good = tmp_path / "info.fifo", tmp_path / "big.json", tmp_path / "info.json"
    os.mkfifo(fifo)
    with open(big, "wb") as f:
        f.truncate(2**30)
    good.write_text('{"num_params": 1000}')
    assert _given_info(AutotuningConfig(model_info_path=str(good))).num_params == 1000
    for path, words in ((fifo, "not a regular file"), (big, "larger than 1 MiB"), (tmp_path, "is a directory"),
                        ("/dev/zero", "not a regular file")):
        with pytest.raises(ConfigError, match=words) as err:
            _given_info(AutotuningConfig(model_info_path=str(path)))
        assert str(path) in str(err.value) and "\n" not in str(err.value)
