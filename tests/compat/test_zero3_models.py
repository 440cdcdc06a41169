"""ZeRO-3 models that transformers builds itself (``from_config``/``from_pretrained`` while a ZeRO-3
config is active: ``deepspeed.zero.Init`` through transformers' integration) under dslaunch: a
Trainer whose model is loaded after ``TrainingArguments``, accelerate's ``zero3_init_flag`` and a
``run_clm.py``-shaped script, with ``load_best_model_at_end``, ``save_only_model`` and a bitwise
``resume_from_checkpoint``, each against the losses of the real DeepSpeed.

Recorded once with the real DeepSpeed 0.19.8 (transformers 5.23.0, accelerate 1.15.0, torch 2.13.0
CPU) in a separate venv: ``DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2
<script> <the arguments below>`` with ``DS_INIT_BEFORE_MODEL=1``: on CPU (``use_cpu=True``)
accelerate starts torch.distributed itself, and DeepSpeed's ``zero.Init`` then reads a world size
of 1 and fails its batch-size check unless ``deepspeed.init_distributed()`` ran first (the scripts
do that only with that variable; dslaunch needs it not, and these tests run without it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged

TOLERANCE = 1e-5  # reduction order differs (gloo buckets)

# trainer_gpt2.py out 6 3 build=config (resumed from checkpoint-3: the same six)
FROM_CONFIG_LOSSES = [4.556344985961914, 4.575181007385254, 4.574129581451416,
                      4.479686737060547, 4.42388916015625, 4.320960521697998]
# trainer_gpt2.py out 2 3 build=<tiny> only_model (the tiny model: trainer_gpt2.py save_model=<tiny>)
FROM_PRETRAINED_LOSSES = [4.559871673583984, 4.555312156677246]  # = test_trainer's ZeRO-2 steps 1-2
# run_clm.py with CLM_ARGS and CLM_CONFIG: the logged losses; the eval losses at steps 2 and 4 and
# after training (greater_is_better makes step 2's checkpoint the best: load_best_model_at_end
# loads it, and the last evaluation sees that model, not the trained one)
CLM_LOSSES = [4.540414333343506, 4.546313285827637, 4.54380989074707, 4.302981376647949]
CLM_EVALS = [4.5405683517456055, 4.1945719718933105, 4.5405683517456055]
# accelerate_gpt2.py acc 6 3 init
ACCELERATE_INIT_LOSSES = [4.8537139892578125, 4.772624492645264, 4.768308639526367,
                          4.682627201080322, 4.751456260681152, 4.638714790344238]

CLM_TEXT = " ".join(f"token{i % 97} is followed by token{(i + 1) % 97}." for i in range(120))
CLM_ARGS = ["--use_cpu", "--block_size", "16", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--max_steps", "4", "--learning_rate", "3e-3",
            "--warmup_steps", "1", "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "2",
            "--save_strategy", "steps", "--save_steps", "2", "--load_best_model_at_end",
            "--metric_for_best_model", "loss", "--greater_is_better", "true", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0"]
CLM_CONFIG = {  # Hugging Face's documented ZeRO-3 config shape
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _launch(compat_bin: Path, script: str, *args: str) -> list[str]:
    return [str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
            str(SCRIPTS / script), *args]


@pytest.fixture(scope="module")
def tiny_model(compat_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GPT-2 (seed 0) saved with save_pretrained, for from_pretrained."""
    path = tmp_path_factory.mktemp("tiny") / "gpt2"
    proc = subprocess.run([str(compat_bin / "python"), str(SCRIPTS / "trainer_gpt2.py"), "-", "0", "0",
                           f"save_model={path}"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.mark.timeout(300)
def test_trainer_from_config_at_zero3_matches_deepspeed_and_resumes_bitwise(compat_bin: Path,
                                                                           tmp_path: Path) -> None:
    """The model built by from_config after TrainingArguments (under zero.Init): DeepSpeed's losses;
    resumed from checkpoint-3 it trains steps 4-6 to the same bits (losses and saved weights)."""
    run = _launch(compat_bin, "trainer_gpt2.py", "out", "6", "3", "build=config")
    first = tagged(run_job([*run, "final=out/final"], cwd=tmp_path, timeout=250), "LOSSES")
    assert first == pytest.approx(FROM_CONFIG_LOSSES, abs=TOLERANCE)
    shutil.rmtree(tmp_path / "out" / "checkpoint-6")  # resume_from_checkpoint=True now picks checkpoint-3
    out = run_job([*run, "resume", "final=out/resumed"], cwd=tmp_path, timeout=250)
    assert out.count("'loss'") == 3, "the resumed run should train only steps 4-6"
    assert tagged(out, "LOSSES") == first  # bitwise
    final, resumed = (tmp_path / "out" / d / "model.safetensors" for d in ("final", "resumed"))
    assert final.read_bytes() == resumed.read_bytes()


@pytest.mark.timeout(200)
def test_trainer_from_pretrained_save_only_model_at_zero3(compat_bin: Path, tiny_model: Path,
                                                          tmp_path: Path) -> None:
    out = run_job(_launch(compat_bin, "trainer_gpt2.py", "out", "2", "3", f"build={tiny_model}", "only_model"), cwd=tmp_path, timeout=180)
    assert tagged(out, "LOSSES") == pytest.approx(FROM_PRETRAINED_LOSSES, abs=TOLERANCE)
    saved = tmp_path / "out" / "checkpoint-2"
    assert (saved / "model.safetensors").exists() and (saved / "trainer_state.json").exists()
    assert not list(saved.glob("global_step*")), "save_only_model saves no engine state"


@pytest.mark.timeout(200)
def test_run_clm_shaped_script_at_zero3_loads_the_best_model(compat_bin: Path, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text(CLM_TEXT)
    (tmp_path / "ds.json").write_text(json.dumps(CLM_CONFIG))
    out = run_job(_launch(compat_bin, "run_clm.py", "--model_name_or_path", str(tiny_model), "--train_file",
                          "text.txt", "--deepspeed", "ds.json", "--output_dir", "out", *CLM_ARGS),
                  cwd=tmp_path, timeout=180)
    assert tagged(out, "LOSSES") == pytest.approx(CLM_LOSSES, abs=TOLERANCE)
    evals = tagged(out, "EVALS")
    assert evals == pytest.approx(CLM_EVALS, abs=TOLERANCE)
    assert evals[2] == evals[0] != evals[1], "the model evaluated after training is step 2's (the best)"
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.timeout(200)
def test_accelerate_zero3_init_flag_builds_under_init(compat_bin: Path, tmp_path: Path) -> None:
    out = run_job(_launch(compat_bin, "accelerate_gpt2.py", "acc", "6", "3", "init"), cwd=tmp_path, timeout=180)
    assert tagged(out, "LOSSES") == pytest.approx(ACCELERATE_INIT_LOSSES, abs=TOLERANCE)
