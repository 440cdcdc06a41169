"""Which failed rank is the root cause: a rank whose collective failed because its peer went away
only echoes the peer's failure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dslaunch.launcher.monitor.failures import is_peer_loss, normalise, root_cause
from dslaunch.launcher.spec import NodeResult

GLOO = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:134. This is typically caused by a remote worker crashing.")


def _rank(rank: int, exception: str | None, code: int = 1) -> NodeResult:
    return NodeResult(0, "localhost", code, rank=rank, exception=exception)


@pytest.mark.parametrize("text, peer", [
    (GLOO, True),
    ("RuntimeError: [pair.cc:598] Connection reset by peer", True),
    ("torch.distributed.DistNetworkError: failed to recv, got 0 bytes", True),
    ("RuntimeError: NCCL communicator was aborted on rank 3.", True),
    ("RuntimeError: injected fault at step 7", False),
    ("ValueError: bad shape", False),
    ("the pipeline batch stopped: stage 1 in the forward pass of micro-batch 1: ValueError: x", True),
    (None, False),
])
def test_peer_loss_is_told_from_the_scripts_own_errors(text, peer):
    assert is_peer_loss(text) is peer


def test_the_first_failure_stays_the_root_cause_unless_it_only_lost_its_peer():
    own, echo = _rank(1, "RuntimeError: injected fault at step 7"), _rank(0, GLOO)
    assert root_cause(echo, [own]) == own
    assert root_cause(own, [echo]) == own
    assert root_cause(echo, [_rank(1, None, 137)]) == echo  # nothing better to name
    assert root_cause(echo, [_rank(1, GLOO)]) == echo
    killed = _rank(1, None, 137)
    assert root_cause(killed, [echo]) == killed


def test_a_rank_that_exited_with_its_own_code_is_preferred_to_the_peer_that_lost_it():
    echo = _rank(0, GLOO)
    own_exit = _rank(1, None, 3)  # sys.exit(3): no exception, no signal
    assert root_cause(echo, [own_exit]) == own_exit
    stopped = NodeResult(0, "localhost", 143, rank=1, signal_name="SIGTERM")  # stopped after the echo
    assert root_cause(echo, [stopped]) == echo
    assert root_cause(echo, [_rank(1, None, 143)]) == echo  # a SIGTERM handler's exit: stopped too


def test_the_earliest_of_the_ranks_that_failed_on_their_own_is_the_root_cause():
    echo = _rank(0, GLOO)
    late = replace(_rank(1, "ValueError: bad shape"), failed_at=20.0)
    early = replace(_rank(2, None, 3), failed_at=10.0)
    assert root_cause(echo, [late, early]) == early


def test_the_rank_that_raised_first_is_the_root_cause_whichever_exited_first():
    """A pipeline stage that raised sends its peers a stop, and they may exit before it does; the
    launcher may even stop it before it printed anything: its beat said what and when."""
    stage = "the pipeline batch stopped: stage 1 in the forward pass of micro-batch 1: ValueError: x"
    echo = replace(_rank(0, stage), raised_at=11.0, failed_at=12.0)
    raiser = replace(NodeResult(0, "localhost", 143, rank=1, signal_name="SIGTERM", exception="ValueError: x"),
                     raised_at=10.0, failed_at=13.0)
    assert root_cause(echo, [raiser]) == raiser
    second = replace(_rank(2, "KeyError: 'y'"), raised_at=10.5, failed_at=11.5)
    assert root_cause(second, [echo, raiser]) == raiser  # the first to raise on its own
    assert root_cause(echo, [replace(raiser, raised_at=None)]) == replace(raiser, raised_at=None)  # old rule


def test_a_rank_stopped_while_tearing_down_after_its_exception_makes_the_job_exit_1():
    # Under load, a raising rank is still printing its traceback when its peer's collective fails
    # and the launcher's SIGTERM reaches it: the job exited 143 (test_faults, once, at load 15).
    raised = "RuntimeError: bad batch at step 3"
    stopped = NodeResult(0, "localhost", 143, rank=1, signal_name="SIGTERM", exception=raised, cause="exception")
    assert root_cause(_rank(0, GLOO), [stopped]) == stopped
    assert stopped.job_exit_code == 1 and "raised RuntimeError: bad batch at step 3 (then SIGTERM in its teardown: exit code 143)" in stopped.describe()
    assert replace(stopped, signal_name="SIGKILL", exit_code=137).job_exit_code == 1
    assert replace(stopped, cause="oom").job_exit_code == 1  # torch's OutOfMemoryError raised, then stopped
    aborted = replace(stopped, signal_name="SIGABRT", exit_code=134)  # gloo's destructor in the teardown
    assert aborted.job_exit_code == 1 and replace(aborted, exception=None).job_exit_code == 134
    killed = replace(stopped, cause="oom", exception=None, signal_name="SIGKILL", exit_code=137)
    assert killed.job_exit_code == 137  # the kernel's OOM killer: no exception, its own signal stays
    assert replace(stopped, exception=None, cause="signal").job_exit_code == 143
    assert replace(stopped, signal_name=None, exit_code=3).job_exit_code == 3


@pytest.mark.parametrize("a, b", [
    ("RuntimeError: bad <Batch object at 0x7f3a2b1c4d90>", "RuntimeError: bad <Batch object at 0x7f11aa0c0010>"),
    (GLOO, GLOO.replace(":134", ":40522")),
    ("RuntimeError: store on port 29500 timed out (pid 4242)", "RuntimeError: store on port 29611 timed out (pid 77)"),
])
def test_two_runs_of_the_same_failure_read_the_same_once_normalised(a, b):
    assert a != b and normalise(a) == normalise(b)
    assert normalise("ValueError: bad shape (3, 4)") == "ValueError: bad shape (3, 4)"
