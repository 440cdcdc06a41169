#!/usr/bin/env python3
"""The training job of ``memory_checkpoint_bench.py``: an MLP of ``--layers`` Linear(H, H) layers
(30 x 2048: ~126M parameters) trained with ZeRO-1 and AdamW on random data, one sample per rank.

``--memory_every K``: the ``memory_checkpoint`` block (snapshots every K steps into ``--memory_dir``);
``--save_every K``: a storage checkpoint into ``--ckpt`` every K steps. Rank 0 prints
``init_s=<s> resumed_at=<step>`` once (the time ``initialize()`` took: in a restarted run it
includes the resume) and ``step=<N> end=<time.time()> dt=<s> block=<s>`` for every step (dt includes the
snapshot's share of the step; block: the time the training thread spent starting a snapshot or
waiting for its copy in that step), and at the end ``shard_copy_s=<s>`` (one copy of rank 0's ZeRO
shard into ready host buffers).
"""

import argparse
import time

import torch
from torch import nn

import dslaunch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--memory_every", type=int, default=0)
    p.add_argument("--memory_dir", default="/dev/shm")
    p.add_argument("--save_every", type=int, default=0)
    p.add_argument("--ckpt")
    p.add_argument("--local_rank", type=int)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 100000,
              "dist_init_timeout": 300}
    if args.memory_every:
        config["memory_checkpoint"] = {"enabled": True, "interval": args.memory_every, "dir": args.memory_dir}
    t0 = time.perf_counter()
    engine, _, _, _ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    if engine.global_rank == 0:
        print(f"init_s={time.perf_counter() - t0:.3f} resumed_at={engine.global_steps} world={engine.world_size}",
              flush=True)
    blocked = _time_snapshots(engine)
    g = torch.Generator().manual_seed(engine.global_rank)
    while engine.global_steps < args.steps:
        start = time.perf_counter()
        before = blocked()
        x = torch.randn(1, args.hidden, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt)
        if engine.global_rank == 0:
            print(f"step={engine.global_steps} end={time.time():.3f} dt={time.perf_counter() - start:.4f} "
                  f"block={blocked() - before:.4f}", flush=True)
    if engine.global_rank == 0:
        print(f"shard_copy_s={_shard_copy_s(engine):.4f}", flush=True)


def _time_snapshots(engine):
    """The seconds the training thread spent in memory snapshots so far: starting them, and the
    optimizer steps that waited for a snapshot's copy (``Checkpointer.gate_wait_s``)."""
    mem, spent = engine.memory_checkpoint, [0.0]
    if mem is None:
        return lambda: 0.0
    snapshot = mem.snapshot

    def timed(parts) -> None:
        t = time.perf_counter()
        snapshot(parts)
        spent[0] += time.perf_counter() - t

    mem.snapshot = timed
    return lambda: spent[0] + engine.checkpoint_parts().io.gate_wait_s


def _shard_copy_s(engine) -> float:
    """One copy of this rank's ZeRO shard (fp32 masters and moments) into ready host buffers: the
    issue's bound on what a snapshot may block a step for."""
    from dslaunch.runtime.checkpoint.writer import Snapshot

    snap, state = Snapshot(), engine.zero.state_dict()
    snap.take(state)
    t = time.perf_counter()
    snap.take(state)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
