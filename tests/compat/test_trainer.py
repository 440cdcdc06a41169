"""An unchanged Hugging Face Trainer job (TrainingArguments(deepspeed=<config with "auto">,
use_cpu=True), a tiny GPT-2, synthetic tokens) under ``dslaunch --num_gpus 2`` at ZeRO 2: the
same losses as under the real DeepSpeed, a checkpoint, and a resume from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged

# Measured once with the real DeepSpeed 0.19.8 (transformers 5.23.0, accelerate 1.15.0, torch
# 2.13.0 CPU) in a separate venv: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2
# scripts/trainer_gpt2.py out 6 2`. Removing out/checkpoint-6 and running again with `resume`
# (resume_from_checkpoint=True, which picks checkpoint-3) gave the same six values.
DEEPSPEED_LOSSES = [4.559871673583984, 4.555312156677246, 4.566503524780273,
                    4.472867488861084, 4.399247169494629, 4.304655075073242]
TOLERANCE = 1e-5  # reduction order differs (gloo buckets); measured difference here: 5e-7


@pytest.fixture(scope="module")
def trained(compat_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    work = tmp_path_factory.mktemp("trainer")
    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "trainer_gpt2.py"), "out", "6", "2"], cwd=work)
    return work, tagged(out, "LOSSES")


@pytest.mark.timeout(180)
def test_trainer_at_zero2_matches_deepspeeds_losses(trained: tuple[Path, list[float]]) -> None:
    _, losses = trained
    assert losses == pytest.approx(DEEPSPEED_LOSSES, abs=TOLERANCE)


@pytest.mark.timeout(180)
def test_trainer_saves_and_resumes_from_checkpoint(trained: tuple[Path, list[float]], compat_bin: Path) -> None:
    work, _ = trained
    step3 = work / "out" / "checkpoint-3"
    assert (step3 / "global_step3" / "manifest.json").exists()  # the engine's checkpoint, dslaunch's format
    assert (step3 / "latest").read_text().strip() == "global_step3"
    shutil.rmtree(work / "out" / "checkpoint-6")  # resume_from_checkpoint=True now picks checkpoint-3
    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "trainer_gpt2.py"), "out", "6", "2", "resume"], cwd=work)
    # steps 1-3 come from trainer_state.json; steps 4-6 are trained again from the checkpoint
    assert tagged(out, "LOSSES") == pytest.approx(DEEPSPEED_LOSSES, abs=TOLERANCE)
    assert out.count("'loss'") == 3, "the resumed run should train only steps 4-6"


@pytest.mark.timeout(180)
def test_trainer_at_zero3_trains_like_zero2(compat_bin: Path, tmp_path: Path) -> None:
    """The same job at ZeRO 3: the model is built before TrainingArguments (plain torch; the engine
    partitions it: models transformers builds under ``zero.Init`` are in test_zero3_models.py), the
    engine gathers its parameters per module, and the run trains to the same losses as DeepSpeed's
    ZeRO 2 (stage 3 reduces gradients alike)."""
    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "trainer_gpt2.py"), "out", "6", "3"], cwd=tmp_path)
    assert tagged(out, "LOSSES") == pytest.approx(DEEPSPEED_LOSSES, abs=TOLERANCE)
