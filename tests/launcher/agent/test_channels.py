"""The agent's stack pipe: a dump counts as finished only after a quiet spell at the end of a line."""

from __future__ import annotations

import os
import time

import pytest

from dslaunch.launcher.agent.channels import Channels


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.timeout(30)
def test_a_dump_cut_mid_line_is_not_settled_until_its_line_ends() -> None:
    channels = Channels()
    beat_w, stack_w = channels.pipes(0)
    try:
        # faulthandler writes a frame's line in pieces; a rank descheduled between them goes quiet
        os.write(stack_w, b'Thread 0x1 (most recent call first):\n  File ')
        time.sleep(0.6)  # quiet for longer than the 0.3 s that ends a dump
        assert not channels._settled([0])
        os.write(stack_w, b'"train_loop.py", line 3 in <module>\n')
        assert _wait_for(lambda: channels._settled([0]))
    finally:
        os.close(beat_w)
        os.close(stack_w)
        channels.close()
