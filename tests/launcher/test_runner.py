"""``python -m dslaunch.launcher.runner``: DeepSpeed's module entry point of its launcher
(``deepspeed.launcher.runner``) runs the launch command. Under the ``deepspeed`` name:
tests/compat/test_package.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(30)
def test_python_m_runner_is_the_launch_command(tmp_path):
    (tmp_path / "train.py").touch()
    run = [sys.executable, "-m", "dslaunch.launcher.runner", "--dry-run", "--num_gpus", "2"]
    ok = subprocess.run([*run, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=25)
    assert ok.returncode == 0, ok.stderr
    workers = [line for line in ok.stdout.splitlines() if "DSLAUNCH_RESTART_COUNT=0" in line]
    assert [w.endswith(f"train.py --local_rank={i}") for i, w in enumerate(workers)] == [True, True], ok.stdout
    missing = subprocess.run([*run, "nope.py"], cwd=tmp_path, capture_output=True, text=True, timeout=25)
    assert missing.returncode == 2 and missing.stderr.endswith(
        f"dslaunch: error: user script 'nope.py' not found (cwd: {tmp_path})\n"), missing.stderr


# -- DeepSpeed's runner helpers over dslaunch's hostfile parser and filter -------------------------

def test_parse_hostfile_takes_lines_and_names_the_bad_one():
    from dslaunch.launcher.runner import _parse_hostfile

    assert _parse_hostfile(["  worker-1 slots=2\n", "# worker-3 slots=1\n", "10.0.0.2 slots=1 # gpu box\n"]) == {
        "worker-1": 2, "10.0.0.2": 1}
    assert list(_parse_hostfile("b slots=1\na slots=2".splitlines())) == ["b", "a"]  # file order
    for lines, words in [(["w slots=2", "x slots=1", "w slots=1"], "<hostfile>:3: duplicate host 'w'"),
                         (["", "this is bad slots=1"], "<hostfile>:2: unexpected 'is' after host 'this'"),
                         (["missingslots"], "<hostfile>:1: host 'missingslots' has no 'slots=N'"),
                         (["", "  "], "no hosts listed")]:
        with pytest.raises(ValueError) as err:
            _parse_hostfile(lines)
        assert words in str(err.value)


def test_parse_resource_filter_is_deepspeeds_on_a_two_host_pool():
    from dslaunch.launcher.runner import parse_resource_filter

    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert parse_resource_filter(hosts) == hosts
    assert parse_resource_filter(hosts, include_str="worker-1:3,0,3") == {"worker-1": [0, 3]}
    assert parse_resource_filter(hosts, include_str="worker-0:1@worker-0:0,1") == {"worker-0": [0, 1]}
    assert parse_resource_filter(hosts, exclude_str="worker-0:0,1@worker-1:3") == {"worker-0": [2, 3],
                                                                                   "worker-1": [0, 1, 2]}
    assert parse_resource_filter(hosts, exclude_str="worker-0@worker-1") == {}  # DeepSpeed's: nothing left
    assert parse_resource_filter({"a": [0, 2]}, exclude_str="a:2") == {"a": [0]}  # an already filtered pool
    for include, exclude, words in [("A", "B", "mutually exclusive"), ("jeff", "", "unknown host 'jeff'"),
                                    ("", "worker-1:4", "host 'worker-1' has slots 0-3, not 4"),
                                    ("", "worker-1@worker-0:1@5", "unknown host '5'")]:
        with pytest.raises(ValueError, match=words):
            parse_resource_filter(hosts, include_str=include, exclude_str=exclude)
    with pytest.raises(ValueError, match="has slots 0,2, not 1"):
        parse_resource_filter({"a": [0, 2]}, include_str="a:1")


def test_gpt_neox_hostfile_helpers(tmp_path, caplog):
    """GPT-NeoX's ``megatron/utils.py`` reads the hostfile with ``fetch_hostfile`` and narrows it
    with ``parse_inclusion_exclusion``; its arguments default to ``DLTS_HOSTFILE``."""
    from dslaunch.launcher.runner import DLTS_HOSTFILE, fetch_hostfile, parse_inclusion_exclusion

    assert DLTS_HOSTFILE == "/job/hostfile"
    path = tmp_path / "hosts"
    path.write_text("worker-0 slots=4\nworker-1 slots=2\n")
    pool = fetch_hostfile(str(path))
    assert list(pool.items()) == [("worker-0", 4), ("worker-1", 2)]
    assert parse_inclusion_exclusion(pool, "", "worker-0:1,2") == {"worker-0": [0, 3], "worker-1": [0, 1]}
    assert parse_inclusion_exclusion(pool, "worker-1", "") == {"worker-1": [0, 1]}
    assert fetch_hostfile(str(tmp_path / "none")) is None  # local resources only, said in a warning
    assert "no hostfile at" in caplog.text
    path.write_text("worker-0 slots=4\nworker-0 slots=1\n")
    with pytest.raises(ValueError, match="hosts:2: duplicate host 'worker-0'"):
        fetch_hostfile(str(path))


CONFLICT = "--num_nodes/--num_gpus cannot be combined with --include/--exclude"


@pytest.mark.timeout(60)
def test_runner_main_raises_value_error_where_the_command_prints_one_line(tmp_path):
    from dslaunch.launcher.runner import main

    for flags in (["--num_nodes", "1", "-i", "localhost"], ["--num_gpus", "1", "-e", "localhost"]):
        with pytest.raises(ValueError, match=CONFLICT):
            main(args=[*flags, "foo.py"])
    command = [sys.executable, "-m", "dslaunch.launcher.runner", "--num_nodes", "1", "-i", "localhost", "foo.py"]
    r = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=25)
    assert (r.returncode, r.stderr) == (2, f"dslaunch: error: {CONFLICT}\n")


@pytest.mark.timeout(90)
def test_runner_main_ends_the_process_with_a_failed_jobs_code(tmp_path, free_port):
    """GPT-NeoX's deepy.py calls runner.main(args) and ignores what it returns, as DeepSpeed's exits."""
    (tmp_path / "fail.py").write_text("import sys; sys.exit(3)\n")
    (tmp_path / "ok.py").write_text("")
    call = ("from dslaunch.launcher.runner import main; "
            f"print(main(['--num_gpus', '1', '--master_port', '{free_port}', {{!r}}]))")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for script, code, printed in [("fail.py", 3, []), ("ok.py", 0, ["None"])]:  # main() returned None
        r = subprocess.run([sys.executable, "-c", call.format(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=80)
        assert r.returncode == code and r.stdout.splitlines()[-1:] == printed, (r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and ("dslaunch: error: rank 0" in r.stderr) is bool(code), r.stderr
