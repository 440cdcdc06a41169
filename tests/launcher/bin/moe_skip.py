#!/usr/bin/env python3
"""An MoE engine job on gloo (world 2) in which one rank skips an MoE layer's dispatch
all-to-all: a deliberately mismatched collective.

The model: Linear, MoE layer 0 (ep 1: no all-to-all), MoE layer 1 (ep 2, 4 experts: 2 a rank),
Linear. In the step after step ``STALL_AT``, rank ``STALL_RANK`` skips layer 1 and goes on to the
engine's gradient all-reduce; its peer waits in layer 1's dispatch: both ranks wait, each in a
collective the other never enters. Prints ``pid RANK PID`` at start.
"""

import os
import time

import torch
from torch import nn

import dslaunch
from dslaunch.moe.layer import MoE

HIDDEN = 8


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.Tanh(), nn.Linear(2 * HIDDEN, HIDDEN))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.moe0 = MoE(HIDDEN, expert(), num_experts=2, ep_size=1, min_capacity=2)
        self.moe1 = MoE(HIDDEN, expert(), num_experts=4, ep_size=2, min_capacity=2)
        self.head = nn.Linear(HIDDEN, 3)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.moe0(self.inp(x))
        if not self.skip:
            h, _, _ = self.moe1(h)
        return self.head(h)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "dist_init_timeout": 120, "steps_per_print": 1000}
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"pid {engine.global_rank} {os.getpid()}", flush=True)
    stall_rank, stall_at = int(os.environ["STALL_RANK"]), int(os.environ["STALL_AT"])
    x, y = torch.randn(8, HIDDEN), torch.randint(0, 3, (8,))
    while True:
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
        model.skip = engine.global_rank == stall_rank and engine.global_steps == stall_at
        time.sleep(0.05)


if __name__ == "__main__":
    main()
