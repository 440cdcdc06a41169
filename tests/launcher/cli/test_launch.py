"""The dslaunch command line: one-line errors, --verbose tracebacks, --dry-run, zero-to-fp32."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys

import pytest

from dslaunch.launcher import cli
from tests.launcher.helpers import DSLAUNCH, FAKE, new_tag, run_dslaunch, tagged_env

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("args, words, code", [
    (["--num_gpuz", "2", FAKE], "unrecognized arguments: --num_gpuz (did you mean '--num_gpus'?)", 2),
    (["--num_gpus", "two", FAKE], "argument --num_gpus/--num_accelerators: invalid integer value: 'two'", 2),
    (["--module", "--no_python", FAKE], "--module and --no_python are mutually exclusive", 2),
    (["--master_port", "70000", FAKE], "--master_port 70000 is not a TCP port", 2),
    (["--launcher", "sssh", FAKE], "unknown --launcher 'sssh' (did you mean 'ssh'?)", 2),
    (["--bind_core_list", "a-b", FAKE], "--bind_core_list 'a-b'", 2),
    ([], "the following arguments are required: user_script (see dslaunch --help)", 2),
])
def test_bad_flags_are_one_line_without_traceback(args, words, code):
    r = run_dslaunch(args)
    assert r.returncode == code
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dslaunch: error: ") and words in lines[0], r.stderr
    assert "user_args" not in r.stderr  # optional: never listed as required


MISSING = "/nonexistent/train.py"


@pytest.mark.parametrize("args, words", [
    (["--ssh_port", "0", FAKE], "--ssh_port 0 is not a TCP port (1-65535)"),
    (["--ssh_port", "65536", FAKE], "--ssh_port 65536 is not a TCP port (1-65535)"),
    (["--hostfile", "", FAKE], "--hostfile '': empty path; give a hostfile, or leave the flag out"),
    (["--num_nodes", "-5", FAKE], "--num_nodes -5: expected 1 to 65536 hosts (or -1, the default: all)"),
    (["--num_gpus", "0", FAKE], "--num_gpus 0: expected 1 to 4096 workers per host"),
    (["--num_gpus", "100000", FAKE], "--num_gpus 100000: expected 1 to 4096 workers per host"),
    (["--num_gpus", "999999999999999999", FAKE], "--num_gpus 999999999999999999: expected 1 to 4096"),
    (["--num_gpus", "9" * 5000, FAKE], "invalid integer value: '99999"),
    (["--grace_period", "inf", FAKE], "--grace_period inf: expected seconds from 0 to 3600"),
    (["--grace_period", "nan", FAKE], "--grace_period nan: expected seconds from 0 to 3600"),
    (["--grace_period", "1e999", FAKE], "--grace_period inf: expected seconds from 0 to 3600"),
    (["--grace_period", "soon", FAKE], "argument --grace_period: invalid float value: 'soon'"),
    (["--master_addr=-x", FAKE], "--master_addr '-x': expected labels"),
    (["--bind_core_list", "3-1", FAKE], "--bind_core_list '3-1': range '3-1' is empty; write it low-high ('1-3')"),
    (["--bind_core_list", "3-", FAKE], "--bind_core_list '3-': '3-' is not a core or a range"),
    (["--bind_core_list", "0,,2", FAKE], "'' is not a core or a range"),
    (["--bind_core_list", "0-3,2", FAKE], "--bind_core_list '0-3,2': core 2 is listed twice"),
    (["--bind_core_list", "0-999999", FAKE], "'0-999999' is not a core or a range"),
    (["--hang_timeout", "0", FAKE], "--hang_timeout 0: expected seconds from 2 (heartbeats reach the launcher "
                                    "up to 1 s late) to 604800 (leave the flag out"),
    (["--hang_timeout", "nan", FAKE], "--hang_timeout nan: expected seconds from 2 "),
    (["--hang_timeout", "0.1", FAKE], "--hang_timeout 0.1: expected seconds from 2 "),
    (["--hang_timeout", "1e-300", FAKE], "--hang_timeout 1e-300: expected seconds from 2 "),
    (["--hang_timeout", "soon", FAKE], "argument --hang_timeout: invalid float value: 'soon'"),
    (["--hang_timeout", "\u0663", FAKE], "argument --hang_timeout: invalid float value: '\u0663'"),
    (["--grace_period", "1_0", FAKE], "argument --grace_period: invalid float value: '1_0'"),
    (["--max_restarts", "2147483648", FAKE], "--max_restarts 2147483648: expected 0 to 1000000"),
    (["--log_dir", "", FAKE], "--log_dir '': not a path (empty, or a NUL character); give a directory, or leave "
                              "the flag out for /"),
    (["--log_dir", "x\0" + "y" * 4300, FAKE], "--log_dir 'x\\x00yyyy"),
    (["--num_gpus", "1_0", FAKE], "argument --num_gpus/--num_accelerators: invalid integer value: '1_0'"),
    (["--master_port", "２９５００", FAKE], "argument --master_port: invalid integer value: '２９５００'"),
    ([*["--" + "x" * 100] * 20, FAKE], "unrecognized arguments: --xxx"),
    (["--dry-run", MISSING], f"user script {MISSING!r} not found"),
    (["--dry-run", "--no_python", "/nonexistent/prog"], "--no_python: program '/nonexistent/prog' not found"),
    (["--dry-run", "--module", "nosuch_mod_3f1c"], "--module: no module named 'nosuch_mod_3f1c' (searched "),
    (["--dry-run", "--module", "nosuch_mod_3f1c.sub"], "--module: no module named 'nosuch_mod_3f1c'"),
    (["--dry-run", "--module", ".rel"], "--module: no module named ''"),
])
def test_bad_input_is_one_line_in_process_too(args, words, capsys):
    """The same contract through main() itself (cheaper than a process per case)."""
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("dslaunch: error: ") and words in lines[0], captured.err
    assert len(lines[0]) <= 500, lines[0]


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null", "/"])
@pytest.mark.timeout(10)  # /dev/zero was read until MemoryError
def test_a_hostfile_that_is_no_regular_file_is_one_line(path, capsys):
    assert cli.main(["-H", path, "--dry-run", FAKE]) == 1
    assert capsys.readouterr().err == (f"dslaunch: error: {path}: not a regular file; a hostfile is a text file "
                                       "of 'host slots=N' lines\n")


def test_dry_run_fails_like_a_real_run(tmp_path, capsys):
    for extra in ([], ["--dry-run"]):
        assert cli.main([*extra, "--num_gpus", "1", MISSING]) == 2
        assert capsys.readouterr().err == f"dslaunch: error: user script {MISSING!r} not found (cwd: {os.getcwd()})\n"
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=1\nnode2 slots=1\n")
    for extra in ([], ["--dry-run"]):
        assert cli.main([*extra, "-H", str(hf), "--launcher", "local", FAKE]) == 2
        assert "the local launcher runs one node, but 2 hosts are selected (node1, node2)" in capsys.readouterr().err


def test_module_check_finds_modules_in_the_cwd_and_installed_ones_without_importing(tmp_path, monkeypatch,
                                                                                    capsys):
    imported = tmp_path / "imported"
    side_effect = f"open({str(imported)!r}, 'a').write(__name__)\n"
    (tmp_path / "mytrain_7c2e.py").write_text(side_effect)
    (tmp_path / "mypkg_7c2e").mkdir()
    (tmp_path / "mypkg_7c2e" / "__init__.py").write_text(side_effect)
    monkeypatch.chdir(tmp_path)  # python -m finds modules in the cwd; so must the check
    for module in ("mytrain_7c2e", "mypkg_7c2e.train", "json.tool", "dslaunch.launcher.cli"):
        assert cli.main(["--num_gpus", "1", "--dry-run", "--module", module]) == 0, capsys.readouterr().err
        assert f"-u -m {module} --local_rank=0" in capsys.readouterr().out
    assert not imported.exists()  # looked up, never imported
    assert "mytrain_7c2e" not in sys.modules and "mypkg_7c2e" not in sys.modules


def test_bad_hostfile_names_file_and_line_and_verbose_adds_traceback(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=2\nnode2 slots=zero\n")
    r = run_dslaunch(["-H", str(hf), FAKE])
    assert r.returncode == 1
    assert r.stderr.strip() == f"dslaunch: error: {hf}:2: slots='zero' is not an integer (digits 0-9 only)"
    r = run_dslaunch(["--verbose", "-H", str(hf), FAKE])
    assert "Traceback" in r.stderr and "HostfileError" in r.stderr


def test_explicit_missing_hostfile_is_an_error(tmp_path):
    r = run_dslaunch(["-H", str(tmp_path / "nope"), FAKE])
    assert r.returncode == 1 and "hostfile not found" in r.stderr


def test_dry_run_prints_commands_and_env_and_starts_nothing(tmp_path):
    marker = tmp_path / "ran"
    r = run_dslaunch(["--num_gpus", "2", "--master_port", "4321", "--dry-run", FAKE, f"grandchild={marker}"])
    assert r.returncode == 0 and not marker.exists()
    lines = r.stdout.splitlines()
    assert lines[0] == "# node 0: localhost (2 workers)"
    cmds = [line for line in lines if FAKE in line]
    assert len(cmds) == 2
    for rank, line in enumerate(cmds):
        assert f"RANK={rank} " in line and "MASTER_PORT=4321" in line and "WORLD_SIZE=2" in line
        assert line.endswith(f"{FAKE} --local_rank={rank} grandchild={marker}")


def test_dry_run_shows_the_monitor_and_writes_nothing(tmp_path):
    r = run_dslaunch(["--num_gpus", "1", "--dry-run", "--hang_timeout", "5", "--log_dir", str(tmp_path / "l"), FAKE])
    assert r.returncode == 0, r.stderr
    last = r.stdout.splitlines()[-1]
    assert re.fullmatch(rf"# monitor: hang_timeout 5 s \(first step: 60 s\); events, error files and stacks in "
                        rf"{tmp_path}/l/\d{{8}}-\d{{6}}-\d+-[0-9a-f]{{6}}", last), last
    assert not (tmp_path / "l").exists()
    r = run_dslaunch(["--num_gpus", "1", "--dry-run", FAKE], cwd=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "s"))
    assert f"# monitor: hang_timeout off; events, error files and stacks in {tmp_path}/s/dslaunch/logs/" in r.stdout
    assert os.listdir(tmp_path) == []


def test_a_log_dir_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    r = run_dslaunch(["--num_gpus", "1", "--log_dir", str(tmp_path / "file"), FAKE])
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == (
        f"dslaunch: error: --log_dir {tmp_path}/file: cannot create or open it as a directory: Not a directory"), r.stderr


def test_dry_run_with_remote_hosts_uses_the_ssh_runner(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=2\nnode2 slots=2\n")
    cfg = cli.parse_config(["-H", str(hf), "--dry-run", FAKE])[0]
    from dslaunch.launcher.gpus import detect
    from dslaunch.launcher.plan import build_job

    assert build_job(cfg, detect).job.launcher == "ssh"


def test_controller_never_imports_torch():
    code = ("import sys; from dslaunch.launcher import cli; from dslaunch.launcher.agent import node, remote; from dslaunch.launcher.runners import local; "
            "assert 'torch' not in sys.modules and 'psutil' not in sys.modules, sorted(sys.modules); "
            "assert 'click' not in sys.modules, 'click is for the subcommands only'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dry_run_into_a_closed_pipe_exits_quietly():
    """The reader already gone when the plan is written (a real pipe, read end closed)."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        r = subprocess.run(DSLAUNCH + ["--num_gpus", "2", "--dry-run", FAKE], stdout=write_fd,
                           stderr=subprocess.PIPE, text=True, timeout=20, env=tagged_env(new_tag()))
    finally:
        os.close(write_fd)
    assert r.returncode == 128 + signal.SIGPIPE
    assert r.stderr.startswith("dslaunch: no GPU") and r.stderr.count("\n") == 1, r.stderr  # the note only


def test_dry_run_piped_into_head_prints_no_traceback():
    """``dslaunch --dry-run ... | head -1`` with a plan larger than the pipe buffer (1000 workers)."""
    cmd = f"{shlex.join(DSLAUNCH)} --num_gpus 1000 --dry-run {shlex.quote(FAKE)} | head -1"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=20,
                       env=tagged_env(new_tag()))
    assert r.stdout == "# node 0: localhost (1000 workers)\n"
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert r.returncode == 128 + signal.SIGPIPE  # pipefail: dslaunch's status, as for any tool cut off by head


def test_cuda_visible_devices_of_the_environment_picks_the_local_gpus():
    from dslaunch.launcher.gpus import Accelerators
    from dslaunch.launcher.plan import build_job

    gpu4 = lambda: Accelerators("cuda", 4)  # noqa: E731
    cfg = cli.parse_config([FAKE], env={"CUDA_VISIBLE_DEVICES": "2"})[0]
    assert build_job(cfg, gpu4).job.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "2"
    cfg = cli.parse_config([FAKE], env={})[0]
    assert build_job(cfg, gpu4).job.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


@pytest.mark.parametrize("value", ["-i /keys/id_ed25519", "-e x", "-H x", "-p 2222 -o StrictHostKeyChecking=no", "-v"])
def test_launcher_args_value_may_start_with_a_dash(value, capsys):
    argv = ["--launcher_args", value, "--num_gpus", "1", "--dry-run", FAKE, "--launcher_args", "-z"]
    assert cli.main(argv) == 0, capsys.readouterr().err  # was: 'expected one argument'
    commands = capsys.readouterr().out.splitlines()[:-1]  # the last line describes the monitor
    assert commands[-1].endswith(f"{FAKE} --local_rank=0 --launcher_args -z")
    cfg = cli.parse_config(argv)[0]
    assert cfg.launcher_args == value and cfg.num_gpus == 1
    assert cfg.user_args == ("--launcher_args", "-z")  # the script's own arguments are not rewritten


def test_launcher_args_as_the_last_word_is_a_one_line_error():
    r = run_dslaunch(["--launcher_args"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "dslaunch: error: argument --launcher_args: expected one argument (see dslaunch --help)"]


@pytest.mark.parametrize("args", [
    ["--comment", "x", FAKE], ["--account", "proj", FAKE], ["--num_gpus", "1", "--comment"],
])
def test_unsupported_deepspeed_flags_are_named(args, capsys):
    flag = next(a for a in args if a.startswith("--") and a != "--num_gpus").split("=")[0]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == (f"dslaunch: error: {flag} is a DeepSpeed launcher flag dslaunch does not "
                                       "support yet; leave it out\n")


def test_no_ssh_check_is_accepted_and_changes_nothing(capsys):
    assert cli.main(["--no_ssh_check", "--num_gpus", "1", "--dry-run", FAKE]) == 0
    with_flag = capsys.readouterr().out
    assert cli.main(["--num_gpus", "1", "--dry-run", FAKE]) == 0
    job_id = re.compile(r"\d{8}-\d{6}-\d+-[0-9a-f]{6}")  # unguessable: differs in every run
    assert job_id.sub("ID", capsys.readouterr().out) == job_id.sub("ID", with_flag)
    assert f"{FAKE} --local_rank=0" in with_flag


def test_no_ssh_runs_this_nodes_workers_with_their_global_ranks(tmp_path):
    """Node 1 of a 2-node hostfile whose hosts this machine cannot reach: nothing is contacted."""
    hf = tmp_path / "hostfile"
    hf.write_text("node-a.invalid slots=2\nnode-b.invalid slots=3\n")
    with socket.create_server(("", 0)) as busy:  # as if node 0's rank 0 were listening on this machine
        port = str(busy.getsockname()[1])
        args = ["--hostfile", str(hf), "--no_ssh", "--master_addr", "10.9.8.7", "--master_port", port]
        r = run_dslaunch([*args, "--node_rank", "1", FAKE, "env"])
        assert r.returncode == 0, r.stderr  # only node 0 hosts the rendezvous port: others do not check it
        r0 = run_dslaunch([*args, "--node_rank", "0", FAKE, "env"])
    assert r0.returncode == 1 and f"--master_port {port} is already in use" in r0.stderr and not r0.stdout
    tagged = [line.partition(" ") for line in r.stdout.splitlines()]  # "[rank3] {...}"
    envs = sorted((json.loads(body) for _, _, body in tagged), key=lambda e: int(e["RANK"]))
    assert sorted(tag for tag, _, _ in tagged) == ["[rank2]", "[rank3]", "[rank4]"]
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("2", "0"), ("3", "1"), ("4", "2")]
    for e in envs:
        assert (e["WORLD_SIZE"], e["NODE_RANK"], e["CROSS_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("5", "1", "2", "3")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"], e["CUDA_VISIBLE_DEVICES"]) == ("10.9.8.7", port, "0,1,2")
    assert "--no_ssh: starting node 1 of 2 (node-b.invalid: ranks 2-4 of 5)" in r.stderr


def _ds_config(tmp_path, monitor) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "monitor": monitor}))
    return str(path)


def test_the_ds_config_monitor_block_sets_the_policy_and_flags_win(tmp_path, capsys):
    ds = _ds_config(tmp_path, {"hang_timeout": 30, "max_restarts": 2, "log_dir": str(tmp_path / "runs")})
    assert cli.main(["--num_gpus", "1", "--dry-run", FAKE, "--deepspeed_config", ds]) == 0
    tail = capsys.readouterr().out.splitlines()[-3:]
    assert tail[0].startswith(f"# monitor: hang_timeout 30 s (first step: 60 s); events, error files and stacks in "
                              f"{tmp_path}/runs/"), tail
    assert tail[1].startswith("# restarts: up to 2, after 1 s"), tail
    assert tail[2] == f"# from the ds_config's monitor block ({ds}): hang_timeout, max_restarts, log_dir (flags win over it)"
    assert cli.main(["--num_gpus", "1", "--dry-run", "--max_restarts", "1", "--hang_timeout", "5", FAKE,
                     f"--deepspeed_config={ds}"]) == 0
    tail = capsys.readouterr().out.splitlines()[-3:]
    assert tail[0].startswith("# monitor: hang_timeout 5 s (first step: 60 s)") and f"{tmp_path}/runs/" in tail[0]
    assert tail[1].startswith("# restarts: up to 1, after 1 s"), tail
    assert tail[2] == f"# from the ds_config's monitor block ({ds}): log_dir (flags win over it)"


@pytest.mark.parametrize("form", [["--deepspeed", "{ds}"], ["--deepspeed={ds}"],
                                  ["--deepspeed", "--deepspeed_config", "{ds}"]])
def test_the_monitor_block_is_read_from_hugging_faces_deepspeed_flag_too(tmp_path, capsys, form):
    ds = _ds_config(tmp_path, {"hang_timeout": 30})
    assert cli.main(["--num_gpus", "1", "--dry-run", FAKE, "--output_dir", "out", *[a.format(ds=ds) for a in form]]) == 0
    tail = capsys.readouterr().out.splitlines()[-2:]
    assert tail[0].startswith("# monitor: hang_timeout 30 s"), tail
    assert tail[1] == f"# from the ds_config's monitor block ({ds}): hang_timeout (flags win over it)"


def test_deepspeeds_own_deepspeed_flag_takes_no_value(tmp_path, capsys):
    """``--deepspeed`` before a script's own argument (DeepSpeed's store_true flag): that argument
    is not read as a config."""
    data = tmp_path / "data.txt"
    data.write_text("not json")
    assert cli.main(["--num_gpus", "1", "--dry-run", FAKE, "--deepspeed", str(data)]) == 0
    assert "monitor block" not in capsys.readouterr().out


@pytest.mark.parametrize("monitor, words", [
    ({"hang_timout": 3}, "'monitor.hang_timout': unknown parameter for section 'monitor' (did you mean 'hang_timeout'?); "
                         "valid parameters: hang_timeout, log_dir, max_restarts"),
    ({"hang_timeout": 0}, "'monitor.hang_timeout': must be in [2, 604800], got int 0"),
    ({"hang_timeout": 0.1}, "'monitor.hang_timeout': must be in [2, 604800], got float 0.1"),
    ({"max_restarts": -1}, "'monitor.max_restarts': must be an integer in [0, 1e6], got int -1"),
    ({"log_dir": ""}, "'monitor.log_dir': must be a directory path (a non-empty string without NUL)"),
    ({"log_dir": "\u0000x"}, "'monitor.log_dir': must be a directory path (a non-empty string without NUL), "
                              "got str '\\x00x'"),
    ([1], "'monitor': must be an object, got list"),
])
def test_a_bad_monitor_block_is_one_line_naming_the_key(tmp_path, capsys, monitor, words):
    ds = _ds_config(tmp_path, monitor)
    assert cli.main(["--num_gpus", "1", "--dry-run", FAKE, "--deepspeed_config", ds]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"dslaunch: error: {ds}: ") and words in line, line


def test_reading_the_monitor_block_imports_no_torch(tmp_path):
    ds = _ds_config(tmp_path, {"hang_timeout": 30})
    code = ("import sys; from dslaunch.launcher import cli; "
            f"assert cli.main(['--num_gpus', '1', '--dry-run', {FAKE!r}, '--deepspeed_config', {ds!r}]) == 0; "
            "assert 'torch' not in sys.modules and 'psutil' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_resume_from_that_cannot_be_a_directory_fails_at_launch_and_in_dry_run(tmp_path, capsys):
    """A file, a path under a file or '' as --resume_from left every restart starting from scratch."""
    afile = tmp_path / "ckpt.pt"
    afile.write_text("x")
    cases = [(str(afile), "is a file; expected the checkpoint directory"),
             (str(afile / "sub" / "dir"), f"is under the file '{afile}'"),
             ("", "--resume_from '': empty path")]
    for path, words in cases:
        for extra in ([], ["--dry-run"]):
            assert cli.main([*extra, "--max_restarts", "1", "--resume_from", path, FAKE]) == 2
            err = capsys.readouterr().err
            assert err.startswith("dslaunch: error: ") and err.count("\n") == 1 and words in err, err


def test_resume_from_that_does_not_exist_yet_is_valid_and_said_in_one_line(tmp_path, capsys):
    later = tmp_path / "ckpt" / "run1"
    assert cli.main(["--dry-run", "--max_restarts", "1", "--resume_from", str(later), FAKE]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "resume_from" in ln]
    assert notes == [f"dslaunch: --resume_from '{later}' does not exist yet: this run starts at step 0; "
                     "a restart resumes from the newest checkpoint saved there"]
    later.mkdir(parents=True)
    assert cli.main(["--dry-run", "--max_restarts", "1", "--resume_from", str(later), FAKE]) == 0
    assert "resume_from" not in capsys.readouterr().err
