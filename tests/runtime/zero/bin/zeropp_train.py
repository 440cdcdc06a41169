"""A rank of ``test_zeropp_cluster.py``: trains the 1-bit optimizers' tiny language model
(``tests/runtime/optim/onebit_task.py``) for ``STEPS`` steps at ZeRO-3, then again with ZeRO++
(quantized weights and gradients, hpZ over the node's ranks); rank 0 prints one JSON line with
each run's held-out loss and its last training losses."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from tests.runtime.optim.onebit_task import build, config, held_out_loss, run_steps

# No prefetch, no reuse: backward gathers every parameter again (a model too large to keep whole)
GATHER_AGAIN = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}

ZEROPP = {"zero_quantized_weights": True, "zero_quantized_gradients": True,
          "zero_hpz_partition_size": int(os.environ["LOCAL_WORLD_SIZE"])}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world, steps = dist.get_rank(), dist.get_world_size(), int(os.environ["STEPS"])
    out = {}
    for name, extra in (("zero3", {}), ("zeropp", ZEROPP)):
        cfg = config({"type": "Adam", "params": {"lr": 3e-3}}, 3)
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, **GATHER_AGAIN, **extra)
        engine = build(cfg)
        losses = run_steps(engine, rank, world, 0, steps)
        out[name] = {"held_out": held_out_loss(engine), "first": losses[0], "last": losses[-20:]}
        engine.destroy()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
