"""A plain torch.distributed job on gloo: init, barrier, all_reduce, print, exit.

Works under any launcher that sets the env contract (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): ``dslaunch --num_gpus 2 scripts/examples/allreduce.py``, ``torchrun
--nproc-per-node 2 ...`` or ``deepspeed --num_gpus 2 ...``. Used by the launcher tests, the
multi-node tests and the launch benchmark, so it stays minimal. Exits non-zero if the sum is wrong.
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    print(f"rank {rank}/{world} local_rank {args.local_rank} host {os.uname().nodename}: "
          f"all_reduce sum {t.item():g} (expected {expected:g})", flush=True)
    dist.destroy_process_group()
    return 0 if t.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main())
