"""One engine configuration trained for a few steps, saved, resumed: the losses as JSON.

A DeepSpeed training script (run it under ``dslaunch``), used by ``scripts/gpu/check.sh`` to run
the same configuration on CUDA/NCCL and on CPU/gloo and compare. The model and data are seeded
and small so that fp32 on the two devices agrees to ~1e-6: the comparison finds device-path bugs
(streams, pinned staging, events, dtype casts), not rounding.

    dslaunch --num_gpus 1 scripts/gpu/engine_check.py --deepspeed_config cfg.json --out out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from torch import nn

import dslaunch as deepspeed

STEPS, SAVE_AT, DIM = 8, 4, 256


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                                    nn.Linear(4 * DIM, DIM)) for _ in range(3)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(x + self.blocks(x)).float(), y)


def _batch(step: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, DIM, generator=g)
    return x.to(device, dtype), x.sum(1, keepdim=True).div(DIM**0.5).to(device)


def _engine(args: argparse.Namespace) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    return engine


def _train(engine, steps: range) -> list[float]:
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half if engine.fp16_enabled() else torch.float
    losses = []
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps()):
            loss = engine(*_batch(step * 10 + micro, engine.device, dtype))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the losses")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args()
    args.deepspeed = True
    deepspeed.init_distributed()
    engine = _engine(args)
    first = _train(engine, range(SAVE_AT))
    with tempfile.TemporaryDirectory() as ckpt:
        engine.save_checkpoint(ckpt, tag="mid")
        rest = _train(engine, range(SAVE_AT, STEPS))
        resumed_engine = _engine(args)
        resumed_engine.load_checkpoint(ckpt, tag="mid")
        resumed = _train(resumed_engine, range(SAVE_AT, STEPS))
    if engine.global_rank == 0:
        result = {"device": str(engine.device), "backend": torch.distributed.get_backend(),
                  "losses": first + rest, "resumed": resumed,
                  "peak_mib": (torch.cuda.max_memory_allocated() / 2**20 if engine.device.type == "cuda"
                               else None),
                  "cuda_name": torch.cuda.get_device_name() if engine.device.type == "cuda" else None}
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
