"""paramiko without invoke at start-up (launcher/runners/ssh/sshlib.py), and ssh config 'Match exec' still works."""

import subprocess
import sys

import pytest

from dslaunch.launcher.runners.ssh.options import SSHOptions, load_config, resolve

pytestmark = pytest.mark.timeout(60)


def test_the_ssh_runner_starts_without_invoke() -> None:
    code = ("import sys, dslaunch.launcher.runners.ssh.runner, dslaunch.launcher.runners.ssh.sshlib as s; "
            "print('invoke' in sys.modules, 'asyncio' in sys.modules, s.paramiko.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "paramiko"]


def test_match_exec_loads_invoke_when_a_config_needs_it(tmp_path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text('Match exec "true"\n    Port 2201\nMatch exec "false"\n    User nobody\n'
                      "Host *\n    User alice\n")
    code = ("import sys\n"
            "from dslaunch.launcher.runners.ssh.options import SSHOptions, load_config, resolve\n"
            f"t = resolve('h', SSHOptions(config_file={str(config)!r}), load_config({str(config)!r}))\n"
            "print(t.port, t.user, 'invoke' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["2201", "alice", "True"]


def test_a_config_without_match_exec_resolves_in_process(tmp_path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host h\n    HostName 10.0.0.9\n    Port 2202\n")
    target = resolve("h", SSHOptions(config_file=str(config)), load_config(str(config)))
    assert (target.hostname, target.port) == ("10.0.0.9", 2202)


def test_the_probe_reports_torch_as_torch_does_without_importing_it(tmp_path) -> None:
    code = ("import sys, json\n"
            "from dslaunch.launcher.agent import bootstrap\n"
            f"info = bootstrap.probe({{'cwd': {str(tmp_path)!r}}})\n"
            "print(json.dumps([info['torch'], info['dslaunch'], 'torch' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    import json

    import torch

    import dslaunch

    assert json.loads(out) == [torch.__version__, dslaunch.__version__, False]
