#!/usr/bin/env python3
"""A custom training loop on gloo that reports through ``dslaunch.heartbeat`` (no initialize).

Each step: one all_reduce, a heartbeat, a short sleep. Prints ``pid RANK PID`` at start, so tests
can signal a rank. Environment knobs (all optional):

- ``STEPS``: stop after this many steps (default: run until stopped);
- ``FAIL_RANK``/``FAIL_AT``/``FAIL_WITH``: on that rank at that step raise ``RuntimeError``
  (``FAIL_WITH=error``), ``torch.OutOfMemoryError`` (``oom``), or exit (``exit=N``);
- ``PLAIN_RANK``: that rank never calls ``dslaunch.heartbeat`` (no beats, no faulthandler: as a
  script that does not use dslaunch's runtime).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import dslaunch


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    print(f"pid {rank} {os.getpid()}", flush=True)
    steps = int(os.environ.get("STEPS", "0")) or None
    fail_rank, fail_at = int(os.environ.get("FAIL_RANK", "-1")), int(os.environ.get("FAIL_AT", "-1"))
    step = 0
    while steps is None or step < steps:
        step += 1
        t = torch.ones(4)
        dist.all_reduce(t)
        if rank == fail_rank and step == fail_at:
            fail(os.environ.get("FAIL_WITH", "error"), step)
        if rank != int(os.environ.get("PLAIN_RANK", "-1")):
            dslaunch.heartbeat(step, loss=torch.tensor(1.0 / step), samples=8 * step)
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


def fail(how: str, step: int) -> None:
    if how == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB at step {step}")
    if how.startswith("exit="):
        os._exit(int(how[5:]))
    try:
        raise ValueError(f"the root cause at step {step}")
    except ValueError as err:
        raise RuntimeError(f"bad batch at step {step}") from err


if __name__ == "__main__":
    sys.exit(main())
