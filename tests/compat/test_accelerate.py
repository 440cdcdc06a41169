"""An accelerate loop (``Accelerator`` with a ``DeepSpeedPlugin``, ZeRO 2, client AdamW, a tiny
GPT-2) run by the ``deepspeed`` command of the compatibility package: DeepSpeed's losses,
``save_state`` and a ``load_state`` resume that continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged

# Measured once with the real DeepSpeed 0.19.8 (transformers 5.23.0, accelerate 1.15.0, torch
# 2.13.0 CPU) in a separate venv: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2
# scripts/accelerate_gpt2.py acc 6 2 3`, then `... acc 6 2 resume:3` printed the last three.
# (accelerate on a machine without GPUs gives every rank all the data; the engine still runs
# ZeRO 2 across both ranks, under DeepSpeed as under dslaunch.)
DEEPSPEED_LOSSES = [4.846139430999756, 4.74976110458374, 4.710165023803711,
                    4.667731761932373, 4.677681922912598, 4.56919002532959]
TOLERANCE = 1e-5  # measured difference here: 5e-7


@pytest.mark.timeout(200)
def test_accelerate_deepspeed_plugin_matches_deepspeed_and_resumes(compat_bin: Path, tmp_path: Path) -> None:
    launch = [str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
              str(SCRIPTS / "accelerate_gpt2.py"), "acc", "6", "2"]
    out = run_job([*launch, "3"], cwd=tmp_path)
    assert tagged(out, "LOSSES") == pytest.approx(DEEPSPEED_LOSSES, abs=TOLERANCE)
    assert (tmp_path / "acc" / "state" / "pytorch_model" / "manifest.json").exists()
    resumed = run_job([*launch, "resume:3"], cwd=tmp_path)
    assert tagged(resumed, "LOSSES") == pytest.approx(DEEPSPEED_LOSSES[3:], abs=TOLERANCE)


@pytest.mark.timeout(200)
def test_accelerate_step_was_skipped_follows_fp16_overflows(compat_bin: Path, tmp_path: Path) -> None:
    """accelerate reads ``engine.optimizer.overflow`` (DeepSpeed's ZeRO wrapper's) for
    ``step_was_skipped``: true exactly at the steps the engine skipped, while the loss scale of
    2**20 halves down to one whose fp16 gradients are finite."""
    out = run_job([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "accelerate_overflow.py"), "10"], cwd=tmp_path)
    skipped, engine, scales = tagged(out, "SKIPPED"), tagged(out, "ENGINE"), tagged(out, "SCALES")
    assert skipped == engine and len(skipped) == 10
    assert skipped[0] and not skipped[-1], skipped  # 2**20 overflows; a few halvings later it does not
    first_clean = skipped.index(False)
    assert skipped == [True] * first_clean + [False] * (10 - first_clean)
    assert scales[:first_clean + 1] == [2.0 ** (19 - i) for i in range(first_clean)] + [2.0 ** (20 - first_clean)]
