#!/usr/bin/env python3
"""A 2-stage pipeline job on gloo in which one stage stops itself (SIGSTOP) after a step.

``STALL_RANK``/``STALL_AT``: that rank stops after that optimizer step (and its checkpoint); the
other stage goes on into the next ``train_batch`` and waits for it in a pipeline receive or send.
Resumed, the stage would train on (as a stage stopped from outside would): the monitor must not
let it. ``SAVE_DIR``: every step is checkpointed there. Each rank prints ``trained N`` per step.
"""

import os
import signal
import time

import torch
from torch import nn

import dslaunch
from dslaunch.pipe import LayerSpec, PipelineModule


def main() -> None:
    torch.set_num_threads(1)
    dslaunch.init_distributed(verbose=False)
    layers = [LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 16, 1)]
    module = PipelineModule(layers, num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "dist_init_timeout": 120,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}, "steps_per_print": 1000}
    engine, *_ = dslaunch.initialize(model=module, config=config)
    print(f"pid {engine.global_rank} {os.getpid()}", flush=True)
    stall_rank, stall_at = int(os.environ["STALL_RANK"]), int(os.environ["STALL_AT"])
    save_dir = os.environ.get("SAVE_DIR")
    x = torch.randn(2, 8)
    data = iter(lambda: (x, x.sum(1, keepdim=True)), None)  # the same micro batch forever
    while True:
        engine.train_batch(data)
        if save_dir:
            engine.save_checkpoint(save_dir)
        print(f"trained {engine.global_steps}", flush=True)
        if engine.global_rank == stall_rank and engine.global_steps == stall_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
