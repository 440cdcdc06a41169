"""DeepSpeed-Chat's actor (``hybrid_engine.enabled``) with a real Hugging Face GPT-2 under ZeRO-3 on
2 ranks: after a training step, ``actor.generate(..., synced_gpus=True)`` gives the tokens the same
weights give in one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged


@pytest.mark.timeout(200)
def test_the_actor_generates_what_its_weights_generate(compat_bin: Path, tmp_path: Path) -> None:
    out = run_job([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "hybrid_generate.py")], cwd=tmp_path)
    seen = tagged(out, "TOKENS")
    assert seen["engine_class"] == "DeepSpeedHybridEngine"
    assert seen["engine"] == seen["alone"] and len(seen["engine"][0]) == 12
