"""A rank of ``test_onebit_cluster.py`` (one rank per namespace host, world 2): times a transfer of
``TRANSFER_BYTES`` from rank 0 to rank 1 over the hosts' shaped links, then trains OneBitAdam
(``freeze_step`` 2) and counts the bytes its host's interface sent during the fp32 warm-up steps and
during the compressed steps (the kernel's counters: what crossed the link, headers included).
Each rank prints one JSON line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

WARMUP, COMPRESSED = 2, 3


class Net(torch.nn.Module):
    """~263K parameters: ~1 MB of fp32 gradient per step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def sent_bytes() -> int:
    """What this host's interface has sent so far (``ip netns exec`` mounts the namespace's sysfs)."""
    return int(Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes").read_text())


def timed_transfer(rank: int, nbytes: int) -> float:
    """Seconds from rank 0 starting to send ``nbytes`` until rank 1's receipt of all of them is back."""
    buf, ack = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(ack, 1)
    else:
        dist.recv(buf, 0)
        dist.send(ack, 0)
    return time.perf_counter() - start


def bytes_per_step(engine, rank: int, first: int, steps: int) -> float:
    """This host's sent bytes per training step over ``steps`` steps (barriers bound the phase)."""
    dist.barrier()
    before = sent_bytes()
    for step in range(first, first + steps):
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step * 2 + rank))
        engine.backward(engine(x))
        engine.step()
    dist.barrier()
    return (sent_bytes() - before) / steps


def main() -> None:
    import dslaunch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"transfer_s": timed_transfer(rank, int(os.environ["TRANSFER_BYTES"]))}
    torch.manual_seed(0)
    cfg = {"train_batch_size": 8, "steps_per_print": 10_000, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": WARMUP}}}
    engine, _, _, _ = dslaunch.initialize(model=Net(), config=cfg)
    out["numel"] = sum(p.numel() for p in engine.module.parameters())
    out["warmup_bytes"] = bytes_per_step(engine, rank, 0, WARMUP)
    out["compressed_bytes"] = bytes_per_step(engine, rank, WARMUP, COMPRESSED)
    engine.destroy()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
