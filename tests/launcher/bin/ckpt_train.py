#!/usr/bin/env python3
"""A small ZeRO training job for restart tests: checkpoints every few steps, can die on purpose.

``ckpt_train.py --steps N --save_every K --ckpt DIR --out FILE [--load] [--fault_rank R --fault_step S
[--fault kill|stop|raise]]``

- data comes from the engine's loader (its position is in the checkpoint) and the model has
  dropout (its RNG is too), so a resumed run matches an uninterrupted one only if both are restored;
- ``--load``: the script resumes itself with ``engine.load_checkpoint(DIR)``; without it, resuming is
  left to ``dslaunch --resume_from DIR``;
- ``--fault_rank/--fault_step``: in the job's first run only (``DSLAUNCH_RESTART_COUNT`` 0), that rank
  faults when it reaches that step: ``--fault kill`` (default) SIGKILLs itself, ``stop`` SIGSTOPs
  itself (a hang), ``raise`` raises ``RuntimeError`` (an exception that does not come back);
- ``--sleep S``: each step takes S seconds more and prints ``rank<R> step=<N>`` (to fault it mid-run);
- ``--monitor DIR``: the ``tensorboard`` and ``csv_monitor`` blocks write to ``DIR/run/``;
- ``--memory_every K --memory_dir DIR``: the ``memory_checkpoint`` block (snapshots every K steps into
  DIR); a faulting rank first waits for its pending snapshot, so that the test knows which one is
  complete when it dies;
- at the end rank 0 writes the weights to FILE; every rank prints ``rank<R> world=<W> resumed_at=<step>``
  (the step the run started from) once.
"""

import argparse
import os
import signal
import time

import torch
from torch import nn

import dslaunch


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _fault(how: str, step: int) -> None:
    if how == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def main() -> None:
    p = argparse.ArgumentParser()
    for name, kind in (("--steps", int), ("--save_every", int), ("--ckpt", str), ("--out", str),
                       ("--fault_rank", int), ("--fault_step", int), ("--local_rank", int)):
        p.add_argument(name, type=kind, default=-1 if kind is int else None)
    p.add_argument("--fault", choices=("kill", "stop", "raise"), default="kill")
    p.add_argument("--load", action="store_true")
    p.add_argument("--monitor", help="output_path of the tensorboard and csv_monitor blocks")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step, printing each step")
    p.add_argument("--memory_every", type=int, default=0, help="memory_checkpoint.interval (0: no block)")
    p.add_argument("--memory_dir", help="memory_checkpoint.dir")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "dist_init_timeout": 60,
              "steps_per_print": 1000}
    if args.monitor:
        config.update({block: {"enabled": True, "output_path": args.monitor, "job_name": "run"}
                       for block in ("tensorboard", "csv_monitor")})
    if args.memory_every:
        config["memory_checkpoint"] = {"enabled": True, "interval": args.memory_every, "dir": args.memory_dir}
    engine, _, loader, _ = dslaunch.initialize(model=model, model_parameters=model.parameters(),
                                               training_data=Pairs(), config=config)
    if args.load:
        engine.load_checkpoint(args.ckpt)
    print(f"rank{engine.global_rank} world={engine.world_size} resumed_at={engine.global_steps}", flush=True)
    first_run = os.environ.get("DSLAUNCH_RESTART_COUNT", "0") == "0"
    while engine.global_steps < args.steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            step = engine.global_steps
            if step % args.save_every == 0:
                engine.save_checkpoint(args.ckpt)
            if first_run and engine.global_rank == args.fault_rank and step == args.fault_step:
                if args.memory_every:
                    engine.wait_for_checkpoint()
                _fault(args.fault, step)
            if args.sleep:
                print(f"rank{engine.global_rank} step={step}", flush=True)
                time.sleep(args.sleep)
            if step >= args.steps:
                break
    if engine.global_rank == 0:
        torch.save({k: v.clone() for k, v in engine.module.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
