"""``dslaunch sbatch`` without submitting: the batch script, and options checked before sbatch runs."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher.cli.sbatch import run

pytestmark = pytest.mark.timeout(30)


def _dry(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "sbatch", "--dry-run", *args],
                         capture_output=True, text=True, env=env, timeout=20)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_batch_script_asks_for_the_nodes_and_runs_dslaunch_through_srun():
    text = _dry("--nodes", "3", "--num_gpus", "4", "--partition", "gpu", "--time", "1:00:00", "--job-name", "x y",
                "--requeue", "--signal", "B:USR1@90", "--sbatch_args", "--qos=high --exclusive",
                "--hang_timeout", "60", "train.py", "--deepspeed_config", "ds.json", "--nodes", "7")
    lines = text.splitlines()
    assert lines[0] == "# sbatch --parsable --qos=high --exclusive < (this script)"
    assert lines[1] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --job-name=x y",
        "#SBATCH --signal=B:USR1@90", "#SBATCH --requeue", f"#SBATCH --chdir={os.getcwd()}"]
    command = shlex.split(lines[-1])
    # The launcher options and the script's own arguments (its --nodes too) go on; sbatch's do not.
    assert command == ["exec", sys.executable, "-m", "dslaunch.launcher.cli", "--launcher", "slurm",
                       "--num_gpus", "4", "--hang_timeout", "60", "train.py", "--deepspeed_config", "ds.json",
                       "--nodes", "7"]


def test_gpus_per_node_zero_asks_for_tasks_only():
    text = _dry("--nodes", "1", "--num_gpus", "2", "--gpus_per_node", "0", "t.py")
    assert "#SBATCH --ntasks-per-node=2" in text and "gpus-per-node" not in text


@pytest.mark.parametrize("args, words", [
    (["--nodes", "2", "--qos", "high", "t.py"], "unknown option --qos: dslaunch sbatch takes --nodes"),
    (["--nodes", "2", "--qos=high", "t.py"], "pass other sbatch options verbatim with --sbatch_args '--qos ...'"),
    (["t.py"], "the following arguments are required: --nodes"),
    (["--nodes", "0", "t.py"], "--nodes 0: expected 1 or more nodes"),
    (["--nodes", "2", "--hang_timeout", "x", "t.py"], "argument --hang_timeout: invalid float value: 'x'"),
    (["--nodes", "2", "--grace_period", "-1", "t.py"], "--grace_period -1: expected seconds"),
    (["--nodes", "2", "-H", "hosts", "t.py"], "leave out --hostfile, --no_ssh and --launcher"),
    (["--nodes", "2", "--launcher", "ssh", "t.py"], "leave out --hostfile, --no_ssh and --launcher"),
])
def test_mistakes_are_one_line_before_anything_is_submitted(args, words):
    with pytest.raises(UsageError) as info:
        run(["--dry-run", *args])
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
