"""AutoSP on a Hugging Face ViT (transformers' ``ViTModel`` from a tiny ``ViTConfig``, no download)
under ``deepspeed.initialize`` with ``sequence_parallel_size`` 2, ZeRO-0, 2 and 3, on 2 gloo
ranks: ``auto_wrap_model_for_sp(engine, groups._get_sequence_parallel_group())`` wraps both
``ViTAttention`` layers; each rank's output rows, the engine's averaged parameter gradients, the
pixel gradient and the parameters after one SGD step equal those of the unwrapped model on the
whole sequence (25 patches split 13/12, the [CLS] token on both ranks). The script
(``scripts/hf_vit_autosp.py``) runs in ``.venv-compat`` (transformers), as tests/compat do."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat.conftest import compat_bin  # noqa: F401 (the fixture, shared)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_vit_autosp.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_hugging_face_vit_equals_the_unwrapped_model(compat_bin, tmp_path, stage: int) -> None:  # noqa: F811
    from dslaunch.utils.ports import free_port
    from tests.compat.conftest import run_job, tagged

    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT),
                   str(stage)], cwd=tmp_path, timeout=100)
    got = tagged(out, "RESULTS")
    assert got["wrapped"] == 2 and got["rows"] in (13, 14), got
    assert got["scale"] > 0.1 and got["pixel_scale"] > 1e-3, got
    # fp32 sums in another order: within 1e-6 of the largest gradient
    assert got["out"] < 1e-5 and got["pixel_grad"] < 1e-6 * got["pixel_scale"], got
    assert got["grads"] < 1e-6 * got["scale"] and got["after_step"] < 1e-6 * got["scale"], got
