"""Which failed rank is the root cause: a rank whose collective failed because its peer went away
only echoes the peer's failure."""

from __future__ import annotations

import pytest

from dslaunch.launcher.monitor.failures import is_peer_loss, root_cause
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
