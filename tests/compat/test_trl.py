"""TRL jobs unchanged under ``dslaunch --num_gpus 2`` (CPU, gloo): SFT full at ZeRO 2 and LoRA (PEFT) at
ZeRO 3 with a reload of what ``save_model`` wrote, and DPO with TRL's reference engine at ZeRO 2 and
3. Each against the losses the real DeepSpeed 0.19.8 gave for the same job and seeds. SFT with
DeepSpeed's sequence parallelism (accelerate's ``ParallelismConfig``) at ZeRO 3 against the same job
in one process.

The model is a 2-layer Llama and a word-level tokenizer built from configs (``scripts/tiny_lm.py``),
saved once per session and loaded by TRL with ``from_pretrained``, as a hub model.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged

# Measured once with the real DeepSpeed 0.19.8 (torch 2.13.0 CPU, transformers 5.23.0, accelerate
# 1.15.0, trl 1.16.0, peft 0.21.0, datasets 5.2.0) in a separate venv, from a model directory made by
# `python scripts/tiny_lm.py lm`: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2
# scripts/trl_sft.py lm out STAGE MODE 4` and `... scripts/trl_dpo.py lm out STAGE 4` (its CPU
# all-reduce op, deepspeed_shm_comm, built for it), at ZeRO 3 with DS_INIT_BEFORE_MODEL=1.
DEEPSPEED = {
    ("sft", 2, "full"): {"LOSSES": [4.193178176879883, 4.132778167724609, 4.186954975128174, 3.9982547760009766],
                         "RELOADED": 3.9026987552642822},
    ("sft", 2, "lora"): {"LOSSES": [4.193178176879883, 4.132778167724609, 4.186954975128174, 4.150238990783691],
                         "RELOADED": 4.182733535766602},
    ("sft", 3, "lora"): {"LOSSES": [4.1932806968688965, 4.132681369781494, 4.187016487121582, 4.1502685546875],
                         "RELOADED": 4.182713508605957},
    ("sft", 3, "full"): {"LOSSES": [4.1932806968688965, 4.132681369781494, 4.187016487121582, 3.99788236618042],
                         "RELOADED": 3.90254807472229},
    ("dpo", 2, "full"): {"LOSSES": [0.6931471824645996, 0.6931471824645996, 0.6931471824645996,
                                    0.6982836723327637]},
    ("dpo", 3, "full"): {"LOSSES": [0.6931656002998352, 0.6931579113006592, 0.693163275718689,
                                    0.6982946395874023]},
}
# Measured difference here: up to 4.0e-4 (SFT full at ZeRO 3: 4.0e-4 at step 4; at ZeRO 2 6.5e-5 at
# step 2 and 1.35e-4 after the reload; DPO: 6.6e-5). Not the optimizer: the weights are still the
# initial ones at steps 2 and 3 (the WarmupLR's first two updates have lr 0) and the losses differ
# there already. DeepSpeed differs from itself as much: its ZeRO 2 and ZeRO 3 runs of the same job
# log 4.193178 and 4.193281 at step 1 (initial weights, 1.0e-4) and 3.998255 and 3.997882 at step 4
# (3.7e-4), where dslaunch's two stages agree with each other within 1e-6. The Trainer test (GPT-2)
# agrees within 5e-7; where DeepSpeed's spread on these jobs comes from is not found yet.
TOLERANCE = 5e-4
STEPS = 4


@pytest.fixture(scope="session")
def tiny_lm(finetune_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_lm") / "lm"
    subprocess.run([str(finetune_bin / "python"), str(SCRIPTS / "tiny_lm.py"), str(out)], check=True,
                   capture_output=True, timeout=120)
    return out


def _job(bin_dir: Path, script: str, *args: str, cwd: Path) -> str:
    return run_job([str(bin_dir / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
                    str(SCRIPTS / script), *args], cwd=cwd, timeout=240)


@pytest.mark.timeout(300)
# LoRA at stage 3 (frozen, partitioned weights) covers what LoRA at stage 2 would; full at stage 3
# (DEEPSPEED keeps its numbers) is the Trainer's ZeRO-3 save and reload of test_zero3_models.py
@pytest.mark.parametrize("stage, mode", [(2, "full"), (3, "lora")])
def test_sft_matches_deepspeed_and_reloads(stage: int, mode: str, finetune_bin: Path, tiny_lm: Path,
                                           tmp_path: Path) -> None:
    out = _job(finetune_bin, "trl_sft.py", str(tiny_lm), "out", str(stage), mode, str(STEPS), cwd=tmp_path)
    want = DEEPSPEED[("sft", stage, mode)]
    assert tagged(out, "LOSSES") == pytest.approx(want["LOSSES"], abs=TOLERANCE)
    # the saved model (or adapter on the base model), rebuilt from disk, is the trained one
    assert tagged(out, "RELOADED") == pytest.approx(want["RELOADED"], abs=TOLERANCE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_dpo_with_reference_model_matches_deepspeed(stage: int, finetune_bin: Path, tiny_lm: Path,
                                                    tmp_path: Path) -> None:
    out = _job(finetune_bin, "trl_dpo.py", str(tiny_lm), "out", str(stage), str(STEPS), cwd=tmp_path)
    assert tagged(out, "LOSSES") == pytest.approx(DEEPSPEED[("dpo", stage, "full")]["LOSSES"], abs=TOLERANCE)
    assert "dslaunch: note: 'auto' left unfilled" in out  # TRL's reference config, said once


@pytest.mark.timeout(400)
def test_sft_with_deepspeed_sequence_parallelism_trains_as_sp1(finetune_bin: Path, tiny_lm: Path,
                                                               tmp_path: Path) -> None:
    """``SFTConfig(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))`` at ZeRO-3
    (SP = the world: torch 2.13's differentiable all_gather, which the Trainer's SP loss uses, fails in
    backward on gloo for a group smaller than the world), SGD so that a gradient's scale shows: the
    logged losses and gradient norms are those of the one-process job, in fp32 (``bf16=False``: under
    SFTConfig's default bf16 each rank's weight gradients over its half of the tokens are rounded to
    bf16 before the ranks add them, 9e-5 apart on the norm, as any data-parallel split). Measured:
    losses within 2.4e-7, gradient norms within 7.7e-7 relative over the four steps."""
    got = {}
    for world, sp in ((1, 1), (2, 2)):
        out = run_job([str(finetune_bin / "dslaunch"), "--num_gpus", str(world), "--master_port", str(free_port()),
                       str(SCRIPTS / "trl_sft_ulysses.py"), str(tiny_lm), f"out{sp}", str(sp), "3", str(STEPS)],
                      cwd=tmp_path, timeout=300)
        got[sp] = tagged(out, "LOSSES"), tagged(out, "GRAD_NORMS")
    (losses1, norms1), (losses2, norms2) = got[1], got[2]
    assert len(losses2) == STEPS and losses1[0] - losses1[-1] > 0.5  # it trains
    assert losses2 == pytest.approx(losses1, abs=1e-6)
    # fp32 rounding only: a token counted twice or dropped (1 of 22) would move the norm by percents
    assert norms2 == pytest.approx(norms1, rel=1e-5)
