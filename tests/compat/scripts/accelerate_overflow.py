"""accelerate's ``step_was_skipped`` under fp16: an ``Accelerator`` with a ``DeepSpeedPlugin`` (ZeRO 2,
fp16 from a loss scale of 2**20 that overflows the fp16 gradients until it has halved enough), a
tiny regression model, a client AdamW.

Nothing here names dslaunch. Rank 0 prints `SKIPPED <json list>` (``optimizer.step_was_skipped``
after each optimizer step), `ENGINE <json list>` (whether the engine's ``skipped_steps`` grew at
that step) and `SCALES <json list>` (``engine.optimizer.cur_scale`` after it).

Usage: accelerate_overflow.py STEPS
"""

import json
import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    steps = int([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1, "loss_scale_window": 1000},
        "steps_per_print": 1000})
    accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    skipped, engine_skipped, scales = [], [], []
    for step, (inputs, target) in enumerate(loader):
        before = model.skipped_steps
        loss = torch.nn.functional.mse_loss(model(inputs.half()).float(), target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
        engine_skipped.append(model.skipped_steps > before)
        scales.append(model.optimizer.cur_scale)
        if step + 1 == steps:
            break
    if accelerator.is_main_process:
        print("SKIPPED " + json.dumps(skipped), flush=True)
        print("ENGINE " + json.dumps(engine_skipped), flush=True)
        print("SCALES " + json.dumps(scales), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
