"""The environment report (``dslaunch report``, ``ds_report``): its fields on this machine, and with
components hidden (modules blocked, no compiler, ssh or SLURM on PATH, a wrong interface name):
each missing piece is a value and a note, never a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from dslaunch.env_report import as_json, as_text, cli_main, collect

pytestmark = pytest.mark.timeout(90)


def test_fields_on_this_machine() -> None:
    import torch

    import dslaunch
    from dslaunch.kernels.cpu import build

    doc = as_json(collect())
    v = doc["versions"]
    assert v["torch"] == torch.__version__ and v["python"] == sys.version.split()[0]
    assert v["gloo"] is True and v["dslaunch"] == dslaunch.__version__
    assert v["torch_cuda"] == torch.version.cuda
    assert doc["devices"]["cpu_count"] == os.cpu_count() and doc["devices"]["host_memory"] > 0
    assert len(doc["devices"]["devices"]) == torch.cuda.device_count()
    assert doc["kernels"]["cache"] == str(build.cache_dir())
    cpu = doc["kernels"]["cpu_kernels"]
    assert cpu in ("built", "buildable", "unavailable")
    if cpu == "built":  # the note is the cached library, and it is there
        assert os.path.isfile(doc["notes"]["kernels.cpu_kernels"])
    assert "lo" in doc["network"]["interfaces"]
    assert doc["install"]["dslaunch_path"] == list(dslaunch.__path__)
    assert doc["install"]["python_executable"] == sys.executable
    text = as_text(collect())
    assert f"torch {'.' * 28} {torch.__version__} [OKAY]" in text  # DeepSpeed's dotted column


_HIDDEN = """
import json, sys
for name in ("triton", "transformers", "accelerate", "pynvml", "paramiko"):
    sys.modules[name] = None  # an import of it now fails as if it were not installed
from dslaunch.env_report import as_json, collect
print(json.dumps(as_json(collect())))
"""


def test_hidden_components_are_reported_not_raised(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CUDA_HOME", "CUDA_PATH", "SLURM_JOB_ID")}
    env.update(PATH=str(tmp_path), GLOO_SOCKET_IFNAME="nosuch0", NCCL_SOCKET_IFNAME="lo",
               DSLAUNCH_KERNELS_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", _HIDDEN], capture_output=True, text=True, env=env, timeout=80)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    for name in ("triton", "transformers", "accelerate"):
        assert doc["versions"][name] is None and f"versions.{name}: not installed" in doc["warnings"]
    assert doc["nvml"]["nvml"] is None and "pynvml not installed" in doc["notes"]["nvml.nvml"]
    assert doc["compilers"]["cc"] is None and doc["compilers"]["nvcc"] is None
    assert doc["kernels"]["cpu_kernels"] == "unavailable"  # no compiler: the torch reference runs
    assert doc["kernels"]["triton_kernels"] == "not installed"
    assert doc["kernels"]["cache"] == str(tmp_path / "cache")
    assert doc["launchers"]["ssh"] is None and doc["launchers"]["srun"] is None
    assert doc["launchers"]["paramiko"] is None and "the ssh launcher needs it" in doc["notes"]["launchers.paramiko"]
    assert doc["network"]["gloo_interface"] == "nosuch0"
    assert "network.gloo_interface: from GLOO_SOCKET_IFNAME: no such interface" in doc["warnings"]
    assert doc["network"]["nccl_interface"] == "lo"


def test_ds_report_flags() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(["--hide_operator_status", "--hide_errors_and_warnings"])
    text = out.getvalue()
    assert "versions:" in text and "kernels:" not in text and "[WARNING]" not in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(["--json"])
    assert set(json.loads(out.getvalue())) >= {"versions", "devices", "nvml", "compilers", "kernels", "network",
                                               "launchers", "install", "warnings"}


def test_dslaunch_report_command() -> None:
    from dslaunch.launcher import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["report", "--json"]) == 0
    assert json.loads(out.getvalue())["versions"]["dslaunch"]
