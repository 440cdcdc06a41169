"""A killed rank, a restart, and a resume from the newest checkpoint that ends bitwise where an
uninterrupted run ends (2 ranks, gloo, ZeRO-1, dropout, the engine's data loader)."""

from __future__ import annotations

import pytest
import torch

from dslaunch.utils.ports import free_port
from tests.launcher.helpers import ROOT, assert_no_job_process, new_tag, run_dslaunch

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")
STEPS, SAVE_EVERY, KILL_AT = 10, 3, 7  # the kill lands one step after the save at step 6


def _train(tmp_path, name: str, *extra: str, launcher: tuple[str, ...] = (), tag: str | None = None):
    out = tmp_path / f"{name}.pt"
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port()), *launcher, SCRIPT, "--steps", str(STEPS), "--save_every",
                      str(SAVE_EVERY), "--ckpt", str(tmp_path / f"ckpt_{name}"), "--out", str(out), *extra],
                     tag=tag, timeout=200)
    return r, out


@pytest.mark.parametrize("how", ["--resume_from", "engine.load_checkpoint"])
def test_a_killed_rank_restarts_and_resumes_to_bitwise_equal_weights(tmp_path, how):
    base, base_out = _train(tmp_path, "base")
    assert base.returncode == 0, base.stderr
    tag = new_tag()
    ckpt = str(tmp_path / "ckpt_faulty")
    launcher = ("--max_restarts", "1", *(("--resume_from", ckpt) if how == "--resume_from" else ()))
    extra = ("--load",) if how != "--resume_from" else ()
    r, out = _train(tmp_path, "faulty", "--kill_rank", "1", "--kill_step", str(KILL_AT), *extra,
                    launcher=launcher, tag=tag)
    assert r.returncode == 0, r.stderr
    assert "dslaunch: restart 1 of 1 in 1 s after signal: rank 1 on localhost was killed by SIGKILL" in r.stderr
    # the first run started from 0, the restart from the newest checkpoint (step 6), on both ranks
    assert r.stdout.count("resumed_at=0") == 2 and r.stdout.count("resumed_at=6") == 2, r.stdout
    want, got = torch.load(base_out), torch.load(out)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert_no_job_process(tag)
