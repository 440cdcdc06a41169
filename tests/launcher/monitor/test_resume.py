"""A faulted rank, a restart, and a resume from the newest checkpoint that ends bitwise where an
uninterrupted run ends (2 ranks, gloo, ZeRO-1, dropout, the engine's data loader), for each fault
the policy restarts: a SIGKILLed rank, a SIGSTOPped (hung) rank, an exception raised once."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

from dslaunch.utils.ports import free_port
from tests.launcher.helpers import ROOT, assert_no_job_process, new_tag, run_dslaunch

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")
STEPS, SAVE_EVERY, FAULT_AT = 10, 3, 7  # the fault lands one step after the save at step 6


def _train(tmp_path, name: str, *extra: str, launcher: tuple[str, ...] = (), tag: str | None = None):
    out = tmp_path / f"{name}.pt"
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port()), *launcher, SCRIPT, "--steps", str(STEPS), "--save_every",
                      str(SAVE_EVERY), "--ckpt", str(tmp_path / f"ckpt_{name}"), "--out", str(out), *extra],
                     tag=tag, timeout=200)
    return r, out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted run (one for every test here)."""
    r, out = _train(tmp_path_factory.mktemp("base"), "base")
    assert r.returncode == 0, r.stderr
    return torch.load(out)


def _faulty(tmp_path, fault: str, *launcher: str, load: bool = True, resumed: str = "6"):
    """Run with rank 1 faulting at FAULT_AT in the first run and one restart; check that it resumed
    from step ``resumed`` (a regex) on both ranks and left no process. Returns the result and the
    final weights."""
    tag = new_tag()
    extra = ("--load",) if load else ()
    r, out = _train(tmp_path, "faulty", "--fault_rank", "1", "--fault_step", str(FAULT_AT), "--fault", fault,
                    *extra, launcher=("--max_restarts", "1", "--log_dir", str(tmp_path / "logs"), *launcher),
                    tag=tag)
    assert r.returncode == 0, r.stderr
    # the first run started from 0, the restart from the newest checkpoint, on both ranks
    assert r.stdout.count("resumed_at=0") == 2, r.stdout
    assert len(set(re.findall(rf"resumed_at=({resumed})$", r.stdout, re.M))) == 1, r.stdout
    assert len(re.findall(rf"resumed_at=({resumed})$", r.stdout, re.M)) == 2, r.stdout
    assert_no_job_process(tag)
    return r, torch.load(out)


def _assert_equal(want: dict, got: dict) -> None:
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def _events(tmp_path) -> list[dict]:
    (job,) = glob.glob(str(tmp_path / "logs" / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("how", ["--resume_from", "engine.load_checkpoint"])
def test_a_killed_rank_restarts_and_resumes_to_bitwise_equal_weights(tmp_path, baseline, how):
    ckpt = str(tmp_path / "ckpt_faulty")
    launcher = ("--resume_from", ckpt) if how == "--resume_from" else ()
    r, got = _faulty(tmp_path, "kill", *launcher, load=how != "--resume_from")
    assert "dslaunch: restart 1 of 1 in 1 s after signal: rank 1 on localhost was killed by SIGKILL" in r.stderr
    _assert_equal(baseline, got)


def test_a_hung_rank_leaves_its_stacks_then_the_job_restarts_and_finishes_bitwise_equal(tmp_path, baseline):
    # The job is frozen before the stacks are taken and killed after: the hung rank, resumed only
    # for its dump while its peer is frozen, trains and saves nothing more (it once went on to
    # save step 9), so the restart resumes from step 6.
    r, got = _faulty(tmp_path, "stop", "--hang_timeout", "3", resumed="6")
    assert "dslaunch: restart 1 of 1 in 1 s after hang: rank 1 on localhost hung at step" in r.stderr, r.stderr
    events = _events(tmp_path)
    (stacks,) = [e for e in events if e["kind"] == "stacks"]
    assert stacks["behind"] == [1] and stacks["ranks"]["1"]["stopped"], stacks
    with open(stacks["ranks"]["1"]["file"]) as f:
        assert "ckpt_train.py" in f.read()  # the hung rank's own stack, taken after SIGCONT
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert (failure["cause"], failure["rank"], failure["exit_code"]) == ("hang", 1, 124)
    assert [e["exit_code"] for e in events if e["kind"] in ("run_end", "end")] == [124, 0, 0]
    _assert_equal(baseline, got)


def test_an_exception_raised_once_is_restarted_and_the_job_finishes_bitwise_equal(tmp_path, baseline):
    r, got = _faulty(tmp_path, "raise")
    # rank 1 raised; rank 0's collective then failed (connection closed by peer), often before rank
    # 1 had finished exiting: rank 1 is still the one named, with its exception, whichever way it ended
    assert re.search(r"^dslaunch: restart 1 of 1 in 1 s after exception: rank 1 on localhost raised "
                     r"RuntimeError: injected fault at step 7 \(", r.stderr, re.M), r.stderr
    (failure,) = [e for e in _events(tmp_path) if e["kind"] == "failure"]
    assert (failure["cause"], failure["rank"], failure["step"]) == ("exception", 1, FAULT_AT), failure
    _assert_equal(baseline, got)
