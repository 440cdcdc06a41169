"""The launcher's job events on the monitors' curves: a job whose rank hangs is restarted by
``dslaunch`` and resumes from its checkpoint; TensorBoard (read with tensorboard's own reader) and
the CSV files (row by row) hold one continuous curve, and the point where it continues carries the
job monitor's reason for the restart."""

from __future__ import annotations

import csv
import glob
import re

import pytest

from dslaunch.utils.ports import free_port
from tests.launcher.helpers import ROOT, assert_no_job_process, new_tag, run_dslaunch

pytestmark = pytest.mark.timeout(240)

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")
STEPS, SAMPLES_PER_STEP = 10, 8  # 2 ranks x 4


def _csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_a_hang_restart_reads_as_one_curve_marked_with_the_monitors_reason(tmp_path) -> None:
    tag, out = new_tag(), str(tmp_path / "tb")
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port()), "--max_restarts", "1",
                      "--hang_timeout", "3", "--log_dir", str(tmp_path / "logs"),
                      "--resume_from", str(tmp_path / "ckpt"), SCRIPT, "--steps", str(STEPS), "--save_every", "3",
                      "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "w.pt"), "--fault_rank", "1",
                      "--fault_step", "7", "--fault", "stop", "--monitor", out], tag=tag, timeout=200)
    assert r.returncode == 0, r.stderr
    assert_no_job_process(tag)
    reason = re.search(r"^dslaunch: (restart 1 of 1 in 1 s after hang: rank 1 on localhost hung at step .*)$",
                       r.stderr, re.M)
    assert reason, r.stderr
    # resumed from step 6 or 9 (the hung rank may train on once its stacks are taken: see test_resume)
    resumed = int(re.findall(r"resumed_at=(\d+)$", r.stdout, re.M)[-1])
    assert resumed in (6, 9), r.stdout
    run = f"{out}/run"
    assert len(glob.glob(f"{run}/events.out.tfevents.*")) == 2  # one file per run

    want_x = [SAMPLES_PER_STEP * step for step in range(1, STEPS + 1)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run)
    acc.Reload()
    for name in ("train_loss", "lr", "grad_norm"):
        rows = _csv(f"{run}/Train_Samples_{name}.csv")
        assert rows[0] == ["step", name]  # one header across both runs
        assert [int(x) for x, _ in rows[1:]] == want_x, name  # each step once, in order
        tb = acc.Scalars(f"Train/Samples/{name}")
        assert [e.step for e in tb] == want_x, name
        assert [e.value for e in tb] == pytest.approx([float(v) for _, v in rows[1:]], rel=1e-6)
    at = SAMPLES_PER_STEP * resumed
    text = f"resumed at step {resumed} ({at} samples), restart 1 ({reason.group(1)})"
    assert _csv(f"{run}/Run_resume.csv") == [["step", "resume"], [str(at), text]]
    marks = acc.Tensors("Run/resume/text_summary")
    assert [(m.step, m.tensor_proto.string_val[0].decode()) for m in marks] == [(at, text)]
