"""DeepSpeed's official example scripts (DeepSpeedExamples), run unchanged under the ``deepspeed``
command of compat/deepspeed: pipeline parallelism, CIFAR-10, Hugging Face text generation.

The scripts are taken from a DeepSpeedExamples checkout (``$DEEPSPEED_EXAMPLES``, by default the
mirror at /work/.mirror/deepspeedai+DeepSpeedExamples/repo, a git directory) and copied to a
temporary folder; without one these tests skip (CI has none: the trimmed scripts under
``tests/compat/scripts`` exercise the same deepspeed names there: ``pipeline_train.py``,
``cifar_train.py``, ``text_generation.py``). Only their flags are chosen here. Two things stand in
for what this machine lacks: torchvision (``stand_ins/torchvision``: synthetic CIFAR-10, a narrow
AlexNet; its only build for torch 2.13 is CUDA's) and, for the GPU-only pipeline script, its
``torch.cuda.set_device`` call on a CPU-only torch (``stand_ins/sitecustomize.py``; DeepSpeed fails
on that line too). The GPT-2 is built from a config (``scripts/tiny_gpt2.py``), nothing downloaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged
from tests.launcher.helpers import own_network

STAND_INS = Path(__file__).resolve().parent / "stand_ins"
CHECKOUT = Path(os.environ.get("DEEPSPEED_EXAMPLES", "/work/.mirror/deepspeedai+DeepSpeedExamples/repo"))


def _example(folder: str, into: Path) -> Path:
    """``folder`` of the DeepSpeedExamples checkout, copied under ``into``; skip without a checkout."""
    if (CHECKOUT / folder).is_dir():  # a work tree
        subprocess.run(["cp", "-r", str(CHECKOUT / folder), str(into)], check=True)
        return into / Path(folder).name
    if not (CHECKOUT / "HEAD").exists():
        pytest.skip(f"no DeepSpeedExamples checkout at {CHECKOUT} (set DEEPSPEED_EXAMPLES); "
                    "tests/compat/scripts cover the same names")
    archive = subprocess.run(["git", "-C", str(CHECKOUT), "archive", "HEAD", folder], capture_output=True, timeout=60)
    assert archive.returncode == 0, archive.stderr.decode()[-2000:]
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / folder


def _env(compat_bin: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(STAND_INS),
            "PATH": f"{compat_bin}{os.pathsep}{os.environ['PATH']}", **extra}


def _own_network(cmd: list[str]) -> list[str]:
    """``cmd`` in a network namespace of its own with loopback up: ``run_ds.sh`` launches on the
    default port 29500 (no flag to change it), which another program may hold on this machine."""
    return [*own_network(), "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(420)
def test_pipeline_parallelism_example_trains(compat_bin: Path, tmp_path: Path) -> None:
    """training/pipeline_parallelism: AlexNet in 2 pipeline stages, its ds_config (gas 32), 2 steps."""
    folder = _example("training/pipeline_parallelism", tmp_path)
    # its config prints every 10 steps: the script is unchanged, its config asks for every step
    config = json.loads((folder / "ds_config.json").read_text())
    (folder / "ds_config.json").write_text(json.dumps({**config, "steps_per_print": 1}))
    proc = _run([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
                 "--deepspeed_config=ds_config.json", "-p", "2", "--steps=2", "--backend", "gloo"],
                folder, _env(compat_bin))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the script prints nothing itself: the pipeline engine's line at steps_per_print (DeepSpeed's)
    steps = re.findall(r"steps: (\d+) loss: ([0-9.]+) iter time \(s\):", out)
    assert [n for n, _ in steps] == ["1", "2"] and all(math.isfinite(float(x)) for _, x in steps), out[-3000:]


@pytest.mark.timeout(420)
def test_cifar_example_trains_with_its_run_script(compat_bin: Path, tmp_path: Path) -> None:
    """training/cifar through its own ``run_ds.sh`` (``--bind_cores_to_rank``, fp16 by default),
    with the dense model's ``--moe-param-group`` path and a loss line per step."""
    folder = _example("training/cifar", tmp_path)
    proc = _run(_own_network(["bash", "run_ds.sh", "--epochs", "2", "--log-interval", "1", "--moe-param-group"]),
                folder, _env(compat_bin))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"\] loss:\s+([0-9.]+)", out)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), out[-3000:]  # 64 images / 16, 2 epochs
    assert "Finished Training" in out and "Accuracy of the network on the 40 test images" in out


@pytest.mark.timeout(420)
def test_cifar_example_trains_with_its_moe_flags(compat_bin: Path, tmp_path: Path) -> None:
    """training/cifar's ``--moe`` run as its ``run_ds_moe.sh`` starts it (2 ranks, 2 experts over 2
    expert-parallel ranks, top-1, RSample noise, expert param groups; fp16 by default), for 2 epochs
    with a loss line per step (the script's own defaults are 30 epochs, a line per 100 steps)."""
    folder = _example("training/cifar", tmp_path)
    assert "--ep-world-size ${EP_SIZE}" in (folder / "run_ds_moe.sh").read_text()  # the flags below are its
    proc = _run([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                 "--bind_cores_to_rank", "cifar10_deepspeed.py", "--deepspeed", "--moe", "--ep-world-size", "2",
                 "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample", "--moe-param-group",
                 "--epochs", "2", "--log-interval", "1"], folder, _env(compat_bin))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"\] loss:\s+([0-9.]+)", out)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), out[-3000:]  # 64 images / 16, 2 epochs
    assert "Finished Training" in out and "Accuracy of the network on the 40 test images" in out


def _generated(out: str) -> list[str]:
    return [line.split("out=", 1)[1] for line in out.splitlines() if line.startswith("[rank0] out=")]


@pytest.mark.timeout(420)
def test_text_generation_example_at_tp2_gives_the_hf_tokens(compat_bin: Path, tmp_path: Path) -> None:
    """inference/huggingface/text-generation: GPT-2 split over 2 ranks by ``init_inference(mp_size=2)``
    generates, greedily, what the same script's Hugging Face baseline (``--hf_baseline``) generates."""
    folder = _example("inference/huggingface/text-generation", tmp_path)
    model = tmp_path / "gpt2"
    run_job([str(compat_bin / "python"), str(SCRIPTS / "tiny_gpt2.py"), str(model)], cwd=tmp_path)
    common = ["inference-test.py", "--model", str(model), "--dtype", "float32", "--max_new_tokens", "6", "--greedy",
              "--batch_size", "3", "--trust_remote_code"]
    outputs = {}
    for ranks, extra in (("2", []), ("1", ["--hf_baseline"])):
        proc = _run([str(compat_bin / "deepspeed"), "--num_gpus", ranks, "--master_port", str(free_port()),
                     *common, *extra], folder, _env(compat_bin))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        outputs[ranks] = _generated(out)
    assert len(outputs["2"]) == 3 and outputs["2"] == outputs["1"], outputs
    assert all(len(o.split()) > len(i.split()) for o, i in zip(outputs["2"], ["DeepSpeed is a machine learning "
               "framework", "He is working on", "He has a"], strict=True))


# ----- the same names, in our words (no checkout needed: what CI runs) ------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages,losses", [("2", 3), ("0", 6)])  # -p 0: the engine, 2 micro batches a step
def test_pipeline_example_shape(compat_bin: Path, tmp_path: Path, stages: str, losses: int) -> None:
    out = run_job([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "pipeline_train.py"), "--deepspeed_config", str(SCRIPTS / "pipeline_ds_config.json"),
                   "-p", stages, "--steps", "3"], cwd=tmp_path, timeout=220)
    got = tagged(out, "LOSSES")
    assert len(got) == losses and all(math.isfinite(x) and 0.3 < x < 1.5 for x in got), got  # 2 classes: ~ln 2


@pytest.mark.timeout(240)
def test_text_generation_example_shape_at_tp2(compat_bin: Path, tmp_path: Path) -> None:
    out = run_job([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "text_generation.py")], cwd=tmp_path, timeout=220)
    assert tagged(out, "SAME") is True
    assert "[rank0] before init" in out and "[rank0] CPU Virtual Memory:  used = " in out  # see_memory_usage
