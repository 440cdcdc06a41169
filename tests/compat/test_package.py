"""The ``deepspeed`` distribution of compat/deepspeed, as the libraries that look for DeepSpeed see
it: metadata, version checks, module identity, the command, DeepSpeed's ``python -m`` entry points."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port

_PROBE = r"""
import importlib.metadata, importlib.util, sys
import deepspeed, dslaunch
assert importlib.util.find_spec("deepspeed") is not None
assert importlib.metadata.version("deepspeed") == deepspeed.__version__, deepspeed.__version__
assert deepspeed.__version__.startswith("0.19.8+dslaunch."), deepspeed.__version__
from accelerate.utils import compare_versions, is_deepspeed_available
from transformers.integrations.deepspeed import is_deepspeed_available as hf_available
assert is_deepspeed_available() and hf_available()
assert compare_versions("deepspeed", ">=", "0.18.2")  # accelerate's newest minimum
import deepspeed.comm, deepspeed.runtime.engine, dslaunch.runtime.engine
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger, groups, set_z3_leaf_modules
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
assert deepspeed.comm is dslaunch.comm and deepspeed.runtime.engine is dslaunch.runtime.engine
assert deepspeed.DeepSpeedEngine is dslaunch.runtime.engine.DeepSpeedEngine
assert deepspeed.initialize is dslaunch.initialize
assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES  # attribute, no import
assert dslaunch.runtime.engine.__spec__.name == "dslaunch.runtime.engine"  # its own spec kept
assert DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
with deepspeed.zero.GatheredParameters([], modifier_rank=0), deepspeed.zero.Init(enabled=False):
    pass  # no-ops below stage 3, as transformers and TRL use them
from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}})
assert not keep.is_zero3() and not is_deepspeed_zero3_enabled()  # models then build as usual
from transformers import GPT2Config, GPT2LMHeadModel
GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1, n_head=1))
assert get_accelerator().device_name() == "cpu" and get_accelerator().communication_backend_name() == "gloo"
try:
    import deepspeed.no_such_module
except ModuleNotFoundError as err:
    assert err.name == "deepspeed.no_such_module", err.name
else:
    raise AssertionError("a module dslaunch lacks imported")
print("ok")
"""


@pytest.mark.timeout(60)
def test_deepspeed_distribution_is_dslaunch(compat_bin: Path) -> None:
    proc = subprocess.run([str(compat_bin / "python"), "-c", _PROBE], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-3000:]


@pytest.mark.timeout(30)
def test_deepspeed_command_is_dslaunchs_launcher(compat_bin: Path, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    proc = subprocess.run([str(compat_bin / "deepspeed"), "--dry-run", "--num_gpus", "2", "train.py",
                           "--deepspeed_config", "ds.json"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=25)
    assert proc.returncode == 0, proc.stderr
    # dslaunch's plan: every worker's command with DSLAUNCH_* variables (DeepSpeed's runner has none)
    workers = [line for line in proc.stdout.splitlines() if "DSLAUNCH_RESTART_COUNT=0" in line]
    assert len(workers) == 2 and all("train.py --local_rank=" in w for w in workers), proc.stdout


@pytest.mark.timeout(60)
def test_ds_report_is_dslaunchs_report(compat_bin: Path) -> None:
    """DeepSpeed's ``ds_report`` command (and ``python -m deepspeed.env_report``) print dslaunch's
    report; in that environment transformers and accelerate are found and the ``deepspeed``
    distribution is dslaunch's."""
    proc = subprocess.run([str(compat_bin / "ds_report"), "--json"], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    versions = json.loads(proc.stdout)["versions"]
    assert versions["transformers"] and versions["accelerate"], versions
    assert "+dslaunch" in versions["deepspeed"], versions
    text = subprocess.run([str(compat_bin / "python"), "-m", "deepspeed.env_report"], capture_output=True,
                          text=True, timeout=50)
    assert text.returncode == 0 and "dslaunch environment report" in text.stdout, text.stderr[-2000:]


@pytest.mark.timeout(60)
def test_deepspeeds_other_command_names(compat_bin: Path, tmp_path: Path) -> None:
    """``ds`` and ``deepspeed.pt`` are the launcher, ``dsr`` the report, ``ds_ssh`` ``dslaunch ssh``."""
    (tmp_path / "train.py").write_text("")
    for name in ("ds", "deepspeed.pt"):
        proc = subprocess.run([str(compat_bin / name), "--dry-run", "--num_gpus", "2", "train.py"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=25)
        assert proc.returncode == 0 and proc.stdout.count("DSLAUNCH_RESTART_COUNT=0") == 2, proc.stdout + proc.stderr
    report = subprocess.run([str(compat_bin / "dsr"), "--json"], capture_output=True, text=True, timeout=50)
    assert report.returncode == 0 and "+dslaunch" in json.loads(report.stdout)["versions"]["deepspeed"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=1\n")
    # DeepSpeed's form, `ds_ssh -f HOSTFILE COMMAND`, against a port no sshd listens on
    ssh = subprocess.run([str(compat_bin / "ds_ssh"), "-f", str(hostfile), "--ssh_port", str(free_port()),
                          "hostname"], capture_output=True, text=True, timeout=25)
    assert ssh.returncode == 255 and "127.0.0.1: dslaunch: connection refused by 127.0.0.1 port" in ssh.stderr, ssh.stderr
    assert "dslaunch ssh: 1 of 1 host(s) failed: 127.0.0.1 (exit 255)" in ssh.stderr, ssh.stderr


_RANKS = "import os, sys; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], sys.argv[1:])\n"


@pytest.mark.timeout(60)
def test_python_m_deepspeed_launcher_runner_is_the_command(compat_bin: Path, tmp_path: Path) -> None:
    # DeepSpeed documents `python -m deepspeed.launcher.runner` as its launcher's module entry point.
    fail = "sys.exit(3 if os.environ['RANK'] == '1' and 'fail' in sys.argv else 0)\n"
    (tmp_path / "train.py").write_text(_RANKS + fail)
    runner = [str(compat_bin / "python"), "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
              str(free_port()), "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([*runner, "x"], cwd=tmp_path, capture_output=True, text=True, timeout=50, env=env)
    assert ok.returncode == 0, ok.stderr
    ranks = sorted(line for line in ok.stdout.splitlines() if " rank " in line)
    assert ranks == ["[rank0] rank 0 of 2 ['--local_rank=0', 'x']",
                     "[rank1] rank 1 of 2 ['--local_rank=1', 'x']"], ok.stdout
    failed = subprocess.run([*runner, "fail"], cwd=tmp_path, capture_output=True, text=True, timeout=50,
                            env=env)
    assert failed.returncode == 3, failed.stderr  # the failing rank's code, as from `deepspeed`
    missing = subprocess.run([*runner[:-1], "nope.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=50, env=env)
    assert missing.returncode == 2 and missing.stderr.endswith(
        f"dslaunch: error: user script 'nope.py' not found (cwd: {tmp_path})\n"), missing.stderr


@pytest.mark.timeout(60)
def test_python_m_deepspeed_launcher_launch_starts_one_node(compat_bin: Path, tmp_path: Path) -> None:
    # What DeepSpeed's runner runs on each node, and multi-node scripts run by hand.
    from dslaunch.launcher.runner import encode_world_info

    (tmp_path / "train.py").write_text(_RANKS)
    launch = [str(compat_bin / "python"), "-m", "deepspeed.launcher.launch",
              f"--world_info={encode_world_info({'localhost': [0, 1]})}", f"--master_port={free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([*launch, "train.py", "x"], cwd=tmp_path, capture_output=True, text=True, timeout=50, env=env)
    assert ok.returncode == 0, ok.stderr
    assert sorted(line for line in ok.stdout.splitlines() if " rank " in line) == [
        "[rank0] rank 0 of 2 ['--local_rank=0', 'x']", "[rank1] rank 1 of 2 ['--local_rank=1', 'x']"], ok.stdout


_SAVE = r"""
import sys, torch, deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
engine, *_ = deepspeed.initialize(model=model, dist_init_required=False, config={
    "train_batch_size": 4, "steps_per_print": 10_000, "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
for _ in range(2):
    engine.backward(engine(torch.randn(4, 4)).square().mean())
    engine.step()
engine.save_checkpoint(sys.argv[1])
torch.save(engine.module.state_dict(), sys.argv[2])
"""


@pytest.mark.timeout(120)
def test_python_m_deepspeed_utils_zero_to_fp32_consolidates(compat_bin: Path, tmp_path: Path) -> None:
    import torch

    python, env = str(compat_bin / "python"), {**os.environ, "OMP_NUM_THREADS": "1"}
    saved = subprocess.run([python, "-c", _SAVE, str(tmp_path / "ckpt"), str(tmp_path / "trained.pt")],
                           capture_output=True, text=True, timeout=100, env=env)
    assert saved.returncode == 0, saved.stderr[-3000:]
    z2f = [python, "-m", "deepspeed.utils.zero_to_fp32"]
    done = subprocess.run([*z2f, str(tmp_path / "ckpt"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k].float()) for k in got)
    z2t = subprocess.run([python, "-m", "deepspeed.utils.zero_to_torch", str(tmp_path / "ckpt"), str(tmp_path / "bf"),
                          "--dtype", "bf16"], capture_output=True, text=True, timeout=60, env=env)
    assert z2t.returncode == 0, z2t.stderr[-3000:]
    bf = torch.load(tmp_path / "bf" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(bf[k], trained[k].to(torch.bfloat16)) for k in got)
    bad = subprocess.run([*z2f, str(tmp_path / "nope"), str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=60, env=env)
    assert bad.returncode == 1 and bad.stderr.splitlines() == [
        f"zero-to-fp32: error: {tmp_path / 'nope'}: not a directory (expected a save_dir or one of its tag "
        "directories)"], bad.stderr


# What transformers 5.23, accelerate 1.15, peft 0.21 and trl 1.16 read from DeepSpeed's ZeRO,
# utils and checkpoint modules (grepped from their installed sources; `pp` is transformers'
# alias of partition_parameters). `deepspeed.utils.is_initialized` (transformers' ESMFold) is left
# out: DeepSpeed 0.19.8 lacks it too.
LIBRARY_NAMES = {
    "deepspeed.runtime.zero.partition_parameters": (
        "zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange", "get_accelerator", "ZeroParamStatus",
        "Init", "GatheredParameters", "register_external_parameter"),
    "deepspeed.runtime.zero": ("partition_parameters", "GatheredParameters", "Init", "ZeroParamStatus"),
    "deepspeed.zero": ("Init", "GatheredParameters", "register_external_parameter"),
    "deepspeed.utils": ("groups", "logger", "set_z3_leaf_modules", "safe_get_full_grad"),
    "deepspeed.utils.groups": ("_get_sequence_parallel_group", "_get_sequence_parallel_world_size",
                               "_get_sequence_parallel_rank"),
    "deepspeed.checkpoint.utils": ("clone_tensors_for_torch_save",),
}
_READ = re.compile(r"from (deepspeed\.(?:runtime\.zero|zero|utils|checkpoint)[\w.]*) import \(?([\w ,]+)"
                   r"|\b(deepspeed\.(?:runtime\.zero|zero|utils|checkpoint)[\w.]*)\.(\w+)\(|\bpp\.(\w+)")

_NAMES_PROBE = r"""
import importlib, json, logging, sys, torch
import deepspeed
for module, names in json.loads(sys.argv[1]).items():
    m = importlib.import_module(module)
    missing = [n for n in names if not hasattr(m, n)]
    assert not missing, (module, missing)
from deepspeed.runtime.zero import partition_parameters as pp
from deepspeed.utils import logger, groups
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
assert isinstance(logger, logging.Logger) and groups._get_sequence_parallel_world_size() == 1
arange = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_arange, torch.bfloat16, torch.device("cpu"))
assert arange(2.0).dtype is torch.bfloat16 and pp.get_accelerator().device_name() == "cpu"
shared = torch.arange(6.0)
cloned = clone_tensors_for_torch_save({"a": shared[:2], "b": [shared[2:]]})
assert cloned["a"].untyped_storage().size() == 8 and torch.equal(cloned["b"][0], shared[2:])
print("ok")
"""


def _read_names(text: str) -> set[tuple[str, str]]:
    """(module, name) pairs a library's source reads from DeepSpeed's zero/utils/checkpoint modules."""
    found = set()
    for imported, names, dotted, attr, pp_attr in _READ.findall(text):
        if imported:
            found |= {(imported, n.split(" as ")[0].strip()) for n in names.split(",") if n.strip()}
        elif dotted:
            found.add((dotted, attr))
        elif "partition_parameters as pp" in text:
            found.add(("deepspeed.runtime.zero.partition_parameters", pp_attr))
    return found


@pytest.mark.timeout(120)
def test_names_the_libraries_read_are_there(compat_bin: Path) -> None:
    """Every name the installed Hugging Face libraries read from DeepSpeed's ZeRO, utils and
    checkpoint modules is listed here, and imports (and behaves) under the compat package."""
    site = next((compat_bin.parent / "lib").glob("python*/site-packages"))
    read = set()
    for lib in ("transformers", "accelerate", "peft", "trl"):
        for source in (site / lib).rglob("*.py") if (site / lib).is_dir() else ():
            text = source.read_text(errors="replace") if "test_utils" not in source.parts else ""
            if "deepspeed" in text:
                read |= _read_names(text)
    listed = {(m, n) for m, names in LIBRARY_NAMES.items() for n in names}
    unlisted = {pair for pair in read - listed if pair[0] != "deepspeed.utils" or pair[1] != "is_initialized"}
    assert ("deepspeed.runtime.zero.partition_parameters", "_orig_torch_arange") in read  # the scan works
    assert not unlisted, f"the libraries read names this test does not list: {sorted(unlisted)}"
    proc = subprocess.run([str(compat_bin / "python"), "-c", _NAMES_PROBE, json.dumps(LIBRARY_NAMES)],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-3000:]
