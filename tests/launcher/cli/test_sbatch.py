"""``dslaunch sbatch`` without submitting: the batch script, and options checked before sbatch runs.

SLURM is out of reach here (``sinfo`` is not on the PATH): the GPU choice is the one made when
SLURM cannot be asked. With the test SLURM: tests/launcher/runners/slurm/test_sbatch.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher.cli.sbatch import run

pytestmark = pytest.mark.timeout(30)


def _sbatch(cwd: Path, *args: str, sinfo: str | None = None) -> subprocess.CompletedProcess:
    """``dslaunch sbatch --dry-run ARGS`` in ``cwd`` (holding train.py and t.py), without SLURM, or
    with a stand-in ``sinfo`` that prints ``sinfo`` (a cluster with GPUs, which the test SLURM lacks)."""
    for name in ("train.py", "t.py"):
        (cwd / name).touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "SBATCH_PARTITION"}
    env["PATH"] = os.path.dirname(sys.executable)  # no sinfo: SLURM cannot be asked
    if sinfo is not None:
        (cwd / "bin").mkdir(exist_ok=True)
        fake = cwd / "bin" / "sinfo"
        fake.write_text(f'#!/bin/sh\n[ "$*" = "--noheader --all --format=%P|%G" ] || exit 9\n'
                        f"printf '%s\\n' {shlex.join(sinfo.splitlines())}\n")
        fake.chmod(0o755)
        env["PATH"] = f"{cwd / 'bin'}:/bin:/usr/bin:{env['PATH']}"
    return subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "sbatch", "--dry-run", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=20)


def _dry(cwd: Path, *args: str) -> str:
    out = _sbatch(cwd, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_batch_script_asks_for_the_nodes_and_runs_dslaunch_through_srun(tmp_path):
    text = _dry(tmp_path, "--nodes", "3", "--num_gpus", "4", "--partition", "gpu", "--time", "1:00:00",
                "--job-name", "x y", "--requeue", "--signal", "B:USR1@90", "--sbatch_args",
                "--qos=high --exclusive", "--hang_timeout", "60", "train.py", "--deepspeed_config", "ds.json",
                "--nodes", "7")
    lines = text.splitlines()
    assert lines[0] == "# sbatch --parsable --qos=high --exclusive < (this script)"
    assert lines[1] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", '#SBATCH --job-name="x y"',
        "#SBATCH --signal=B:USR1@90", "#SBATCH --requeue", f"#SBATCH --chdir={tmp_path}"]
    command = shlex.split(lines[-1])
    # The launcher options and the script's own arguments (its --nodes too) go on; sbatch's do not.
    assert command == ["exec", sys.executable, "-m", "dslaunch.launcher.cli", "--launcher", "slurm",
                       "--num_gpus", "4", "--hang_timeout", "60", "train.py", "--deepspeed_config", "ds.json",
                       "--nodes", "7"]


def test_gpus_per_node_zero_asks_for_tasks_only(tmp_path):
    out = _sbatch(tmp_path, "--nodes", "1", "--num_gpus", "2", "--gpus_per_node", "0", "t.py")
    assert "#SBATCH --ntasks-per-node=2" in out.stdout and "gpus-per-node" not in out.stdout
    assert out.stderr == ""  # nothing was asked, nothing to say


def test_without_slurm_to_ask_the_script_asks_for_the_gpus_and_says_so(tmp_path):
    out = _sbatch(tmp_path, "--nodes", "2", "--num_gpus", "2", "t.py")
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --gpus-per-node=2" in out.stdout
    assert out.stderr == ("dslaunch: cannot ask SLURM which GPUs the partition offers (sinfo not found (not "
                          "a SLURM login node)): the batch script asks for 2 GPUs per node (--num_gpus); add "
                          "--gpus_per_node 0 for nodes without GPUs\n")


GPU_CLUSTER = "gpu*|gpu:a100:4(S:0-1)\ngpu*|gpu:h100:8(S:0-1)\ncpu|(null)\n"


def test_a_partition_with_gpus_gets_them_and_one_without_gets_cpu_workers(tmp_path):
    on_gpus = _sbatch(tmp_path, "--nodes", "2", "--num_gpus", "8", "t.py", sinfo=GPU_CLUSTER)
    assert on_gpus.returncode == 0, on_gpus.stderr
    assert "#SBATCH --gpus-per-node=8" in on_gpus.stdout.splitlines()
    assert on_gpus.stderr == ("dslaunch: partition 'gpu' has GPUs (up to 8 per node): asking for 8 GPUs "
                              "per node\n")
    on_cpus = _sbatch(tmp_path, "--nodes", "2", "--num_gpus", "8", "--partition", "cpu", "t.py",
                      sinfo=GPU_CLUSTER)
    assert on_cpus.returncode == 0 and "gpus-per-node" not in on_cpus.stdout, on_cpus.stderr
    assert on_cpus.stderr.startswith("dslaunch: partition 'cpu' has no GPUs (no gpu GRES on its nodes): "
                                     "asking for 8 tasks per node and no GPUs"), on_cpus.stderr


def test_more_gpus_than_the_partitions_nodes_have_is_one_line(tmp_path):
    out = _sbatch(tmp_path, "--nodes", "2", "--num_gpus", "16", "t.py", sinfo=GPU_CLUSTER)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("dslaunch: error: --num_gpus 16: the nodes of partition 'gpu' have at most 8 GPUs; "
                          "ask for 8 or fewer per node\n")


def test_values_stay_one_argument_of_their_sbatch_line(tmp_path):
    # sbatch splits #SBATCH lines at blanks and ends them at '#': unquoted, --uid=0 would be an option.
    text = _dry(tmp_path, "--nodes", "1", "--job_name", 'a "b" \\c #d --uid=0', "--output", "my out/%j.log",
                "--partition", "p1,p2", "t.py")
    assert '#SBATCH --job-name="a \\"b\\" \\\\c #d --uid=0"' in text.splitlines()
    assert '#SBATCH --output="my out/%j.log"' in text.splitlines()
    assert "#SBATCH --partition=p1,p2" in text.splitlines()


@pytest.mark.parametrize("flag, named", [(f, f) for f in ("--job_name", "--partition", "--output", "--error",
                                                             "--account", "--time", "--signal")]
                         + [("--job-name", "--job_name")])  # sbatch's spelling: named as the help shows it
def test_a_line_break_in_an_sbatch_value_is_refused(flag, named):
    # It would end the #SBATCH line: the rest runs as a command of the batch script.
    with pytest.raises(UsageError) as info:
        run(["--dry-run", "--nodes", "1", flag, "x\necho INJECTED", "t.py"])
    text = str(info.value)
    assert text.startswith(f"{named} 'x\\necho INJECTED' holds a line break") and "\n" not in text, text


def test_a_line_break_in_the_working_directory_is_refused(tmp_path):
    cwd = tmp_path / "run\n#SBATCH --uid=0"
    cwd.mkdir()
    out = _sbatch(cwd, "--nodes", "1", "t.py")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("dslaunch: error: the working directory '") and out.stderr.count("\n") == 1
    assert "run\\n#SBATCH --uid=0' holds a line break" in out.stderr, out.stderr


@pytest.mark.parametrize("args, words", [
    (["--nodes", "2", "--qos", "high", "t.py"], "unknown option --qos: dslaunch sbatch takes --nodes"),
    (["--nodes", "2", "--qos=high", "t.py"], "pass other sbatch options verbatim with --sbatch_args '--qos ...'"),
    (["t.py"], "the following arguments are required: --nodes"),
    (["--nodes", "0", "t.py"], "--nodes 0: expected 1 or more nodes"),
    (["--nodes", "2", "--hang_timeout", "x", "t.py"], "argument --hang_timeout: invalid float value: 'x'"),
    (["--nodes", "2", "--grace_period", "-1", "t.py"], "--grace_period -1: expected seconds"),
    (["--nodes", "2", "-H", "hosts", "t.py"], "leave out --hostfile, --no_ssh and --launcher"),
    (["--nodes", "2", "--launcher", "ssh", "t.py"], "leave out --hostfile, --no_ssh and --launcher"),
    (["--nodes", "2", "--sbatch_args", "--comment='x", "t.py"],
     "--sbatch_args \"--comment='x\": no closing quotation; it is split like a shell line"),
    (["--nodes", "2", "--gpus_per_node", "-5", "t.py"], "--gpus_per_node -5: expected 0 to 4096 GPUs"),
    (["--nodes", "2", "--max_restarts", "-1", "t.py"], "--max_restarts -1: expected 0"),
    (["--nodes", "2", "--min_elastic_nodes", "2", "t.py"], "--min_elastic_nodes 2 is only used with"),
    (["--nodes", "2", "--num_gpus", "2", "no_such_script.py"], "user script 'no_such_script.py' not found"),
    (["--nodes", "2", "--module", "no_such_module_x", "a"], "--module: no module named 'no_such_module_x'"),
])
def test_mistakes_are_one_line_before_anything_is_submitted(args, words):
    with pytest.raises(UsageError) as info:
        run(["--dry-run", *args])
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
