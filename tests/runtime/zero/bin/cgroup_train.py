"""A dslaunch worker for ``test_memory.py``'s limit test: it moves itself into its own cgroup v1
memory group (``$CGROUP_PREFIX-rank$RANK``, limit ``$LIMIT_BYTES``) after importing torch and
before building the model, then
trains an MLP of ``$PARAMS`` parameters for 3 steps with the ds_config in ``$DS_CONFIG``.

Charges made before the move stay where they were (cgroup v1 moves none by default), so the limit
bounds what this rank allocates for the model and its training state, not torch's own import.
"""

from __future__ import annotations

import json
import os

CGROUP_ROOT = "/sys/fs/cgroup/memory"


def join_cgroup(prefix: str, limit: int) -> str:
    path = os.path.join(CGROUP_ROOT, f"{prefix}-rank{os.environ['RANK']}")
    os.makedirs(path, exist_ok=True)
    for name, value in (("memory.limit_in_bytes", limit), ("cgroup.procs", os.getpid())):
        with open(os.path.join(path, name), "w") as f:
            f.write(str(value))
    return path


def main() -> None:
    import torch

    import dslaunch
    import dslaunch.zero

    path = join_cgroup(os.environ["CGROUP_PREFIX"], int(os.environ["LIMIT_BYTES"]))
    cfg = json.loads(os.environ["DS_CONFIG"])
    width = 1024
    layers = int(os.environ["PARAMS"]) // (width * width)
    with dslaunch.zero.Init(enabled=cfg["zero_optimization"]["stage"] == 3):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    world = int(os.environ["WORLD_SIZE"])
    for _ in range(3):
        x = torch.randn(cfg["train_batch_size"] // world, width)
        engine.backward(engine(x).square().mean())
        engine.step()
    with open(os.path.join(path, "memory.max_usage_in_bytes")) as f:
        print(f"rank {os.environ['RANK']} peak {int(f.read())}", flush=True)


if __name__ == "__main__":
    main()
