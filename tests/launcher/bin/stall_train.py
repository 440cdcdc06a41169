#!/usr/bin/env python3
"""A ZeRO engine job on gloo in which one rank stalls in the script's own code after a step.

Prints ``pid RANK PID`` at start. Environment knobs:

- ``ZERO``: the ZeRO stage (0-3); ``OFFLOAD``: ``optimizer`` (CPU optimizer offload) or ``param``
  (stage 3: parameters and optimizer on the CPU), empty for none;
- ``STALL_RANK``/``STALL_AT``: that rank stalls after that step (the others go on into the next
  step and wait for it in the engine's collectives);
- ``STALL_HOW``: ``sleep``, ``spin`` (a busy Python loop), ``read`` (a read of a pipe nobody writes
  to) or ``stop`` (SIGSTOP to itself).
"""

import os
import signal
import time

import torch
from torch import nn

import dslaunch


def stall(how: str) -> None:
    if how == "sleep":
        time.sleep(3600)
    elif how == "spin":
        while True:
            pass
    elif how == "read":
        r, _w = os.pipe()  # the write end stays open and unused: the read blocks
        os.read(r, 1)
    elif how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # the monitor resumes it (SIGCONT) to take its stack, then kills it
    raise SystemExit(f"unknown STALL_HOW {how!r}")


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    zero: dict = {"stage": int(os.environ.get("ZERO", "0"))}
    offload = os.environ.get("OFFLOAD", "")
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "param":
        zero["offload_param"] = {"device": "cpu"}
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "dist_init_timeout": 120,
              "steps_per_print": 1000}
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"pid {engine.global_rank} {os.getpid()}", flush=True)
    stall_rank, stall_at = int(os.environ["STALL_RANK"]), int(os.environ["STALL_AT"])
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    while True:
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        if engine.global_rank == stall_rank and engine.global_steps == stall_at:
            stall(os.environ["STALL_HOW"])
        time.sleep(0.05)


if __name__ == "__main__":
    main()
